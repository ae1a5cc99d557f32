//! Micro-batched admission: the grabs that arrive together for one shard go to Redis in
//! one script call, decided in order (see `lua/seckill.lua`), and each request gets its
//! own outcome back.
//!
//! One task per shard, one call in flight per shard: a grab arriving while the shard is
//! idle leaves at once (no timer, no added latency); grabs arriving while a call is in
//! flight wait for it and leave together in the next (at most `max` per call). A slow
//! shard holds up only its own grabs.

use redis::RedisResult;
use tokio::sync::{mpsc, oneshot};

use std::sync::Arc;

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
    /// the returned batcher's [`Batcher::tally`]; each call waits for `replicas`.
    pub fn start(
        conn: RedisConn,
        keys: Keys,
        max: usize,
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
                tokio::spawn(run_shard(rx, call, tally, max.max(1)));
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
) {
    let mut grabs = Vec::with_capacity(max);
    let mut replies = Vec::with_capacity(max);
    while let Some(first) = rx.recv().await {
        let mut next = Some(first);
        while let Some((grab, reply)) = next.take() {
            // A request that gave up while queued (client gone, request timed out) is
            // not sent: as before batching, a grab never sent admits nothing.
            if !reply.is_closed() {
                grabs.push(grab);
                replies.push(reply);
            }
            if grabs.len() < max {
                next = rx.try_recv().ok();
            }
        }
        if grabs.is_empty() {
            continue;
        }
        let decided = call.admit(&grabs).await;
        // Each grab's answer, counted for the live view under one lock.
        match decided {
            Ok(outcomes) => {
                tally.add_answers(grabs.iter().zip(&outcomes).filter_map(|(g, &o)| {
                    Some((g.voucher_id, tally::answer(&Ok(o), g.order_id)?))
                }));
                for (reply, outcome) in replies.drain(..).zip(outcomes) {
                    let _ = reply.send(Ok(outcome));
                }
            }
            Err(e) => {
                let failed = tally::failure(&e);
                tally.add_answers(grabs.iter().map(|g| (g.voucher_id, failed)));
                for reply in replies.drain(..) {
                    let _ = reply.send(Err(copy(&e)));
                }
            }
        }
        grabs.clear();
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
