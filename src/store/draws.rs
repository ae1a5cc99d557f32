//! `sale_draws`: a lottery sale's draw, as it was done in Redis, and its window.

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use crate::domain::VoucherId;

/// A draw: the seed, every entrant in increasing user id (the order the draw consumed
/// them), the winners in the order they were drawn.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Draw {
    pub seed: String,
    pub entrants: Vec<i64>,
    pub winners: Vec<i64>,
    pub drawn_at: DateTime<Utc>,
}

/// A lottery sale's entry window's end (`None`: no such sale, or it opens first come).
pub async fn window_end(
    db: &PgPool,
    voucher_id: VoucherId,
) -> Result<Option<DateTime<Utc>>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT begin_time + lottery_window_ms * interval '1 millisecond' \
         FROM seckill_vouchers WHERE voucher_id = $1 AND opening_mode = 'lottery'",
    )
    .bind(voucher_id)
    .fetch_optional(db)
    .await
}

/// Records the draw; a draw recorded already stays as it is (there is one per sale).
pub async fn insert(db: &PgPool, voucher_id: VoucherId, draw: &Draw) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO sale_draws (voucher_id, seed, entrants, winners, drawn_at) \
         VALUES ($1, $2, $3, $4, $5) ON CONFLICT (voucher_id) DO NOTHING",
    )
    .bind(voucher_id)
    .bind(&draw.seed)
    .bind(&draw.entrants)
    .bind(&draw.winners)
    .bind(draw.drawn_at)
    .execute(db)
    .await?;
    Ok(())
}

/// A lottery sale's commitment, and its draw once recorded (one row, the draw's columns
/// null until then).
#[derive(sqlx::FromRow)]
struct Published {
    draw_commitment: String,
    seed: Option<String>,
    entrants: Option<Vec<i64>>,
    winners: Option<Vec<i64>>,
    drawn_at: Option<DateTime<Utc>>,
}

/// A lottery sale's commitment, and its draw once recorded; `None`: no lottery sale.
pub async fn get(
    db: &PgPool,
    voucher_id: VoucherId,
) -> Result<Option<(String, Option<Draw>)>, sqlx::Error> {
    let row: Option<Published> = sqlx::query_as(
        "SELECT s.draw_commitment, d.seed, d.entrants, d.winners, d.drawn_at \
         FROM seckill_vouchers s LEFT JOIN sale_draws d ON d.voucher_id = s.voucher_id \
         WHERE s.voucher_id = $1 AND s.opening_mode = 'lottery'",
    )
    .bind(voucher_id)
    .fetch_optional(db)
    .await?;
    Ok(row.map(|p| {
        let draw = match (p.seed, p.entrants, p.winners, p.drawn_at) {
            (Some(seed), Some(entrants), Some(winners), Some(drawn_at)) => Some(Draw {
                seed,
                entrants,
                winners,
                drawn_at,
            }),
            _ => None,
        };
        (p.draw_commitment, draw)
    }))
}
