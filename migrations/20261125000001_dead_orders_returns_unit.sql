-- Whether burying an order gave its unit back to the sale's live stock in Redis. Kept
-- with the tombstone so that whoever settles the order in Redis (the burying worker, or
-- another that meets the same order later, dead already) settles it the same way: an
-- order buried because Postgres had no unit for it must never return one to Redis.
ALTER TABLE dead_orders ADD COLUMN returns_unit boolean NOT NULL DEFAULT true;
