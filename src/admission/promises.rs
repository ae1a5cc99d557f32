//! The 202s an instance gave, kept until their stream entry is acknowledged (written to
//! Postgres, or settled otherwise). Redis can lose an admitted order with every copy of
//! it: a primary restarted from an older snapshot before Sentinel noticed, whose replicas
//! then resynchronized from it; a failover whose acknowledging replica followed another
//! primary. The instance that answered 202 is then the last to know of it. So when a
//! server it uses shows a new term (it lost writes) and its sales are rebuilt, the
//! instance admits its promises again into their sales' current states under their own
//! ids (`seckill_adopt`): those the rebuild counted are found there already, the others
//! take a unit if one is left and their user holds no other order. A promise that can
//! no longer be kept is logged and counted; an instance that dies takes its promises
//! with it.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Mutex;

use redis::aio::ConnectionLike;
use sqlx::PgPool;

use super::Grab;
use crate::domain::{OrderId, UserId};
use crate::keys::{Keys, SalePart, Shard};
use crate::scripts::Replicas;
use crate::store;
use crate::stream::{readmit, Readmitted};

/// The most promises kept: a worker that cannot write for long (Postgres away) leaves
/// them unacknowledged; past this, the oldest are forgotten (with a warning).
const MOST: usize = 1_000_000;

/// One 202.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Promise {
    order_id: OrderId,
    user_id: UserId,
    part: SalePart,
    shard: Shard,
    /// The stream entry that holds it: `(ms, seq)`.
    entry: (u64, u64),
}

/// This instance's promises not yet known acknowledged, oldest first.
#[derive(Debug, Default)]
pub struct Promises {
    kept: Mutex<VecDeque<Promise>>,
}

/// What keeping the promises again did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Kept {
    /// Found in their sale's current state, or admitted again there.
    pub kept: usize,
    /// Could not be (no unit left, or their user holds another order).
    pub broken: usize,
    /// Their sale's current state is not where this instance looked: tried again later.
    pub pending: usize,
}

impl Promises {
    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Promise>> {
        self.kept.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Remembers the grabs a call admitted, held by its stream entry `entry`.
    pub(crate) fn record(&self, keys: &Keys, admitted: &[Grab], entry: &str) {
        let Some(entry) = crate::stream::parse_entry_id(entry) else {
            return;
        };
        let mut kept = self.lock();
        for g in admitted {
            let part = g.sale_part();
            kept.push_back(Promise {
                order_id: g.order_id,
                user_id: g.user_id,
                part,
                shard: keys.shard_of_part(part),
                entry,
            });
        }
        if kept.len() > MOST {
            let over = kept.len() - MOST;
            kept.drain(..over);
            tracing::warn!(
                forgotten = over,
                "too many 202s not yet written: the oldest are no longer kept by this instance"
            );
        }
    }

    /// How many are kept.
    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }

    /// Forgets the promises whose entry the workers acknowledged: those before the
    /// oldest pending entry of its shard's group, and not after its last delivered one.
    pub(crate) async fn forget_acknowledged<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        keys: &Keys,
    ) -> redis::RedisResult<()> {
        let shards: Vec<Shard> = {
            let kept = self.lock();
            let mut shards: Vec<Shard> = kept.iter().map(|p| p.shard).collect();
            shards.sort_unstable();
            shards.dedup();
            shards
        };
        for shard in shards {
            let Some(done) = crate::stream::done_below(conn, keys, shard).await? else {
                continue;
            };
            self.lock().retain(|p| p.shard != shard || p.entry >= done);
        }
        Ok(())
    }

    /// Admits again into their sales' current states the promises on `shards` that
    /// Postgres does not hold yet (after those shards' server lost writes and its sales
    /// were rebuilt). Kept and broken ones are forgotten; the others stay.
    pub(crate) async fn keep<C: ConnectionLike + Send>(
        &self,
        db: &PgPool,
        conn: &mut C,
        keys: &Keys,
        shards: &[Shard],
        replicas: Replicas,
    ) -> anyhow::Result<Kept> {
        let due: Vec<Promise> = self
            .lock()
            .iter()
            .filter(|p| shards.contains(&p.shard))
            .copied()
            .collect();
        let mut report = Kept::default();
        if due.is_empty() {
            return Ok(report);
        }
        let ids: Vec<OrderId> = due.iter().map(|p| p.order_id).collect();
        let settled = store::orders::settled_among(db, &ids).await?;
        let mut epochs: HashMap<SalePart, Option<crate::domain::Epoch>> = HashMap::new();
        let mut done: HashSet<OrderId> = HashSet::new();
        for p in due {
            if settled.contains(&p.order_id) {
                done.insert(p.order_id);
                continue;
            }
            let epoch = match epochs.get(&p.part) {
                Some(e) => *e,
                None => *epochs
                    .entry(p.part)
                    .or_insert(store::epochs::of(db, p.part).await?),
            };
            let Some(epoch) = epoch else {
                done.insert(p.order_id);
                continue;
            };
            let admitted_at = chrono::DateTime::from_timestamp_millis(
                super::order_id::timestamp_ms(p.order_id) as i64,
            )
            .unwrap_or_else(chrono::Utc::now);
            match readmit(
                conn,
                keys,
                p.part,
                epoch,
                p.user_id,
                p.order_id,
                admitted_at,
                replicas,
            )
            .await
            {
                Readmitted::Kept => {
                    report.kept += 1;
                    done.insert(p.order_id);
                }
                Readmitted::Refused => {
                    tracing::error!(
                        order_id = p.order_id.get(),
                        voucher_id = p.part.voucher_id.get(),
                        user_id = p.user_id.get(),
                        "a 202 redis lost cannot be kept: no unit left for it, or its user \
                         holds another order"
                    );
                    metrics::counter!(crate::metrics::PROMISES_BROKEN).increment(1);
                    report.broken += 1;
                    done.insert(p.order_id);
                }
                Readmitted::Elsewhere => report.pending += 1,
            }
        }
        self.lock().retain(|p| !done.contains(&p.order_id));
        Ok(report)
    }
}
