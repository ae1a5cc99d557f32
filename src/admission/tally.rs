//! Each sale's grab outcomes, counted for the live view (`/live`) across every API
//! instance: counted in memory per process (one lock per admission call, not per grab)
//! and added to one Redis hash per sale every second, which every instance reads. The
//! admission script stays as it is: these counts are an observation, never a decision.
//!
//! Counts survive as long as the hash ([`RETAIN`] after the last grab); a Redis restart
//! loses them (the orders, which are what matters, are in Postgres). A flush that fails
//! or is cut off (a timeout, shutdown) keeps what it had not written for the next one;
//! the process's last flush comes after its last request. A write whose answer was lost
//! after Redis applied it is written again: that sale's counts are then too high by one
//! second's worth, the one way they can be wrong.
//!
//! Rate limiting answers before anything knows whether the sale exists, so a
//! `rate_limited` grab is counted only for a sale this process has seen decided
//! (admitted, sold out, ...): grabs at made-up voucher ids cost nothing here.

use std::collections::{HashMap, HashSet};
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

/// Sales counted between flushes, and sales known, at most (beyond it, new sales'
/// counts are dropped).
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
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    counts: HashMap<i64, Counts>,
    /// Sales whose admission script answered here: they exist.
    known: HashSet<i64>,
}

impl State {
    fn add(&mut self, voucher_id: i64, counts: Counts) {
        if self.counts.len() >= MAX_SALES && !self.counts.contains_key(&voucher_id) {
            return;
        }
        let entry = self.counts.entry(voucher_id).or_default();
        for (sum, n) in entry.iter_mut().zip(counts) {
            *sum += n;
        }
    }
}

impl Tally {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds one to `voucher_id`'s count of outcome `index`.
    pub fn add(&self, voucher_id: i64, index: usize) {
        self.add_all(std::iter::once((voucher_id, index)));
    }

    /// Adds each `(voucher_id, outcome index)`, under one lock.
    pub fn add_all(&self, outcomes: impl IntoIterator<Item = (i64, usize)>) {
        let mut state = self.lock();
        for (voucher_id, index) in outcomes {
            if index == RATE_LIMITED {
                if !state.known.contains(&voucher_id) {
                    continue;
                }
            } else if state.known.len() < MAX_SALES {
                state.known.insert(voucher_id);
            }
            let mut one = Counts::default();
            one[index] = 1;
            state.add(voucher_id, one);
        }
    }

    fn take(&self) -> HashMap<i64, Counts> {
        std::mem::take(&mut self.lock().counts)
    }

    /// Adds the counts since the last flush to Redis, one pipeline per sale (one key
    /// each: valid on a cluster). Cancel-safe: what was not written, on an error or when
    /// the future is dropped, is kept for the next flush.
    pub async fn flush<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        keys: &Keys,
    ) -> redis::RedisResult<()> {
        let mut unwritten = Unwritten {
            tally: self,
            left: self.take().into_iter().collect(),
        };
        while let Some(&(voucher_id, counts)) = unwritten.left.last() {
            let key = keys.live_counts(voucher_id);
            let mut pipe = redis::pipe();
            for (field, &n) in OUTCOMES.iter().zip(&counts) {
                if n > 0 {
                    pipe.hincr(&key, *field, n).ignore();
                }
            }
            pipe.expire(&key, RETAIN.as_secs() as i64).ignore();
            pipe.query_async::<()>(conn).await?;
            unwritten.left.pop();
        }
        Ok(())
    }
}

/// A flush's counts not yet written: put back when it ends, however it ends.
struct Unwritten<'a> {
    tally: &'a Tally,
    left: Vec<(i64, Counts)>,
}

impl Drop for Unwritten<'_> {
    fn drop(&mut self) {
        if self.left.is_empty() {
            return;
        }
        let mut state = self.tally.lock();
        for (voucher_id, counts) in self.left.drain(..) {
            state.add(voucher_id, counts);
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
