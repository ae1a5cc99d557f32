//! `sale_draws`: a lottery sale's draw, as it was done in Redis, recorded with its
//! winners' orders; and its window.

use std::collections::HashSet;

use chrono::{DateTime, Utc};
use futures_util::future::BoxFuture;
use sqlx::{PgPool, Postgres, Transaction};

use super::orders::{self, NewOrder, Persisted, Rejection};
use super::vouchers::lock_sales;
use crate::domain::{Epoch, OrderId, UserId, VoucherId};

/// A draw: the seed, every entrant in increasing user id (the order the draw consumed
/// them), the winners in the order they were drawn.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Draw {
    pub seed: String,
    pub entrants: Vec<i64>,
    pub winners: Vec<i64>,
    pub drawn_at: DateTime<Utc>,
}

/// A lottery sale's entry window: its end, and the segments its entries are spread over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub end: DateTime<Utc>,
    pub segments: u8,
}

/// A lottery sale's entry window (`None`: no such sale, or it opens first come).
pub async fn window(db: &PgPool, voucher_id: VoucherId) -> Result<Option<Window>, sqlx::Error> {
    let row: Option<(DateTime<Utc>, i16)> = sqlx::query_as(
        "SELECT begin_time + lottery_window_ms * interval '1 millisecond', segments \
         FROM seckill_vouchers WHERE voucher_id = $1 AND opening_mode = 'lottery'",
    )
    .bind(voucher_id)
    .fetch_optional(db)
    .await?;
    Ok(row.map(|(end, segments)| Window {
        end,
        segments: segments as u8,
    }))
}

/// A lottery sale [`due`] lists, and whether Postgres records its draw.
#[derive(Debug, Clone, Copy, PartialEq, Eq, sqlx::FromRow)]
pub struct Due {
    pub voucher_id: VoucherId,
    pub recorded: bool,
}

/// The lottery sales whose window is over, not ended, whose draw is not recorded; the
/// segmented ones drawn in the last ten minutes (a segment may still hold its window, its
/// rebuild after the draw cut short); and the others drawn (a state may still wait for
/// the record's mark). At most 100, those not recorded first, then the latest windows.
pub async fn due(db: &PgPool) -> Result<Vec<Due>, sqlx::Error> {
    sqlx::query_as(
        "SELECT s.voucher_id, d.voucher_id IS NOT NULL AS recorded FROM seckill_vouchers s \
           LEFT JOIN sale_draws d ON d.voucher_id = s.voucher_id \
         WHERE s.opening_mode = 'lottery' AND s.end_time > now() \
           AND s.begin_time + s.lottery_window_ms * interval '1 millisecond' < now() \
           AND (d.voucher_id IS NULL OR s.segments = 1 \
                OR d.drawn_at > now() - interval '10 minutes') \
         ORDER BY d.voucher_id IS NULL DESC, s.begin_time DESC LIMIT 100",
    )
    .fetch_all(db)
    .await
}

/// A lottery sale's secret seed and its units: its initial stock, all of them until its
/// draw (nothing is sold before it), read the same by every instance drawing at any
/// moment; `None`: no lottery sale.
pub async fn seed_and_stock(
    db: &PgPool,
    voucher_id: VoucherId,
) -> Result<Option<(String, i32)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT draw_seed, initial_stock FROM seckill_vouchers \
         WHERE voucher_id = $1 AND opening_mode = 'lottery' AND draw_seed IS NOT NULL",
    )
    .bind(voucher_id)
    .fetch_optional(db)
    .await
}

/// The order each winner holds from the draw (its first for the sale: one bought later,
/// its draw's order closed, has a larger id).
pub async fn winners_orders(
    db: &PgPool,
    voucher_id: VoucherId,
    winners: &[i64],
) -> Result<Vec<(i64, OrderId)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT DISTINCT ON (user_id) user_id, id FROM voucher_orders \
         WHERE voucher_id = $1 AND user_id = ANY($2) ORDER BY user_id, id",
    )
    .bind(voucher_id)
    .bind(winners)
    .fetch_all(db)
    .await
}

/// Whether the order is a row of that user and voucher that still holds its unit (not
/// closed: cancelled, expired, refunded).
pub async fn holds_unit(
    db: &PgPool,
    order_id: OrderId,
    user_id: UserId,
    voucher_id: VoucherId,
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM voucher_orders \
         WHERE id = $1 AND user_id = $2 AND voucher_id = $3 AND closed_at IS NULL)",
    )
    .bind(order_id)
    .bind(user_id)
    .bind(voucher_id)
    .fetch_one(db)
    .await
}

/// What became of recording a draw.
#[derive(Debug, PartialEq, Eq)]
pub enum Recorded {
    /// The draw and every winner's order are rows now (or were already).
    Yes,
    /// The Redis state that drew is no longer the sale's (rebuilt, or not its current
    /// build): nothing written.
    NotHeld,
    /// Postgres refuses it (another draw recorded, a winner's order impossible): nothing
    /// written; why.
    Refused(String),
}

/// Whether the Redis state that drew is still the sale's, asked under its row lock.
pub type StillHeld<'a> = &'a (dyn Fn() -> BoxFuture<'a, anyhow::Result<bool>> + Send + Sync);

/// Records the draw and its winners' orders in ONE transaction, written as the worker
/// writes (rows in id order, then the sale's row lock: the fence every build of its
/// Redis state takes, so the two never wait for each other in a circle); under the lock
/// `still_held` says whether the state that drew is still the sale's. So a held press
/// is answered from a draw only once the draw is Postgres's truth: a Redis that comes
/// back older (the draw lost) is rebuilt with the winners as buyers and is never armed
/// to draw again. Under the lock too, the entries were read from the builds Postgres
/// names (`epochs`, by segment): an old primary's copy of a segment, its entries maybe
/// older, draws nothing. A segmented sale's segments get `allotments` (one per segment,
/// empty for a sale in one) in the same transaction: each its winners' units and its
/// share of the rest.
pub async fn record(
    db: &PgPool,
    voucher_id: VoucherId,
    draw: &Draw,
    winners: &[NewOrder],
    epochs: &[Option<Epoch>],
    allotments: &[i32],
    still_held: StillHeld<'_>,
) -> anyhow::Result<Recorded> {
    let mut tx = db.begin().await?;
    let outcomes = if winners.is_empty() {
        lock_sales(&mut tx, &[voucher_id]).await?;
        if !still_held().await? {
            return Ok(Recorded::NotHeld);
        }
        Vec::new()
    } else {
        let under_lock = |asked: Vec<OrderId>| -> BoxFuture<'_, anyhow::Result<HashSet<OrderId>>> {
            Box::pin(async move {
                Ok(match still_held().await? {
                    true => asked.into_iter().collect(),
                    false => HashSet::new(),
                })
            })
        };
        match orders::write(&mut tx, winners, &under_lock).await? {
            Some(outcomes) => outcomes,
            None => {
                return Ok(Recorded::Refused(
                    "no stock left in postgres for the winners".into(),
                ))
            }
        }
    };
    for outcome in outcomes {
        match outcome {
            Persisted::Inserted | Persisted::AlreadyThere => {}
            Persisted::Rejected(Rejection::StaleEpoch) | Persisted::Vanished => {
                return Ok(Recorded::NotHeld)
            }
            Persisted::Rejected(why) => return Ok(Recorded::Refused(why.reason())),
        }
    }
    if let Some(segment) = read_from_an_older_build(&mut tx, voucher_id, epochs).await? {
        tracing::warn!(
            voucher_id = voucher_id.get(),
            segment,
            "a lottery's entries were read from a redis state postgres no longer names \
             (an old primary?): not drawn from them"
        );
        return Ok(Recorded::NotHeld);
    }
    let inserted = sqlx::query(
        "INSERT INTO sale_draws (voucher_id, seed, entrants, winners, drawn_at) \
         VALUES ($1, $2, $3, $4, $5) ON CONFLICT (voucher_id) DO NOTHING",
    )
    .bind(voucher_id)
    .bind(&draw.seed)
    .bind(&draw.entrants)
    .bind(&draw.winners)
    .bind(draw.drawn_at)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    // Shared out once, by the record that made the draw: units may have moved since.
    if inserted == 1 && !allotments.is_empty() {
        super::segments::allot(&mut tx, voucher_id, allotments).await?;
    }
    let (seed, recorded): (String, Vec<i64>) =
        sqlx::query_as("SELECT seed, winners FROM sale_draws WHERE voucher_id = $1")
            .bind(voucher_id)
            .fetch_one(&mut *tx)
            .await?;
    if seed != draw.seed || recorded != draw.winners {
        return Ok(Recorded::Refused(
            "another draw is recorded for this sale".into(),
        ));
    }
    tx.commit().await?;
    Ok(Recorded::Yes)
}

/// The first segment whose entries were not read from the build Postgres names its
/// current one (read under no epoch, or another); a segment Postgres names none for
/// (never built by a release that knows epochs) passes.
async fn read_from_an_older_build(
    tx: &mut Transaction<'_, Postgres>,
    voucher_id: VoucherId,
    epochs: &[Option<Epoch>],
) -> Result<Option<i16>, sqlx::Error> {
    Ok(super::epochs::of_sale(tx, voucher_id)
        .await?
        .into_iter()
        .find(|(segment, epoch)| epochs.get(*segment as usize).copied().flatten() != Some(*epoch))
        .map(|(segment, _)| segment))
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
