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

mod adopt;
mod batch;
mod read;

use read::{Held, Source};

use std::time::Duration;

use sqlx::PgPool;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::config::defaults;
use crate::keys::{Keys, Shard};
use crate::redis_conn::RedisConn;
use crate::stream::{self, Delivery, ReadFrom};

#[derive(Debug, Clone)]
pub struct WorkerConfig {
    pub consumer: String,
    pub batch_size: usize,
    pub block: Duration,
    /// Entries another consumer left pending this long are taken over (that consumer
    /// is presumed dead). Must exceed the time a healthy batch takes.
    pub claim_idle: Duration,
    /// An entry delivered more often than this is written alone; more than twice as
    /// often, buried as poison.
    pub max_deliveries: u64,
    /// How often acknowledged entries are trimmed from the stream.
    pub trim_every: Duration,
    /// Replicas that must hold a buried order's settlement before it counts.
    pub replicas: crate::scripts::Replicas,
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
            batch_size: defaults::WORKER_BATCH_SIZE as usize,
            block: Duration::from_millis(defaults::WORKER_BLOCK_MS),
            claim_idle: Duration::from_millis(defaults::WORKER_CLAIM_IDLE_MS),
            max_deliveries: defaults::WORKER_MAX_DELIVERIES,
            trim_every: Duration::from_secs(1),
            replicas: crate::scripts::Replicas::NONE,
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
    /// Orders the fence refused, or whose entry was gone, admitted again into their
    /// sale's current state (written from there).
    pub adopted: usize,
}

impl BatchReport {
    fn add(&mut self, other: BatchReport) {
        self.entries += other.entries;
        self.inserted += other.inserted;
        self.already_there += other.already_there;
        self.dead_lettered += other.dead_lettered;
        self.vanished += other.vanished;
        self.adopted += other.adopted;
    }
}

pub struct Worker {
    db: PgPool,
    redis: RedisConn,
    keys: Keys,
    config: WorkerConfig,
    /// Orders per stream entry in the last read (an entry holds one admission call's
    /// orders): reads ask for `batch_size` orders' worth of entries.
    orders_per_entry: std::sync::atomic::AtomicUsize,
    /// Since when each sale segment's current state has been out of this worker's reach
    /// (see `adopt`).
    out_of_reach:
        std::sync::Mutex<std::collections::HashMap<crate::keys::SaleSegment, adopt::OutOfReach>>,
}

impl Worker {
    /// `redis` must be a connection of the worker's own (see [`crate::redis_conn`]).
    pub fn new(db: PgPool, redis: RedisConn, keys: Keys, config: WorkerConfig) -> Self {
        Self {
            db,
            redis,
            keys,
            config,
            orders_per_entry: std::sync::atomic::AtomicUsize::new(1),
            out_of_reach: Default::default(),
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

    pub async fn read_batch(&self, shard: Shard, from: ReadFrom) -> anyhow::Result<Vec<Delivery>> {
        let mut conn = self.redis.clone();
        let orders = stream::read(
            &mut conn,
            &self.keys,
            shard,
            &self.config.consumer,
            from,
            self.entries_per_read(),
        )
        .await?;
        self.saw(&orders);
        Ok(orders)
    }

    /// How many entries a read asks for: about `batch_size` orders.
    pub(crate) fn entries_per_read(&self) -> usize {
        let per_entry = self
            .orders_per_entry
            .load(std::sync::atomic::Ordering::Relaxed);
        (self.config.batch_size / per_entry.max(1)).max(1)
    }

    /// Remembers how many orders an entry of `orders` held.
    pub(crate) fn saw(&self, orders: &[Delivery]) {
        let entries = stream::entry_ids(orders).len();
        if entries > 0 {
            self.orders_per_entry.store(
                orders.len().div_ceil(entries),
                std::sync::atomic::Ordering::Relaxed,
            );
        }
    }

    /// Replays this consumer's pending entries (delivered, never acknowledged).
    pub(crate) async fn replay_pending(&self) -> anyhow::Result<BatchReport> {
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
        let mut state = LoopState::new(self.round(), &self.config);
        // While failing: whether because of the schema (logged again when that changes).
        let mut failing: Option<bool> = None;
        while !cancel.is_cancelled() {
            match self.step(&mut state).await {
                Ok(()) => {
                    if failing.take().is_some() {
                        tracing::info!("worker recovered");
                    }
                    backoff.reset();
                }
                Err(e) => {
                    let schema = is_schema_mismatch(&e);
                    if failing != Some(schema) {
                        log_failure(&e, schema);
                        failing = Some(schema);
                    }
                    self.count_failure(&e, &mut state);
                    // The held batch stays ours through the pause: keep it fresh so live
                    // workers do not take it over.
                    let pause = tokio::time::sleep(backoff.next_delay());
                    let wait = async {
                        match &state.held {
                            Some(batch) => self.heartbeat(batch.shard, &batch.entries, pause).await,
                            None => pause.await,
                        }
                    };
                    tokio::select! {
                        _ = cancel.cancelled() => break,
                        _ = wait => {}
                    }
                }
            }
        }
        if state.held.is_some() {
            tracing::warn!(
                "stopping with an unwritten batch; it stays pending for the next worker"
            );
        }
        tracing::info!(consumer = %self.config.consumer, "worker stopped");
    }

    /// One turn of the loop: take a batch if none is held (own pending list first, then
    /// claims when due, else new entries), write it, trim when due. On `Err` a batch
    /// taken stays held and is retried as it is.
    async fn step(&self, st: &mut LoopState) -> anyhow::Result<()> {
        if st.held.is_none() {
            if !st.groups_ready {
                self.ensure_groups().await?;
                st.groups_ready = true;
            }
            let source = if !st.replayed {
                Source::OwnPending
            } else if st.last_claim.elapsed() >= st.claim_every {
                Source::Claim
            } else {
                Source::New
            };
            st.held = self.next_batch(source, &mut st.round).await?;
            match source {
                Source::OwnPending if st.held.is_none() => st.replayed = true,
                Source::Claim if st.held.is_none() => {
                    // Every shard's pending list walked: the pass is over.
                    st.round.restart_claims();
                    st.last_claim = Instant::now();
                }
                _ => {}
            }
        }
        if let Some(batch) = &st.held {
            let report = self.process_held(batch).await?;
            tracing::debug!(?report, "batch done");
            st.held = None;
        }
        if st.last_trim.elapsed() >= self.config.trim_every {
            self.trim().await?;
            st.last_trim = Instant::now();
        }
        Ok(())
    }

    /// Counts a failed turn by the dependency at fault; after `NOGROUP` (Redis lost the
    /// stream or the group, and our pending list with it) the groups are re-created.
    fn count_failure(&self, e: &anyhow::Error, st: &mut LoopState) {
        metrics::counter!(crate::metrics::WORKER_BATCH_ERRORS).increment(1);
        let redis_error = e.downcast_ref::<redis::RedisError>();
        let dependency = if e.downcast_ref::<sqlx::Error>().is_some() {
            "postgres"
        } else if redis_error.is_some() {
            "redis"
        } else {
            "other"
        };
        metrics::counter!(crate::metrics::DEPENDENCY_ERRORS, "dependency" => dependency, "in" => "worker")
            .increment(1);
        if is_schema_mismatch(e) {
            metrics::counter!(crate::metrics::WORKER_SCHEMA_ERRORS).increment(1);
        }
        if redis_error.is_some_and(|r| r.code() == Some("NOGROUP")) {
            st.groups_ready = false;
        }
    }
}

fn is_schema_mismatch(e: &anyhow::Error) -> bool {
    e.downcast_ref::<sqlx::Error>()
        .is_some_and(crate::store::is_schema_mismatch)
}

fn log_failure(e: &anyhow::Error, schema: bool) {
    let error = format!("{e:#}");
    if schema {
        // Burying would break every 202 this worker holds; waiting breaks none.
        tracing::error!(
            error,
            "the database schema is newer or older than this worker expects: its batch \
             stays pending and is retried with backoff, nothing is dead-lettered; run the \
             worker of the release that matches the schema"
        );
    } else {
        tracing::warn!(error, "worker failing, retrying with backoff");
    }
}

/// What the loop carries from one turn to the next.
struct LoopState {
    /// A batch taken and not yet written.
    held: Option<Held>,
    groups_ready: bool,
    /// This consumer's own pending list has been replayed since the start.
    replayed: bool,
    round: read::Round,
    claim_every: Duration,
    last_claim: Instant,
    last_trim: Instant,
}

impl LoopState {
    fn new(round: read::Round, config: &WorkerConfig) -> Self {
        Self {
            held: None,
            groups_ready: false,
            replayed: false,
            round,
            claim_every: (config.claim_idle / 2).max(Duration::from_millis(100)),
            last_claim: Instant::now(),
            last_trim: Instant::now(),
        }
    }
}
