//! A lottery sale's held presses. In its window a press makes its shopper an entrant
//! (one entry per shopper, under the order id minted for the first press) and is held;
//! the first admission call after the window draws (`lua/seckill.lua`, draw_lottery),
//! and each held press then learns its answer by grabbing again under the order id it
//! entered with: its own order (drawn, a 202) or `sold_out`. The draw's record, left in
//! the sale's Redis state, is copied to Postgres (`sale_draws`) by whoever sees it first.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use crate::domain::VoucherId;
use crate::keys::{Keys, SaleSegment};
use crate::redis_conn::RedisConn;
use crate::store;

/// How long after its window a held press may wait for the draw's answer.
pub const ANSWER_WITHIN: Duration = Duration::from_millis(500);

/// The lottery sales this instance holds presses for: their windows' ends, and whether
/// their draw's record is in Postgres.
#[derive(Default)]
pub struct Lottery {
    ends: Mutex<HashMap<VoucherId, Option<DateTime<Utc>>>>,
    recorded: Mutex<HashSet<VoucherId>>,
}

impl Lottery {
    /// When the sale's entry window ends (`None`: not a lottery), asked of Postgres once.
    pub async fn window_end(
        &self,
        db: &PgPool,
        voucher_id: VoucherId,
    ) -> Result<Option<DateTime<Utc>>, sqlx::Error> {
        if let Some(end) = lock(&self.ends).get(&voucher_id) {
            return Ok(*end);
        }
        let end = store::draws::window_end(db, voucher_id).await?;
        lock(&self.ends).insert(voucher_id, end);
        Ok(end)
    }

    /// Copies the draw's record from the sale's Redis state to Postgres, once.
    pub async fn record(&self, db: &PgPool, redis: &RedisConn, keys: &Keys, voucher_id: VoucherId) {
        // Claimed first: thousands of held presses end together, one copy is enough.
        if !lock(&self.recorded).insert(voucher_id) {
            return;
        }
        let copied = copy_draw(db, redis, keys, voucher_id).await;
        if let Err(e) = &copied {
            tracing::warn!(voucher_id = voucher_id.get(), error = %e,
                "the draw's record could not be copied to postgres (tried again by the next press)");
        }
        if !matches!(copied, Ok(true)) {
            lock(&self.recorded).remove(&voucher_id);
        }
    }
}

/// The draw's record in Redis, written to Postgres (`false`: not drawn yet).
pub async fn copy_draw(
    db: &PgPool,
    redis: &RedisConn,
    keys: &Keys,
    voucher_id: VoucherId,
) -> anyhow::Result<bool> {
    let key = keys.segment(SaleSegment::new(voucher_id, 0, 1));
    let mut conn = redis.clone();
    let [seed, drawn_ms, entrants, winners]: [Option<String>; 4] = redis::cmd("HMGET")
        .arg(&key)
        .arg(&["lottery_seed", "drawn_ms", "draw_entrants", "draw_winners"])
        .query_async::<Vec<Option<String>>>(&mut conn)
        .await?
        .try_into()
        .map_err(|_| anyhow::anyhow!("HMGET of four fields answered otherwise"))?;
    let (Some(seed), Some(drawn_ms)) = (seed, drawn_ms) else {
        return Ok(false);
    };
    let drawn_at = DateTime::from_timestamp_millis(drawn_ms.parse()?)
        .ok_or_else(|| anyhow::anyhow!("drawn_ms out of range"))?;
    let draw = store::draws::Draw {
        seed,
        entrants: ids(entrants.as_deref())?,
        winners: ids(winners.as_deref())?,
        drawn_at,
    };
    store::draws::insert(db, voucher_id, &draw).await?;
    Ok(true)
}

fn ids(joined: Option<&str>) -> anyhow::Result<Vec<i64>> {
    match joined {
        None | Some("") => Ok(Vec::new()),
        Some(s) => Ok(s.split(',').map(str::parse).collect::<Result<_, _>>()?),
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
