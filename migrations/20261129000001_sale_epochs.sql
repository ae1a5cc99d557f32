-- The fence's epoch: which Redis state each sale (each part of a segmented sale) was
-- last built into. Every build of a sale's state from Postgres (a creation, a heal, a
-- repair) draws a new epoch under the sale's row lock and records it here in the same
-- transaction; the state in Redis carries it, and every admission stamps its stream
-- entry with it. The worker writes an order only when its entry's epoch is the sale's
-- current one (or the build that drew it counted the order in flight: `sale_carried`),
-- checked under the same lock. An entry admitted by any other Redis state (an old
-- primary still reachable after a failover) is never an order: it is buried as
-- `stale_epoch`, without taking a unit.
--
-- A sale without a row here was never built by a release that knows epochs: its
-- entries are written as before, until its next build.
--
-- `term` is the term of the Redis server life the epoch was built into (it begins with
-- the server's clock when it was drawn): a build by a server in an older term (an old
-- primary still reachable after a failover) may not take the sale from a newer one, and
-- a newer one takes it back from an older one.
CREATE SEQUENCE sale_epoch_seq;

CREATE TABLE sale_epochs (
    voucher_id bigint      NOT NULL REFERENCES seckill_vouchers (voucher_id) ON DELETE CASCADE,
    part       smallint    NOT NULL CHECK (part >= 0 AND part < 64),
    epoch      bigint      NOT NULL CHECK (epoch > 0),
    term       text        NOT NULL,
    built_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (voucher_id, part)
);

-- The orders a build counted in flight (admitted in an earlier epoch, still on their
-- way to Postgres): carried into the epoch it drew, so the fence itself loses no 202.
-- Replaced by the part's next build.
CREATE TABLE sale_carried (
    voucher_id bigint   NOT NULL REFERENCES seckill_vouchers (voucher_id) ON DELETE CASCADE,
    part       smallint NOT NULL,
    order_id   bigint   NOT NULL,
    user_id    bigint   NOT NULL,
    PRIMARY KEY (voucher_id, part, order_id, user_id)
);
