//! The order worker: one consumer in the group, moving admitted orders from the stream
//! into Postgres.
//!
//! Each batch is written in one transaction and acknowledged only after the commit, so
//! a crash anywhere leaves the entries pending; on start and after any failure the
//! worker first replays its own pending list. Inserts are idempotent, so a replay of an
//! already committed batch changes nothing.

use std::time::Duration;

use sqlx::PgPool;
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
    /// written, then acknowledges the batch. On `Err` nothing was acknowledged.
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
                Entry::Malformed { .. } => None,
            })
            .collect();
        let mut outcomes = orders::persist_batch(&self.db, &new_orders)
            .await?
            .into_iter();

        let mut conn = self.redis.clone();
        for entry in entries {
            let reason = match entry {
                Entry::Malformed { reason, .. } => Some(reason.clone()),
                Entry::Order { .. } => match outcomes.next().expect("one outcome per order") {
                    Persisted::Inserted => {
                        report.inserted += 1;
                        None
                    }
                    Persisted::AlreadyThere => {
                        report.already_there += 1;
                        None
                    }
                    Persisted::Rejected(reason) => Some(reason),
                },
            };
            if let Some(reason) = reason {
                tracing::warn!(entry_id = entry.entry_id(), %reason, "dead-lettering stream entry");
                stream::dead_letter(&mut conn, &self.keys, shard, entry, &reason).await?;
                report.dead_lettered += 1;
            }
        }
        let all: Vec<&Entry> = entries.iter().collect();
        stream::ack(&mut conn, &self.keys, shard, &all).await?;
        Ok(report)
    }

    /// Replays this consumer's pending entries (delivered, never acknowledged).
    pub async fn replay_pending(&self) -> anyhow::Result<BatchReport> {
        let mut report = BatchReport::default();
        for shard in self.keys.shards() {
            loop {
                let entries = self.read_batch(shard, ReadFrom::OwnPending).await?;
                if entries.is_empty() {
                    break;
                }
                report.add(self.process_batch(shard, &entries).await?);
            }
        }
        Ok(report)
    }

    /// Takes over and processes entries that other consumers left pending for longer
    /// than `claim_idle`.
    pub async fn reclaim(&self) -> anyhow::Result<BatchReport> {
        let mut report = BatchReport::default();
        let mut conn = self.redis.clone();
        let min_idle_ms = self.config.claim_idle.as_millis() as u64;
        for shard in self.keys.shards() {
            let mut cursor = "0-0".to_string();
            loop {
                let (next, entries) = stream::claim(
                    &mut conn,
                    &self.keys,
                    shard,
                    &self.config.consumer,
                    min_idle_ms,
                    &cursor,
                    self.config.batch_size,
                )
                .await?;
                if !entries.is_empty() {
                    tracing::info!(
                        claimed = entries.len(),
                        "took over entries of an idle consumer"
                    );
                    report.add(self.process_batch(shard, &entries).await?);
                }
                if next == "0-0" {
                    break;
                }
                cursor = next;
            }
        }
        Ok(report)
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
        Ok(report)
    }

    /// One step of the service loop: a read of new entries in each shard, processed.
    async fn step(&self) -> anyhow::Result<BatchReport> {
        let mut report = BatchReport::default();
        let block_ms = self.config.block.as_millis().max(1) as u64;
        for shard in self.keys.shards() {
            let entries = self.read_batch(shard, ReadFrom::New { block_ms }).await?;
            if !entries.is_empty() {
                report.add(self.process_batch(shard, &entries).await?);
            }
        }
        Ok(report)
    }

    /// Runs until `cancel` fires. A batch in progress is finished and acknowledged
    /// first; reads block at most `block`, so shutdown takes about that long.
    pub async fn run(self, cancel: CancellationToken) {
        tracing::info!(consumer = %self.config.consumer, "worker started");
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        let mut ready = false;
        let mut failing = false;
        let claim_every = (self.config.claim_idle / 2).max(Duration::from_millis(100));
        let mut last_claim = tokio::time::Instant::now();
        while !cancel.is_cancelled() {
            let result = async {
                if !ready {
                    self.ensure_groups().await?;
                    let replayed = self.replay_pending().await?;
                    if replayed.entries > 0 {
                        tracing::info!(?replayed, "replayed pending entries");
                    }
                    ready = true;
                }
                if last_claim.elapsed() >= claim_every {
                    self.reclaim().await?;
                    last_claim = tokio::time::Instant::now();
                }
                self.step().await
            }
            .await;
            match result {
                Ok(report) => {
                    if failing {
                        tracing::info!("worker recovered");
                        failing = false;
                    }
                    backoff.reset();
                    if report.entries > 0 {
                        tracing::debug!(?report, "batch done");
                    }
                }
                Err(e) => {
                    // Replay our own pending list (and re-create a lost group) first.
                    ready = false;
                    if !failing {
                        tracing::warn!(error = %e, "worker failing, retrying with backoff");
                        failing = true;
                    }
                    tokio::select! {
                        _ = cancel.cancelled() => break,
                        _ = tokio::time::sleep(backoff.next_delay()) => {}
                    }
                }
            }
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
        // Full jitter over the upper half keeps many workers from retrying in step.
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
