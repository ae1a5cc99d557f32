-- An order id belongs to the first order that claims it: its row in voucher_orders, or
-- its tombstone here. Another order minted with the same id (another user or voucher)
-- is a duplicate and is buried here too, beside the owner's row or tombstone: the key is
-- the whole order, so each duplicate is buried (and dead-lettered, and counted) once.
ALTER TABLE dead_orders DROP CONSTRAINT dead_orders_pkey;
ALTER TABLE dead_orders ADD PRIMARY KEY (id, user_id, voucher_id);
