-- A sale's stock is split over segments: the API and `seckill_vouchers.segments` call
-- them so, and so do the tables and columns that called each one a part. Renames only
-- (catalog changes: no row is rewritten or scanned; each takes its table's lock for
-- that moment). A process of the previous release names the old tables and columns and
-- fails on every query of them: stop the previous release before this runs (see
-- docs/operations.md, "Schema migrations").
ALTER TABLE seckill_parts RENAME TO seckill_segments;
ALTER TABLE seckill_segments RENAME COLUMN part TO segment;
ALTER TABLE seckill_segments RENAME CONSTRAINT seckill_parts_pkey TO seckill_segments_pkey;
ALTER TABLE seckill_segments
    RENAME CONSTRAINT seckill_parts_part_check TO seckill_segments_segment_check;
ALTER TABLE seckill_segments
    RENAME CONSTRAINT seckill_parts_allotted_check TO seckill_segments_allotted_check;
ALTER TABLE seckill_segments
    RENAME CONSTRAINT seckill_parts_voucher_id_fkey TO seckill_segments_voucher_id_fkey;

ALTER TABLE seckill_part_moves RENAME TO seckill_segment_moves;
ALTER TABLE seckill_segment_moves RENAME COLUMN from_part TO from_segment;
ALTER TABLE seckill_segment_moves RENAME COLUMN to_part TO to_segment;
ALTER TABLE seckill_segment_moves
    RENAME CONSTRAINT seckill_part_moves_pkey TO seckill_segment_moves_pkey;
ALTER TABLE seckill_segment_moves
    RENAME CONSTRAINT seckill_part_moves_check TO seckill_segment_moves_check;
ALTER TABLE seckill_segment_moves
    RENAME CONSTRAINT seckill_part_moves_id_check TO seckill_segment_moves_id_check;
ALTER TABLE seckill_segment_moves
    RENAME CONSTRAINT seckill_part_moves_units_check TO seckill_segment_moves_units_check;
ALTER TABLE seckill_segment_moves
    RENAME CONSTRAINT seckill_part_moves_voucher_id_fkey TO seckill_segment_moves_voucher_id_fkey;
ALTER INDEX seckill_part_moves_uncredited_idx RENAME TO seckill_segment_moves_uncredited_idx;

ALTER TABLE sale_epochs RENAME COLUMN part TO segment;
ALTER TABLE sale_epochs RENAME CONSTRAINT sale_epochs_part_check TO sale_epochs_segment_check;

ALTER TABLE sale_carried RENAME COLUMN part TO segment;
