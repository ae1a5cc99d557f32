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

use chrono::Utc;
use redis::aio::ConnectionLike;
use redis::{RedisResult, Value};
use sqlx::PgPool;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::loader::{self, Mode};
use crate::domain::VoucherId;
use crate::keys::{Keys, SalePart, Shard};
use crate::redis_conn::RedisConn;
use crate::scripts::{Call, Replicas};

/// A server's term and how long ago it was drawn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Term {
    pub term: String,
    pub age: Duration,
}

/// The term of the server holding `route_key` (drawn now if this is its first call).
pub(crate) async fn of<C: ConnectionLike + Send>(
    conn: &mut C,
    route_key: &str,
) -> RedisResult<Term> {
    ask(conn, "seckill_term", route_key).await
}

/// Draws a new term on the server holding `route_key`: every sale on it is stale.
async fn draw_new<C: ConnectionLike + Send>(conn: &mut C, route_key: &str) -> RedisResult<Term> {
    ask(conn, "seckill_new_term", route_key).await
}

async fn ask<C: ConnectionLike + Send>(
    conn: &mut C,
    function: &'static str,
    route_key: &str,
) -> RedisResult<Term> {
    let (term, age_ms): (String, u64) =
        Call::function(function).key(route_key).invoke(conn).await?;
    Ok(Term {
        term,
        age: Duration::from_millis(age_ms),
    })
}

/// Refuses a Redis that may evict keys (`maxmemory-policy` other than `noeviction`):
/// every key of ours is state a promise rests on (a sale's stock and buyers, a lease),
/// and the `volatile-*` policies evict exactly ours, which expire. A server whose
/// policy cannot be read (CONFIG disabled, as on some managed services) is allowed
/// with a warning; one that does not answer is checked at the next start.
pub(crate) async fn refuse_eviction(conn: &mut RedisConn, keys: &Keys) -> anyhow::Result<()> {
    for (shard, _) in servers(conn, keys) {
        let mut get = redis::cmd("CONFIG");
        get.arg("GET").arg("maxmemory-policy");
        let reply = on_node_of(conn, keys.stream(shard), get).await;
        let policy = match reply.and_then(|v| Ok(redis::from_redis_value::<Vec<String>>(v)?)) {
            Ok(pair) => pair.get(1).cloned().unwrap_or_default(),
            Err(e) if e.is_io_error() || e.is_connection_refusal() => {
                tracing::warn!(error = %e, "redis not reachable: maxmemory-policy not checked");
                return Ok(());
            }
            Err(e) => {
                tracing::warn!(
                    error = %e,
                    "cannot read redis's maxmemory-policy: make sure it is noeviction \
                     (an evicted sale or lease breaks the service's promises)"
                );
                continue;
            }
        };
        anyhow::ensure!(
            policy == "noeviction",
            "redis's maxmemory-policy is {policy}: it may evict a sale's stock and buyers or \
             an order-id lease, and a 202 would no longer be a promise; set \
             maxmemory-policy noeviction (a full Redis then refuses writes, and grabs get 503)"
        );
    }
    Ok(())
}

/// Runs `cmd` on the server holding `route_key` (a cluster routes a command without a
/// key anywhere).
async fn on_node_of(
    conn: &mut RedisConn,
    route_key: &str,
    cmd: redis::Cmd,
) -> RedisResult<redis::Value> {
    match conn {
        RedisConn::Cluster(c) => {
            use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
            let route = Route::new(crate::keys::slot(route_key), SlotAddr::Master);
            c.route_command(
                cmd,
                RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route)),
            )
            .await
        }
        other => cmd.query_async(other).await,
    }
}

/// A server's run id and replication id: a restart changes the first, a promotion the
/// second.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Identity {
    run_id: String,
    replid: String,
}

/// The term of the server holding `route_key`, and that server's identity, from one
/// round trip on one connection. An INFO sent alone may describe ANOTHER server: while
/// the connection to a slot's master is down (a failover), the cluster client sends a
/// command routed to that master to a random node instead, and an identity recorded
/// from there makes the next look see a "change" under the same term (a needless new
/// term: every sale on the server rebuilt twice). Behind the term's call, which only
/// the slot's master runs (any other node redirects it, and the client then sends both
/// again to the node named), the INFO is that master's. The identity is `None` when INFO
/// is not allowed (some managed services rename it: the term alone then tells), when
/// the server says it is no master, or when the call failed there (then the term is
/// asked alone, which installs the library if missing).
async fn term_and_identity(
    conn: &mut RedisConn,
    route_key: &str,
) -> RedisResult<(Term, Option<Identity>)> {
    let mut pipe = redis::pipe();
    pipe.cmd("FCALL")
        .arg("seckill_term")
        .arg(1)
        .arg(route_key)
        .cmd("INFO")
        .arg("server")
        .arg("replication");
    let replies: Vec<Value> = match &mut *conn {
        RedisConn::Cluster(c) => {
            use redis::cluster_routing::{Route, SingleNodeRoutingInfo, SlotAddr};
            let route = Route::new(crate::keys::slot(route_key), SlotAddr::Master);
            c.route_pipeline(pipe, 0, 2, SingleNodeRoutingInfo::SpecificNode(route))
                .await?
        }
        other => pipe.ignore_errors().query_async(other).await?,
    };
    let mut replies = replies.into_iter();
    let (Some(term), Some(info)) = (replies.next(), replies.next()) else {
        return Ok((of(conn, route_key).await?, None));
    };
    let Ok(term) = term.extract_error() else {
        return Ok((of(conn, route_key).await?, None));
    };
    let (term, age_ms): (String, u64) = redis::from_redis_value(term)?;
    let term = Term {
        term,
        age: Duration::from_millis(age_ms),
    };
    let identity = info
        .extract_error()
        .ok()
        .and_then(|v| redis::from_redis_value::<String>(v).ok())
        .and_then(|text| identity_in(&text));
    Ok((term, identity))
}

/// A master's identity in its `INFO server replication` text.
fn identity_in(text: &str) -> Option<Identity> {
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(|v| v.trim().to_string())
    };
    if field("role")? != "master" {
        return None;
    }
    Some(Identity {
        run_id: field("run_id")?,
        replid: field("master_replid")?,
    })
}

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
}

/// How often every process looks at the terms.
const EVERY: Duration = Duration::from_secs(1);

/// What the watcher remembers of one server.
#[derive(Debug, Clone, Default)]
struct Seen {
    term: Option<String>,
    identity: Option<Identity>,
}

/// Watches the terms: every sale whose state is missing or stale is healed at the first
/// look, then what each new term makes stale.
pub(crate) struct Watcher {
    w: Watch,
    seen: HashMap<Shard, Seen>,
    failing: bool,
    /// Woken, and every server not yet healed since: kept until a look succeeds (the
    /// wake comes once; the look right after a loss of data may well fail).
    heal_everything: bool,
}

impl Watcher {
    pub(crate) fn new(w: Watch) -> Self {
        Self {
            w,
            seen: HashMap::new(),
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

    /// Looks every [`EVERY`] until `cancel`; when woken (a grab met a stale sale, a
    /// lease found its key gone: Redis lost data without a new term, say a FLUSHALL),
    /// heals every server at once.
    pub(crate) async fn run(mut self, cancel: CancellationToken) {
        while !cancel.is_cancelled() {
            let woken = tokio::select! {
                _ = cancel.cancelled() => break,
                _ = tokio::time::sleep(EVERY) => false,
                _ = self.w.wake.notified() => true,
            };
            self.look_healing(woken).await;
        }
    }
}

/// The shards to ask, each with the shards on the same server: one server holds every
/// shard unless this is a cluster.
fn servers(conn: &RedisConn, keys: &Keys) -> Vec<(Shard, Vec<Shard>)> {
    match conn {
        RedisConn::Cluster(_) => keys.shards().map(|s| (s, vec![s])).collect(),
        _ => vec![(Shard(0), keys.shards().collect())],
    }
}

/// One look at every server: a changed identity draws a new term; a new term (or the
/// first look, or `everything`) heals the server's shards.
async fn pass(w: &Watch, seen: &mut HashMap<Shard, Seen>, everything: bool) -> anyhow::Result<()> {
    let mut conn = w.redis.clone();
    for (asked, shards) in servers(&w.redis, &w.keys) {
        let key = w.keys.stream(asked).to_string();
        let was = seen.get(&asked).cloned().unwrap_or_default();
        if was.term.is_none() || everything {
            // Once per process and server (and when woken: the server may have lost
            // it): the library this binary carries, or newer.
            crate::scripts::install_library(&mut conn, Some(&key.as_bytes().to_vec())).await?;
        }
        let (term, now) = term_and_identity(&mut conn, &key).await?;
        // A restart or a promotion draws a term by itself; a term that outlived a change
        // of identity (a replica promoted again after a partial resync keeps its Lua
        // state) is drawn anew here.
        let kept = was.term.as_ref() == Some(&term.term);
        let term = match (&was.identity, &now) {
            (Some(before), Some(after)) if before != after && kept => {
                tracing::warn!(
                    ?before,
                    ?after,
                    "redis server changed identity under the same term: drawing a new one"
                );
                draw_new(&mut conn, &key).await?
            }
            _ => term,
        };
        let changed = was.term.as_ref() != Some(&term.term);
        if changed || everything {
            let rebuilt = heal(w, &shards).await?;
            // A term that replaced one seen before is a rollback even when a grab that
            // met it rebuilt every sale first (and woke this look).
            if (changed && was.term.is_some()) || !rebuilt.is_empty() {
                metrics::counter!(crate::metrics::ROLLBACKS_HEALED).increment(1);
                tracing::warn!(
                    term = %term.term,
                    rebuilt = ?rebuilt,
                    "redis may have lost writes (new term): sales rebuilt from postgres"
                );
            }
        }
        seen.insert(
            asked,
            Seen {
                term: Some(term.term),
                // An identity from before a new term would look like a change under
                // the next look's (same) term.
                identity: if changed { now } else { now.or(was.identity) },
            },
        );
    }
    Ok(())
}

/// Rebuilds, through the fence, every sale of `shards` whose state is stale (built in
/// another term) or missing while the sale is open; returns the sales rebuilt. An ended
/// sale whose state is gone stays so (admission answers `ended` from Postgres).
async fn heal(w: &Watch, shards: &[Shard]) -> anyhow::Result<Vec<VoucherId>> {
    let since = Utc::now() - chrono::Duration::from_std(w.retention)?;
    let now = Utc::now();
    let mut conn = w.redis.clone();
    let mut rebuilt = Vec::new();
    for sale in crate::store::vouchers::sales_ending_after(&w.db, since).await? {
        // The sale's parts on these shards (a segmented sale's other parts live on
        // other shards, perhaps on a node that lost nothing).
        let here: Vec<SalePart> = SalePart::all(sale.voucher_id, sale.parts())
            .filter(|p| shards.contains(&w.keys.shard_of_part(*p)))
            .collect();
        if here.is_empty() {
            continue;
        }
        if sale.end_time <= now {
            let mut exists = false;
            for part in &here {
                exists |= redis::cmd("EXISTS")
                    .arg(w.keys.part(*part))
                    .query_async::<bool>(&mut conn)
                    .await?;
            }
            if !exists {
                continue;
            }
        }
        let id = sale.voucher_id;
        let loaded = loader::load_sale(
            &w.db,
            &mut conn,
            &w.keys,
            id,
            w.retention,
            Mode::Heal,
            w.replicas,
        )
        .await?;
        if loaded.is_some() {
            metrics::counter!(crate::metrics::SALES_REBUILT).increment(1);
            rebuilt.push(id);
        }
    }
    Ok(rebuilt)
}
