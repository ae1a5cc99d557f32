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
//! (admitted, sold out, ...): grabs at made-up voucher ids cost nothing here. So are the
//! grabs answered 503 because the admission call failed ([`ERRORS`]).
//!
//! Each batch also carries its recent figures: its grabs, its errors, and how long each
//! grab waited for its admission call, by bucket ([`LATENCY_BOUNDS`]). Redis adds them to
//! the current second's cell, by its own clock, of a small ring in the same hash, so the
//! live view reads the last seconds' rates, error rate and admission time from any
//! instance at any moment ([`read_live`]): a page opening mid-sale shows them at once.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::ConnectionLike;
use redis::Script;

use super::Outcome;
use crate::domain::{OrderId, VoucherId};
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

pub const SOLD_OUT: usize = 1;
pub const RATE_LIMITED: usize = 3;
/// The count of grabs answered at the edge (see [`OUTCOMES`]).
pub const AT_EDGE: usize = 6;

/// Counts per outcome, indexed as [`OUTCOMES`].
pub type Counts = [u64; OUTCOMES.len()];

/// Grabs answered `503` by the admission call, counted per sale as [`OUTCOMES`] are:
/// nothing was reserved (Redis refused the call or could not be reached, or the sale is
/// being rebuilt from Postgres), or the outcome is unknown (Redis may have run the call;
/// its answer did not come). As `http::seckill::answer` tells them apart.
pub const ERRORS: [&str; 2] = ["unavailable", "unknown"];
pub const UNAVAILABLE: usize = 0;
pub const UNKNOWN: usize = 1;

/// Upper bounds, in seconds, of the buckets timing each grab's wait for its admission
/// call (queued behind its shard's call in flight, then its own): those of
/// `seckill_admission_duration_seconds` up to the default request timeout. One more
/// bucket holds the grabs above the last bound.
pub const LATENCY_BOUNDS: [f64; 14] = [
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];
pub const LATENCY_BUCKETS: usize = LATENCY_BOUNDS.len() + 1;

/// Cells (seconds) in each sale's ring of recent figures.
const RING: u64 = 8;
/// The recent figures are those of this many whole seconds before the current one (by
/// Redis's clock): every instance flushes once a second, so each adds to every second.
pub const WINDOW_SECS: u64 = 5;
/// A ring cell's values: grabs, errors, then [`LATENCY_BUCKETS`].
const CELL_VALUES: usize = 2 + LATENCY_BUCKETS;

/// The bucket of a wait of `took`.
fn latency_bucket(took: Duration) -> usize {
    let secs = took.as_secs_f64();
    LATENCY_BOUNDS
        .iter()
        .position(|&bound| secs <= bound)
        .unwrap_or(LATENCY_BOUNDS.len())
}

/// How one admission call answered a grab, for [`Tally::add_answers`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// Decided: the index in [`OUTCOMES`].
    Outcome(usize),
    /// Refused with a 503 by a sale that exists (its Redis state is being rebuilt).
    Refused,
    /// The call failed: the index in [`ERRORS`].
    Failed(usize),
}

/// How `answer` counts for the grab that minted `minted`; `None` for a grab at a sale
/// not in Redis (perhaps no sale at all: not worth a key).
pub fn answer(answer: &redis::RedisResult<Outcome>, minted: OrderId) -> Option<Answer> {
    match answer {
        Ok(Outcome::Stale | Outcome::Corrupt | Outcome::Held | Outcome::Fenced) => {
            Some(Answer::Refused)
        }
        Ok(outcome) => index(outcome, minted).map(Answer::Outcome),
        Err(e) => Some(failure(e)),
    }
}

/// How a call that failed counts (whatever grabs it carried).
pub fn failure(e: &redis::RedisError) -> Answer {
    // Surely not run: no connection was made, or Redis refused with an error reply.
    if e.is_connection_refusal() || matches!(e.kind(), redis::ErrorKind::Server(_)) {
        Answer::Failed(UNAVAILABLE)
    } else {
        Answer::Failed(UNKNOWN)
    }
}

/// Sales counted between flushes, and sales known, at most (beyond it, new sales'
/// counts are dropped).
const MAX_SALES: usize = 10_000;

/// How long a sale's counts stay in Redis after its last grab.
pub const RETAIN: Duration = Duration::from_secs(7 * 24 * 3600);

/// The index of `outcome` in [`OUTCOMES`], for the grab that minted `minted`; `None`
/// for a sale not in Redis (perhaps no sale at all: not worth a key).
pub fn index(outcome: &Outcome, minted: OrderId) -> Option<usize> {
    match outcome {
        // The script ran twice for this grab (a re-sent call): still its admission.
        Outcome::AlreadyOrdered { order_id } if *order_id == minted => Some(0),
        other => counted(other),
    }
}

/// The index of `outcome` in [`OUTCOMES`], when the live view counts it.
pub fn counted(outcome: &Outcome) -> Option<usize> {
    Some(match outcome {
        Outcome::Admitted { .. } => 0,
        Outcome::SoldOut => SOLD_OUT,
        Outcome::AlreadyOrdered { .. } => 2,
        Outcome::RateLimited { .. } => RATE_LIMITED,
        Outcome::NotStarted => 4,
        Outcome::Ended => 5,
        // (A drained segment's grab is decided again once units moved: counted then.)
        _ => return None,
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

/// One sale's counts of a batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct SaleCounts {
    outcomes: Counts,
    errors: [u64; ERRORS.len()],
    latency: [u64; LATENCY_BUCKETS],
}

impl SaleCounts {
    /// Its total fields and counts to add (the counts that are not 0).
    fn totals(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        OUTCOMES
            .iter()
            .zip(&self.outcomes)
            .chain(ERRORS.iter().zip(&self.errors))
            .filter(|(_, &n)| n > 0)
            .map(|(&f, &n)| (f, n))
    }

    /// Its values for the current second's ring cell (see `lua/add_live_counts.lua`):
    /// grabs (every answer, those at the edge once), errors, admission waits by bucket.
    fn recent(&self) -> [u64; CELL_VALUES] {
        let errors: u64 = self.errors.iter().sum();
        let mut cell = [0; CELL_VALUES];
        cell[0] = self.outcomes[..AT_EDGE].iter().sum::<u64>() + errors;
        cell[1] = errors;
        cell[2..].copy_from_slice(&self.latency);
        cell
    }
}

#[derive(Default)]
struct State {
    /// Counts since each sale's batch was formed, not yet part of one.
    counts: HashMap<VoucherId, SaleCounts>,
    /// Each sale's batch sent and not yet acknowledged: sent again, unchanged, until
    /// Redis answers, and only then does the sale's next batch form. Its answer may
    /// have been lost after Redis added it, so it must never be merged or re-numbered.
    /// (Ordered by sale only so that flushes are repeatable.)
    batches: BTreeMap<VoucherId, Batch>,
    /// The last sequence number given to a batch (of any sale).
    seq: u64,
    /// Sales whose admission script answered here: they exist.
    known: HashSet<VoucherId>,
}

#[derive(Clone, Copy)]
struct Batch {
    seq: u64,
    counts: SaleCounts,
}

impl State {
    /// `voucher_id`'s counts to add to, unless too many sales are counted already.
    fn counts(&mut self, voucher_id: VoucherId) -> Option<&mut SaleCounts> {
        if self.counts.len() >= MAX_SALES && !self.counts.contains_key(&voucher_id) {
            return None;
        }
        Some(self.counts.entry(voucher_id).or_default())
    }

    /// Whether an answer of `voucher_id`'s that does not show the sale exists (rate
    /// limited, a failed call) is counted: only for a sale seen decided. Any other
    /// answer shows it exists.
    fn counted(&mut self, voucher_id: VoucherId, shows_it_exists: bool) -> bool {
        if !shows_it_exists {
            return self.known.contains(&voucher_id);
        }
        if self.known.len() < MAX_SALES {
            self.known.insert(voucher_id);
        }
        true
    }

    /// Every sale's batch to send now: the unacknowledged ones as they were, and a new
    /// one for each other sale with counts.
    fn batches(&mut self) -> Vec<(VoucherId, Batch)> {
        let counted: Vec<VoucherId> = self
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
    pub fn add(&self, voucher_id: VoucherId, index: usize) {
        self.add_all(std::iter::once((voucher_id, index)));
    }

    /// Adds one to `voucher_id`'s count of outcome `index`, answered at the edge.
    pub fn add_at_edge(&self, voucher_id: VoucherId, index: usize) {
        self.add_all([(voucher_id, index), (voucher_id, AT_EDGE)]);
    }

    /// Adds each `(voucher_id, outcome index)`, under one lock.
    pub fn add_all(&self, outcomes: impl IntoIterator<Item = (VoucherId, usize)>) {
        let mut state = self.lock();
        for (voucher_id, index) in outcomes {
            if !state.counted(voucher_id, index != RATE_LIMITED) {
                continue;
            }
            if let Some(counts) = state.counts(voucher_id) {
                counts.outcomes[index] += 1;
            }
        }
    }

    /// Adds each grab's `(voucher_id, answer, wait)` from admission calls (the answer
    /// and how long the grab waited for it), under one lock.
    pub fn add_answers(&self, answers: impl IntoIterator<Item = (VoucherId, Answer, Duration)>) {
        let mut state = self.lock();
        for (voucher_id, answer, took) in answers {
            if !state.counted(voucher_id, !matches!(answer, Answer::Failed(_))) {
                continue;
            }
            let Some(counts) = state.counts(voucher_id) else {
                continue;
            };
            match answer {
                Answer::Outcome(index) => counts.outcomes[index] += 1,
                Answer::Refused => counts.errors[UNAVAILABLE] += 1,
                Answer::Failed(index) => counts.errors[index] += 1,
            }
            counts.latency[latency_bucket(took)] += 1;
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
                .arg(RETAIN.as_secs())
                .arg(RING)
                .arg(CELL_VALUES)
                .arg(batch.counts.totals().count());
            for (field, n) in batch.counts.totals() {
                call.arg(field).arg(n);
            }
            let recent = batch.counts.recent();
            if recent[0] > 0 {
                for (i, &n) in recent.iter().enumerate().filter(|(_, &n)| n > 0) {
                    call.arg(i).arg(n);
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
    voucher_ids: &[VoucherId],
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

static READ: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../lua/read_live_counts.lua")));

/// A sale's counts as the live view shows them: the totals and the recent figures.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ShownCounts {
    pub outcomes: Counts,
    /// Indexed as [`ERRORS`].
    pub errors: [u64; ERRORS.len()],
    pub recent: Recent,
}

/// A sale's figures of the last [`WINDOW_SECS`] whole seconds, all instances together.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Recent {
    pub grabs: u64,
    pub errors: u64,
    /// Grabs by how long they waited for their admission call ([`LATENCY_BOUNDS`]).
    pub latency: [u64; LATENCY_BUCKETS],
}

impl Recent {
    /// From a ring cell's values (as [`SaleCounts::recent`] makes them), summed.
    fn from_cell(values: &[u64]) -> Self {
        let value = |i: usize| values.get(i).copied().unwrap_or(0);
        let mut recent = Self {
            grabs: value(0),
            errors: value(1),
            ..Self::default()
        };
        for (i, n) in recent.latency.iter_mut().enumerate() {
            *n = value(2 + i);
        }
        recent
    }

    /// Grabs a second over the window, to a tenth.
    pub fn grabs_per_sec(&self) -> f64 {
        per_sec(self.grabs)
    }

    /// Grabs answered 503 a second over the window, to a tenth.
    pub fn errors_per_sec(&self) -> f64 {
        per_sec(self.errors)
    }

    /// The `q`-quantile of the admission waits, in seconds, as Prometheus's
    /// `histogram_quantile` estimates it from the buckets (linear within a bucket; the
    /// last bound when it falls above it); `None` without a wait in the window.
    pub fn latency_quantile(&self, q: f64) -> Option<f64> {
        let total: u64 = self.latency.iter().sum();
        if total == 0 {
            return None;
        }
        let rank = q.clamp(0.0, 1.0) * total as f64;
        let mut below = 0u64;
        for (i, &n) in self.latency.iter().enumerate() {
            if n > 0 && (below + n) as f64 >= rank {
                let Some(&upper) = LATENCY_BOUNDS.get(i) else {
                    return LATENCY_BOUNDS.last().copied();
                };
                let lower = if i == 0 { 0.0 } else { LATENCY_BOUNDS[i - 1] };
                return Some(lower + (upper - lower) * (rank - below as f64) / n as f64);
            }
            below += n;
        }
        LATENCY_BOUNDS.last().copied()
    }
}

fn per_sec(n: u64) -> f64 {
    (n as f64 / WINDOW_SECS as f64 * 10.0).round() / 10.0
}

/// The counts in Redis for each of `voucher_ids` (zeros for a sale without any), with
/// their recent figures: the last [`WINDOW_SECS`] whole seconds', by the clock of the
/// Redis server holding each (`lua/read_live_counts.lua`).
pub async fn read_live<C: ConnectionLike + Send + Clone>(
    conn: &C,
    keys: &Keys,
    voucher_ids: &[VoucherId],
) -> redis::RedisResult<Vec<ShownCounts>> {
    let reads = voucher_ids.iter().map(|&voucher_id| {
        let mut conn = conn.clone();
        let mut call = READ.key(keys.live_counts(voucher_id));
        call.arg(RING)
            .arg(CELL_VALUES)
            .arg(WINDOW_SECS)
            .arg(&OUTCOMES[..])
            .arg(&ERRORS[..]);
        async move {
            let (totals, recent): (Vec<Option<u64>>, Vec<u64>) =
                call.invoke_async(&mut conn).await?;
            let mut live = ShownCounts::default();
            let counts = live.outcomes.iter_mut().chain(live.errors.iter_mut());
            for (c, n) in counts.zip(totals) {
                *c = n.unwrap_or(0);
            }
            live.recent = Recent::from_cell(&recent);
            Ok::<_, redis::RedisError>(live)
        }
    });
    futures_util::future::try_join_all(reads).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_goes_to_the_first_bucket_whose_bound_it_does_not_exceed() {
        assert_eq!(latency_bucket(Duration::from_micros(100)), 0);
        assert_eq!(latency_bucket(Duration::from_micros(500)), 0);
        assert_eq!(latency_bucket(Duration::from_micros(501)), 1);
        assert_eq!(latency_bucket(Duration::from_millis(3)), 3);
        assert_eq!(
            latency_bucket(Duration::from_secs(60)),
            LATENCY_BOUNDS.len()
        );
    }

    #[test]
    fn the_rates_are_the_windows_counts_a_second() {
        let recent = Recent::from_cell(&[30, 3, 30]);
        assert_eq!(
            (recent.grabs, recent.errors, recent.latency[0]),
            (30, 3, 30)
        );
        assert_eq!(recent.grabs_per_sec(), 6.0);
        assert_eq!(recent.errors_per_sec(), 0.6);
    }

    #[test]
    fn the_quantile_is_estimated_from_the_buckets_as_prometheus_does() {
        let mut recent = Recent::default();
        assert_eq!(
            recent.latency_quantile(0.99),
            None,
            "no wait: unknown, not 0"
        );
        // 90 waits up to 0.5 ms, 10 between 1 and 2 ms.
        recent.latency[0] = 90;
        recent.latency[2] = 10;
        let p99 = recent.latency_quantile(0.99).unwrap();
        assert!((p99 - 0.0019).abs() < 1e-9, "{p99}");
        let p50 = recent.latency_quantile(0.5).unwrap();
        assert!((p50 - 0.0005 * 50.0 / 90.0).abs() < 1e-9, "{p50}");
        // Above the last bound: the last bound.
        recent.latency[LATENCY_BOUNDS.len()] = 1000;
        assert_eq!(recent.latency_quantile(0.99), Some(10.0));
    }

    #[test]
    fn a_batch_sends_its_totals_that_are_not_zero_and_its_recent_cell() {
        let mut counts = SaleCounts::default();
        counts.outcomes[0] = 2; // admitted
        counts.outcomes[1] = 3; // sold out
        counts.outcomes[AT_EDGE] = 3; // of which at the edge
        counts.errors[UNKNOWN] = 1;
        counts.latency[1] = 3;
        let totals: Vec<_> = counts.totals().collect();
        assert_eq!(
            totals,
            [
                ("admitted", 2),
                ("sold_out", 3),
                ("at_edge", 3),
                ("unknown", 1)
            ]
        );
        let cell = counts.recent();
        assert_eq!(&cell[..4], &[6, 1, 0, 3]);
    }

    #[test]
    fn a_failed_call_counts_only_for_a_sale_seen_decided() {
        let tally = Tally::default();
        let ms = Duration::from_millis(1);
        let one = VoucherId::new(1).unwrap();
        tally.add_answers([(one, Answer::Failed(UNKNOWN), ms)]);
        assert!(
            tally.lock().counts.is_empty(),
            "an unknown voucher costs nothing"
        );
        tally.add_answers([
            (one, Answer::Outcome(0), ms),
            (one, Answer::Failed(UNKNOWN), ms),
            (one, Answer::Refused, ms),
        ]);
        let state = tally.lock();
        let counts = state.counts[&one];
        assert_eq!(counts.outcomes[0], 1);
        assert_eq!(counts.errors, [1, 1]);
        assert_eq!(counts.latency[latency_bucket(ms)], 3);
    }
}
