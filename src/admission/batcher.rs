//! Micro-batched admission: the grabs that arrive together for one shard go to Redis in
//! one script call, decided in order (see `lua/seckill.lua`), and each request gets its
//! own outcome back.
//!
//! One task per shard, one call in flight per shard: a grab arriving while the shard is
//! idle leaves at once (no timer, no added latency); grabs arriving while a call is in
//! flight wait for it and leave together in the next (at most `max` per call). While
//! the shard is busy, that next call may linger a moment for more grabs, up to as many
//! as its recent calls carried (see [`Pace`]): fewer, larger calls for Redis. A slow
//! shard holds up only its own grabs.

use redis::RedisResult;
use tokio::sync::{mpsc, oneshot};

use std::sync::Arc;
use std::time::Duration;

use super::fence::Fence;
use super::guard::ReplicaGate;
use super::promises::Promises;
use super::tally::{self, Tally};
use super::{decide, Grab, Outcome};
use crate::keys::Keys;
use crate::redis_conn::RedisConn;
use crate::scripts::Replicas;

/// Grabs per script call, at most.
/// (The script unpacks every buyer field of a call into one HMGET and one HSET; Lua's
/// stack allows a few thousand values, far above this.)
pub const MAX_BATCH: usize = 128;
/// Grabs queued per shard before senders wait (back-pressure, not loss).
const QUEUE: usize = 16_384;

type ReplyTo = oneshot::Sender<RedisResult<Outcome>>;

/// A grab, and where its answer goes.
type Queued = (Grab, ReplyTo);

/// The senders to each shard's task; the tasks end when this is dropped.
pub struct Batcher {
    keys: Keys,
    shards: Vec<mpsc::Sender<Queued>>,
    tally: Arc<Tally>,
    gate: Arc<ReplicaGate>,
    promises: Arc<Promises>,
}

impl Batcher {
    /// Starts one task per shard (needs a Tokio runtime). Outcomes are counted in
    /// the returned batcher's [`Batcher::tally`]; each call waits for `replicas`, and a
    /// busy shard's call waits at most `linger` for more grabs (zero: never).
    pub fn start(
        conn: RedisConn,
        keys: Keys,
        max: usize,
        linger: Duration,
        replicas: Replicas,
        promises: Arc<Promises>,
        fence: Arc<Fence>,
    ) -> Self {
        let tally = Arc::new(Tally::default());
        let gate = Arc::new(ReplicaGate::new(keys.shards().count()));
        let shards = keys
            .shards()
            .map(|shard| {
                let (tx, rx) = mpsc::channel(QUEUE);
                let (conn, keys, tally) = (conn.clone(), keys.clone(), tally.clone());
                let call = ShardCall {
                    conn,
                    keys,
                    shard,
                    replicas,
                    gate: gate.clone(),
                    promises: promises.clone(),
                    fence: fence.clone(),
                };
                tokio::spawn(run_shard(rx, call, tally, max.max(1), linger));
                tx
            })
            .collect();
        Self {
            keys,
            shards,
            tally,
            gate,
            promises,
        }
    }

    /// The 202s this instance gave and keeps until their entries are acknowledged.
    pub fn promises(&self) -> &Arc<Promises> {
        &self.promises
    }

    /// Whether each shard's replicas acknowledge lately (with replicas to wait for):
    /// fed by the calls themselves and by [`crate::admission::guard::probe_replicas`].
    pub fn replica_gate(&self) -> &Arc<ReplicaGate> {
        &self.gate
    }

    /// The outcomes decided so far and not yet flushed (see [`tally`]).
    pub fn tally(&self) -> &Arc<Tally> {
        &self.tally
    }

    /// Decides one grab, in the next call of its shard.
    pub async fn admit(&self, grab: Grab) -> RedisResult<Outcome> {
        let shard = self.keys.shard_of_segment(grab.sale_segment());
        let (reply, answer) = oneshot::channel();
        if self.shards[shard.0 as usize]
            .send((grab, reply))
            .await
            .is_err()
        {
            return Err(gone());
        }
        answer.await.unwrap_or_else(|_| Err(gone()))
    }
}

/// The shard's task stopped (shutdown): the grab was never sent.
fn gone() -> redis::RedisError {
    std::io::Error::new(
        std::io::ErrorKind::ConnectionRefused,
        "admission is shutting down",
    )
    .into()
}

/// Where a shard's calls go, and how.
struct ShardCall {
    conn: RedisConn,
    keys: Keys,
    shard: crate::keys::Shard,
    replicas: Replicas,
    gate: Arc<ReplicaGate>,
    promises: Arc<Promises>,
    fence: Arc<Fence>,
}

impl ShardCall {
    /// Decides `grabs` in one call, unless the shard's replicas were silent lately:
    /// then they are refused unsent (nothing reserved), rather than taken and answered
    /// "unknown". A call whose replicas do not acknowledge shuts the gate.
    async fn admit(&mut self, grabs: &[Grab]) -> RedisResult<Vec<Outcome>> {
        let waits = self.replicas.waits();
        if waits && !self.gate.is_open(self.shard) {
            return Err(super::guard::replicas_silent());
        }
        // A master the sentinels are about to replace takes no unit (its replicas may
        // follow the new one, and what they acknowledged here go with them).
        if !self.conn.master_confirmed() {
            return Err(super::guard::master_unconfirmed());
        }
        let decided = decide(
            &mut self.conn,
            &self.keys,
            self.shard,
            grabs,
            self.replicas,
            &self.fence,
        )
        .await;
        if waits
            && decided
                .as_ref()
                .is_err_and(crate::scripts::is_not_replicated)
        {
            self.gate.set(self.shard, false);
        }
        let decided = decided?;
        if let Some(entry) = &decided.entry {
            let admitted: Vec<Grab> = grabs
                .iter()
                .zip(&decided.outcomes)
                .filter(|(g, o)| {
                    **o == Outcome::Admitted {
                        order_id: g.order_id,
                    }
                })
                .map(|(g, _)| *g)
                .collect();
            self.promises.record(&self.keys, &admitted, entry);
        }
        Ok(decided.outcomes)
    }
}

async fn run_shard(
    mut rx: mpsc::Receiver<Queued>,
    mut call: ShardCall,
    tally: Arc<Tally>,
    max: usize,
    linger: Duration,
) {
    let mut pace = Pace::new(linger);
    let mut pending: Vec<Queued> = Vec::with_capacity(max);
    let mut grabs = Vec::with_capacity(max);
    while gather(&mut rx, &mut pending, max, &pace).await {
        // A request that gave up while queued (client gone, request timed out) is not
        // sent: as before batching, a grab never sent admits nothing. (Looked at again
        // here: one may have given up while the call lingered.)
        pending.retain(|(_, reply)| !reply.is_closed());
        if pending.is_empty() {
            continue;
        }
        grabs.extend(pending.iter().map(|(grab, _)| *grab));
        pace.called(grabs.len());
        let decided = call.admit(&grabs).await;
        // Each grab's answer, counted for the live view under one lock.
        match decided {
            Ok(outcomes) => {
                tally.add_answers(grabs.iter().zip(&outcomes).filter_map(|(g, &o)| {
                    Some((g.voucher_id, tally::answer(&Ok(o), g.order_id)?))
                }));
                for ((_, reply), outcome) in pending.drain(..).zip(outcomes) {
                    let _ = reply.send(Ok(outcome));
                }
            }
            Err(e) => {
                let failed = tally::failure(&e);
                tally.add_answers(grabs.iter().map(|g| (g.voucher_id, failed)));
                for (_, reply) in pending.drain(..) {
                    let _ = reply.send(Err(copy(&e)));
                }
            }
        }
        grabs.clear();
    }
}

/// Gathers the shard's next call into `pending` (empty on entry): the first grab, as
/// soon as there is one, and every grab queued behind it (at most `max`). When grabs
/// were already waiting as the shard became free (it is busy) and fewer than its calls
/// carried lately, it lingers for more, as [`Pace`] allows. A grab reaching an idle
/// shard leaves at once. `false`: the shard's queue is closed and empty (shutdown).
async fn gather(
    rx: &mut mpsc::Receiver<Queued>,
    pending: &mut Vec<Queued>,
    max: usize,
    pace: &Pace,
) -> bool {
    let busy = match rx.try_recv() {
        Ok(queued) => {
            pending.push(queued);
            true
        }
        Err(mpsc::error::TryRecvError::Disconnected) => return false,
        Err(mpsc::error::TryRecvError::Empty) => match rx.recv().await {
            Some(queued) => {
                pending.push(queued);
                false
            }
            None => return false,
        },
    };
    take_queued(rx, pending, max);
    let Some((until, wanted)) = pace.linger(busy, pending.len(), max) else {
        return true;
    };
    let until = tokio::time::Instant::now() + until;
    while pending.len() < wanted {
        match tokio::time::timeout_at(until, rx.recv()).await {
            Ok(Some(queued)) => {
                pending.push(queued);
                take_queued(rx, pending, max);
            }
            // Shut down (what was gathered is still sent), or lingered long enough.
            Ok(None) | Err(_) => break,
        }
    }
    true
}

/// Moves the grabs queued now into `pending`, up to `max` in all; those whose request
/// gave up already are dropped (answered by nobody: their requests are gone).
fn take_queued(rx: &mut mpsc::Receiver<Queued>, pending: &mut Vec<Queued>, max: usize) {
    pending.retain(|(_, reply)| !reply.is_closed());
    while pending.len() < max {
        match rx.try_recv() {
            Ok(queued) if queued.1.is_closed() => {}
            Ok(queued) => pending.push(queued),
            Err(_) => break,
        }
    }
}

/// When a busy shard waits for more grabs before it calls: fewer, larger calls for the
/// same grabs, since Redis spends about as much on handling a call as on a dozen grabs
/// in it. A call that finds fewer grabs waiting than its recent calls carried waits
/// until that many are there, at most `linger` (Tokio's timer counts whole
/// milliseconds, so a wait that runs out may run up to one more). Only while grabs were
/// already queued when the shard became free: at an idle shard the first grab leaves at
/// once, and a lone grab is never held back.
#[derive(Debug)]
struct Pace {
    linger: Duration,
    /// Grabs per call lately: the largest call, fading by an eighth per call.
    carried: usize,
}

impl Pace {
    fn new(linger: Duration) -> Self {
        Self { linger, carried: 0 }
    }

    /// A call carried `grabs` grabs.
    fn called(&mut self, grabs: usize) {
        self.carried = grabs.max(self.carried - self.carried / 8);
    }

    /// How long to wait for more grabs, and for how many in all, when `waiting` are
    /// gathered (`busy`: some were queued as the shard became free); `None`: send them
    /// now.
    fn linger(&self, busy: bool, waiting: usize, max: usize) -> Option<(Duration, usize)> {
        let wanted = self.carried.min(max);
        if !busy || waiting >= wanted || self.linger.is_zero() {
            return None;
        }
        Some((self.linger, wanted))
    }
}

/// The call's error for each of its grabs (`RedisError` is not `Clone`): whether the
/// script may have run is what the answer depends on, and that is kept.
fn copy(e: &redis::RedisError) -> redis::RedisError {
    if e.is_connection_refusal() {
        return std::io::Error::new(std::io::ErrorKind::ConnectionRefused, e.to_string()).into();
    }
    match crate::scripts::surely_not_run(e) {
        true => redis::RedisError::from((
            redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError),
            "admission script refused",
            e.to_string(),
        )),
        false => std::io::Error::new(std::io::ErrorKind::TimedOut, e.to_string()).into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{OrderId, UserId, VoucherId};

    fn queued(n: i64) -> (Queued, oneshot::Receiver<RedisResult<Outcome>>) {
        let (reply, answer) = oneshot::channel();
        let grab = Grab {
            voucher_id: VoucherId::new(1).unwrap(),
            user_id: UserId::new(n).unwrap(),
            order_id: OrderId::new(n).unwrap(),
            segment: 0,
            segments: 1,
        };
        ((grab, reply), answer)
    }

    /// A pace whose recent calls carried `carried` grabs.
    fn pace(linger: Duration, carried: usize) -> Pace {
        let mut pace = Pace::new(linger);
        pace.called(carried);
        pace
    }

    const LINGER: Duration = Duration::from_secs(1);

    // The paused clock moves only when every task waits on a timer: a gather that
    // returns at the same instant waited for none.

    #[tokio::test(start_paused = true)]
    async fn a_grab_at_an_idle_shard_leaves_at_once_whatever_recent_calls_carried() {
        let (tx, mut rx) = mpsc::channel(16);
        let pace = pace(LINGER, 64);
        let (first, _answer) = queued(1);
        let start = tokio::time::Instant::now();
        let sender = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(5)).await;
            tx.send(first).await.unwrap();
            tx
        });
        let mut pending = Vec::new();
        // The shard waits for its first grab (idle), then sends it alone at once: when
        // it arrived, not a linger later.
        assert!(gather(&mut rx, &mut pending, 128, &pace).await);
        assert_eq!(
            tokio::time::Instant::now() - start,
            Duration::from_millis(5)
        );
        assert_eq!(pending.len(), 1);
        let _tx = sender.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_busy_shard_waits_for_as_many_grabs_as_its_calls_carried_lately() {
        let (tx, mut rx) = mpsc::channel(16);
        let pace = pace(LINGER, 4);
        let mut answers = Vec::new();
        for n in 1..=2 {
            let (q, answer) = queued(n);
            tx.send(q).await.unwrap();
            answers.push(answer);
        }
        let later: Vec<_> = (3..=5).map(queued).collect();
        let start = tokio::time::Instant::now();
        let sender = tokio::spawn(async move {
            let mut answers = Vec::new();
            for (q, answer) in later {
                tokio::time::sleep(Duration::from_millis(1)).await;
                tx.send(q).await.unwrap();
                answers.push(answer);
            }
            (tx, answers)
        });
        let mut pending = Vec::new();
        assert!(gather(&mut rx, &mut pending, 128, &pace).await);
        // Two were waiting: it waited for two more (not for the fifth), well within the
        // linger.
        assert_eq!(pending.len(), 4);
        assert_eq!(
            tokio::time::Instant::now() - start,
            Duration::from_millis(2)
        );
        let _kept = sender.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_busy_shard_waits_no_longer_than_its_linger() {
        let (tx, mut rx) = mpsc::channel(16);
        let pace = pace(Duration::from_millis(3), 10);
        let (q, _answer) = queued(1);
        tx.send(q).await.unwrap();
        let start = tokio::time::Instant::now();
        let mut pending = Vec::new();
        assert!(gather(&mut rx, &mut pending, 128, &pace).await);
        assert_eq!(pending.len(), 1);
        assert_eq!(
            tokio::time::Instant::now() - start,
            Duration::from_millis(3)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn no_linger_means_no_wait_even_when_busy() {
        let (tx, mut rx) = mpsc::channel(16);
        let pace = pace(Duration::ZERO, 10);
        let (q, _answer) = queued(1);
        tx.send(q).await.unwrap();
        let start = tokio::time::Instant::now();
        let mut pending = Vec::new();
        assert!(gather(&mut rx, &mut pending, 128, &pace).await);
        assert_eq!(pending.len(), 1);
        assert_eq!(tokio::time::Instant::now(), start);
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_never_carries_more_than_max_nor_a_grab_whose_request_gave_up() {
        let (tx, mut rx) = mpsc::channel(16);
        let pace = pace(LINGER, 3);
        let mut answers = Vec::new();
        for n in 1..=6 {
            let (q, answer) = queued(n);
            tx.send(q).await.unwrap();
            answers.push(answer);
        }
        // The second request gave up while queued.
        drop(answers.remove(1));
        let mut pending = Vec::new();
        assert!(gather(&mut rx, &mut pending, 3, &pace).await);
        let users: Vec<i64> = pending.iter().map(|(g, _)| g.user_id.get()).collect();
        assert_eq!(users, [1, 3, 4]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_closed_queue_ends_the_gathering_once_empty() {
        let (tx, mut rx) = mpsc::channel(16);
        let pace = pace(LINGER, 10);
        let (q, _answer) = queued(1);
        tx.send(q).await.unwrap();
        drop(tx);
        let mut pending = Vec::new();
        // What was queued is still sent, without waiting for more.
        assert!(gather(&mut rx, &mut pending, 128, &pace).await);
        assert_eq!(pending.len(), 1);
        pending.clear();
        assert!(!gather(&mut rx, &mut pending, 128, &pace).await);
    }
}
