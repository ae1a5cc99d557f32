//! Each sale's grab outcomes, counted for the live view (`/live`) across every API
//! instance: counted in memory per process (one lock per admission call, not per grab)
//! and added to one Redis hash per sale every second, which every instance reads. The
//! admission script stays as it is: these counts are an observation, never a decision.
//!
//! Counts survive as long as the hash ([`RETAIN`] after the last grab); a Redis restart
//! loses them (the orders, which are what matters, are in Postgres). Each sale's counts
//! go as numbered batches that Redis adds at most once (the hash keeps, per process, the
//! last number added: one `seq:<process id>` field per process that counted the sale,
//! gone with the hash), so a batch whose answer was lost (a timeout, a dropped
//! connection) is sent again unchanged until answered: counted neither twice nor never,
//! while the process lives. One sale failing (its cluster node down) holds no other
//! back. The process's last flush comes after its last request.
//!
//! Rate limiting answers before anything knows whether the sale exists, so a
//! `rate_limited` grab is counted only for a sale this process has seen decided
//! (admitted, sold out, ...): grabs at made-up voucher ids cost nothing here.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::ConnectionLike;
use redis::Script;

use super::Outcome;
use crate::keys::Keys;

/// The outcomes counted, in the order of [`Counts`]; and last, how many of them an
/// instance answered at the edge, without Redis (a subset of the others, not an outcome).
pub const OUTCOMES: [&str; 7] = [
    "admitted",
    "sold_out",
    "already_ordered",
    "rate_limited",
    "not_started",
    "ended",
    "at_edge",
];

pub const RATE_LIMITED: usize = 3;
/// The count of grabs answered at the edge (see [`OUTCOMES`]).
pub const AT_EDGE: usize = 6;

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
        Outcome::NotLoaded | Outcome::Stale | Outcome::Corrupt => return None,
    })
}

/// This process's counts not yet in Redis.
pub struct Tally {
    state: Mutex<State>,
    /// This process's field in every sale's hash (`seq:<random id>`): unique to this
    /// process's lifetime, so its sequence numbers never meet another's.
    seq_field: String,
}

impl Default for Tally {
    fn default() -> Self {
        Self {
            state: Mutex::default(),
            seq_field: format!("seq:{:016x}", rand::random::<u64>()),
        }
    }
}

#[derive(Default)]
struct State {
    /// Counts since each sale's batch was formed, not yet part of one.
    counts: HashMap<i64, Counts>,
    /// Each sale's batch sent and not yet acknowledged: sent again, unchanged, until
    /// Redis answers, and only then does the sale's next batch form. Its answer may
    /// have been lost after Redis added it, so it must never be merged or re-numbered.
    /// (Ordered by sale only so that flushes are repeatable.)
    batches: BTreeMap<i64, Batch>,
    /// The last sequence number given to a batch (of any sale).
    seq: u64,
    /// Sales whose admission script answered here: they exist.
    known: HashSet<i64>,
}

#[derive(Clone, Copy)]
struct Batch {
    seq: u64,
    counts: Counts,
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

    /// Every sale's batch to send now: the unacknowledged ones as they were, and a new
    /// one for each other sale with counts.
    fn batches(&mut self) -> Vec<(i64, Batch)> {
        let counted: Vec<i64> = self
            .counts
            .keys()
            .filter(|v| !self.batches.contains_key(v))
            .copied()
            .collect();
        for voucher_id in counted {
            if let Some(counts) = self.counts.remove(&voucher_id) {
                self.seq += 1;
                let seq = self.seq;
                self.batches.insert(voucher_id, Batch { seq, counts });
            }
        }
        self.batches.iter().map(|(&v, &b)| (v, b)).collect()
    }
}

/// Sales' batches in flight at once in one flush (each one script call).
const CONCURRENT_SALES: usize = 32;

static ADD: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../lua/add_live_counts.lua")));

impl Tally {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds one to `voucher_id`'s count of outcome `index`.
    pub fn add(&self, voucher_id: i64, index: usize) {
        self.add_all(std::iter::once((voucher_id, index)));
    }

    /// Adds one to `voucher_id`'s count of outcome `index`, answered at the edge.
    pub fn add_at_edge(&self, voucher_id: i64, index: usize) {
        self.add_all([(voucher_id, index), (voucher_id, AT_EDGE)]);
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

    /// Adds the counts not yet in Redis, each sale's as one batch (one script call on
    /// one key: valid on a cluster), several sales at once. A batch counts once however
    /// often it is sent (`lua/add_live_counts.lua`), so one whose answer is lost (an
    /// error, a timeout, the future dropped) is sent again as it was by the next flush.
    /// One sale failing holds no other back: the error returned is the first of them,
    /// after every sale was tried.
    pub async fn flush<C: ConnectionLike + Send + Clone>(
        &self,
        conn: &C,
        keys: &Keys,
    ) -> redis::RedisResult<()> {
        let batches = self.lock().batches();
        let sends = batches.into_iter().map(|(voucher_id, batch)| {
            let mut conn = conn.clone();
            let mut call = ADD.key(keys.live_counts(voucher_id));
            call.arg(&self.seq_field)
                .arg(batch.seq)
                .arg(RETAIN.as_secs());
            for (field, &n) in OUTCOMES.iter().zip(&batch.counts) {
                if n > 0 {
                    call.arg(*field).arg(n);
                }
            }
            async move {
                call.invoke_async::<i64>(&mut conn).await?;
                // Acknowledged (added now or before): the sale's next batch may form.
                let mut state = self.lock();
                if state.batches.get(&voucher_id).map(|b| b.seq) == Some(batch.seq) {
                    state.batches.remove(&voucher_id);
                }
                Ok(())
            }
        });
        let results: Vec<redis::RedisResult<()>> = futures_util::stream::iter(sends)
            .buffer_unordered(CONCURRENT_SALES)
            .collect()
            .await;
        results.into_iter().collect()
    }

    /// Flushes every `every` (each flush cut off after `deadline`: what it did not get
    /// answered is sent by the next) until `stop` resolves (the last request answered);
    /// then flushes what is left, trying for up to `last_deadline`. On a task of its
    /// own: a slow Redis delays no live snapshot.
    pub async fn keep_flushing<C: ConnectionLike + Send + Clone>(
        self: Arc<Self>,
        conn: C,
        keys: Keys,
        every: Duration,
        deadline: Duration,
        stop: impl Future<Output = ()>,
        last_deadline: Duration,
    ) {
        let mut ticks = tokio::time::interval(every);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::pin!(stop);
        loop {
            tokio::select! {
                biased;
                _ = &mut stop => break,
                _ = ticks.tick() => {}
            }
            match tokio::time::timeout(deadline, self.flush(&conn, &keys)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "grab counts not flushed yet; kept for the next flush")
                }
                Err(_) => tracing::debug!("grab counts flush cut off; the rest goes next time"),
            }
        }
        // No later flush to leave a failure to: try again until the deadline.
        let flushed = tokio::time::timeout(last_deadline, async {
            while self.flush(&conn, &keys).await.is_err() {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
        .await;
        if flushed.is_err() {
            tracing::warn!("the last grab counts were not written to Redis");
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
