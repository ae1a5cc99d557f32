-- A sale may open as a lottery: every shopper who presses in the first `lottery_window_ms`
-- after `begin_time` is an entrant, and one draw picks the winners (lua/seckill.lua,
-- draw_lottery). The draw's seed is secret until the draw; its SHA-256 is published when
-- the sale is created (`draw_commitment`). The draw's record lands in `sale_draws`.
ALTER TABLE seckill_vouchers
    ADD COLUMN opening_mode text NOT NULL DEFAULT 'first_come'
        CHECK (opening_mode IN ('first_come', 'lottery')),
    ADD COLUMN lottery_window_ms integer CHECK (lottery_window_ms BETWEEN 100 AND 10000),
    ADD COLUMN draw_seed text,
    ADD COLUMN draw_commitment text,
    ADD CONSTRAINT lottery_has_its_window_and_seed CHECK (
        (opening_mode = 'lottery') = (lottery_window_ms IS NOT NULL)
        AND (opening_mode = 'lottery') = (draw_seed IS NOT NULL AND draw_commitment IS NOT NULL)
    );

CREATE TABLE sale_draws (
    voucher_id bigint PRIMARY KEY REFERENCES seckill_vouchers (voucher_id),
    -- The seed, hex, as the draw used it (its SHA-256 is the sale's draw_commitment).
    seed text NOT NULL,
    -- Every entrant's user id, in increasing order: the order the draw consumed them.
    entrants bigint[] NOT NULL,
    -- The winners' user ids, in the order they were drawn.
    winners bigint[] NOT NULL,
    drawn_at timestamptz NOT NULL
);
