//! The edge: what each API instance remembers Redis told it about a sale, so that the
//! presses that can win nothing (most presses of a flash sale) are answered here and
//! only those that still can reach Redis.
//!
//! A sale is remembered as not yet open (until the instant it opens, by Redis's clock),
//! ended, sold out (with its buyers: a buyer pressing again must still hear
//! `already_ordered` with their order id, which only Redis says), or not a sale at all.
//! Nothing here ever answers 202: an admission is always Redis's decision.
//!
//! How a memory stays true:
//! - It is learned from one read of the sale's state (`seckill_peek`) after Redis
//!   answered a grab with such a verdict, not from the verdict alone.
//! - Every move that can bring a unit back (release, settle, load) changes the sale's
//!   `gen`, and is announced on a pub/sub channel: each instance forgets the sale on
//!   hearing it. A message that arrives while a memory is being learned (between its
//!   read and its recording) stops the recording.
//! - A lost message (a silent network partition, a process killed between the move and
//!   its announcement) cannot strand a unit: a memory is believed for at most `ttl` after
//!   its read; the next press then goes to Redis and the sale is read again.
//! - A sold-out sale's buyers are read once (HSCAN); while its `gen` and term stay, no
//!   buyer can have joined (admission needs a unit, and a unit comes back only with a
//!   new `gen`), so a read again finds the list still complete without scanning.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use redis::aio::ConnectionLike;
use redis::RedisResult;

use super::Outcome;
use crate::domain::{UserId, VoucherId};
use crate::keys::{Keys, SaleSegment};

/// Sales remembered at most (a storm of made-up voucher ids must not grow memory
/// without bound: beyond it, new sales are not remembered). Lookups of sales Redis does
/// not hold (perhaps made up) may fill half of it, so that real sales keep room.
const MAX_SALES: usize = 100_000;
/// A sale nobody pressed for this long is dropped from memory, its buyers with it.
const IDLE: Duration = Duration::from_secs(10);
/// A sold-out sale with more buyers than this is scanned again at most once per
/// [`RESCAN_EVERY`] (units coming back one by one must not keep every instance
/// scanning a large hash; in between, its presses go to Redis).
const LARGE_SALE: usize = 10_000;
const RESCAN_EVERY: Duration = Duration::from_secs(5);

/// What the last read of a sale said.
#[derive(Debug, Clone)]
enum Verdict {
    /// Opens at this instant (Redis's opening, on this instance's clock; never later).
    NotStarted {
        opens: Instant,
    },
    Ended,
    SoldOut {
        buyers: Arc<KnownBuyers>,
    },
    NotFound,
    NoVoucher,
}

/// A sold-out sale's buyers, as of one `gen` and term of its state.
#[derive(Debug)]
struct KnownBuyers {
    users: HashSet<UserId>,
    signature: Signature,
}

/// What identifies the set of a sale's buyers: its state's `gen` (which moves with
/// every admission, every unit that comes back and every load) and the server's term
/// (a state rebuilt after Redis lost writes may hold other buyers).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Signature {
    gen: String,
    term: String,
}

#[derive(Debug)]
struct Remembered {
    verdict: Option<Verdict>,
    /// When the read behind the verdict was sent.
    read_at: Instant,
    /// The last buyers read, kept across forgets: reused only under the same signature.
    buyers: Option<Arc<KnownBuyers>>,
    /// When the buyers were last scanned, and how many there were.
    scanned: Option<(Instant, usize)>,
    /// Bumped by every forget: a learning that began before it must not record.
    epoch: u64,
    /// A read of this sale is under way (one at a time per sale and instance).
    learning: bool,
}

#[derive(Default)]
struct Memory {
    sales: HashMap<VoucherId, Remembered>,
    /// Bumped by [`Edge::forget_all`].
    epoch: u64,
    /// When idle sales were last dropped.
    pruned_at: Option<Instant>,
}

/// One instance's memory of sales; shared by every request.
pub struct Edge {
    ttl: Duration,
    memory: RwLock<Memory>,
}

/// Why a learning begins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Purpose {
    /// Redis answered a grab of the sale with a verdict the edge could give.
    Verdict,
    /// Redis holds no state of the sale: Postgres is asked whether it exists.
    Lookup,
}

/// One learning under way. Recording ends it; so does dropping it (a request cancelled
/// mid-lookup), recording nothing, so that the sale can be learned again.
pub struct Learning {
    edge: Arc<Edge>,
    voucher_id: VoucherId,
    /// The epochs when it began: [`Learning::record`] records nothing if the sale (or
    /// everything) was forgotten since.
    all: u64,
    sale: u64,
    done: bool,
}

impl Learning {
    fn record(mut self, read_at: Instant, verdict: Option<Verdict>) {
        self.done = true;
        self.edge
            .record(self.voucher_id, (self.all, self.sale), read_at, verdict);
    }

    /// Postgres says there is no such sale: remembered, unless it was announced since
    /// the lookup began (`asked_at`: when Postgres was asked).
    pub fn not_found(self, asked_at: Instant) {
        self.record(asked_at, Some(Verdict::NotFound));
    }

    /// Postgres has no voucher with this id at all: remembered as [`Learning::not_found`].
    pub fn no_voucher(self, asked_at: Instant) {
        self.record(asked_at, Some(Verdict::NoVoucher));
    }

    /// Nothing to remember.
    pub fn nothing(self) {
        self.record(Instant::now(), None);
    }
}

impl Drop for Learning {
    fn drop(&mut self) {
        if !self.done {
            self.edge
                .record(self.voucher_id, (self.all, self.sale), Instant::now(), None);
        }
    }
}

impl Edge {
    /// `ttl`: how long a read is believed without confirmation; zero turns the edge off
    /// (every press goes to Redis).
    pub fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            memory: RwLock::default(),
        }
    }

    pub fn enabled(&self) -> bool {
        !self.ttl.is_zero()
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Memory> {
        self.memory.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Memory> {
        self.memory.write().unwrap_or_else(|e| e.into_inner())
    }

    /// The answer to `user`'s press on `voucher_id`, when the instance knows it without
    /// Redis (never an admission: that is always Redis's decision); `None`: ask Redis.
    pub fn answer(&self, voucher_id: VoucherId, user_id: UserId, now: Instant) -> Option<Outcome> {
        let memory = self.read();
        let entry = memory.sales.get(&voucher_id)?;
        if now.saturating_duration_since(entry.read_at) >= self.ttl {
            return None;
        }
        match entry.verdict.as_ref()? {
            Verdict::NotStarted { opens } if now < *opens => Some(Outcome::NotStarted),
            Verdict::NotStarted { .. } => None,
            Verdict::Ended => Some(Outcome::Ended),
            // A buyer hears `already_ordered` with their id from Redis.
            Verdict::SoldOut { buyers } if buyers.users.contains(&user_id) => None,
            Verdict::SoldOut { .. } => Some(Outcome::SoldOut),
            Verdict::NotFound => Some(Outcome::NotFound),
            Verdict::NoVoucher => Some(Outcome::NoVoucher),
        }
    }

    /// Starts learning `voucher_id` unless a learning of it is under way, the edge is off
    /// or memory is full.
    fn begin(self: &Arc<Self>, voucher_id: VoucherId, purpose: Purpose) -> Option<Learning> {
        if !self.enabled() {
            return None;
        }
        // Most calls find a learning under way: no write lock for those.
        if self
            .read()
            .sales
            .get(&voucher_id)
            .is_some_and(|e| e.learning)
        {
            return None;
        }
        let mut memory = self.write();
        self.prune(&mut memory);
        let room = match purpose {
            Purpose::Verdict => MAX_SALES,
            Purpose::Lookup => MAX_SALES / 2,
        };
        if memory.sales.len() >= room && !memory.sales.contains_key(&voucher_id) {
            return None;
        }
        let all = memory.epoch;
        let entry = memory
            .sales
            .entry(voucher_id)
            .or_insert_with(|| Remembered {
                verdict: None,
                read_at: Instant::now(),
                buyers: None,
                scanned: None,
                epoch: 0,
                learning: false,
            });
        if entry.learning {
            return None;
        }
        entry.learning = true;
        Some(Learning {
            edge: self.clone(),
            voucher_id,
            all,
            sale: entry.epoch,
            done: false,
        })
    }

    /// Drops the sales nobody pressed lately (at most once a second: a storm of made-up
    /// ids must not pay a sweep per press).
    fn prune(&self, memory: &mut Memory) {
        if memory
            .pruned_at
            .is_some_and(|at| at.elapsed() < Duration::from_secs(1))
        {
            return;
        }
        memory.pruned_at = Some(Instant::now());
        memory
            .sales
            .retain(|_, e| e.learning || e.read_at.elapsed() < IDLE);
    }

    /// Records what a learning found (or, with `None`, only that it ended), unless the
    /// sale was forgotten since it began.
    fn record(
        &self,
        voucher_id: VoucherId,
        (all, sale): (u64, u64),
        read_at: Instant,
        verdict: Option<Verdict>,
    ) {
        let mut memory = self.write();
        let current = memory.epoch;
        let Some(entry) = memory.sales.get_mut(&voucher_id) else {
            return;
        };
        entry.learning = false;
        if all != current || sale != entry.epoch {
            return;
        }
        if let Some(Verdict::SoldOut { buyers }) = &verdict {
            entry.buyers = Some(buyers.clone());
        }
        entry.verdict = verdict;
        entry.read_at = read_at;
    }

    /// The buyers last read for a sale (reused while their signature holds), and when
    /// its buyers were last scanned and how many.
    fn buyers(
        &self,
        voucher_id: VoucherId,
    ) -> (Option<Arc<KnownBuyers>>, Option<(Instant, usize)>) {
        match self.read().sales.get(&voucher_id) {
            Some(e) => (e.buyers.clone(), e.scanned),
            None => (None, None),
        }
    }

    fn scanned(&self, voucher_id: VoucherId, buyers: usize) {
        if let Some(entry) = self.write().sales.get_mut(&voucher_id) {
            entry.scanned = Some((Instant::now(), buyers));
        }
    }

    /// Forgets one sale (its state changed: a unit came back, it was loaded or closed).
    pub fn forget(&self, voucher_id: VoucherId) {
        let mut memory = self.write();
        if let Some(entry) = memory.sales.get_mut(&voucher_id) {
            entry.verdict = None;
            entry.epoch += 1;
        }
    }

    /// Forgets every sale (announcements may have been missed).
    pub fn forget_all(&self) {
        let mut memory = self.write();
        memory.epoch += 1;
        memory.sales.retain(|_, e| e.learning);
        for entry in memory.sales.values_mut() {
            entry.verdict = None;
            entry.buyers = None;
        }
    }

    /// Begins a lookup in Postgres of a sale Redis holds no state of (see
    /// [`Learning::not_found`]); `None` when one is under way, the edge is off or memory
    /// is full. Draw it before asking Postgres.
    pub fn lookup(self: &Arc<Self>, voucher_id: VoucherId) -> Option<Learning> {
        self.begin(voucher_id, Purpose::Lookup)
    }

    /// After Redis answered a grab of `voucher_id` with a verdict the edge could have
    /// given (sold out, not started, ended): reads the sale's state and remembers it, in
    /// the background, once per sale at a time.
    pub fn learn_in_background<C>(
        self: &Arc<Self>,
        conn: &C,
        keys: &Keys,
        voucher_id: VoucherId,
        segments: u8,
    ) where
        C: ConnectionLike + Send + Clone + 'static,
    {
        let Some(learning) = self.begin(voucher_id, Purpose::Verdict) else {
            return;
        };
        let (edge, mut conn, keys) = (self.clone(), conn.clone(), keys.clone());
        tokio::spawn(async move {
            let read_at = Instant::now();
            let verdict = match edge
                .learn(&mut conn, &keys, voucher_id, segments, read_at)
                .await
            {
                Ok(v) => v,
                Err(e) => {
                    tracing::debug!(voucher_id = voucher_id.get(), error = %e, "reading a sale for the edge failed");
                    None
                }
            };
            learning.record(read_at, verdict);
        });
    }

    /// The verdict one read of the sale (of every segment of it) supports (`None`: the
    /// sale can still sell, or its state cannot be trusted: nothing to remember).
    async fn learn<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        keys: &Keys,
        voucher_id: VoucherId,
        segments: u8,
        read_at: Instant,
    ) -> RedisResult<Option<Verdict>> {
        let moves: Vec<String> = match segments {
            1 => Vec::new(),
            _ => SaleSegment::all(voucher_id, segments)
                .map(|p| keys.moves_out(p))
                .collect(),
        };
        let keys = StateKeys::all(keys, voucher_id, segments);
        let Some(state) = peek_all(conn, &keys).await? else {
            return Ok(None);
        };
        if state.now_ms >= state.end_ms {
            return Ok(Some(Verdict::Ended));
        }
        if state.now_ms < state.begin_ms {
            // Sent at `read_at`, read by Redis later: this instant is never after the
            // opening, at most one round trip before it (the millisecond taken off covers
            // Redis's clock read rounded down).
            let wait = Duration::from_millis((state.begin_ms - state.now_ms - 1).max(0) as u64);
            return Ok(Some(Verdict::NotStarted {
                opens: read_at + wait,
            }));
        }
        // (A lottery's window, or its draw not recorded yet: presses wait for the draw.)
        if state.stock > 0
            || state.window
            || state.gen.is_empty()
            || on_their_way(conn, &moves).await?
        {
            return Ok(None);
        }
        let signature = Signature {
            gen: state.gen,
            term: state.term,
        };
        self.sold_out_to(conn, &keys, voucher_id, signature).await
    }

    /// A sale read sold out with `signature`: its buyers (known, or scanned), if the
    /// sale is still the same state once they are read.
    async fn sold_out_to<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        keys: &[StateKeys],
        voucher_id: VoucherId,
        signature: Signature,
    ) -> RedisResult<Option<Verdict>> {
        let (known, scanned) = self.buyers(voucher_id);
        if let Some(buyers) = known.filter(|k| k.signature == signature) {
            return Ok(Some(Verdict::SoldOut { buyers }));
        }
        if scanned.is_some_and(|(at, n)| n > LARGE_SALE && at.elapsed() < RESCAN_EVERY) {
            return Ok(None);
        }
        let mut users = HashSet::new();
        for key in keys {
            users.extend(scan_buyers(conn, &key.sale).await?);
        }
        self.scanned(voucher_id, users.len());
        // Still the same state, and still sold out: then the list is complete.
        match peek_all(conn, keys).await? {
            Some(after)
                if after.stock == 0
                    && after.gen == signature.gen
                    && after.term == signature.term =>
            {
                Ok(Some(Verdict::SoldOut {
                    buyers: Arc::new(KnownBuyers { users, signature }),
                }))
            }
            _ => Ok(None),
        }
    }
}

mod listen;
mod read;
use read::{on_their_way, peek_all, scan_buyers};
pub(crate) use read::{peek, StateKeys};

#[cfg(test)]
mod tests;
