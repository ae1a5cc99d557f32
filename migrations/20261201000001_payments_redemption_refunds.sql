-- A coupon's life after payment: paid through the payment provider (its signed
-- notifications recorded in `payment_events`), redeemed at the shop (`used`), refunded
-- (`refunding` -> `refunded`). A payment that comes after the order was closed sends the
-- order to `refunding` (reason `late_payment`) without taking its unit again.
--
-- `closed_at` is when an order gave its unit back on sale: cancelled, expired, or
-- refunded while its sale was open. An order with `closed_at IS NULL` holds a unit, so
-- for every sale: initial_stock = stock + (its orders with closed_at IS NULL).

ALTER TABLE vouchers
    ADD COLUMN refundable boolean NOT NULL DEFAULT false;

ALTER TABLE voucher_orders
    ADD COLUMN pay_type       text   CHECK (pay_type IN ('provider', 'manual')),
    ADD COLUMN transaction_id text   CHECK (char_length(transaction_id) BETWEEN 1 AND 128),
    ADD COLUMN paid_amount    bigint CHECK (paid_amount >= 0),
    ADD COLUMN paid_currency  text   CHECK (char_length(paid_currency) = 3),
    ADD COLUMN pay_reason     text   CHECK (char_length(pay_reason) BETWEEN 1 AND 256),
    ADD COLUMN redeem_code    text,
    ADD COLUMN used_at        timestamptz,
    ADD COLUMN used_by        bigint,
    ADD COLUMN refund_reason  text   CHECK (refund_reason IN ('requested', 'late_payment', 'admin')),
    ADD COLUMN refund_asked_at timestamptz,
    ADD COLUMN refunded_at    timestamptz;

-- Orders paid before payments went through the provider were marked paid by their
-- shopper (or an admin): recorded as manual payments.
UPDATE voucher_orders
SET pay_type = 'manual',
    pay_reason = coalesce('payment_ref: ' || payment_ref, 'marked paid by hand before payments went through the provider'),
    redeem_code = md5(random()::text || id::text || clock_timestamp()::text)
WHERE status = 'paid';

ALTER TABLE voucher_orders DROP CONSTRAINT voucher_orders_status_check;
ALTER TABLE voucher_orders ADD CONSTRAINT voucher_orders_status_check CHECK (
    status IN ('created', 'paid', 'used', 'refunding', 'refunded', 'cancelled', 'expired'));

-- Each status carries exactly its own facts.
ALTER TABLE voucher_orders DROP CONSTRAINT voucher_orders_lifecycle_check;
ALTER TABLE voucher_orders ADD CONSTRAINT voucher_orders_lifecycle_check CHECK (
    (status = 'created' AND paid_at IS NULL AND closed_at IS NULL
        AND used_at IS NULL AND refund_reason IS NULL)
    OR (status IN ('cancelled', 'expired') AND paid_at IS NULL AND closed_at IS NOT NULL
        AND used_at IS NULL AND refund_reason IS NULL)
    OR (status = 'paid' AND paid_at IS NOT NULL AND pay_type IS NOT NULL AND closed_at IS NULL
        AND used_at IS NULL AND refund_reason IS NULL)
    OR (status = 'used' AND paid_at IS NOT NULL AND pay_type IS NOT NULL AND closed_at IS NULL
        AND used_at IS NOT NULL AND refund_reason IS NULL)
    OR (status = 'refunding' AND paid_at IS NOT NULL AND pay_type IS NOT NULL
        AND used_at IS NULL AND refund_reason IS NOT NULL AND refund_asked_at IS NOT NULL
        AND refunded_at IS NULL)
    OR (status = 'refunded' AND paid_at IS NOT NULL AND pay_type IS NOT NULL
        AND used_at IS NULL AND refund_reason IS NOT NULL AND refunded_at IS NOT NULL));
ALTER TABLE voucher_orders ADD CONSTRAINT voucher_orders_payment_check CHECK (
    pay_type IS NULL
    OR (pay_type = 'provider' AND transaction_id IS NOT NULL AND paid_amount IS NOT NULL
        AND paid_currency IS NOT NULL)
    OR (pay_type = 'manual' AND pay_reason IS NOT NULL));

-- One order holding a unit per user and voucher (a late payment's `refunding` order
-- gave its unit back when it closed: it does not stand in the way).
DROP INDEX voucher_orders_one_active_idx;
CREATE UNIQUE INDEX voucher_orders_one_active_idx ON voucher_orders (user_id, voucher_id)
    WHERE closed_at IS NULL;
DROP INDEX voucher_orders_closed_user_idx;
CREATE INDEX voucher_orders_closed_user_idx ON voucher_orders (user_id, id)
    WHERE closed_at IS NOT NULL;
-- A provider's transaction pays one order.
CREATE UNIQUE INDEX voucher_orders_transaction_idx ON voucher_orders (transaction_id)
    WHERE transaction_id IS NOT NULL;
-- A shop's orders (its staff's listing) go through the voucher; orders to refund are
-- few: their own index.
CREATE INDEX voucher_orders_refunding_idx ON voucher_orders (refund_asked_at)
    WHERE status = 'refunding';

-- Each sale's orders by status, kept beside its stock by the transactions that move
-- them: every status but `created` (derived, see below) counts the sale's orders in it
-- now; `units_back` counts the orders that gave their unit back (`closed_at` set).
--   orders written = initial_stock - stock + units_back
--   created        = written - paid - used - refunding - refunded - cancelled - expired
-- `late_payments` counts payments that came after their order closed (only grows).
ALTER TABLE seckill_vouchers
    ADD COLUMN used          integer NOT NULL DEFAULT 0 CHECK (used >= 0),
    ADD COLUMN refunding     integer NOT NULL DEFAULT 0 CHECK (refunding >= 0),
    ADD COLUMN refunded      integer NOT NULL DEFAULT 0 CHECK (refunded >= 0),
    ADD COLUMN late_payments integer NOT NULL DEFAULT 0 CHECK (late_payments >= 0),
    ADD COLUMN units_back    integer NOT NULL DEFAULT 0 CHECK (units_back >= 0);
LOCK TABLE voucher_orders IN SHARE MODE;
UPDATE seckill_vouchers SET units_back = cancelled + expired;

-- Every notification the payment provider sent that was signed right: applied or not,
-- it is kept (a payment is money; none may be dropped). Idempotent by the event's id
-- and by the provider's transaction id: a replay answers from here.
CREATE TABLE payment_events (
    event_id       text        PRIMARY KEY CHECK (char_length(event_id) BETWEEN 1 AND 128),
    kind           text        NOT NULL CHECK (kind IN ('payment.succeeded', 'refund.succeeded')),
    order_id       bigint      NOT NULL CHECK (order_id > 0),
    transaction_id text        NOT NULL CHECK (char_length(transaction_id) BETWEEN 1 AND 128),
    amount         bigint      NOT NULL,
    currency       text        NOT NULL,
    outcome        text        NOT NULL,
    received_at    timestamptz NOT NULL DEFAULT now(),
    settled_at     timestamptz,
    UNIQUE (kind, transaction_id)
);
CREATE INDEX payment_events_order_idx ON payment_events (order_id);
CREATE INDEX payment_events_outcome_idx ON payment_events (outcome, received_at);
