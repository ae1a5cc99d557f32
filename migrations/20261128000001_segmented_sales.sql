-- A sale's stock split over several Redis parts (segments), each on its own hash slot, so
-- one hot sale's admissions spread over several Redis masters. 1 = one part, as before.
ALTER TABLE seckill_vouchers
    ADD COLUMN segments smallint NOT NULL DEFAULT 1 CHECK (segments BETWEEN 1 AND 64);

-- Each part's share of a segmented sale's units: its first allotment, plus what moved in,
-- minus what moved out. A part's own stock is its allotment minus the active orders of
-- the users whose home it is, so each part can be rebuilt in Redis alone. Only sales in
-- more than one part have rows.
CREATE TABLE seckill_parts (
    voucher_id bigint   NOT NULL REFERENCES seckill_vouchers (voucher_id) ON DELETE CASCADE,
    part       smallint NOT NULL CHECK (part >= 0 AND part < 64),
    allotted   integer  NOT NULL CHECK (allotted >= 0),
    PRIMARY KEY (voucher_id, part)
);

-- Units moved from a drained part's neighbour to it. Recorded (and the allotments
-- changed) only while the donor's Redis state still holds the units taken out; credited
-- to the recipient's Redis state afterwards, exactly once (credited_at set under the
-- sale's lock, with the credit).
CREATE TABLE seckill_part_moves (
    id          bigint      PRIMARY KEY CHECK (id > 0),
    voucher_id  bigint      NOT NULL REFERENCES seckill_vouchers (voucher_id) ON DELETE CASCADE,
    from_part   smallint    NOT NULL,
    to_part     smallint    NOT NULL,
    units       integer     NOT NULL CHECK (units > 0),
    recorded_at timestamptz NOT NULL DEFAULT now(),
    credited_at timestamptz,
    CHECK (from_part <> to_part)
);
CREATE INDEX seckill_part_moves_uncredited_idx ON seckill_part_moves (voucher_id)
    WHERE credited_at IS NULL;
