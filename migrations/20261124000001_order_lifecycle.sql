-- The order lifecycle: created -> paid | cancelled | expired. A cancelled or expired
-- order gives its unit back: Postgres's stock in the transaction that closes it, Redis's
-- live stock afterwards through `stock_releases` (the outbox of releases still owed).

ALTER TABLE seckill_vouchers
    ADD COLUMN pay_within_secs integer NOT NULL DEFAULT 900
        CHECK (pay_within_secs BETWEEN 1 AND 86400);

ALTER TABLE voucher_orders
    ADD COLUMN pay_before  timestamptz,
    ADD COLUMN paid_at     timestamptz,
    ADD COLUMN closed_at   timestamptz,
    ADD COLUMN payment_ref text CHECK (char_length(payment_ref) BETWEEN 1 AND 128);

ALTER TABLE voucher_orders DROP CONSTRAINT voucher_orders_status_check;
ALTER TABLE voucher_orders ADD CONSTRAINT voucher_orders_status_check
    CHECK (status IN ('created', 'paid', 'cancelled', 'expired'));

-- Orders written before payments existed were complete purchases: they become `paid`
-- (when written), not orders that would now expire and give their unit away.
UPDATE voucher_orders o
SET status = 'paid',
    paid_at = o.persisted_at,
    pay_before = o.created_at + make_interval(secs => coalesce(
        (SELECT s.pay_within_secs FROM seckill_vouchers s WHERE s.voucher_id = o.voucher_id),
        900));
-- No default: every writer must set the deadline (a worker of the previous version,
-- still running after the upgrade, fails to insert and leaves its entries pending for
-- the new workers instead of writing orders without one).
ALTER TABLE voucher_orders ALTER COLUMN pay_before SET NOT NULL;

-- Each status carries exactly its own timestamps.
ALTER TABLE voucher_orders ADD CONSTRAINT voucher_orders_lifecycle_check CHECK (
    (status = 'created' AND paid_at IS NULL AND closed_at IS NULL)
    OR (status = 'paid' AND paid_at IS NOT NULL AND closed_at IS NULL)
    OR (status IN ('cancelled', 'expired') AND paid_at IS NULL AND closed_at IS NOT NULL));

-- One ACTIVE order per user and voucher: a cancelled or expired order no longer
-- stands in the way of the user's next grab.
ALTER TABLE voucher_orders DROP CONSTRAINT voucher_orders_user_id_voucher_id_key;
CREATE UNIQUE INDEX voucher_orders_one_active_idx ON voucher_orders (user_id, voucher_id)
    WHERE status IN ('created', 'paid');
-- The caller's closed orders (the active ones are in the index above). Partial, so the
-- worker's inserts (all `created`) do not pay for a second index of random keys.
CREATE INDEX voucher_orders_closed_user_idx ON voucher_orders (user_id, id)
    WHERE status IN ('cancelled', 'expired');
-- The expiry sweeper's queue: unpaid orders by deadline.
CREATE INDEX voucher_orders_due_idx ON voucher_orders (pay_before) WHERE status = 'created';

-- Releases owed to Redis: written in the transaction that closes an order, deleted once
-- the release script has run (it acts only while the buyer record still names the
-- order, so running it twice changes nothing). A crash in between leaves the row for
-- the worker's sweeper to finish.
CREATE TABLE stock_releases (
    order_id   bigint      PRIMARY KEY REFERENCES voucher_orders (id),
    voucher_id bigint      NOT NULL,
    user_id    bigint      NOT NULL,
    owed_since timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX stock_releases_voucher_id_idx ON stock_releases (voucher_id);
