//! Where the next batch comes from: the own pending list after a start, entries idle
//! consumers left behind, or new entries; the shards in turn.

use super::Worker;
use crate::keys::Shard;
use crate::stream::{self, DeadReason, Delivery, ReadFrom};

/// A batch read from the stream and not yet acknowledged.
#[derive(Debug)]
pub(super) struct Held {
    pub(super) shard: Shard,
    pub(super) entries: Vec<Delivery>,
    /// Some entry was delivered more than `max_deliveries` times: write each entry in
    /// a transaction of its own, so one entry that kills workers cannot take its
    /// batch-mates down with it.
    pub(super) isolate: bool,
}

/// Where the next batch comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Source {
    /// This consumer's own pending list (after a start).
    OwnPending,
    /// Entries idle consumers left behind.
    Claim,
    New,
}

/// Marks a shard whose pending list has been walked in the current claim pass.
pub(super) const CLAIM_DONE: &str = "done";

/// The worker's place in its round over the shards: each read starts at the shard after
/// the one served last (so a backlog on one shard cannot starve another), and each
/// shard has its own XAUTOCLAIM cursor.
#[derive(Debug)]
pub(super) struct Round {
    pub(super) next: usize,
    pub(super) claim_cursors: Vec<String>,
}

impl Round {
    pub(super) fn new(shards: usize) -> Self {
        Self {
            next: 0,
            claim_cursors: vec!["0-0".to_string(); shards],
        }
    }

    /// Starts a new claim pass over every shard.
    pub(super) fn restart_claims(&mut self) {
        for c in &mut self.claim_cursors {
            *c = "0-0".to_string();
        }
    }
}

impl Worker {
    /// Screens redelivered entries. Delivered more than `max_deliveries` times (workers
    /// died holding them, or were killed): the batch is written entry by entry. More
    /// than twice that, even alone: poison, buried (after asking Postgres whether it
    /// was written after all).
    pub(super) async fn screen_redeliveries(
        &self,
        shard: Shard,
        entries: Vec<Delivery>,
    ) -> anyhow::Result<Held> {
        let mut conn = self.redis.clone();
        let counts = stream::delivery_counts(&mut conn, &self.keys, shard, &entries).await?;
        let max = self.config.max_deliveries;
        let mut isolate = false;
        let entries = entries
            .into_iter()
            .map(|e| match counts.get(e.entry_id()) {
                Some(&n) if n > 2 * max => e.into_dead_letter(DeadReason::Poison { deliveries: n }),
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
    pub(super) async fn next_batch(
        &self,
        source: Source,
        round: &mut Round,
    ) -> anyhow::Result<Option<Held>> {
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
    pub(super) async fn claim_some(
        &self,
        shard: Shard,
        cursor: &mut String,
    ) -> anyhow::Result<Vec<Delivery>> {
        let mut conn = self.redis.clone();
        while cursor != CLAIM_DONE {
            let (next, entries) = stream::claim(
                &mut conn,
                &self.keys,
                shard,
                &self.config.consumer,
                self.config.claim_idle.as_millis() as u64,
                cursor,
                self.entries_per_read(),
            )
            .await?;
            self.saw(&entries);
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

    pub(super) fn round(&self) -> Round {
        Round::new(self.keys.shards().count())
    }
}
