//! `seckill_segments` and `seckill_segment_moves`: how a segmented sale's units are shared
//! out over its segments, and the units moved between them.

use sqlx::{FromRow, PgExecutor, Postgres, Transaction};

use crate::domain::VoucherId;
use crate::keys::SaleSegment;

/// Units moved from one segment of a sale to another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Move {
    /// Minted like an order id: unique across instances and restarts.
    pub id: i64,
    pub from: SaleSegment,
    pub to: u8,
    pub units: i32,
}

impl Move {
    pub fn recipient(&self) -> SaleSegment {
        self.from.sibling(self.to)
    }
}

#[derive(FromRow)]
struct MoveRow {
    id: i64,
    voucher_id: VoucherId,
    from_segment: i16,
    to_segment: i16,
    units: i32,
    segments: i16,
}

impl From<MoveRow> for Move {
    fn from(r: MoveRow) -> Self {
        Move {
            id: r.id,
            from: SaleSegment::new(r.voucher_id, r.from_segment as u8, r.segments as u8),
            to: r.to_segment as u8,
            units: r.units,
        }
    }
}

/// The first allotment of each of `segments` segments: the stock shared out evenly, the
/// first segments one more when it does not divide.
pub fn first_allotments(stock: i32, segments: u8) -> Vec<i32> {
    let k = segments.max(1) as i32;
    (0..k)
        .map(|p| stock / k + i32::from(p < stock % k))
        .collect()
}

/// Records the first allotments of a new sale in `segments` segments (nothing for one segment).
#[tracing::instrument(skip(tx))]
pub(crate) async fn insert_allotments(
    tx: &mut Transaction<'_, Postgres>,
    voucher_id: VoucherId,
    stock: i32,
    segments: u8,
) -> Result<(), sqlx::Error> {
    if segments <= 1 {
        return Ok(());
    }
    let allotted = first_allotments(stock, segments);
    let segment: Vec<i16> = (0..segments as i16).collect();
    sqlx::query(
        "INSERT INTO seckill_segments (voucher_id, segment, allotted) \
         SELECT $1, p, a FROM unnest($2::smallint[], $3::int[]) AS t(p, a)",
    )
    .bind(voucher_id)
    .bind(&segment)
    .bind(&allotted)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Shares a sale's units out anew over its segments (a lottery's draw: nothing sold
/// before it, nothing moved). Call under the sale's lock.
#[tracing::instrument(skip(tx))]
pub(crate) async fn allot(
    tx: &mut Transaction<'_, Postgres>,
    voucher_id: VoucherId,
    allotted: &[i32],
) -> Result<(), sqlx::Error> {
    let segment: Vec<i16> = (0..allotted.len() as i16).collect();
    sqlx::query(
        "UPDATE seckill_segments s SET allotted = t.a \
         FROM unnest($2::smallint[], $3::int[]) AS t(p, a) \
         WHERE s.voucher_id = $1 AND s.segment = t.p",
    )
    .bind(voucher_id)
    .bind(&segment)
    .bind(allotted)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// How many segments a sale has (`None`: the voucher has no flash sale).
#[tracing::instrument(skip(db))]
pub(crate) async fn segments_of<'e>(
    db: impl PgExecutor<'e>,
    voucher_id: VoucherId,
) -> Result<Option<u8>, sqlx::Error> {
    let segments: Option<i16> =
        sqlx::query_scalar("SELECT segments FROM seckill_vouchers WHERE voucher_id = $1")
            .bind(voucher_id)
            .fetch_optional(db)
            .await?;
    Ok(segments.map(|p| p as u8))
}

/// A segment's allotment (under the sale's lock, for a load).
#[tracing::instrument(skip(tx))]
pub(crate) async fn allotted(
    tx: &mut Transaction<'_, Postgres>,
    segment: SaleSegment,
) -> Result<i32, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT allotted FROM seckill_segments WHERE voucher_id = $1 AND segment = $2",
    )
    .bind(segment.voucher_id)
    .bind(segment.segment as i16)
    .fetch_one(&mut **tx)
    .await
}

/// Records a move and shifts the two allotments, once: `false` when it was recorded
/// already. Call under the sale's lock.
#[tracing::instrument(skip(tx))]
pub(crate) async fn record_move(
    tx: &mut Transaction<'_, Postgres>,
    m: &Move,
) -> Result<bool, sqlx::Error> {
    let inserted = sqlx::query(
        "INSERT INTO seckill_segment_moves (id, voucher_id, from_segment, to_segment, units) \
         VALUES ($1, $2, $3, $4, $5) ON CONFLICT (id) DO NOTHING",
    )
    .bind(m.id)
    .bind(m.from.voucher_id)
    .bind(m.from.segment as i16)
    .bind(m.to as i16)
    .bind(m.units)
    .execute(&mut **tx)
    .await?
    .rows_affected()
        == 1;
    if inserted {
        sqlx::query(
            "UPDATE seckill_segments SET allotted = allotted + \
               CASE WHEN segment = $2 THEN -$4 ELSE $4 END \
             WHERE voucher_id = $1 AND segment IN ($2, $3)",
        )
        .bind(m.from.voucher_id)
        .bind(m.from.segment as i16)
        .bind(m.to as i16)
        .bind(m.units)
        .execute(&mut **tx)
        .await?;
    }
    Ok(inserted)
}

/// Whether a move is recorded, and if so whether it was credited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MoveState {
    Unknown,
    Recorded,
    Credited,
}

#[tracing::instrument(skip(tx))]
pub(crate) async fn move_state(
    tx: &mut Transaction<'_, Postgres>,
    id: i64,
) -> Result<MoveState, sqlx::Error> {
    let row: Option<(bool,)> =
        sqlx::query_as("SELECT credited_at IS NOT NULL FROM seckill_segment_moves WHERE id = $1")
            .bind(id)
            .fetch_optional(&mut **tx)
            .await?;
    Ok(match row {
        None => MoveState::Unknown,
        Some((false,)) => MoveState::Recorded,
        Some((true,)) => MoveState::Credited,
    })
}

/// The units of a recorded move.
#[tracing::instrument(skip(tx))]
pub(crate) async fn units_of(
    tx: &mut Transaction<'_, Postgres>,
    id: i64,
) -> Result<i32, sqlx::Error> {
    sqlx::query_scalar("SELECT units FROM seckill_segment_moves WHERE id = $1")
        .bind(id)
        .fetch_one(&mut **tx)
        .await
}

#[tracing::instrument(skip(tx))]
pub(crate) async fn mark_credited(
    tx: &mut Transaction<'_, Postgres>,
    id: i64,
) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE seckill_segment_moves SET credited_at = now() WHERE id = $1")
        .bind(id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Recorded moves of a sale not yet credited to their recipient.
#[tracing::instrument(skip(db))]
pub(crate) async fn uncredited<'e>(
    db: impl PgExecutor<'e>,
    voucher_id: VoucherId,
) -> Result<Vec<Move>, sqlx::Error> {
    Ok(sqlx::query_as::<_, MoveRow>(
        "SELECT m.id, m.voucher_id, m.from_segment, m.to_segment, m.units, s.segments \
         FROM seckill_segment_moves m JOIN seckill_vouchers s USING (voucher_id) \
         WHERE m.voucher_id = $1 AND m.credited_at IS NULL ORDER BY m.id",
    )
    .bind(voucher_id)
    .fetch_all(db)
    .await?
    .into_iter()
    .map(Move::from)
    .collect())
}

/// Which of the given move ids are recorded.
#[tracing::instrument(skip(tx, ids))]
pub(crate) async fn recorded_among(
    tx: &mut Transaction<'_, Postgres>,
    ids: &[i64],
) -> Result<Vec<i64>, sqlx::Error> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    sqlx::query_scalar("SELECT id FROM seckill_segment_moves WHERE id = ANY($1)")
        .bind(ids)
        .fetch_all(&mut **tx)
        .await
}

/// Segmented sales that have not ended (the ones whose moves may need finishing).
#[tracing::instrument(skip(db))]
pub(crate) async fn open_segmented<'e>(
    db: impl PgExecutor<'e>,
) -> Result<Vec<(VoucherId, u8)>, sqlx::Error> {
    Ok(sqlx::query_as::<_, (VoucherId, i16)>(
        "SELECT voucher_id, segments FROM seckill_vouchers \
         WHERE segments > 1 AND end_time > now() - interval '1 hour' ORDER BY voucher_id",
    )
    .fetch_all(db)
    .await?
    .into_iter()
    .map(|(v, k)| (v, k as u8))
    .collect())
}

#[cfg(test)]
mod tests {
    use super::first_allotments;

    #[test]
    fn the_first_allotments_share_the_stock_out_evenly() {
        assert_eq!(first_allotments(3000, 3), vec![1000, 1000, 1000]);
        assert_eq!(first_allotments(10, 4), vec![3, 3, 2, 2]);
        assert_eq!(first_allotments(2, 3), vec![1, 1, 0]);
        assert_eq!(first_allotments(7, 1), vec![7]);
        for (stock, k) in [(0, 5), (1_000_000, 64), (63, 64)] {
            assert_eq!(first_allotments(stock, k).iter().sum::<i32>(), stock);
        }
    }
}
