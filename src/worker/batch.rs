//! Writing one batch: persist under the sales' row locks, bury what cannot be
//! written, acknowledge; entries kept fresh in the pending list meanwhile.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::time::Instant;

use super::read::Held;
use super::{BatchReport, Worker};
use crate::domain::OrderId;
use crate::keys::Shard;
use crate::redis_conn::RedisConn;
use crate::store::dead_orders::{self, Burial};
use crate::store::orders::{self, NewOrder, Persisted, Rejection};
use crate::stream::{self, DeadReason, Delivery};

/// What becomes of one entry of a batch.
pub(super) enum Fate {
    Write(NewOrder),
    /// Will not be written: buried in Postgres, settled in Redis.
    Bury(NewOrder, Rejection),
    /// No order in it: dead-lettered as it is.
    Malformed,
    /// Its entry is no longer pending (Redis lost it): not written from here.
    Gone(NewOrder),
    /// Admitted again into its sale's current state (see [`Worker::adopt`]): written
    /// from there, not from here.
    Adopted,
}

impl Worker {
    /// Runs `work` while keeping the batch's entries fresh in the pending list, so that
    /// peers do not take over a batch that is only waiting (for a row lock, a slow
    /// Postgres): being claimed would count as a delivery and end in a dead letter.
    pub(super) async fn heartbeat<T>(
        &self,
        shard: Shard,
        entries: &[Delivery],
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
    /// then acknowledges the batch. On `Err` nothing was acknowledged, and the batch may
    /// simply be processed again. The batch holds every order of its entries (a read
    /// returns entries whole), so an entry is acknowledged only once all its orders are
    /// settled.
    #[tracing::instrument(skip_all, fields(entries = entries.len()))]
    pub async fn process_batch(
        &self,
        shard: Shard,
        entries: &[Delivery],
    ) -> anyhow::Result<BatchReport> {
        self.acked_after(shard, entries, self.process_rounds(shard, entries))
            .await
    }

    /// Runs `settle` on a batch (kept fresh in the pending list meanwhile), then
    /// acknowledges the batch but for the entries `settle` says are not ours.
    async fn acked_after(
        &self,
        shard: Shard,
        entries: &[Delivery],
        settle: impl std::future::Future<Output = anyhow::Result<(BatchReport, HashSet<String>)>>,
    ) -> anyhow::Result<BatchReport> {
        self.heartbeat(shard, entries, async {
            let (report, reused) = settle.await?;
            self.ack(shard, entries, reused).await?;
            Ok(report)
        })
        .await
    }

    /// An order id twice in one batch (minted twice, or an entry added twice): the batch
    /// goes in rounds in which no id repeats, each finished before the next, which then
    /// finds the id taken (a duplicate, buried) or its own order written (a replay).
    /// Returns what was done and the entries not ours to acknowledge.
    async fn process_rounds(
        &self,
        shard: Shard,
        entries: &[Delivery],
    ) -> anyhow::Result<(BatchReport, HashSet<String>)> {
        let rounds = orders::rounds_of_unique_ids(entries.iter().map(|e| e.order().map(|o| o.id)));
        if rounds.len() <= 1 {
            return self.process_batch_inner(shard, entries).await;
        }
        let rounds = rounds
            .into_iter()
            .map(|round| round.into_iter().map(|i| entries[i].clone()).collect())
            .collect();
        self.in_turn(shard, rounds).await
    }

    /// Settles the parts of a batch one after the other, each finished before the next.
    /// Returns what was done and the entries not ours to acknowledge.
    async fn in_turn(
        &self,
        shard: Shard,
        parts: Vec<Vec<Delivery>>,
    ) -> anyhow::Result<(BatchReport, HashSet<String>)> {
        let mut report = BatchReport::default();
        let mut reused = HashSet::new();
        for part in parts {
            let (r, u) = self.process_batch_inner(shard, &part).await?;
            report.add(r);
            reused.extend(u);
        }
        Ok((report, reused))
    }

    async fn process_batch_inner(
        &self,
        shard: Shard,
        entries: &[Delivery],
    ) -> anyhow::Result<(BatchReport, HashSet<String>)> {
        let mut report = BatchReport {
            entries: entries.len(),
            ..Default::default()
        };
        let mut fates = self.fates(shard, entries);
        let reused = self.write(shard, entries, &mut fates, &mut report).await?;
        self.adopt(&mut fates, &mut report).await?;
        self.dead_letter(shard, entries, &fates, &mut report)
            .await?;
        count(&report);
        Ok((report, reused))
    }

    /// What becomes of each entry, as far as the entry alone tells.
    fn fates(&self, shard: Shard, entries: &[Delivery]) -> Vec<Fate> {
        entries
            .iter()
            .map(|e| match e {
                // An order naming a voucher of another shard was not written by the
                // admission script: nothing of it is in that sale's state.
                Delivery::Order { order, .. }
                    if self.keys.shard_of_segment(order.sale_segment()) != shard =>
                {
                    Fate::Malformed
                }
                Delivery::Order { order, .. } => Fate::Write(*order),
                Delivery::DeadLetter {
                    order: Some(order),
                    reason: reason @ DeadReason::Poison { .. },
                    ..
                } if self.keys.shard_of_segment(order.sale_segment()) == shard => {
                    Fate::Bury(*order, Rejection::Poison(reason.to_string()))
                }
                Delivery::DeadLetter { .. } => Fate::Malformed,
            })
            .collect()
    }

    /// Writes the batch's orders to Postgres in one transaction, each fate updated with
    /// what Postgres said; returns the entries whose id Redis gave to another order
    /// (that order's, not ours to acknowledge).
    async fn write(
        &self,
        shard: Shard,
        entries: &[Delivery],
        fates: &mut [Fate],
        report: &mut BatchReport,
    ) -> anyhow::Result<HashSet<String>> {
        let new_orders: Vec<NewOrder> = fates
            .iter()
            .filter_map(|f| match f {
                Fate::Write(order) => Some(*order),
                _ => None,
            })
            .collect();
        let entry_of: HashMap<OrderId, &str> = entries
            .iter()
            .filter_map(|e| Some((e.order()?.id, e.entry_id())))
            .collect();
        let reused: Mutex<HashSet<String>> = Mutex::default();
        let still_pending = |ids: Vec<OrderId>| -> BoxFuture<'_, anyhow::Result<HashSet<OrderId>>> {
            let (entry_of, reused) = (&entry_of, &reused);
            Box::pin(async move {
                let wanted: Vec<(&str, OrderId)> = ids
                    .iter()
                    .filter_map(|id| Some((*entry_of.get(id)?, *id)))
                    .collect();
                let now = stream::still_pending(&self.redis, &self.keys, shard, &wanted).await?;
                reused.lock().expect("not poisoned").extend(now.reused);
                Ok(ids
                    .into_iter()
                    .filter(|id| entry_of.get(id).is_some_and(|e| now.alive.contains(*e)))
                    .collect())
            })
        };
        let started = std::time::Instant::now();
        let mut outcomes = orders::persist_batch(&self.db, &new_orders, &still_pending)
            .await?
            .into_iter();
        // Only batches that went to Postgres: a turn of malformed or poison entries
        // alone writes nothing and would drag both histograms towards zero.
        if !new_orders.is_empty() {
            metrics::histogram!(crate::metrics::WORKER_COMMIT_SECONDS)
                .record(started.elapsed().as_secs_f64());
            metrics::histogram!(crate::metrics::WORKER_BATCH_SIZE).record(new_orders.len() as f64);
        }
        for fate in fates.iter_mut() {
            if let Fate::Write(order) = fate {
                match outcomes.next().expect("one outcome per order") {
                    Persisted::Inserted => report.inserted += 1,
                    Persisted::AlreadyThere => report.already_there += 1,
                    Persisted::Vanished => {
                        tracing::warn!(
                            order_id = order.id.get(),
                            "not writing an order whose stream entry is gone (redis lost it)"
                        );
                        report.vanished += 1;
                        *fate = Fate::Gone(*order);
                    }
                    Persisted::Rejected(why) => *fate = Fate::Bury(*order, why),
                }
            }
        }
        Ok(reused.into_inner().expect("not poisoned"))
    }

    /// Dead-letters the malformed entries and buries the orders that cannot be written.
    async fn dead_letter(
        &self,
        shard: Shard,
        entries: &[Delivery],
        fates: &[Fate],
        report: &mut BatchReport,
    ) -> anyhow::Result<()> {
        let mut conn = self.redis.clone();
        for (entry, fate) in entries.iter().zip(fates) {
            match fate {
                Fate::Write(_) | Fate::Gone(_) | Fate::Adopted => {}
                Fate::Malformed => {
                    tracing::warn!(
                        entry_id = entry.entry_id(),
                        "dead-lettering a malformed stream entry"
                    );
                    let reason = match entry {
                        Delivery::DeadLetter { reason, .. } => reason.clone(),
                        Delivery::Order { .. } => DeadReason::OtherShard,
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
        Ok(())
    }

    /// Acknowledges the batch, but for entries whose id now holds another order: that
    /// order is still to be written (a worker takes it over once it is idle).
    async fn ack(
        &self,
        shard: Shard,
        entries: &[Delivery],
        reused: HashSet<String>,
    ) -> anyhow::Result<()> {
        let mut conn = self.redis.clone();
        if reused.is_empty() {
            stream::ack(&mut conn, &self.keys, shard, entries).await?;
            return Ok(());
        }
        tracing::warn!(
            entry_ids = ?reused,
            "redis gave these entry ids to other orders (it lost the batch's entries): \
             not acknowledging them"
        );
        let ours: Vec<Delivery> = entries
            .iter()
            .filter(|e| !reused.contains(e.entry_id()))
            .cloned()
            .collect();
        stream::ack(&mut conn, &self.keys, shard, &ours).await?;
        Ok(())
    }

    /// Buries an order that will not be written: Postgres first (under the sale's row
    /// lock: written after all, or tombstoned so no replay can write it), then the dead
    /// letter, then Redis (buyer record handed back to the order Postgres
    /// holds, unit returned) in one script. `false` when it was written after all.
    async fn bury(
        &self,
        conn: &mut RedisConn,
        shard: Shard,
        entry: &Delivery,
        order: &NewOrder,
        why: &Rejection,
    ) -> anyhow::Result<bool> {
        let reason = why.reason();
        let burial = match why {
            Rejection::StaleEpoch => dead_orders::bury_stale(&self.db, order).await?,
            _ => dead_orders::bury(&self.db, order, &reason, why.returns_unit()).await?,
        };
        match burial {
            Burial::Written => Ok(false),
            // A passing state: the batch is retried as it is, and writes it.
            Burial::Admissible => anyhow::bail!(
                "order {} of a stale epoch was carried into its sale's current one while \
                 it was being buried: retrying its batch",
                order.id
            ),
            Burial::Dead {
                newly,
                holder,
                returns_unit,
                duplicate,
            } => {
                let (why, reason) = match duplicate {
                    true => (&Rejection::IdTaken, Rejection::IdTaken.reason()),
                    false => (why, reason),
                };
                if newly {
                    tracing::warn!(entry_id = entry.entry_id(), order_id = order.id.get(), %reason, "dead-lettering order");
                    let dead = entry.clone().into_dead_letter(DeadReason::Refused(reason));
                    stream::dead_letter(conn, &self.keys, shard, &dead).await?;
                    metrics::counter!(crate::metrics::DEAD_LETTERED, "kind" => why.kind())
                        .increment(1);
                }
                // An order of a stale epoch holds a record only in a state that is not
                // its sale's (the one that admitted it, an old primary's, say): tidying
                // that up need not wait for replicas, which such a server may not have.
                let replicas = match why {
                    Rejection::StaleEpoch => crate::scripts::Replicas::NONE,
                    _ => self.config.replicas,
                };
                stream::settle_dead(
                    conn,
                    &self.keys,
                    order.sale_segment(),
                    order.user_id,
                    order.id,
                    holder,
                    returns_unit,
                    replicas,
                )
                .await?;
                Ok(true)
            }
        }
    }

    /// Processes a batch, order by order if it must be isolated (each in a transaction
    /// of its own), acknowledged once all are settled; processing one again changes
    /// nothing.
    pub(super) async fn process_held(&self, held: &Held) -> anyhow::Result<BatchReport> {
        if !held.isolate {
            return self.process_batch(held.shard, &held.entries).await;
        }
        let one_by_one = held
            .entries
            .iter()
            .map(|order| vec![order.clone()])
            .collect();
        self.acked_after(
            held.shard,
            &held.entries,
            self.in_turn(held.shard, one_by_one),
        )
        .await
    }
}

/// Counts a batch's settled entries by result.
fn count(report: &BatchReport) {
    metrics::counter!(crate::metrics::WORKER_ORDERS, "result" => "inserted")
        .increment(report.inserted as u64);
    metrics::counter!(crate::metrics::WORKER_ORDERS, "result" => "already_there")
        .increment(report.already_there as u64);
    metrics::counter!(crate::metrics::WORKER_ORDERS, "result" => "dead_lettered")
        .increment(report.dead_lettered as u64);
}
