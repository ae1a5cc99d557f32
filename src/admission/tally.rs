//! Each sale's grab outcomes, counted for the live view (`/live`) across every API
//! instance: counted in memory per process (one lock per admission call, not per grab)
//! and added to one Redis hash per sale every second, which every instance reads. The
//! admission script stays as it is: these counts are an observation, never a decision.
//!
//! Counts survive as long as the hash ([`RETAIN`] after the last grab); a Redis restart
//! loses them (the orders, which are what matters, are in Postgres).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use redis::aio::ConnectionLike;

use super::Outcome;
use crate::keys::Keys;

/// The outcomes counted, in the order of [`Counts`].
pub const OUTCOMES: [&str; 6] = [
    "admitted",
    "sold_out",
    "already_ordered",
    "rate_limited",
    "not_started",
    "ended",
];

pub const RATE_LIMITED: usize = 3;

/// Counts per outcome, indexed as [`OUTCOMES`].
pub type Counts = [u64; OUTCOMES.len()];

/// Sales counted between flushes, at most: grabs for made-up voucher ids while Redis is
/// away must not grow the map without end (beyond it, new sales' counts are dropped).
const MAX_SALES: usize = 10_000;

/// How long a sale's counts stay in Redis after its last grab.
pub const RETAIN: Duration = Duration::from_secs(7 * 24 * 3600);

/// The index of `outcome` in [`OUTCOMES`], for the grab that minted `minted`; `None`
/// for a sale not in Redis (perhaps no sale at all: not worth a key).
pub fn index(outcome: &Outcome, minted: i64) -> Option<usize> {
    Some(match outcome {
        Outcome::Admitted { .. } => 0,
        // The script ran twice for this grab (a re-sent call): still its admission.
        Outcome::AlreadyOrdered { order_id } if *order_id == minted => 0,
        Outcome::SoldOut => 1,
        Outcome::AlreadyOrdered { .. } => 2,
        Outcome::NotStarted => 4,
        Outcome::Ended => 5,
        Outcome::NotLoaded => return None,
    })
}

/// This process's counts since the last flush.
#[derive(Default)]
pub struct Tally {
    counts: Mutex<HashMap<i64, Counts>>,
}

impl Tally {
    /// Adds one to `voucher_id`'s count of outcome `index`.
    pub fn add(&self, voucher_id: i64, index: usize) {
        self.add_all(std::iter::once((voucher_id, index)));
    }

    /// Adds each `(voucher_id, outcome index)`, under one lock.
    pub fn add_all(&self, outcomes: impl IntoIterator<Item = (i64, usize)>) {
        let mut counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        for (voucher_id, index) in outcomes {
            if counts.len() < MAX_SALES || counts.contains_key(&voucher_id) {
                counts.entry(voucher_id).or_default()[index] += 1;
            }
        }
    }

    fn take(&self) -> HashMap<i64, Counts> {
        std::mem::take(&mut *self.counts.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Adds the counts since the last flush to Redis; on failure what was not written
    /// is kept for the next flush (nothing counted is lost while Redis is away, only
    /// delayed).
    pub async fn flush<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        keys: &Keys,
    ) -> redis::RedisResult<()> {
        let mut left: Vec<(i64, Counts)> = self.take().into_iter().collect();
        while let Some((voucher_id, counts)) = left.pop() {
            let key = keys.live_counts(voucher_id);
            // Rate limiting comes before anything knows whether the sale exists: such
            // counts alone go only to a sale already counted, so that made-up voucher
            // ids cannot create keys.
            let decided = counts
                .iter()
                .enumerate()
                .any(|(i, &n)| i != RATE_LIMITED && n > 0);
            if !decided {
                let exists: bool = match redis::cmd("EXISTS").arg(&key).query_async(conn).await {
                    Ok(exists) => exists,
                    Err(e) => {
                        left.push((voucher_id, counts));
                        self.put_back(left);
                        return Err(e);
                    }
                };
                if !exists {
                    continue;
                }
            }
            let mut pipe = redis::pipe();
            for (field, &n) in OUTCOMES.iter().zip(&counts) {
                if n > 0 {
                    pipe.hincr(&key, *field, n).ignore();
                }
            }
            pipe.expire(&key, RETAIN.as_secs() as i64).ignore();
            // (One key per pipeline: valid on a cluster.)
            if let Err(e) = pipe.query_async::<()>(conn).await {
                left.push((voucher_id, counts));
                self.put_back(left);
                return Err(e);
            }
        }
        Ok(())
    }

    fn put_back(&self, unwritten: Vec<(i64, Counts)>) {
        let mut all = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        for (voucher_id, counts) in unwritten {
            if all.len() >= MAX_SALES && !all.contains_key(&voucher_id) {
                continue;
            }
            let entry = all.entry(voucher_id).or_default();
            for (sum, n) in entry.iter_mut().zip(counts) {
                *sum += n;
            }
        }
    }
}

/// The counts in Redis for each of `voucher_ids` (zeros for a sale without any).
pub async fn read<C: ConnectionLike + Send + Clone>(
    conn: &C,
    keys: &Keys,
    voucher_ids: &[i64],
) -> redis::RedisResult<Vec<Counts>> {
    let reads = voucher_ids.iter().map(|&voucher_id| {
        let mut conn = conn.clone();
        let cmd = redis::cmd("HMGET")
            .arg(keys.live_counts(voucher_id))
            .arg(&OUTCOMES[..])
            .clone();
        async move {
            let values: Vec<Option<u64>> = cmd.query_async(&mut conn).await?;
            let mut counts = Counts::default();
            for (c, v) in counts.iter_mut().zip(values) {
                *c = v.unwrap_or(0);
            }
            Ok::<_, redis::RedisError>(counts)
        }
    });
    futures_util::future::try_join_all(reads).await
}
