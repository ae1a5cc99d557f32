-- Orders the worker gave up on (dead-lettered). An id here is never written to
-- voucher_orders afterwards, however late a slow or partitioned worker replays its
-- stream entry: the worker inserts only ids absent from this table, and both the
-- tombstone and every insert happen under the sale's seckill_vouchers row lock.
CREATE TABLE dead_orders (
    id         bigint      PRIMARY KEY CHECK (id > 0),
    user_id    bigint      NOT NULL,
    voucher_id bigint      NOT NULL,
    reason     text        NOT NULL,
    dead_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX dead_orders_voucher_id_idx ON dead_orders (voucher_id);
