-- Each sale's orders by final status, kept beside its stock by the transactions that
-- move them (pay, cancel, expiry), so that the live view reads a sale's figures from
-- its one row instead of counting its orders every second. With them:
--   orders written = initial_stock - stock + cancelled + expired
--   created        = initial_stock - stock - paid
-- They only ever grow: a paid order stays paid, cancelled and expired are final.
ALTER TABLE seckill_vouchers
    ADD COLUMN paid      integer NOT NULL DEFAULT 0 CHECK (paid >= 0),
    ADD COLUMN cancelled integer NOT NULL DEFAULT 0 CHECK (cancelled >= 0),
    ADD COLUMN expired   integer NOT NULL DEFAULT 0 CHECK (expired >= 0);

-- The orders written before: counted once, under a lock that keeps transitions out
-- until the counts are in.
LOCK TABLE voucher_orders IN SHARE MODE;
UPDATE seckill_vouchers s
SET paid = c.paid, cancelled = c.cancelled, expired = c.expired
FROM (
    SELECT voucher_id,
           count(*) FILTER (WHERE status = 'paid')      AS paid,
           count(*) FILTER (WHERE status = 'cancelled') AS cancelled,
           count(*) FILTER (WHERE status = 'expired')   AS expired
    FROM voucher_orders
    GROUP BY voucher_id
) c
WHERE c.voucher_id = s.voucher_id;
