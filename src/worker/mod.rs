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

use std::time::Duration;

use sqlx::PgPool;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::admission::keys::{Keys, Shard};
use crate::redis_conn::RedisConn;
use crate::store::orders::{self, Persisted};
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
}

impl BatchReport {
    fn add(&mut self, other: BatchReport) {
        self.entries += other.entries;
        self.inserted += other.inserted;
        self.already_there += other.already_there;
        self.dead_lettered += other.dead_lettered;
    }
}

/// A batch read from the stream and not yet acknowledged.
#[derive(Debug)]
struct Held {
    shard: Shard,
    entries: Vec<Entry>,
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

    pub fn consumer(&self) -> &str {
        &self.config.consumer
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

    /// Writes a batch to Postgres in one transaction, dead-letters what can never be
    /// written, then acknowledges the batch. On `Err` nothing was acknowledged and the
    /// batch may simply be processed again.
    #[tracing::instrument(skip_all, fields(entries = entries.len()))]
    pub async fn process_batch(
        &self,
        shard: Shard,
        entries: &[Entry],
    ) -> anyhow::Result<BatchReport> {
        let mut report = BatchReport {
            entries: entries.len(),
            ..Default::default()
        };
        let new_orders: Vec<_> = entries
            .iter()
            .filter_map(|e| match e {
                Entry::Order { order, .. } => Some(*order),
                Entry::DeadLetter { .. } => None,
            })
            .collect();
        let started = std::time::Instant::now();
        let mut outcomes = orders::persist_batch(&self.db, &new_orders)
            .await?
            .into_iter();
        metrics::histogram!(crate::metrics::WORKER_COMMIT_SECONDS)
            .record(started.elapsed().as_secs_f64());
        metrics::histogram!(crate::metrics::WORKER_BATCH_SIZE).record(entries.len() as f64);

        let mut conn = self.redis.clone();
        for entry in entries {
            let dead = match entry {
                Entry::DeadLetter { .. } => Some(entry.clone()),
                Entry::Order { .. } => match outcomes.next().expect("one outcome per order") {
                    Persisted::Inserted => {
                        report.inserted += 1;
                        None
                    }
                    Persisted::AlreadyThere => {
                        report.already_there += 1;
                        None
                    }
                    Persisted::Rejected(reason) => Some(entry.clone().into_dead_letter(reason)),
                },
            };
            if let Some(dead) = dead {
                if let Entry::DeadLetter { reason, .. } = &dead {
                    tracing::warn!(entry_id = dead.entry_id(), %reason, "dead-lettering stream entry");
                }
                stream::dead_letter(&mut conn, &self.keys, shard, &dead).await?;
                if let Some(order) = dead.order() {
                    // The buyer holds no order now: let them see that, and try again.
                    crate::admission::forget_buyer(
                        &mut conn,
                        &self.keys,
                        order.voucher_id,
                        order.user_id,
                        order.id,
                    )
                    .await?;
                }
                report.dead_lettered += 1;
                if let Entry::DeadLetter { reason, .. } = &dead {
                    let kind = match reason.split(':').next() {
                        Some("malformed") => "malformed",
                        Some("poison") => "poison",
                        _ => "rejected",
                    };
                    metrics::counter!(crate::metrics::DEAD_LETTERED, "kind" => kind).increment(1);
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

    /// Marks entries delivered more than `max_deliveries` times as dead letters: they
    /// have outlived that many workers without being written.
    async fn screen_redeliveries(
        &self,
        shard: Shard,
        entries: Vec<Entry>,
    ) -> anyhow::Result<Vec<Entry>> {
        let mut conn = self.redis.clone();
        let counts = stream::delivery_counts(&mut conn, &self.keys, shard, &entries).await?;
        Ok(entries
            .into_iter()
            .map(|e| match counts.get(e.entry_id()) {
                Some(&n) if n > self.config.max_deliveries => {
                    e.into_dead_letter(format!("poison: delivered {n} times without being written"))
                }
                _ => e,
            })
            .collect())
    }

    /// The next batch from `source` in any shard, or `None` when that source is empty.
    async fn next_batch(
        &self,
        source: Source,
        claim_cursor: &mut String,
    ) -> anyhow::Result<Option<Held>> {
        for shard in self.keys.shards() {
            let entries = match source {
                Source::OwnPending => self.read_batch(shard, ReadFrom::OwnPending).await?,
                Source::Claim => {
                    let mut conn = self.redis.clone();
                    let (next, entries) = stream::claim(
                        &mut conn,
                        &self.keys,
                        shard,
                        &self.config.consumer,
                        self.config.claim_idle.as_millis() as u64,
                        claim_cursor,
                        self.config.batch_size,
                    )
                    .await?;
                    *claim_cursor = next;
                    if !entries.is_empty() {
                        tracing::info!(
                            claimed = entries.len(),
                            "took over entries of an idle consumer"
                        );
                    }
                    entries
                }
                Source::New => {
                    // One blocking read per shard in turn, so a round over all shards
                    // still waits at most `block` when everything is idle.
                    let shards = self.keys.shards().count().max(1) as u128;
                    let block_ms = (self.config.block.as_millis() / shards).max(1) as u64;
                    self.read_batch(shard, ReadFrom::New { block_ms }).await?
                }
            };
            if entries.is_empty() {
                continue;
            }
            let entries = match source {
                Source::New => entries,
                Source::OwnPending | Source::Claim => {
                    self.screen_redeliveries(shard, entries).await?
                }
            };
            return Ok(Some(Held { shard, entries }));
        }
        Ok(None)
    }

    /// Replays this consumer's pending entries (delivered, never acknowledged).
    pub async fn replay_pending(&self) -> anyhow::Result<BatchReport> {
        let mut report = BatchReport::default();
        let mut cursor = String::new();
        while let Some(held) = self.next_batch(Source::OwnPending, &mut cursor).await? {
            report.add(self.process_batch(held.shard, &held.entries).await?);
        }
        Ok(report)
    }

    /// Takes over and processes entries that other consumers left pending for longer
    /// than `claim_idle`.
    pub async fn reclaim(&self) -> anyhow::Result<BatchReport> {
        let mut report = BatchReport::default();
        let mut cursor = "0-0".to_string();
        loop {
            if let Some(held) = self.next_batch(Source::Claim, &mut cursor).await? {
                report.add(self.process_batch(held.shard, &held.entries).await?);
            }
            if cursor == "0-0" {
                return Ok(report);
            }
        }
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
        for shard in self.keys.shards() {
            loop {
                let entries = self
                    .read_batch(shard, ReadFrom::New { block_ms: 1 })
                    .await?;
                if entries.is_empty() {
                    break;
                }
                report.add(self.process_batch(shard, &entries).await?);
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
        let mut claim_cursor = "0-0".to_string();
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
                    held = self.next_batch(source, &mut claim_cursor).await?;
                    match source {
                        Source::OwnPending if held.is_none() => replayed = true,
                        Source::Claim if claim_cursor == "0-0" => last_claim = Instant::now(),
                        _ => {}
                    }
                }
                if let Some(batch) = &held {
                    let report = self.process_batch(batch.shard, &batch.entries).await?;
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
                    if format!("{e:#}").contains("NOGROUP") {
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
                    tokio::select! {
                        _ = cancel.cancelled() => break,
                        _ = tokio::time::sleep(backoff.next_delay()) => {}
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

/// Capped exponential backoff with jitter.
#[derive(Debug)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
    attempt: u32,
}

impl Backoff {
    pub fn new(base: Duration, cap: Duration) -> Self {
        Self {
            base,
            cap,
            attempt: 0,
        }
    }

    pub fn next_delay(&mut self) -> Duration {
        let exp = self.base.saturating_mul(1 << self.attempt.min(16));
        self.attempt += 1;
        let capped = exp.min(self.cap);
        // Jitter over the upper half keeps many workers from retrying in step.
        let half = capped / 2;
        half + half.mul_f64(rand::random::<f64>())
    }

    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_stays_under_its_cap() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        let first = b.next_delay();
        assert!(first <= Duration::from_millis(100));
        for _ in 0..30 {
            assert!(b.next_delay() <= Duration::from_secs(5));
        }
        assert!(b.next_delay() >= Duration::from_millis(2500));
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }
}
