//! What the live view (`/live`) reads from Postgres: the sales not ended (and those
//! ended moments ago, with their final figures), with their orders by status.

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use crate::domain::VoucherId;

/// How long an ended sale stays on the page.
pub const ENDED_SHOWN_SECS: i64 = 300;

/// The live view's own read gives up after this (its reader stops waiting sooner).
pub const STATEMENT_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(800);

#[derive(Debug, Clone, sqlx::FromRow)]
pub struct SaleRow {
    pub voucher_id: VoucherId,
    pub title: String,
    /// `upcoming`, `open` or `ended`, by Postgres's clock: one clock for every instance,
    /// whatever their own clocks say.
    pub state: String,
    pub initial_stock: i32,
    /// Postgres's stock: units not taken by an order written here.
    pub stock: i32,
    pub begin_time: DateTime<Utc>,
    pub end_time: DateTime<Utc>,
    pub created: i64,
    pub paid: i64,
    pub used: i64,
    pub refunding: i64,
    pub refunded: i64,
    pub cancelled: i64,
    pub expired: i64,
    /// Orders that gave their unit back on sale (cancelled, expired, refunded while open).
    pub units_back: i64,
    /// Payments that came after their order closed (to refund).
    pub late_payments: i64,
    pub dead_letters: i64,
    /// Of the dead letters, the orders admitted by a Redis state that was no longer the
    /// sale's (`stale_epoch`).
    pub stale_epoch: i64,
    pub releases_owed: i64,
    /// Segments the sale's stock is split over.
    pub segments: i16,
    /// A lottery opening's entry window (`None`: first come).
    pub lottery_window_ms: Option<i32>,
    /// A lottery's draw once recorded: its entrants and winners counted, and when.
    pub draw_entrants: Option<i32>,
    pub draw_winners: Option<i32>,
    pub drawn_at: Option<DateTime<Utc>>,
    /// Sales qualifying for the page, however many were returned.
    #[sqlx(rename = "total")]
    pub qualifying: i64,
}

/// The sales on show and how many qualify (more than shown when over the limit).
#[derive(Debug, Clone, Default)]
pub struct Sales {
    pub rows: Vec<SaleRow>,
    pub total: i64,
    /// Postgres's clock at the read.
    pub now: DateTime<Utc>,
}

/// The sales on show, with their counts: one statement reading each sale's own row
/// (its orders by status are counted there by the transactions that move them) and the
/// few dead letters and owed releases it has. The server gives up on it after
/// [`STATEMENT_TIMEOUT`], so that a slow Postgres does not gather abandoned reads.
/// At most `limit` sales: open ones with units left first, then upcoming, then open
/// with none left, then ended; the soonest ending first within each. Units left are
/// Postgres's stock, except for the sales in `sold_out`: `(voucher id, Postgres's stock
/// when Redis said none was left)`, none left while their stock is no higher (a unit
/// coming back raises it). A sale still selling in Redis has units left here too
/// (Redis's stock is Postgres's less the orders in flight and the returns owed), so the
/// limit never leaves a selling sale out for another kind, once the caller has told the
/// ones Redis has sold out.
#[tracing::instrument(level = "debug", skip(db, sold_out))]
pub async fn sales(db: &PgPool, limit: i64, sold_out: &[(VoucherId, i32)]) -> sqlx::Result<Sales> {
    let (sold_ids, sold_stock): (Vec<VoucherId>, Vec<i32>) = sold_out.iter().copied().unzip();
    let mut tx = db.begin().await?;
    // The timeout, and Postgres's clock (the one the states below are decided by) in
    // the same round trip.
    let (now, _): (DateTime<Utc>, String) =
        sqlx::query_as("SELECT now(), set_config('statement_timeout', $1, true)")
            .bind(STATEMENT_TIMEOUT.as_millis().to_string())
            .fetch_one(&mut *tx)
            .await?;
    let rows = sqlx::query_as::<_, SaleRow>(
        r#"
        SELECT s.voucher_id, v.title,
               CASE WHEN s.end_time <= now() THEN 'ended'
                    WHEN s.begin_time > now() THEN 'upcoming' ELSE 'open' END AS state,
               s.initial_stock, s.stock, s.begin_time, s.end_time,
               (s.initial_stock - s.stock + s.units_back - s.paid - s.used - s.refunding
                - s.refunded - s.cancelled - s.expired)::int8 AS created,
               s.paid::int8 AS paid, s.used::int8 AS used, s.refunding::int8 AS refunding,
               s.refunded::int8 AS refunded, s.cancelled::int8 AS cancelled,
               s.expired::int8 AS expired, s.units_back::int8 AS units_back,
               s.late_payments::int8 AS late_payments,
               (SELECT count(*) FROM dead_orders d WHERE d.voucher_id = s.voucher_id) AS dead_letters,
               (SELECT count(*) FROM dead_orders d
                WHERE d.voucher_id = s.voucher_id AND d.reason LIKE $5) AS stale_epoch,
               (SELECT count(*) FROM stock_releases r WHERE r.voucher_id = s.voucher_id) AS releases_owed,
               s.segments, s.lottery_window_ms,
               cardinality(d.entrants) AS draw_entrants, cardinality(d.winners) AS draw_winners,
               d.drawn_at, count(*) OVER () AS total
        FROM seckill_vouchers s
        JOIN vouchers v ON v.id = s.voucher_id
        LEFT JOIN sale_draws d ON d.voucher_id = s.voucher_id
        WHERE s.end_time > now() - make_interval(secs => $1)
        ORDER BY CASE WHEN s.end_time <= now() THEN 3 WHEN s.begin_time > now() THEN 1
                      WHEN s.stock <= 0 THEN 2
                      WHEN EXISTS (SELECT 1 FROM unnest($3::int8[], $4::int4[]) AS d(id, stock)
                                   WHERE d.id = s.voucher_id AND s.stock <= d.stock) THEN 2
                      ELSE 0 END,
                 s.end_time, s.voucher_id
        LIMIT $2
        "#,
    )
    .bind(ENDED_SHOWN_SECS as f64)
    .bind(limit)
    .bind(&sold_ids)
    .bind(&sold_stock)
    .bind(format!("{}%", super::admitted::STALE_EPOCH))
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    // Counted before the LIMIT (a window runs first); no row, no sale.
    let total = rows.first().map_or(0, |r| r.qualifying);
    Ok(Sales { rows, total, now })
}
