//! The order worker: one consumer in the group, moving admitted orders from the stream
//! into Postgres.
//!
//! Each batch is written in one transaction and acknowledged only after the commit, so
//! a crash anywhere leaves the entries pending; on start the worker first replays its
//! own pending list, and it takes over entries that dead consumers left behind. Inserts
//! are idempotent, so a replay of an already committed batch changes nothing.
//!
//! A batch that fails for a passing reason (Postgres down, Redis down) is held in memory
//! and retried with backoff; it is not read again, so an outage does not count as a
//! delivery. A batch that keeps killing workers is re-delivered each time, and an entry
//! delivered more than `max_deliveries` times goes to the dead-letter stream.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use futures_util::future::BoxFuture;

use sqlx::PgPool;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::keys::{Keys, Shard};
use crate::redis_conn::RedisConn;
use crate::store::orders::{self, Burial, NewOrder, Persisted, Rejection};
use crate::stream::{self, Entry, ReadFrom};

#[derive(Debug, Clone)]
pub struct WorkerConfig {
    pub consumer: String,
    pub batch_size: usize,
    pub block: Duration,
    /// Entries another consumer left pending this long are taken over (that consumer
    /// is presumed dead). Must exceed the time a healthy batch takes.
    pub claim_idle: Duration,
    /// An entry delivered more often than this is dead-lettered instead of written.
    pub max_deliveries: u64,
    /// How often acknowledged entries are trimmed from the stream.
    pub trim_every: Duration,
}

impl WorkerConfig {
    /// A consumer name no other process uses: host, pid and a random part.
    pub fn unique_consumer_name() -> String {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "host".into());
        format!(
            "{host}-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        )
    }
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            consumer: Self::unique_consumer_name(),
            batch_size: 256,
            block: Duration::from_secs(1),
            claim_idle: Duration::from_secs(15),
            max_deliveries: 5,
            trim_every: Duration::from_secs(1),
        }
    }
}

/// What one or more batches did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BatchReport {
    pub entries: usize,
    pub inserted: usize,
    pub already_there: usize,
    pub dead_lettered: usize,
    /// Orders not written because their entry was no longer pending.
    pub vanished: usize,
}

impl BatchReport {
    fn add(&mut self, other: BatchReport) {
        self.entries += other.entries;
        self.inserted += other.inserted;
        self.already_there += other.already_there;
        self.dead_lettered += other.dead_lettered;
        self.vanished += other.vanished;
    }
}

/// A batch read from the stream and not yet acknowledged.
#[derive(Debug)]
struct Held {
    shard: Shard,
    entries: Vec<Entry>,
    /// Some entry was delivered more than `max_deliveries` times: write each entry in
    /// a transaction of its own, so one entry that kills workers cannot take its
    /// batch-mates down with it.
    isolate: bool,
}

/// Where the next batch comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    /// This consumer's own pending list (after a start).
    OwnPending,
    /// Entries idle consumers left behind.
    Claim,
    New,
}

/// Marks a shard whose pending list has been walked in the current claim pass.
const CLAIM_DONE: &str = "done";

/// The worker's place in its round over the shards: each read starts at the shard after
/// the one served last (so a backlog on one shard cannot starve another), and each
/// shard has its own XAUTOCLAIM cursor.
#[derive(Debug)]
struct Round {
    next: usize,
    claim_cursors: Vec<String>,
}

impl Round {
    fn new(shards: usize) -> Self {
        Self {
            next: 0,
            claim_cursors: vec!["0-0".to_string(); shards],
        }
    }

    /// Starts a new claim pass over every shard.
    fn restart_claims(&mut self) {
        for c in &mut self.claim_cursors {
            *c = "0-0".to_string();
        }
    }
}

/// What becomes of one entry of a batch.
enum Fate {
    Write(NewOrder),
    /// Will not be written: buried in Postgres, settled in Redis.
    Bury(NewOrder, Rejection),
    /// No order in it: dead-lettered as it is.
    Malformed,
    /// Its entry is no longer pending: nothing to do.
    Gone,
}

pub struct Worker {
    db: PgPool,
    redis: RedisConn,
    keys: Keys,
    config: WorkerConfig,
}

impl Worker {
    /// `redis` must be a connection of the worker's own (see [`crate::redis_conn`]).
    pub fn new(db: PgPool, redis: RedisConn, keys: Keys, config: WorkerConfig) -> Self {
        Self {
            db,
            redis,
            keys,
            config,
        }
    }

    /// Creates the consumer group of every shard (and the streams) if missing.
    pub async fn ensure_groups(&self) -> anyhow::Result<()> {
        let mut conn = self.redis.clone();
        for shard in self.keys.shards() {
            stream::ensure_group(&mut conn, &self.keys, shard).await?;
        }
        Ok(())
    }

    pub async fn read_batch(&self, shard: Shard, from: ReadFrom) -> anyhow::Result<Vec<Entry>> {
        let mut conn = self.redis.clone();
        Ok(stream::read(
            &mut conn,
            &self.keys,
            shard,
            &self.config.consumer,
            from,
            self.config.batch_size,
        )
        .await?)
    }

    /// Runs `work` while keeping the batch's entries fresh in the pending list, so that
    /// peers do not take over a batch that is only waiting (for a row lock, a slow
    /// Postgres): being claimed would count as a delivery and end in a dead letter.
    async fn heartbeat<T>(
        &self,
        shard: Shard,
        entries: &[Entry],
        work: impl std::future::Future<Output = T>,
    ) -> T {
        tokio::pin!(work);
        let every = (self.config.claim_idle / 3).max(Duration::from_millis(50));
        let mut tick = tokio::time::interval_at(Instant::now() + every, every);
        loop {
            tokio::select! {
                done = &mut work => return done,
                _ = tick.tick() => {
                    let mut conn = self.redis.clone();
                    if let Err(e) = stream::touch(&mut conn, &self.keys, shard, &self.config.consumer, entries).await {
                        tracing::debug!(error = %e, "could not refresh the batch's idle time");
                    }
                }
            }
        }
    }

    /// Writes a batch to Postgres in one transaction, buries what can never be written,
    /// then acknowledges the batch. On `Err` nothing was acknowledged that was not
    /// finished, and the batch may simply be processed again.
    #[tracing::instrument(skip_all, fields(entries = entries.len()))]
    pub async fn process_batch(
        &self,
        shard: Shard,
        entries: &[Entry],
    ) -> anyhow::Result<BatchReport> {
        self.heartbeat(shard, entries, self.process_batch_inner(shard, entries))
            .await
    }

    async fn process_batch_inner(
        &self,
        shard: Shard,
        entries: &[Entry],
    ) -> anyhow::Result<BatchReport> {
        let mut report = BatchReport {
            entries: entries.len(),
            ..Default::default()
        };
        let mut fates: Vec<Fate> = entries
            .iter()
            .map(|e| match e {
                // An order naming a voucher of another shard was not written by the
                // admission script: nothing of it is in that sale's state.
                Entry::Order { order, .. } if self.keys.shard_of(order.voucher_id) != shard => {
                    Fate::Malformed
                }
                Entry::Order { order, .. } => Fate::Write(*order),
                Entry::DeadLetter {
                    order: Some(order),
                    reason,
                    ..
                } if self.keys.shard_of(order.voucher_id) == shard => {
                    Fate::Bury(*order, Rejection::Poison(reason.clone()))
                }
                Entry::DeadLetter { .. } => Fate::Malformed,
            })
            .collect();

        let new_orders: Vec<NewOrder> = fates
            .iter()
            .filter_map(|f| match f {
                Fate::Write(order) => Some(*order),
                _ => None,
            })
            .collect();
        let entry_of: HashMap<i64, &str> = entries
            .iter()
            .filter_map(|e| Some((e.order()?.id, e.entry_id())))
            .collect();
        let live = |ids: Vec<i64>| -> BoxFuture<'_, anyhow::Result<HashSet<i64>>> {
            let mut conn = self.redis.clone();
            let entry_of = &entry_of;
            Box::pin(async move {
                let mut wanted: Vec<&str> = ids
                    .iter()
                    .filter_map(|id| entry_of.get(id).copied())
                    .collect();
                wanted.sort_by_key(|id| stream::parse_id(id));
                let pending = stream::still_pending(&mut conn, &self.keys, shard, &wanted).await?;
                Ok(ids
                    .into_iter()
                    .filter(|id| entry_of.get(id).is_some_and(|e| pending.contains(*e)))
                    .collect())
            })
        };
        let started = std::time::Instant::now();
        let mut outcomes = orders::persist_batch(&self.db, &new_orders, &live)
            .await?
            .into_iter();
        metrics::histogram!(crate::metrics::WORKER_COMMIT_SECONDS)
            .record(started.elapsed().as_secs_f64());
        metrics::histogram!(crate::metrics::WORKER_BATCH_SIZE).record(entries.len() as f64);
        for fate in &mut fates {
            if let Fate::Write(order) = fate {
                match outcomes.next().expect("one outcome per order") {
                    Persisted::Inserted => report.inserted += 1,
                    Persisted::AlreadyThere => report.already_there += 1,
                    Persisted::Vanished => {
                        tracing::warn!(
                            order_id = order.id,
                            "not writing an order whose stream entry is gone (redis lost it)"
                        );
                        report.vanished += 1;
                        *fate = Fate::Gone;
                    }
                    Persisted::Rejected(why) => *fate = Fate::Bury(*order, why),
                }
            }
        }

        let mut conn = self.redis.clone();
        for (entry, fate) in entries.iter().zip(&fates) {
            match fate {
                Fate::Write(_) | Fate::Gone => {}
                Fate::Malformed => {
                    tracing::warn!(
                        entry_id = entry.entry_id(),
                        "dead-lettering a malformed stream entry"
                    );
                    let reason = match entry {
                        Entry::DeadLetter { reason, .. } => reason.clone(),
                        Entry::Order { .. } => "malformed: voucher of another shard".into(),
                    };
                    let dead = entry.clone().into_dead_letter(reason);
                    stream::dead_letter(&mut conn, &self.keys, shard, &dead).await?;
                    metrics::counter!(crate::metrics::DEAD_LETTERED, "kind" => "malformed")
                        .increment(1);
                    report.dead_lettered += 1;
                }
                Fate::Bury(order, why) => {
                    if self.bury(&mut conn, shard, entry, order, why).await? {
                        report.dead_lettered += 1;
                    } else {
                        report.already_there += 1;
                    }
                }
            }
        }
        stream::ack(&mut conn, &self.keys, shard, entries).await?;
        metrics::counter!(crate::metrics::WORKER_ORDERS, "result" => "inserted")
            .increment(report.inserted as u64);
        metrics::counter!(crate::metrics::WORKER_ORDERS, "result" => "already_there")
            .increment(report.already_there as u64);
        metrics::counter!(crate::metrics::WORKER_ORDERS, "result" => "dead_lettered")
            .increment(report.dead_lettered as u64);
        Ok(report)
    }

    /// Buries an order that will not be written: Postgres first (under the sale's row
    /// lock: written after all, or tombstoned so no replay can write it), then the dead
    /// letter, then Redis (acknowledged, buyer record handed back to the order Postgres
    /// holds, unit returned) in one script. `false` when it was written after all.
    async fn bury(
        &self,
        conn: &mut RedisConn,
        shard: Shard,
        entry: &Entry,
        order: &NewOrder,
        why: &Rejection,
    ) -> anyhow::Result<bool> {
        let reason = why.reason();
        match orders::bury(&self.db, order, &reason).await? {
            Burial::Written => Ok(false),
            Burial::Dead { newly, holder } => {
                if newly {
                    tracing::warn!(entry_id = entry.entry_id(), order_id = order.id, %reason, "dead-lettering order");
                    let dead = entry.clone().into_dead_letter(reason);
                    stream::dead_letter(conn, &self.keys, shard, &dead).await?;
                    metrics::counter!(crate::metrics::DEAD_LETTERED, "kind" => why.kind())
                        .increment(1);
                }
                stream::settle_dead(
                    conn,
                    &self.keys,
                    entry.entry_id(),
                    order.voucher_id,
                    order.user_id,
                    order.id,
                    holder,
                    why.returns_unit(),
                )
                .await?;
                Ok(true)
            }
        }
    }

    /// Screens redelivered entries. Delivered more than `max_deliveries` times (workers
    /// died holding them, or were killed): the batch is written entry by entry. More
    /// than twice that, even alone: poison, buried (after asking Postgres whether it
    /// was written after all).
    async fn screen_redeliveries(&self, shard: Shard, entries: Vec<Entry>) -> anyhow::Result<Held> {
        let mut conn = self.redis.clone();
        let counts = stream::delivery_counts(&mut conn, &self.keys, shard, &entries).await?;
        let max = self.config.max_deliveries;
        let mut isolate = false;
        let entries = entries
            .into_iter()
            .map(|e| match counts.get(e.entry_id()) {
                Some(&n) if n > 2 * max => {
                    e.into_dead_letter(format!("delivered {n} times without being written"))
                }
                Some(&n) if n > max => {
                    isolate = true;
                    e
                }
                _ => e,
            })
            .collect();
        Ok(Held {
            shard,
            entries,
            isolate,
        })
    }

    /// The next batch from `source`, trying the shards in turn from the one after the
    /// shard served last; `None` when that source is empty in every shard.
    async fn next_batch(&self, source: Source, round: &mut Round) -> anyhow::Result<Option<Held>> {
        let n = self.keys.shards().count().max(1);
        // New entries: first what any shard has now; only when all are empty, one
        // blocking read per shard in turn (so an idle round waits about `block`, and a
        // busy shard never waits behind an empty one's block).
        // `None`: a claim pass (XAUTOCLAIM, not a read).
        let passes: &[Option<ReadFrom>] = match source {
            Source::New => &[
                Some(ReadFrom::Ready),
                Some(ReadFrom::New {
                    block_ms: (self.config.block.as_millis() / n as u128).max(1) as u64,
                }),
            ],
            Source::OwnPending => &[Some(ReadFrom::OwnPending)],
            Source::Claim => &[None],
        };
        for &from in passes {
            for i in 0..n {
                let index = (round.next + i) % n;
                let shard = Shard(index as u32);
                let entries = match from {
                    None => {
                        self.claim_some(shard, &mut round.claim_cursors[index])
                            .await?
                    }
                    Some(from) => self.read_batch(shard, from).await?,
                };
                if entries.is_empty() {
                    continue;
                }
                round.next = (index + 1) % n;
                return Ok(Some(match source {
                    Source::New => Held {
                        shard,
                        entries,
                        isolate: false,
                    },
                    Source::OwnPending | Source::Claim => {
                        self.screen_redeliveries(shard, entries).await?
                    }
                }));
            }
        }
        Ok(None)
    }

    /// Walks the shard's pending list from `cursor` until it takes over some entries or
    /// reaches the end (then `cursor` becomes [`CLAIM_DONE`]).
    async fn claim_some(&self, shard: Shard, cursor: &mut String) -> anyhow::Result<Vec<Entry>> {
        let mut conn = self.redis.clone();
        while cursor != CLAIM_DONE {
            let (next, entries) = stream::claim(
                &mut conn,
                &self.keys,
                shard,
                &self.config.consumer,
                self.config.claim_idle.as_millis() as u64,
                cursor,
                self.config.batch_size,
            )
            .await?;
            *cursor = if next == "0-0" {
                CLAIM_DONE.into()
            } else {
                next
            };
            if !entries.is_empty() {
                tracing::info!(
                    claimed = entries.len(),
                    shard = shard.0,
                    "took over entries of an idle consumer"
                );
                return Ok(entries);
            }
        }
        Ok(Vec::new())
    }

    fn round(&self) -> Round {
        Round::new(self.keys.shards().count())
    }

    /// Processes a batch, entry by entry if it must be isolated. Entries finished
    /// before an error are acknowledged; processing them again changes nothing.
    async fn process_held(&self, held: &Held) -> anyhow::Result<BatchReport> {
        if !held.isolate {
            return self.process_batch(held.shard, &held.entries).await;
        }
        let mut report = BatchReport::default();
        for entry in &held.entries {
            report.add(
                self.process_batch(held.shard, std::slice::from_ref(entry))
                    .await?,
            );
        }
        Ok(report)
    }

    /// Replays this consumer's pending entries (delivered, never acknowledged).
    pub async fn replay_pending(&self) -> anyhow::Result<BatchReport> {
        let mut report = BatchReport::default();
        let mut round = self.round();
        while let Some(held) = self.next_batch(Source::OwnPending, &mut round).await? {
            report.add(self.process_held(&held).await?);
        }
        Ok(report)
    }

    /// Takes over and processes entries that other consumers left pending for longer
    /// than `claim_idle`.
    pub async fn reclaim(&self) -> anyhow::Result<BatchReport> {
        let mut report = BatchReport::default();
        let mut round = self.round();
        while let Some(held) = self.next_batch(Source::Claim, &mut round).await? {
            report.add(self.process_held(&held).await?);
        }
        Ok(report)
    }

    /// Removes acknowledged entries from every stream, and consumers long dead with
    /// nothing pending; returns how many entries went.
    pub async fn trim(&self) -> anyhow::Result<u64> {
        let mut conn = self.redis.clone();
        let mut trimmed = 0;
        // Four claim periods: long after its last entry could have been taken over.
        let idle_ms = (self.config.claim_idle * 4).as_millis() as u64;
        for shard in self.keys.shards() {
            trimmed += stream::trim_acknowledged(&mut conn, &self.keys, shard).await?;
            stream::forget_idle_consumers(&mut conn, &self.keys, shard, idle_ms).await?;
        }
        Ok(trimmed)
    }

    /// Processes everything there is now and returns when the streams are empty
    /// (tools and tests; the service uses [`Worker::run`]).
    pub async fn drain(&self) -> anyhow::Result<BatchReport> {
        self.ensure_groups().await?;
        let mut report = self.replay_pending().await?;
        report.add(self.reclaim().await?);
        loop {
            let mut any = false;
            for shard in self.keys.shards() {
                let entries = self
                    .read_batch(shard, ReadFrom::New { block_ms: 1 })
                    .await?;
                if !entries.is_empty() {
                    any = true;
                    report.add(self.process_batch(shard, &entries).await?);
                }
            }
            if !any {
                break;
            }
        }
        self.trim().await?;
        Ok(report)
    }

    /// Runs until `cancel` fires. A batch in progress is finished and acknowledged
    /// first (or, if its dependencies are down, left pending for the next worker);
    /// reads block at most `block`, so shutdown takes about that long.
    pub async fn run(self, cancel: CancellationToken) {
        tracing::info!(consumer = %self.config.consumer, "worker started");
        crate::metrics::handle();
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        let mut held: Option<Held> = None;
        let mut groups_ready = false;
        let mut replayed = false;
        let mut failing = false;
        let mut round = self.round();
        let claim_every = (self.config.claim_idle / 2).max(Duration::from_millis(100));
        let mut last_claim = Instant::now();
        let mut last_trim = Instant::now();

        while !cancel.is_cancelled() {
            let result: anyhow::Result<()> = async {
                if held.is_none() {
                    if !groups_ready {
                        self.ensure_groups().await?;
                        groups_ready = true;
                    }
                    let source = if !replayed {
                        Source::OwnPending
                    } else if last_claim.elapsed() >= claim_every {
                        Source::Claim
                    } else {
                        Source::New
                    };
                    held = self.next_batch(source, &mut round).await?;
                    match source {
                        Source::OwnPending if held.is_none() => replayed = true,
                        Source::Claim if held.is_none() => {
                            // Every shard's pending list walked: the pass is over.
                            round.restart_claims();
                            last_claim = Instant::now();
                        }
                        _ => {}
                    }
                }
                if let Some(batch) = &held {
                    let report = self.process_held(batch).await?;
                    tracing::debug!(?report, "batch done");
                    held = None;
                }
                if last_trim.elapsed() >= self.config.trim_every {
                    self.trim().await?;
                    last_trim = Instant::now();
                }
                Ok(())
            }
            .await;

            match result {
                Ok(()) => {
                    if failing {
                        tracing::info!("worker recovered");
                        failing = false;
                    }
                    backoff.reset();
                }
                Err(e) => {
                    metrics::counter!(crate::metrics::WORKER_BATCH_ERRORS).increment(1);
                    let dependency = if e.downcast_ref::<sqlx::Error>().is_some() {
                        "postgres"
                    } else if e.downcast_ref::<redis::RedisError>().is_some() {
                        "redis"
                    } else {
                        "other"
                    };
                    metrics::counter!(crate::metrics::DEPENDENCY_ERRORS, "dependency" => dependency, "in" => "worker")
                        .increment(1);
                    if e.downcast_ref::<redis::RedisError>()
                        .is_some_and(|r| r.code() == Some("NOGROUP"))
                    {
                        // Redis lost the stream or the group: re-create it. Our pending
                        // list is gone with it, so there is nothing to replay.
                        groups_ready = false;
                    }
                    if !failing {
                        tracing::warn!(
                            error = format!("{e:#}"),
                            "worker failing, retrying with backoff"
                        );
                        failing = true;
                    }
                    if let Some(batch) = &held {
                        // Still ours: keep live workers from taking it over meanwhile.
                        let mut conn = self.redis.clone();
                        let _ = stream::touch(
                            &mut conn,
                            &self.keys,
                            batch.shard,
                            &self.config.consumer,
                            &batch.entries,
                        )
                        .await;
                    }
                    let pause = backoff.next_delay();
                    let sleep = async {
                        // Keep refreshing a held batch through a long pause too.
                        match &held {
                            Some(batch) => {
                                self.heartbeat(
                                    batch.shard,
                                    &batch.entries,
                                    tokio::time::sleep(pause),
                                )
                                .await
                            }
                            None => tokio::time::sleep(pause).await,
                        }
                    };
                    tokio::select! {
                        _ = cancel.cancelled() => break,
                        _ = sleep => {}
                    }
                }
            }
        }
        if held.is_some() {
            tracing::warn!(
                "stopping with an unwritten batch; it stays pending for the next worker"
            );
        }
        tracing::info!(consumer = %self.config.consumer, "worker stopped");
    }
}
