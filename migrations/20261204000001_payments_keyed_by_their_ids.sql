-- A payment notification is keyed by what identifies it, and each key by what it names:
-- an event id names one notification, a provider's transaction pays (or refunds) one
-- order. A notification whose id or transaction is recorded for another order (or, for
-- its event id, with other content) is refused as `id_conflict` and kept beside the
-- first, once. A notification refused as `amount_mismatch` does not consume its
-- transaction: a corrected one is judged afresh. The list's cursor is the row's `seq`.
ALTER TABLE payment_events DROP CONSTRAINT payment_events_pkey;
ALTER TABLE payment_events DROP CONSTRAINT payment_events_kind_transaction_id_key;
ALTER TABLE payment_events ADD COLUMN seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY;
CREATE UNIQUE INDEX payment_events_event_idx ON payment_events (event_id)
    WHERE outcome <> 'id_conflict';
CREATE UNIQUE INDEX payment_events_event_conflict_idx ON payment_events (event_id)
    WHERE outcome = 'id_conflict';
CREATE UNIQUE INDEX payment_events_transaction_idx ON payment_events (kind, transaction_id)
    WHERE outcome NOT IN ('amount_mismatch', 'id_conflict');
CREATE INDEX payment_events_page_idx ON payment_events (received_at, seq);

-- A payment made by hand records what it was paid (the voucher's price), so the
-- provider's refund of it matches and completes.
UPDATE voucher_orders o
SET paid_amount = v.pay_value, paid_currency = 'CNY'
FROM vouchers v
WHERE v.id = o.voucher_id AND o.pay_type = 'manual' AND o.paid_amount IS NULL;
