-- The API instances that keep 202s Redis may lose (src/admission/promises.rs), and the
-- Redis terms each has vouched for. A server in a new term (a restart, a failover) may
-- have lost admitted orders that only the instance that answered them still knows:
-- its sales admit nothing until every instance alive has admitted its own again there
-- and vouched for the term here, or a shopper could win a second time before their
-- first 202 is back (and that 202 could then never be kept).
--
-- An instance is alive while it beats (each look of its term watcher that reached
-- Redis, about every second), with the terms it is on (`terms`); one silent for longer
-- than the lease (seckill's code: ten seconds) no longer holds a term back. Of those
-- alive, only the instances on the new term, on the term whose data it took over, or
-- on a term some sale was built into (`sale_epochs`) hold it back: an instance on
-- another Redis altogether does not. Rows of instances gone for a day are deleted.
CREATE TABLE promise_keepers (
    keeper  text        PRIMARY KEY,
    beat_at timestamptz NOT NULL DEFAULT now(),
    terms   text[]      NOT NULL DEFAULT '{}'
);

CREATE TABLE promise_vouches (
    keeper    text        NOT NULL REFERENCES promise_keepers (keeper) ON DELETE CASCADE,
    term      text        NOT NULL,
    vouched_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (keeper, term)
);

CREATE INDEX promise_vouches_by_term ON promise_vouches (term);

-- Which instances a new term waits for, when the server came back empty (it names no
-- term whose data it took over): those on a term some sale was built into, now or in
-- the build before (`term_before`: a heal into the new term replaces the old one).
ALTER TABLE sale_epochs ADD COLUMN term_before text;
CREATE INDEX sale_epochs_by_term ON sale_epochs (term);
CREATE INDEX sale_epochs_by_term_before ON sale_epochs (term_before);
