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

use crate::keys::{self, Keys};
use crate::scripts::Call;

/// Sales remembered at most (a storm of made-up voucher ids must not grow memory
/// without bound: beyond it, new sales are not remembered).
const MAX_SALES: usize = 100_000;

/// An answer the instance gives by itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EdgeAnswer {
    NotStarted,
    Ended,
    SoldOut,
    /// No flash sale with this voucher id.
    NotFound,
}

impl EdgeAnswer {
    /// A stable name for metrics (the outcome's).
    pub fn label(self) -> &'static str {
        match self {
            EdgeAnswer::NotStarted => "not_started",
            EdgeAnswer::Ended => "ended",
            EdgeAnswer::SoldOut => "sold_out",
            EdgeAnswer::NotFound => "not_found",
        }
    }
}

/// What the last read of a sale said.
#[derive(Debug, Clone)]
enum Verdict {
    /// Opens at this instant (Redis's opening, on this instance's clock; never later).
    NotStarted {
        opens: Instant,
    },
    Ended,
    SoldOut {
        buyers: Arc<Buyers>,
    },
    NotFound,
}

/// A sold-out sale's buyers, as of one `gen` and term of its state.
#[derive(Debug)]
struct Buyers {
    users: HashSet<i64>,
    signature: Signature,
}

/// What identifies the set of a sold-out sale's buyers: its state's `gen` and the
/// server's term (read apart: a state rebuilt in a new term may hold other buyers).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Signature {
    gen: String,
    term: String,
}

#[derive(Debug)]
struct Entry {
    verdict: Option<Verdict>,
    /// When the read behind the verdict was sent.
    read_at: Instant,
    /// Bumped by every forget: a learning that began before it must not record.
    epoch: u64,
    /// A read of this sale is under way (one at a time per sale and instance).
    learning: bool,
}

/// Proof of when a learning began: [`Edge::record`] refuses it if the sale (or
/// everything) was forgotten since.
#[derive(Debug, Clone, Copy)]
pub struct Ticket {
    all: u64,
    sale: u64,
}

#[derive(Default)]
struct Memory {
    sales: HashMap<i64, Entry>,
    /// Bumped by [`Edge::forget_all`].
    epoch: u64,
    /// When expired memories were last dropped (at most once per time to live: a storm
    /// of made-up ids at a full memory must not pay a sweep per press).
    pruned_at: Option<Instant>,
}

/// One instance's memory of sales; shared by every request.
pub struct Edge {
    ttl: Duration,
    memory: RwLock<Memory>,
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

    /// The answer to `user`'s press on `voucher_id`, when the instance knows it without
    /// Redis; `None`: ask Redis.
    pub fn answer(&self, voucher_id: i64, user_id: i64, now: Instant) -> Option<EdgeAnswer> {
        let memory = self.memory.read().unwrap_or_else(|e| e.into_inner());
        let entry = memory.sales.get(&voucher_id)?;
        if now.saturating_duration_since(entry.read_at) >= self.ttl {
            return None;
        }
        match entry.verdict.as_ref()? {
            Verdict::NotStarted { opens } if now < *opens => Some(EdgeAnswer::NotStarted),
            Verdict::NotStarted { .. } => None,
            Verdict::Ended => Some(EdgeAnswer::Ended),
            // A buyer hears `already_ordered` with their id from Redis.
            Verdict::SoldOut { buyers } if buyers.users.contains(&user_id) => None,
            Verdict::SoldOut { .. } => Some(EdgeAnswer::SoldOut),
            Verdict::NotFound => Some(EdgeAnswer::NotFound),
        }
    }

    /// Starts learning `voucher_id` unless a learning of it is under way or the memory
    /// of it is fresh; the ticket to record with.
    fn begin(&self, voucher_id: i64) -> Option<Ticket> {
        if !self.enabled() {
            return None;
        }
        let mut memory = self.memory.write().unwrap_or_else(|e| e.into_inner());
        let all = memory.epoch;
        if memory.sales.len() >= MAX_SALES && !memory.sales.contains_key(&voucher_id) {
            let ttl = self.ttl;
            if memory.pruned_at.is_none_or(|at| at.elapsed() >= ttl) {
                memory.pruned_at = Some(Instant::now());
                memory
                    .sales
                    .retain(|_, e| e.learning || e.read_at.elapsed() < ttl);
            }
            if memory.sales.len() >= MAX_SALES {
                return None;
            }
        }
        let entry = memory.sales.entry(voucher_id).or_insert_with(|| Entry {
            verdict: None,
            read_at: Instant::now(),
            epoch: 0,
            learning: false,
        });
        if entry.learning {
            return None;
        }
        entry.learning = true;
        Some(Ticket {
            all,
            sale: entry.epoch,
        })
    }

    /// Records what a learning found (or, with `None`, only that it ended), unless the
    /// sale was forgotten since the ticket was drawn.
    fn record(&self, voucher_id: i64, ticket: Ticket, read_at: Instant, verdict: Option<Verdict>) {
        let mut memory = self.memory.write().unwrap_or_else(|e| e.into_inner());
        let all = memory.epoch;
        let Some(entry) = memory.sales.get_mut(&voucher_id) else {
            return;
        };
        entry.learning = false;
        if ticket.all != all || ticket.sale != entry.epoch {
            return;
        }
        entry.verdict = verdict;
        entry.read_at = read_at;
    }

    /// The buyers remembered for a sold-out sale, to reuse while its signature holds.
    fn buyers(&self, voucher_id: i64) -> Option<Arc<Buyers>> {
        let memory = self.memory.read().unwrap_or_else(|e| e.into_inner());
        match memory.sales.get(&voucher_id)?.verdict.as_ref()? {
            Verdict::SoldOut { buyers } => Some(buyers.clone()),
            _ => None,
        }
    }

    /// Forgets one sale (its state changed: a unit came back, it was loaded or closed).
    pub fn forget(&self, voucher_id: i64) {
        let mut memory = self.memory.write().unwrap_or_else(|e| e.into_inner());
        if let Some(entry) = memory.sales.get_mut(&voucher_id) {
            entry.verdict = None;
            entry.epoch += 1;
        }
    }

    /// Forgets every sale (announcements may have been missed).
    pub fn forget_all(&self) {
        let mut memory = self.memory.write().unwrap_or_else(|e| e.into_inner());
        memory.epoch += 1;
        memory.sales.retain(|_, e| e.learning);
        for entry in memory.sales.values_mut() {
            entry.verdict = None;
        }
    }

    /// Sales remembered now (fresh memories only).
    pub fn remembered(&self) -> usize {
        let memory = self.memory.read().unwrap_or_else(|e| e.into_inner());
        memory
            .sales
            .values()
            .filter(|e| e.verdict.is_some() && e.read_at.elapsed() < self.ttl)
            .count()
    }

    /// Remembers that there is no flash sale `voucher_id` (Postgres said so), unless it
    /// was announced meanwhile. `ticket` from [`Edge::ticket_for_lookup`], drawn before
    /// Postgres was asked.
    pub fn remember_not_found(&self, voucher_id: i64, ticket: Ticket, asked_at: Instant) {
        self.record(voucher_id, ticket, asked_at, Some(Verdict::NotFound));
    }

    /// A ticket for a lookup in Postgres (see [`Edge::remember_not_found`]); `None` when
    /// one is under way or the edge is off.
    pub fn ticket_for_lookup(&self, voucher_id: i64) -> Option<Ticket> {
        self.begin(voucher_id)
    }

    /// Ends a lookup that found a sale after all (nothing to remember).
    pub fn lookup_found_a_sale(&self, voucher_id: i64, ticket: Ticket) {
        self.record(voucher_id, ticket, Instant::now(), None);
    }

    /// After Redis answered a grab of `voucher_id` with a verdict the edge could have
    /// given (sold out, not started, ended): reads the sale's state and remembers it, in
    /// the background, once per sale at a time.
    pub fn learn_in_background<C>(self: &Arc<Self>, conn: &C, keys: &Keys, voucher_id: i64)
    where
        C: ConnectionLike + Send + Clone + 'static,
    {
        let Some(ticket) = self.begin(voucher_id) else {
            return;
        };
        let (edge, mut conn, keys) = (self.clone(), conn.clone(), keys.clone());
        tokio::spawn(async move {
            let read_at = Instant::now();
            let verdict = match edge.learn(&mut conn, &keys, voucher_id, read_at).await {
                Ok(v) => v,
                Err(e) => {
                    tracing::debug!(voucher_id, error = %e, "reading a sale for the edge failed");
                    None
                }
            };
            edge.record(voucher_id, ticket, read_at, verdict);
        });
    }

    /// The verdict one read of the sale supports (`None`: the sale can still sell, or
    /// its state cannot be trusted: nothing to remember).
    async fn learn<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        keys: &Keys,
        voucher_id: i64,
        read_at: Instant,
    ) -> RedisResult<Option<Verdict>> {
        let key = keys.voucher(voucher_id);
        let Some(state) = peek(conn, &key).await? else {
            return Ok(None);
        };
        if state.now_ms >= state.end_ms {
            return Ok(Some(Verdict::Ended));
        }
        if state.now_ms < state.begin_ms {
            let wait = Duration::from_millis((state.begin_ms - state.now_ms) as u64);
            // Sent at `read_at`, read by Redis later: this instant is never after the
            // opening, at most one round trip before it.
            return Ok(Some(Verdict::NotStarted {
                opens: read_at + wait,
            }));
        }
        if state.stock > 0 || state.gen.is_empty() {
            return Ok(None);
        }
        let signature = Signature {
            gen: state.gen,
            term: state.term,
        };
        if let Some(known) = self.buyers(voucher_id) {
            if known.signature == signature {
                return Ok(Some(Verdict::SoldOut { buyers: known }));
            }
        }
        let users = scan_buyers(conn, &key).await?;
        // Still the same state, and still sold out: then the list is complete.
        match peek(conn, &key).await? {
            Some(after)
                if after.stock == 0
                    && after.gen == signature.gen
                    && after.term == signature.term =>
            {
                Ok(Some(Verdict::SoldOut {
                    buyers: Arc::new(Buyers { users, signature }),
                }))
            }
            _ => Ok(None),
        }
    }

    /// Listens for announcements until cancelled: forgets each sale named, and every
    /// sale whenever the subscription was (re)made (messages may have been missed).
    pub async fn listen(
        self: Arc<Self>,
        source: crate::redis_conn::Subscriber,
        channel: String,
        cancel: tokio_util::sync::CancellationToken,
    ) {
        use futures_util::StreamExt;
        let mut backoff =
            crate::backoff::Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
        loop {
            let subscribed = async {
                let mut pubsub = source.connect().await?;
                pubsub.subscribe(&channel).await?;
                RedisResult::Ok(pubsub)
            };
            let pubsub = tokio::select! {
                _ = cancel.cancelled() => return,
                r = subscribed => r,
            };
            match pubsub {
                Ok(pubsub) => {
                    backoff.reset();
                    self.forget_all();
                    tracing::debug!(%channel, "listening for sale changes");
                    let mut messages = pubsub.into_on_message();
                    loop {
                        let message = tokio::select! {
                            _ = cancel.cancelled() => return,
                            m = messages.next() => m,
                        };
                        let Some(message) = message else { break };
                        metrics::counter!(crate::metrics::SALE_CHANGES_HEARD).increment(1);
                        match message.get_payload::<i64>() {
                            Ok(voucher_id) => self.forget(voucher_id),
                            Err(_) => self.forget_all(),
                        }
                    }
                    tracing::warn!(%channel, "lost the subscription to sale changes; resubscribing");
                }
                Err(e) => {
                    tracing::warn!(%channel, error = %e, "cannot subscribe to sale changes");
                }
            }
            self.forget_all();
            source.next_node();
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(backoff.next_delay()) => {}
            }
        }
    }
}

/// A sale's state as `seckill_peek` reads it.
struct Peeked {
    now_ms: i64,
    begin_ms: i64,
    end_ms: i64,
    stock: i64,
    gen: String,
    term: String,
}

/// Reads a sale's state; `None` when it is not loaded, stale or corrupt.
async fn peek<C: ConnectionLike + Send>(conn: &mut C, key: &str) -> RedisResult<Option<Peeked>> {
    let mut call = Call::function("seckill_peek");
    call.key(key);
    let reply: Vec<String> = call.invoke(conn).await?;
    let number = |i: usize| reply.get(i).and_then(|v| v.parse::<i64>().ok());
    Ok(
        match (
            reply.first().map(String::as_str),
            number(1),
            number(2),
            number(3),
            number(4),
        ) {
            (Some("0"), Some(now_ms), Some(begin_ms), Some(end_ms), Some(stock)) => Some(Peeked {
                now_ms,
                begin_ms,
                end_ms,
                stock,
                gen: reply.get(5).cloned().unwrap_or_default(),
                term: reply.get(6).cloned().unwrap_or_default(),
            }),
            _ => None,
        },
    )
}

/// Every buyer recorded in a sale's hash (a page at a time: a large sale never stalls
/// Redis).
async fn scan_buyers<C: ConnectionLike + Send>(
    conn: &mut C,
    key: &str,
) -> RedisResult<HashSet<i64>> {
    let pattern = format!("{}*", keys::BUYER_PREFIX);
    let mut users = HashSet::new();
    let mut cursor = 0u64;
    loop {
        let (next, page): (u64, Vec<String>) = redis::cmd("HSCAN")
            .arg(key)
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(conn)
            .await?;
        for field in page.iter().step_by(2) {
            if let Some(user) = field
                .strip_prefix(keys::BUYER_PREFIX)
                .and_then(|u| u.parse().ok())
            {
                users.insert(user);
            }
        }
        if next == 0 {
            return Ok(users);
        }
        cursor = next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sold_out(edge: &Edge, voucher_id: i64, buyers: &[i64]) {
        let ticket = edge.begin(voucher_id).unwrap();
        let buyers = Arc::new(Buyers {
            users: buyers.iter().copied().collect(),
            signature: Signature {
                gen: "1".into(),
                term: "t".into(),
            },
        });
        edge.record(
            voucher_id,
            ticket,
            Instant::now(),
            Some(Verdict::SoldOut { buyers }),
        );
    }

    #[test]
    fn a_sold_out_sale_is_answered_at_the_edge_except_to_its_buyers() {
        let edge = Edge::new(Duration::from_secs(5));
        sold_out(&edge, 7, &[1, 2]);
        let now = Instant::now();
        assert_eq!(edge.answer(7, 3, now), Some(EdgeAnswer::SoldOut));
        assert_eq!(edge.answer(7, 1, now), None, "a buyer hears Redis");
        assert_eq!(edge.answer(8, 3, now), None, "another sale is not known");
    }

    #[test]
    fn a_memory_is_believed_only_for_its_time_to_live() {
        let edge = Edge::new(Duration::from_millis(500));
        sold_out(&edge, 7, &[]);
        let now = Instant::now();
        assert_eq!(edge.answer(7, 3, now), Some(EdgeAnswer::SoldOut));
        assert_eq!(edge.answer(7, 3, now + Duration::from_millis(500)), None);
    }

    #[test]
    fn an_announcement_during_a_learning_stops_its_recording() {
        let edge = Edge::new(Duration::from_secs(5));
        let ticket = edge.begin(7).unwrap();
        assert!(edge.begin(7).is_none(), "one learning per sale at a time");
        edge.forget(7);
        edge.record(7, ticket, Instant::now(), Some(Verdict::Ended));
        assert_eq!(edge.answer(7, 1, Instant::now()), None);
        // The next learning may record.
        let ticket = edge.begin(7).unwrap();
        edge.record(7, ticket, Instant::now(), Some(Verdict::Ended));
        assert_eq!(edge.answer(7, 1, Instant::now()), Some(EdgeAnswer::Ended));
        edge.forget_all();
        assert_eq!(edge.answer(7, 1, Instant::now()), None);
    }

    #[test]
    fn a_sale_not_yet_open_is_answered_until_its_opening_only() {
        let edge = Edge::new(Duration::from_secs(5));
        let now = Instant::now();
        let ticket = edge.begin(7).unwrap();
        let opens = now + Duration::from_millis(200);
        edge.record(7, ticket, now, Some(Verdict::NotStarted { opens }));
        assert_eq!(edge.answer(7, 1, now), Some(EdgeAnswer::NotStarted));
        assert_eq!(edge.answer(7, 1, opens), None);
    }

    #[test]
    fn a_full_memory_takes_no_new_sale_until_old_memories_expire() {
        let edge = Edge::new(Duration::from_secs(1));
        for voucher_id in 0..MAX_SALES as i64 {
            let ticket = edge.begin(voucher_id).unwrap();
            edge.record(voucher_id, ticket, Instant::now(), Some(Verdict::NotFound));
        }
        assert!(edge.begin(-1).is_none(), "full");
        assert!(
            edge.begin(7).is_some(),
            "a sale already remembered may be learned again"
        );
        std::thread::sleep(Duration::from_millis(1100));
        assert!(edge.begin(-1).is_some(), "expired memories make room");
    }

    #[test]
    fn an_edge_with_no_time_to_live_remembers_nothing() {
        let edge = Edge::new(Duration::ZERO);
        assert!(edge.begin(7).is_none());
        assert_eq!(edge.answer(7, 1, Instant::now()), None);
    }
}
