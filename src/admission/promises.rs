//! The 202s an instance gave, kept until the workers are done with their stream entry
//! (written to Postgres, or settled otherwise). Redis can lose an admitted order with
//! every copy of it: a primary restarted from an older snapshot before Sentinel noticed,
//! whose replicas then resynchronized from it; a failover whose acknowledging replica
//! followed another primary. The instance that answered 202 is then the last to know of
//! it. So when a server it uses shows a new term (it may have lost writes) and its sales
//! are rebuilt, the instance admits its promises whose entries the server no longer
//! holds again into their sales' current states under their own ids
//! ([`crate::stream::readmit`]): they take a unit if one is left and their user holds no
//! other order. A promise that can no longer be kept is logged and counted; an instance
//! that dies takes its promises with it.
//!
//! With a promises file (`PROMISES_FILE`), each 202 is also appended there before it is
//! answered, and an instance started again on the same file keeps the promises of its
//! previous life: a `kill -9` or a crash of the process loses none (the file is written,
//! not synced: a crash of the host's kernel may lose its last moments).
//!
//! Promises are forgotten only from the term watcher's look, which reads the server's
//! term and where the workers are done in the same instant: below that, while the term
//! is the one it knows (a server that lost writes shows a new term before anything else,
//! and then nothing is forgotten until the promises are kept).
//!
//! While a server's promises may be lost and are not kept again yet (its term changed,
//! or a grab met a state of another term), a grab by a user this instance holds such a
//! promise for on the same sale is refused (503, nothing reserved): admitted afresh, it
//! would take the place of the 202 that user was already given.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fs::File;
use std::io::{BufRead, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use redis::aio::ConnectionLike;
use sqlx::PgPool;

use super::Grab;
use crate::domain::{OrderId, UserId, VoucherId};
use crate::keys::{Keys, SaleSegment, Shard};
use crate::scripts::Replicas;
use crate::stream::{self, Readmission, Readmitted};

mod file;

/// The most promises kept per shard: a worker that cannot write for long (Postgres away)
/// leaves them unacknowledged; past this, the oldest are forgotten (with a warning).
const MOST: usize = 1_000_000;

/// Looks after which a promise whose sale is still out of reach counts as broken.
const PATIENCE: u32 = 30;

/// One 202.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Promise {
    order_id: OrderId,
    user_id: UserId,
    segment: SaleSegment,
    /// The stream entry that holds it: `(ms, seq)`.
    entry: (u64, u64),
    /// Looks that found its sale out of reach.
    tries: u32,
}

/// This instance's promises not yet known done with, per shard, in the order of their
/// entries (one admission call at a time per shard).
#[derive(Debug)]
pub struct Promises {
    /// This instance's name among the keepers ([`super::keepers`]): one per life, or
    /// one per promises file.
    keeper: String,
    kept: Mutex<HashMap<Shard, VecDeque<Promise>>>,
    /// Where they are written too, if anywhere.
    log: Option<Mutex<Log>>,
    /// Shards whose server may have lost them, until they are kept again.
    due: Mutex<HashMap<Shard, Due>>,
    /// Whether any shard is due (the grab path's one look when none is).
    any_due: AtomicBool,
}

/// A shard whose promises may be lost: the users and sales they were given on, and the
/// alarm it answers to (each alarm draws a new one: the watcher clears only the alarm
/// it saw before keeping them again).
#[derive(Debug)]
struct Due {
    alarm: u64,
    users: HashSet<(UserId, VoucherId)>,
}

/// The promises file: one line per promise recorded, rewritten with only the promises
/// still kept once it holds many more lines than that.
#[derive(Debug)]
struct Log {
    path: PathBuf,
    /// Locked for this process's life: two instances on one file would forget each
    /// other's promises.
    file: File,
    lines: usize,
    /// A write failed (logged once; the promises are still kept in memory).
    failing: bool,
}

/// What keeping the promises again did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Kept {
    /// Admitted again where their sale lives.
    pub readmitted: usize,
    /// Could not be (no unit left, or their user holds another order).
    pub broken: usize,
    /// Their sale's current state is out of reach: tried again at the next look.
    pub waiting: usize,
}

impl Default for Promises {
    fn default() -> Self {
        Self {
            keeper: uuid::Uuid::new_v4().to_string(),
            kept: Default::default(),
            log: None,
            due: Default::default(),
            any_due: AtomicBool::new(false),
        }
    }
}

impl Promises {
    /// This instance's name among the keepers.
    pub(crate) fn keeper(&self) -> &str {
        &self.keeper
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Shard, VecDeque<Promise>>> {
        self.kept.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Remembers the grabs a call admitted, held by its stream entry `entry` (before
    /// their 202s are answered).
    pub(crate) fn record(&self, keys: &Keys, admitted: &[Grab], entry: &str) {
        let (Some(entry), Some(first)) = (stream::parse_entry_id(entry), admitted.first()) else {
            return;
        };
        let shard = keys.shard_of_segment(first.sale_segment());
        let mut kept = self.lock();
        let queue = kept.entry(shard).or_default();
        let new = admitted.iter().map(|g| Promise {
            order_id: g.order_id,
            user_id: g.user_id,
            segment: g.sale_segment(),
            entry,
            tries: 0,
        });
        let from = queue.len();
        queue.extend(new);
        if let Some(log) = &self.log {
            let mut log = log.lock().unwrap_or_else(|e| e.into_inner());
            let lines: String = queue.range(from..).map(|p| p.line(shard)).collect();
            log.append(lines.as_bytes(), queue.len() - from);
        }
        if queue.len() > MOST {
            let over = queue.len() - MOST;
            queue.drain(..over);
            tracing::warn!(
                forgotten = over,
                "too many 202s not yet written: the oldest are no longer kept by this instance"
            );
        }
    }

    /// Raises an alarm on `shards`: their server may have lost their promises, and until
    /// they are kept again, their users' fresh grabs on those sales wait.
    pub(crate) fn alarm(&self, shards: impl IntoIterator<Item = Shard>) {
        let raised: Vec<(Shard, HashSet<(UserId, VoucherId)>)> = {
            let kept = self.lock();
            shards
                .into_iter()
                .map(|shard| {
                    let users = kept.get(&shard).map_or_else(HashSet::new, |queue| {
                        queue
                            .iter()
                            .map(|p| (p.user_id, p.segment.voucher_id))
                            .collect()
                    });
                    (shard, users)
                })
                .collect()
        };
        let mut due = self.due.lock().unwrap_or_else(|e| e.into_inner());
        for (shard, users) in raised {
            let alarm = due.get(&shard).map_or(0, |d| d.alarm) + 1;
            due.insert(shard, Due { alarm, users });
        }
        self.any_due.store(!due.is_empty(), Ordering::Release);
    }

    /// The alarms `shards` answer to now (read before their promises are kept again).
    pub(crate) fn alarms(&self, shards: &[Shard]) -> Vec<Option<u64>> {
        let due = self.due.lock().unwrap_or_else(|e| e.into_inner());
        shards.iter().map(|s| due.get(s).map(|d| d.alarm)).collect()
    }

    /// `shards`' promises are kept again: their alarms `seen` are over (one raised
    /// meanwhile stays).
    pub(crate) fn all_clear(&self, shards: &[Shard], seen: &[Option<u64>]) {
        let mut due = self.due.lock().unwrap_or_else(|e| e.into_inner());
        for (shard, seen) in shards.iter().zip(seen) {
            if due.get(shard).map(|d| d.alarm) == *seen {
                due.remove(shard);
            }
        }
        self.any_due.store(!due.is_empty(), Ordering::Release);
    }

    /// Whether this instance holds a promise to `user_id` on `voucher_id` that its
    /// server may have lost and that is not kept again yet: a fresh grab of theirs there
    /// waits until it is.
    pub fn at_risk(&self, user_id: UserId, voucher_id: VoucherId) -> bool {
        if !self.any_due.load(Ordering::Acquire) {
            return false;
        }
        let due = self.due.lock().unwrap_or_else(|e| e.into_inner());
        due.values()
            .any(|d| d.users.contains(&(user_id, voucher_id)))
    }

    /// How many are kept.
    pub(crate) fn len(&self) -> usize {
        self.lock().values().map(VecDeque::len).sum()
    }

    /// Forgets the shard's promises below `done`: the workers are done with those
    /// entries (read with a term the watcher knows).
    pub(crate) fn forget_below(&self, shard: Shard, done: (u64, u64)) {
        let mut kept = self.lock();
        let Some(queue) = kept.get_mut(&shard) else {
            return;
        };
        // (Oldest first; a promise admitted again may have moved later: kept.)
        while queue.front().is_some_and(|p| p.entry < done) {
            queue.pop_front();
        }
    }

    /// After `shards`' server lost writes and its sales were rebuilt: admits again into
    /// their sales' current states the promises whose entries that server no longer
    /// holds. Those kept move to their new entry; broken ones are forgotten.
    pub(crate) async fn keep<C: ConnectionLike + Send>(
        &self,
        db: &PgPool,
        conn: &mut C,
        keys: &Keys,
        shards: &[Shard],
        replicas: Replicas,
    ) -> anyhow::Result<Kept> {
        let mut report = Kept::default();
        let mut rewrite = false;
        for &shard in shards {
            let due: Vec<Promise> = self
                .lock()
                .get(&shard)
                .map(|q| q.iter().copied().collect())
                .unwrap_or_default();
            if due.is_empty() {
                continue;
            }
            let moved = keep_lost(db, conn, keys, shard, due, replicas, &mut report).await?;
            rewrite |= moved.values().any(|m| !matches!(m, Move::Wait));
            self.settle(shard, &moved);
        }
        if rewrite {
            if let Err(e) = self.rewrite(true) {
                tracing::warn!(error = %e, "promises file not rewritten");
            }
        }
        Ok(report)
    }

    /// Moves the promises kept to their new entries, forgets those settled or broken,
    /// and counts a try for those still waiting.
    fn settle(&self, shard: Shard, moved: &HashMap<OrderId, Move>) {
        let mut kept = self.lock();
        let Some(queue) = kept.get_mut(&shard) else {
            return;
        };
        let mut rest: Vec<Promise> = queue
            .drain(..)
            .filter_map(|mut p| match moved.get(&p.order_id) {
                Some(Move::Forget) => None,
                Some(Move::To(entry)) => {
                    p.entry = *entry;
                    Some(p)
                }
                Some(Move::Wait) => {
                    p.tries += 1;
                    Some(p)
                }
                None => Some(p),
            })
            .collect();
        rest.sort_by_key(|p| p.entry);
        queue.extend(rest);
    }
}

/// What becomes of one promise after an attempt to keep it.
enum Move {
    /// Kept, held by this entry now.
    To((u64, u64)),
    /// Settled in Postgres, or broken.
    Forget,
    /// Its sale out of reach: another try at the next look.
    Wait,
}

/// When an order was admitted, as its id says.
fn admitted_at(order_id: OrderId) -> chrono::DateTime<chrono::Utc> {
    chrono::DateTime::from_timestamp_millis(super::order_id::timestamp_ms(order_id) as i64)
        .unwrap_or_else(crate::clock::now)
}

/// What becomes of `due`, the promises kept for `shard`: those whose entries its server
/// no longer holds are admitted again (or found settled, or broken), counted in
/// `report`.
async fn keep_lost<C: ConnectionLike + Send>(
    db: &PgPool,
    conn: &mut C,
    keys: &Keys,
    shard: Shard,
    due: Vec<Promise>,
    replicas: Replicas,
    report: &mut Kept,
) -> anyhow::Result<HashMap<OrderId, Move>> {
    let entries: Vec<(OrderId, (u64, u64))> = due.iter().map(|p| (p.order_id, p.entry)).collect();
    let held = stream::held_in(conn, keys, shard, &entries).await?;
    let lost: Vec<Promise> = due
        .into_iter()
        .filter(|p| !held.contains(&p.order_id))
        .collect();
    // Those Postgres holds already (most, after a restart on a promises file), in one
    // query; each other one is checked again under its sale's lock.
    let ids: Vec<OrderId> = lost.iter().map(|p| p.order_id).collect();
    let settled = crate::store::orders::settled_among(db, &ids).await?;
    let mut moved: HashMap<OrderId, Move> = settled.iter().map(|id| (*id, Move::Forget)).collect();
    for p in lost.into_iter().filter(|p| !settled.contains(&p.order_id)) {
        let r = Readmission {
            segment: p.segment,
            user_id: p.user_id,
            order_id: p.order_id,
            admitted_at: admitted_at(p.order_id),
        };
        let readmitted = stream::readmit(db, conn, keys, r, replicas).await?;
        moved.insert(p.order_id, report.count(&p, readmitted));
    }
    Ok(moved)
}

impl Kept {
    /// Counts what became of promise `p`, and says where it goes.
    fn count(&mut self, p: &Promise, readmitted: Readmitted) -> Move {
        match readmitted {
            Readmitted::Kept { entry, anew } => {
                if anew {
                    self.readmitted += 1;
                    metrics::counter!(crate::metrics::PROMISES_READMITTED).increment(1);
                }
                Move::To(entry.unwrap_or(p.entry))
            }
            Readmitted::Settled => Move::Forget,
            Readmitted::Elsewhere if p.tries + 1 < PATIENCE => {
                self.waiting += 1;
                Move::Wait
            }
            Readmitted::Refused | Readmitted::Elsewhere => {
                broken(p);
                self.broken += 1;
                Move::Forget
            }
        }
    }
}

fn broken(p: &Promise) {
    tracing::error!(
        order_id = p.order_id.get(),
        voucher_id = p.segment.voucher_id.get(),
        user_id = p.user_id.get(),
        "a 202 redis lost cannot be kept: no unit left for it, or its user holds another \
         order, or its sale stayed out of reach"
    );
    metrics::counter!(crate::metrics::PROMISES_BROKEN).increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::VoucherId;

    #[test]
    fn a_promise_reads_back_from_its_line_and_a_torn_line_is_no_promise() {
        let p = Promise {
            order_id: OrderId::new(119_610_283_197_054_976).unwrap(),
            user_id: UserId::new(10_012).unwrap(),
            segment: SaleSegment::new(VoucherId::new(68).unwrap(), 1, 3),
            entry: (1_795_742_908_154, 7),
            tries: 4,
        };
        let line = p.line(Shard(2));
        assert_eq!(line, "2 119610283197054976 10012 68 1 3 1795742908154-7\n");
        let (shard, back) = Promise::parse(line.trim_end()).unwrap();
        assert_eq!((shard, back), (Shard(2), Promise { tries: 0, ..p }));
        assert_eq!(
            Promise::parse("2 119610283197054976 10012 68 1 3 17957"),
            None
        );
        assert_eq!(Promise::parse("2 119610283197054976 10012"), None);
        assert_eq!(Promise::parse(&format!("{} x", line.trim_end())), None);
    }

    #[test]
    fn a_users_fresh_grab_waits_only_while_their_promise_there_may_be_lost() {
        let keys = Keys::with_shards("", 2).unwrap();
        let promises = Promises::default();
        let (user, other) = (UserId::new(7).unwrap(), UserId::new(8).unwrap());
        let (sale, elsewhere) = (VoucherId::new(3).unwrap(), VoucherId::new(4).unwrap());
        let grab = Grab {
            voucher_id: sale,
            user_id: user,
            order_id: OrderId::new(119_610_283_197_054_976).unwrap(),
            segment: 0,
            segments: 1,
        };
        promises.record(&keys, &[grab], "1795742908154-7");
        let shard = keys.shard_of_segment(grab.sale_segment());
        assert!(!promises.at_risk(user, sale), "nothing lost: redis answers");
        promises.alarm(keys.shards());
        assert!(promises.at_risk(user, sale));
        assert!(!promises.at_risk(other, sale));
        assert!(!promises.at_risk(user, elsewhere));
        // An alarm raised while the promises were being kept again outlives that keep.
        let seen = promises.alarms(&[shard]);
        promises.alarm([shard]);
        promises.all_clear(&[shard], &seen);
        assert!(promises.at_risk(user, sale), "the later alarm stands");
        let seen = promises.alarms(&[shard]);
        promises.all_clear(&[shard], &seen);
        assert!(!promises.at_risk(user, sale), "kept again");
    }
}
