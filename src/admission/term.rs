//! Noticing that Redis lost writes, and healing by itself.
//!
//! Redis acknowledges a write before it is on disk or on a replica, so a restart, a
//! failover or a restore can hand us an OLDER Redis: more stock than Postgres has, a
//! cancelled buyer still blocked, a closed sale open again. Nothing in the data tells:
//! an old copy is consistent with itself. What does tell is the server's term (see
//! `lua/seckill.lua`): drawn at the first call of each life of the server, held only in
//! its memory. Every sale's state carries the term it was built in, and admission
//! refuses a state of another term, so from the first grab after a restart or failover
//! no unit is sold on old state. Meanwhile every process watches the term (and the
//! server's run and replication ids, for the rare change a term survives) once a second,
//! and rebuilds each sale of a new term from Postgres through the fence, as
//! `reconcile --repair` does: what Redis lost is redone from Postgres (units returned by
//! cancels and expiries, buried orders settled, admin closes, orders in flight counted).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::loader::{self, Mode};
use super::{guard, keepers};
use crate::domain::VoucherId;
use crate::keys::{Keys, SaleSegment, Shard};
use crate::redis_conn::RedisConn;
use crate::scripts::Replicas;

mod read;
use read::{draw_new, term_and_identity, Identity, Term};
/// What the watcher needs.
#[derive(Clone)]
pub(crate) struct Watch {
    pub db: PgPool,
    pub redis: RedisConn,
    pub keys: Keys,
    pub retention: Duration,
    pub replicas: Replicas,
    /// Wakes the watcher before its next tick (admission met a stale sale; a lease
    /// found its key gone).
    pub wake: Arc<Notify>,
    /// A look soon, healing nothing more (a grab met a held sale).
    pub look_soon: Arc<Notify>,
    /// An API instance's 202s not yet known written: admitted again after a server
    /// that lost writes is healed (none in a worker).
    pub promises: Option<Arc<super::promises::Promises>>,
}

/// How often every process looks at the terms.
const EVERY: Duration = Duration::from_secs(1);

/// How soon a look asked for comes (held grabs come in storms: one look for each).
const SOON: Duration = Duration::from_millis(50);

/// What the watcher remembers: the term it last saw on each server, and the identity
/// each term was last seen with (on any server).
#[derive(Debug, Default)]
struct Seen {
    terms: HashMap<Shard, String>,
    identities: HashMap<String, Identity>,
    /// Servers (by the shard asked) whose promises are to be kept again: healed, and
    /// some promise's sale not found where it lives yet.
    promises_due: std::collections::HashSet<Shard>,
    /// Servers (by the shard asked) to heal at the next look, each with whether it lost
    /// writes (a term replaced one seen before): their heal has not succeeded yet.
    heal_due: HashMap<Shard, bool>,
    /// Per server, the term this instance kept its promises in, and the one it last
    /// vouched for in Postgres (see [`super::keepers`]).
    kept_in: HashMap<Shard, String>,
    vouched: HashMap<Shard, String>,
    /// Servers whose term is not opened yet.
    held: HashMap<Shard, keepers::Held>,
    /// The last beat or opening failed.
    unsettled: bool,
    /// This look read some server's term (this instance reaches Redis: it beats).
    reached: bool,
    /// Each server's memory settings, as last read (see [`guard::Memory`]).
    memory: HashMap<Shard, guard::Memory>,
}

impl Seen {
    /// A server's memory as a look read it: a change is logged, and the gauges say
    /// whether any server may evict keys or is full.
    fn note_memory(&mut self, server: Shard, memory: guard::Memory) {
        if self.memory.get(&server) != Some(&memory) {
            match memory.trouble() {
                Some(why) => tracing::error!(server = server.0, "{why}"),
                None if self.memory.contains_key(&server) => {
                    tracing::info!(server = server.0, "redis keeps every key again: admitting")
                }
                None => {}
            }
            self.memory.insert(server, memory);
        }
        let any = |m: fn(&guard::Memory) -> bool| self.memory.values().any(m) as u8 as f64;
        metrics::gauge!(crate::metrics::REDIS_MAY_EVICT)
            .set(any(|m| matches!(m, guard::Memory::MayEvict { .. })));
        metrics::gauge!(crate::metrics::REDIS_MEMORY_FULL).set(any(|m| *m == guard::Memory::Full));
    }

    /// Terms remembered with their identity, at most (older ones are forgotten first
    /// when there are more; a server's current term is always kept).
    const IDENTITIES: usize = 256;

    fn remember(&mut self, term: &str, identity: Identity) {
        if self.identities.len() >= Self::IDENTITIES {
            let current: std::collections::HashSet<&String> = self.terms.values().collect();
            self.identities.retain(|t, _| current.contains(t));
        }
        self.identities.insert(term.to_string(), identity);
    }
}

/// Watches the terms: every sale whose state is missing or stale is healed at the first
/// look, then what each new term makes stale.
pub(crate) struct Watcher {
    w: Watch,
    seen: Seen,
    failing: bool,
    /// Woken, and every server not yet healed since: kept until a look succeeds (the
    /// wake comes once; the look right after a loss of data may well fail).
    heal_everything: bool,
}

impl Watcher {
    pub(crate) fn new(w: Watch) -> Self {
        Self {
            w,
            seen: Seen::default(),
            failing: false,
            heal_everything: false,
        }
    }

    /// One look at every server (a failure is logged once, and the next look retries).
    pub(crate) async fn look(&mut self) {
        self.look_healing(false).await
    }

    /// A look that heals every server, new term or not (`everything`, or a woken look
    /// that failed), or only those in a new term.
    async fn look_healing(&mut self, everything: bool) {
        self.heal_everything |= everything;
        match pass(&self.w, &mut self.seen, self.heal_everything).await {
            Ok(()) => {
                self.heal_everything = false;
                if self.failing {
                    tracing::info!("term watch recovered");
                    self.failing = false;
                }
            }
            Err(e) => {
                if !self.failing {
                    tracing::warn!(error = format!("{e:#}"), "term watch failing, retrying");
                }
                self.failing = true;
            }
        }
    }

    /// Looks every [`EVERY`] until `cancel`; when woken (a grab met a stale or held
    /// sale, a lease found its key gone: Redis lost data without a new term, say a
    /// FLUSHALL), heals every server at once. An instance that keeps promises leaves
    /// the keepers when it stops.
    pub(crate) async fn run(mut self, cancel: CancellationToken) {
        while !cancel.is_cancelled() {
            let woken = tokio::select! {
                _ = cancel.cancelled() => break,
                _ = tokio::time::sleep(EVERY) => false,
                _ = self.w.wake.notified() => true,
                _ = self.w.look_soon.notified() => {
                    tokio::time::sleep(SOON).await;
                    false
                }
            };
            self.look_healing(woken).await;
        }
        if let Some(promises) = &self.w.promises {
            keepers::leave(&self.w.db, promises.keeper()).await;
        }
    }
}

/// One look at every server: a term seen before under another identity draws a new
/// term; a new term (or the first look, or `everything`) heals the server's shards.
async fn pass(w: &Watch, seen: &mut Seen, everything: bool) -> anyhow::Result<()> {
    let mut conn = w.redis.clone();
    // Each server on its own: one that fails (down, or refusing writes for want of
    // replicas) does not keep the others from being looked at. The first error is the
    // look's, and the next look tries that server again.
    let mut first: Option<anyhow::Error> = None;
    seen.reached = false;
    for (asked, shards) in w.redis.servers(&w.keys) {
        if let Err(e) = look_at(w, seen, &mut conn, asked, &shards, everything).await {
            first.get_or_insert(e);
        }
    }
    // (Postgres away: logged once, apart from the look, which reached Redis.)
    if seen.reached {
        match hold_or_open(w, seen, &mut conn).await {
            Ok(()) if seen.unsettled => {
                tracing::info!("keepers' beat and terms' opening recovered");
                seen.unsettled = false;
            }
            Ok(()) => {}
            Err(e) if !seen.unsettled => {
                tracing::warn!(
                    error = format!("{e:#}"),
                    "keepers' beat or terms' opening failing (a new term stays held), retrying"
                );
                seen.unsettled = true;
            }
            Err(_) => {}
        }
    }
    first.map_or(Ok(()), Err)
}

/// After a look that reached Redis: this instance beats and vouches for the terms it
/// kept its promises in since, and every held term all live instances vouched for is
/// opened.
async fn hold_or_open(w: &Watch, seen: &mut Seen, conn: &mut RedisConn) -> anyhow::Result<()> {
    let keeper = w.promises.as_ref().map(|p| p.keeper());
    let fresh: Vec<(Shard, String)> = seen
        .kept_in
        .iter()
        .filter(|(shard, term)| seen.vouched.get(*shard) != Some(*term))
        .map(|(shard, term)| (*shard, term.clone()))
        .collect();
    let vouching: Vec<String> = fresh.iter().map(|(_, t)| t.clone()).collect();
    let held: Vec<keepers::Held> = seen.held.values().cloned().collect();
    let on: Vec<String> = seen.terms.values().cloned().collect();
    let beat = keeper.map(|keeper| keepers::Beat {
        keeper,
        on: &on,
        vouching: &vouching,
    });
    let opened = keepers::settle(&w.db, conn, &w.keys, beat, &held).await?;
    seen.vouched.extend(fresh);
    seen.held.retain(|_, h| !opened.contains(&h.term));
    Ok(())
}

/// One server (the one holding shard `asked`, and `shards`): its term; a new one (or
/// the first look, or `everything`) heals its shards.
async fn look_at(
    w: &Watch,
    seen: &mut Seen,
    conn: &mut RedisConn,
    asked: Shard,
    shards: &[Shard],
    everything: bool,
) -> anyhow::Result<()> {
    let term = read_term(w, seen, conn, asked, shards, everything).await?;
    let due = seen.heal_due.get(&asked).copied();
    if due.is_none() && !seen.promises_due.contains(&asked) {
        // The term it knows, read with where the workers are done: no write was lost
        // below that, so those promises are kept already.
        if let Some(promises) = &w.promises {
            for (shard, done) in shards.iter().zip(&term.done) {
                if let Some(done) = done {
                    promises.forget_below(*shard, *done);
                }
            }
        }
    }
    let healed = match due {
        Some(rollback) => heal_due(w, seen, asked, shards, &term.term, rollback).await,
        None => Ok(()),
    };
    seen.terms.insert(asked, term.term.clone());
    if term.opened {
        seen.held.remove(&asked);
    } else {
        let held = keepers::Held {
            term: term.term.clone(),
            came_after: term.came_after.clone(),
            shards: shards.to_vec(),
        };
        seen.held.insert(asked, held);
    }
    keep_due_promises(w, seen, conn, asked, shards, term.term).await?;
    healed
}

/// The server's term, drawn anew if it outlived a change of identity; a term not seen
/// before makes the server require its replicas and marks its shards due a heal.
async fn read_term(
    w: &Watch,
    seen: &mut Seen,
    conn: &mut RedisConn,
    asked: Shard,
    shards: &[Shard],
    everything: bool,
) -> anyhow::Result<Term> {
    let marker = w.keys.term_marker(asked);
    let was = seen.terms.get(&asked).cloned();
    if was.is_none() || everything {
        // Once per process and server (and when woken: the server may have lost it):
        // the library this binary carries, or newer.
        crate::scripts::install_library(conn, Some(&marker.as_bytes().to_vec())).await?;
    }
    let streams: Vec<&str> = shards.iter().map(|s| w.keys.stream(*s)).collect();
    let read::Look {
        term,
        identity: now,
        memory,
    } = term_and_identity(conn, &marker, &streams).await?;
    seen.reached = true;
    if let Some(memory) = memory {
        seen.note_memory(asked, memory);
    }
    // A restart or a promotion draws a term by itself, and so does a server whose data
    // another life wrote (the term marker); a term that outlived a change of identity
    // all the same (a replica promoted again after a partial resync keeps its Lua state)
    // is drawn anew here.
    let term = match (seen.identities.get(&term.term), &now) {
        (Some(before), Some(after)) if before != after => {
            tracing::warn!(
                ?before,
                ?after,
                "redis server changed identity under the same term: drawing a new one"
            );
            draw_new(conn, &marker).await?
        }
        _ => term,
    };
    if let Some(now) = now {
        seen.remember(&term.term, now);
    }
    if was.as_ref() != Some(&term.term) {
        // A new life of the server (a promoted replica, say): it refuses writes while
        // too few replicas acknowledge, from now on.
        super::guard::require_replicas(conn, &marker, w.replicas).await?;
        // A term that replaced one seen before is a rollback even when a grab that met
        // it rebuilds every sale first (and wakes a look).
        *seen.heal_due.entry(asked).or_default() |= was.is_some();
    } else if everything {
        seen.heal_due.entry(asked).or_default();
    }
    Ok(term)
}

/// Heals `shards`, due since `term` (a `rollback`: it replaced a term seen before).
/// Until a heal succeeds (a promoted master refuses writes until it has a replica, say),
/// every look tries again.
async fn heal_due(
    w: &Watch,
    seen: &mut Seen,
    asked: Shard,
    shards: &[Shard],
    term: &str,
    rollback: bool,
) -> anyhow::Result<()> {
    seen.promises_due.insert(asked);
    if let Some(promises) = &w.promises {
        // Until they are kept again, their users' fresh grabs wait.
        promises.alarm(shards.iter().copied());
    }
    let rebuilt = heal(w, shards).await?;
    seen.heal_due.remove(&asked);
    if rollback || !rebuilt.is_empty() {
        metrics::counter!(crate::metrics::ROLLBACKS_HEALED).increment(1);
        tracing::warn!(
            term = %term,
            rebuilt = ?rebuilt,
            "redis may have lost writes (new term): sales rebuilt from postgres"
        );
    }
    Ok(())
}

/// Admits again the promises due on `shards` (kept even when some sale could not be
/// healed: the others' promises are admitted again now, the rest at the next look), and
/// vouches for `term` once none waits (or the last that waited is counted broken).
async fn keep_due_promises(
    w: &Watch,
    seen: &mut Seen,
    conn: &mut RedisConn,
    asked: Shard,
    shards: &[Shard],
    term: String,
) -> anyhow::Result<()> {
    if seen.promises_due.contains(&asked) {
        let alarms = w.promises.as_ref().map(|p| p.alarms(shards));
        if keep_promises(w, conn, shards).await? {
            seen.promises_due.remove(&asked);
            if let (Some(promises), Some(alarms)) = (&w.promises, alarms) {
                promises.all_clear(shards, &alarms);
            }
        }
    }
    if !seen.promises_due.contains(&asked) {
        seen.kept_in.insert(asked, term);
    }
    if let Some(promises) = &w.promises {
        metrics::gauge!(crate::metrics::PROMISES_KEPT).set(promises.len() as f64);
        if let Err(e) = promises.compact() {
            tracing::warn!(error = %e, "promises file not compacted");
        }
    }
    Ok(())
}

/// Admits again this instance's promises of `shards` that their server lost; whether
/// none is left waiting for its sale.
async fn keep_promises(w: &Watch, conn: &mut RedisConn, shards: &[Shard]) -> anyhow::Result<bool> {
    let Some(promises) = &w.promises else {
        return Ok(true);
    };
    let kept = promises
        .keep(&w.db, conn, &w.keys, shards, w.replicas)
        .await?;
    if kept.readmitted + kept.broken > 0 {
        tracing::warn!(
            readmitted = kept.readmitted,
            broken = kept.broken,
            waiting = kept.waiting,
            "this instance's 202s that redis lost, admitted again into the rebuilt sales"
        );
    }
    Ok(kept.waiting == 0)
}

/// Rebuilds, through the fence, every sale of `shards` whose state is stale (built in
/// another term) or missing while the sale is open; returns the sales rebuilt. An ended
/// sale whose state is gone stays so (admission answers `ended` from Postgres).
async fn heal(w: &Watch, shards: &[Shard]) -> anyhow::Result<Vec<VoucherId>> {
    let now = crate::clock::now();
    let since = now - chrono::Duration::from_std(w.retention)?;
    let mut conn = w.redis.clone();
    let mut rebuilt = Vec::new();
    let mut first: Option<anyhow::Error> = None;
    for sale in crate::store::vouchers::sales_ending_after(&w.db, since).await? {
        // The sale's segments on these shards (a segmented sale's other segments live on
        // other shards, perhaps on a node that lost nothing).
        let here: Vec<SaleSegment> = SaleSegment::all(sale.voucher_id, sale.segments())
            .filter(|p| shards.contains(&w.keys.shard_of_segment(*p)))
            .collect();
        if here.is_empty() {
            continue;
        }
        if sale.end_time <= now {
            let mut exists = false;
            for segment in &here {
                exists |= redis::cmd("EXISTS")
                    .arg(w.keys.segment(*segment))
                    .query_async::<bool>(&mut conn)
                    .await?;
            }
            if !exists {
                continue;
            }
        }
        let id = sale.voucher_id;
        // Each sale on its own: one that cannot be built here (its node away, or it
        // lives on a newer server) does not keep the others from being healed.
        match loader::load_sale(
            &w.db,
            &mut conn,
            &w.keys,
            id,
            w.retention,
            Mode::Heal,
            w.replicas,
        )
        .await
        {
            Ok(Some(_)) => {
                metrics::counter!(crate::metrics::SALES_REBUILT).increment(1);
                rebuilt.push(id);
            }
            Ok(None) => {}
            Err(e) => {
                first.get_or_insert(e.context(format!("healing voucher {id}")));
            }
        }
    }
    first.map_or(Ok(rebuilt), Err)
}
