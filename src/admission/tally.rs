//! Each sale's grab outcomes, counted for the live view (`/live`) across every API
//! instance: counted in memory per process (one lock per admission call, not per grab)
//! and added to one Redis hash per sale every second, which every instance reads. They
//! must be shared and exact: every instance shows the same sums, presses answered at
//! the edge (which never reach Redis) included. The admission script stays as it is:
//! these counts are an observation, never a decision. (How long admission takes is not
//! counted here: the live view reads it from this process's Prometheus recorder.)
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
//! Each batch also adds its grabs and errors to the current second's cell, by Redis's
//! own clock, of a small ring in the same hash, so that any instance reads the rates of
//! the last [`WINDOW_SECS`] whole seconds at any moment ([`read`]): a page opening
//! mid-sale, or on an instance that served none of the sale's grabs, shows them at once.

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

/// Grabs per outcome, indexed by [`Outcome::index`], each kept in the hash under its
/// label ([`Outcome::LABELS`]); only the outcomes [`counted`] are ever above 0.
pub type Counts = [u64; Outcome::LABELS.len()];

/// The hash field of the grabs an instance answered at the edge, without Redis (a
/// subset of the outcomes, not one).
pub const AT_EDGE: &str = "at_edge";

/// Grabs answered `503` by the admission call, counted per sale as outcomes are:
/// nothing was reserved (Redis refused the call or could not be reached, or the sale is
/// being rebuilt from Postgres), or the outcome is unknown (Redis may have run the call;
/// its answer did not come). As `http::seckill::answer` tells them apart.
pub const ERRORS: [&str; 2] = ["unavailable", "unknown"];

/// Cells (seconds) in each sale's ring of recent figures.
const RING: u64 = 8;
/// The recent figures are those of this many whole seconds before the current one (by
/// Redis's clock): every instance flushes once a second, so each adds to every second.
pub const WINDOW_SECS: u64 = 5;

/// Whether the live view counts `outcome` ([`Outcome::describe`]).
pub fn counted(outcome: &Outcome) -> bool {
    outcome.describe().counted
}

/// How one admission call answered a grab, for [`Tally::add_answers`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// Decided (counted when [`counted`]).
    Decided(Outcome),
    /// Refused with a 503 by a sale that exists (its Redis state is being rebuilt).
    Refused,
    /// The call failed: `unknown` when Redis may have run it (else nothing was
    /// reserved).
    Failed { unknown: bool },
}

/// How `answer` counts for the grab that minted `minted`; `None` for a grab at a sale
/// not in Redis (perhaps no sale at all: not worth a key).
pub fn answer(answer: &redis::RedisResult<Outcome>, minted: OrderId) -> Option<Answer> {
    match answer {
        Ok(
            Outcome::Stale | Outcome::Corrupt | Outcome::Held | Outcome::Fenced | Outcome::Evicting,
        ) => Some(Answer::Refused),
        // The script ran twice for this grab (a re-sent call): still its admission.
        Ok(Outcome::AlreadyOrdered { order_id }) if *order_id == minted => {
            Some(Answer::Decided(Outcome::Admitted { order_id: minted }))
        }
        Ok(outcome) => counted(outcome).then_some(Answer::Decided(*outcome)),
        Err(e) => Some(failure(e)),
    }
}

/// How a call that failed counts (whatever grabs it carried).
pub fn failure(e: &redis::RedisError) -> Answer {
    // Surely not run: no connection was made, or Redis refused with an error reply.
    let not_run = e.is_connection_refusal() || matches!(e.kind(), redis::ErrorKind::Server(_));
    Answer::Failed { unknown: !not_run }
}

/// Sales counted between flushes, and sales known, at most (beyond it, new sales'
/// counts are dropped).
const MAX_SALES: usize = 10_000;

/// How long a sale's counts stay in Redis after its last grab.
pub const RETAIN: Duration = Duration::from_secs(7 * 24 * 3600);

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

/// One sale's counts: of a batch, or read back from Redis.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SaleCounts {
    pub outcomes: Counts,
    pub at_edge: u64,
    /// Indexed as [`ERRORS`].
    pub errors: [u64; ERRORS.len()],
}

impl SaleCounts {
    /// The count of the outcome labelled `label` (0 for a label no outcome has).
    pub fn outcome(&self, label: &str) -> u64 {
        let index = Outcome::LABELS.iter().position(|l| *l == label);
        debug_assert!(index.is_some(), "no outcome is labelled {label}");
        index.map_or(0, |i| self.outcomes[i])
    }

    /// Every answer (those at the edge once), and the 503s among them.
    fn grabs_and_errors(&self) -> (u64, u64) {
        let errors = self.errors.iter().sum();
        (self.outcomes.iter().sum::<u64>() + errors, errors)
    }

    /// Its hash fields and counts, in [`fields`]' order.
    fn values(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        let counts = self
            .outcomes
            .iter()
            .chain([&self.at_edge])
            .chain(&self.errors);
        fields().zip(counts.copied())
    }

    fn from_values(values: impl IntoIterator<Item = u64>) -> Self {
        let mut counts = Self::default();
        let slots = (counts.outcomes.iter_mut())
            .chain([&mut counts.at_edge])
            .chain(&mut counts.errors);
        for (slot, n) in slots.zip(values) {
            *slot = n;
        }
        counts
    }
}

/// The hash fields of the totals: each outcome's label, [`AT_EDGE`], then [`ERRORS`].
fn fields() -> impl Iterator<Item = &'static str> {
    Outcome::LABELS.into_iter().chain([AT_EDGE]).chain(ERRORS)
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

    /// Counts `outcome` for `voucher_id`, if the live view counts it.
    pub fn add(&self, voucher_id: VoucherId, outcome: &Outcome) {
        self.add_answers([(voucher_id, Answer::Decided(*outcome))]);
    }

    /// Counts `outcome` for `voucher_id`, answered at the edge.
    pub fn add_at_edge(&self, voucher_id: VoucherId, outcome: &Outcome) {
        if !counted(outcome) {
            return;
        }
        let mut state = self.lock();
        // (Every outcome answered at the edge shows the sale exists.)
        state.counted(voucher_id, true);
        if let Some(counts) = state.counts(voucher_id) {
            counts.outcomes[outcome.index()] += 1;
            counts.at_edge += 1;
        }
    }

    /// Counts each grab's `(voucher_id, answer)`, under one lock.
    pub fn add_answers(&self, answers: impl IntoIterator<Item = (VoucherId, Answer)>) {
        let mut state = self.lock();
        for (voucher_id, answer) in answers {
            let shows_it_exists = match answer {
                Answer::Decided(outcome) if !counted(&outcome) => continue,
                Answer::Decided(outcome) => !matches!(outcome, Outcome::RateLimited { .. }),
                Answer::Refused => true,
                Answer::Failed { .. } => false,
            };
            if !state.counted(voucher_id, shows_it_exists) {
                continue;
            }
            let Some(counts) = state.counts(voucher_id) else {
                continue;
            };
            match answer {
                Answer::Decided(outcome) => counts.outcomes[outcome.index()] += 1,
                // (`ERRORS`: `unavailable`, then `unknown`.)
                Answer::Refused => counts.errors[0] += 1,
                Answer::Failed { unknown } => counts.errors[usize::from(unknown)] += 1,
            }
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
            let call = self.add_call(keys, voucher_id, &batch);
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

    /// The script call adding `batch` to `voucher_id`'s hash: its totals that are not 0,
    /// and its grabs and errors for the ring.
    fn add_call(
        &self,
        keys: &Keys,
        voucher_id: VoucherId,
        batch: &Batch,
    ) -> redis::ScriptInvocation<'static> {
        let (grabs, errors) = batch.counts.grabs_and_errors();
        let mut call = ADD.key(keys.live_counts(voucher_id));
        call.arg(&self.seq_field)
            .arg(batch.seq)
            .arg(RETAIN.as_secs())
            .arg(RING)
            .arg(grabs)
            .arg(errors);
        for (field, n) in batch.counts.values().filter(|&(_, n)| n > 0) {
            call.arg(field).arg(n);
        }
        call
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

static READ: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../lua/read_live_counts.lua")));

/// A sale's counts as the live view shows them: the totals and the recent figures.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Shown {
    pub totals: SaleCounts,
    pub recent: Recent,
}

/// A sale's grabs (every answer) and errors (503s) of the last [`WINDOW_SECS`] whole
/// seconds, all instances together.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Recent {
    pub grabs: u64,
    pub errors: u64,
}

impl Recent {
    /// Grabs a second over the window, to a tenth.
    pub fn grabs_per_sec(&self) -> f64 {
        per_sec(self.grabs)
    }

    /// Grabs answered 503 a second over the window, to a tenth.
    pub fn errors_per_sec(&self) -> f64 {
        per_sec(self.errors)
    }
}

fn per_sec(n: u64) -> f64 {
    (n as f64 / WINDOW_SECS as f64 * 10.0).round() / 10.0
}

/// The counts in Redis for each of `voucher_ids` (zeros for a sale without any), with
/// their recent figures: the last [`WINDOW_SECS`] whole seconds', by the clock of the
/// Redis server holding each (`lua/read_live_counts.lua`).
pub async fn read<C: ConnectionLike + Send + Clone>(
    conn: &C,
    keys: &Keys,
    voucher_ids: &[VoucherId],
) -> redis::RedisResult<Vec<Shown>> {
    let reads = voucher_ids.iter().map(|&voucher_id| {
        let mut conn = conn.clone();
        let mut call = READ.key(keys.live_counts(voucher_id));
        call.arg(RING)
            .arg(WINDOW_SECS)
            .arg(fields().collect::<Vec<_>>());
        async move {
            let (totals, (grabs, errors)): (Vec<Option<u64>>, (u64, u64)) =
                call.invoke_async(&mut conn).await?;
            Ok::<_, redis::RedisError>(Shown {
                totals: SaleCounts::from_values(totals.into_iter().map(Option::unwrap_or_default)),
                recent: Recent { grabs, errors },
            })
        }
    });
    futures_util::future::try_join_all(reads).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rates_are_the_windows_counts_a_second() {
        let recent = Recent {
            grabs: 30,
            errors: 3,
        };
        assert_eq!(recent.grabs_per_sec(), 6.0);
        assert_eq!(recent.errors_per_sec(), 0.6);
    }

    #[test]
    fn a_batch_sends_its_totals_under_the_outcomes_labels_and_its_grabs_once() {
        let mut counts = SaleCounts::default();
        counts.outcomes[Outcome::Admitted {
            order_id: OrderId::new(1).unwrap(),
        }
        .index()] = 2;
        counts.outcomes[Outcome::SoldOut.index()] = 3;
        counts.at_edge = 3; // of the sold out
        counts.errors[1] = 1;
        let totals: Vec<_> = counts.values().filter(|&(_, n)| n > 0).collect();
        assert_eq!(
            totals,
            [
                ("admitted", 2),
                ("sold_out", 3),
                ("at_edge", 3),
                ("unknown", 1)
            ]
        );
        assert_eq!(counts.grabs_and_errors(), (6, 1));
        assert_eq!(counts.outcome("sold_out"), 3);
        let read = SaleCounts::from_values(counts.values().map(|(_, n)| n));
        assert_eq!(read, counts, "read back as written");
    }

    #[test]
    fn a_failed_call_counts_only_for_a_sale_seen_decided() {
        let tally = Tally::default();
        let one = VoucherId::new(1).unwrap();
        tally.add_answers([(one, Answer::Failed { unknown: true })]);
        tally.add(
            one,
            &Outcome::RateLimited {
                retry_after_secs: 1,
            },
        );
        assert!(
            tally.lock().counts.is_empty(),
            "an unknown voucher costs nothing"
        );
        tally.add_answers([
            (one, Answer::Decided(Outcome::SoldOut)),
            (one, Answer::Failed { unknown: true }),
            (one, Answer::Refused),
        ]);
        tally.add(
            one,
            &Outcome::RateLimited {
                retry_after_secs: 1,
            },
        );
        let state = tally.lock();
        let counts = state.counts[&one];
        assert_eq!(counts.outcome("sold_out"), 1);
        assert_eq!(counts.outcome("rate_limited"), 1);
        assert_eq!(counts.errors, [1, 1]);
    }

    #[test]
    fn an_outcome_the_live_view_does_not_count_is_not_counted() {
        let tally = Tally::default();
        let one = VoucherId::new(1).unwrap();
        tally.add(one, &Outcome::NotLoaded);
        tally.add_at_edge(one, &Outcome::NotFound);
        assert!(tally.lock().counts.is_empty());
        tally.add_at_edge(one, &Outcome::SoldOut);
        let counts = tally.lock().counts[&one];
        assert_eq!((counts.outcome("sold_out"), counts.at_edge), (1, 1));
    }
}
