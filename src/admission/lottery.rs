//! A lottery sale's held presses. In its window a press makes its shopper an entrant
//! (one entry per shopper, under the order id minted for the first press) and is held;
//! the first admission call after the window draws (`lua/seckill.lua`, draw_lottery).
//! Then one held press per instance grabs again, which draws if nobody has yet, and
//! reads the draw's record from the sale's Redis state; every other held press of the
//! instance is answered from that record (its shopper drawn: the 202 of the order it
//! entered under; not: `sold_out`), so thousands of held presses cost Redis one call
//! and one read per instance. The record is copied to Postgres (`sale_draws`) then.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use tokio::sync::OnceCell;

use crate::domain::VoucherId;
use crate::keys::{Keys, SaleSegment};
use crate::redis_conn::RedisConn;
use crate::store;
use crate::store::draws::Draw;

/// How long after its window a held press may wait for the draw's answer.
pub const ANSWER_WITHIN: Duration = Duration::from_millis(500);

/// A draw as a held press needs it: who entered, who won (user ids).
#[derive(Debug, Default)]
pub struct Drawn {
    pub entrants: HashSet<i64>,
    pub winners: HashSet<i64>,
}

impl From<Draw> for Drawn {
    fn from(d: Draw) -> Self {
        Self {
            entrants: d.entrants.into_iter().collect(),
            winners: d.winners.into_iter().collect(),
        }
    }
}

/// The lottery sales this instance holds presses for: their windows' ends, and their
/// draws once read.
#[derive(Default)]
pub struct Lottery {
    ends: Mutex<HashMap<VoucherId, Option<DateTime<Utc>>>>,
    drawn: Mutex<HashMap<VoucherId, Arc<OnceCell<Arc<Drawn>>>>>,
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

    /// The sale's draw, once some held press of this instance has read it; `None`: it
    /// may still be read (the one reading now failed, or the draw is not done).
    pub fn draw_of(&self, voucher_id: VoucherId) -> Arc<OnceCell<Arc<Drawn>>> {
        lock(&self.drawn).entry(voucher_id).or_default().clone()
    }
}

/// The draw's record in the sale's Redis state, copied to Postgres (where a record of
/// it already is, it stays; while Postgres is down, the next reader copies it);
/// `None`: not drawn.
pub async fn copy_draw(
    db: &PgPool,
    redis: &RedisConn,
    keys: &Keys,
    voucher_id: VoucherId,
) -> anyhow::Result<Option<Draw>> {
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
        return Ok(None);
    };
    let draw = Draw {
        seed,
        entrants: ids(entrants.as_deref())?,
        winners: ids(winners.as_deref())?,
        drawn_at: DateTime::from_timestamp_millis(drawn_ms.parse()?)
            .ok_or_else(|| anyhow::anyhow!("drawn_ms out of range"))?,
    };
    if let Err(e) = store::draws::insert(db, voucher_id, &draw).await {
        tracing::warn!(voucher_id = voucher_id.get(), error = %e,
            "the draw's record is not in postgres yet (copied by the next reader)");
    }
    Ok(Some(draw))
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
