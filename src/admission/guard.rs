//! The Redis settings the promises rest on, checked (and, where Redis lets us, set) by
//! every process: keys are never evicted (the admission function refuses every grab
//! on a server whose policy may evict; `/readyz` and the term watcher say so), and with
//! `REDIS_WAIT_REPLICAS=N` a master refuses every write of ours (before a unit is
//! taken) while it has fewer than N replicas that acknowledged lately.

use std::time::Duration;

use redis::RedisResult;

use crate::keys::{Keys, Shard};
use crate::redis_conn::RedisConn;
use crate::scripts::Replicas;

/// What a server's memory settings mean for the promises, as its `INFO memory` says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Memory {
    /// `maxmemory-policy noeviction`, room left: a full Redis refuses writes (grabs get
    /// 503, nothing reserved) rather than forget a key.
    Keeps,
    /// A policy that may evict keys: every key of ours is state a promise rests on (a
    /// sale's stock and buyers, the order stream, a lease; the `volatile-*` policies
    /// evict exactly ours, which expire). The admission function refuses every grab
    /// there (`evicting`), and any eviction is lost writes (a new term).
    MayEvict { policy: String },
    /// `noeviction`, and the memory used reached `maxmemory`: Redis refuses every
    /// write (`OOM`), admissions included.
    Full,
    /// INFO is not allowed (some managed services rename it): the policy is the
    /// operator's to keep `noeviction`.
    Unknown,
}

impl Memory {
    /// From an `INFO memory` text.
    pub(crate) fn of_info(text: &str) -> Self {
        let field = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                .map(str::trim)
        };
        let number = |name: &str| field(name).and_then(|v| v.parse::<u64>().ok());
        match field("maxmemory_policy") {
            None => Memory::Unknown,
            Some("noeviction") => {
                // As Redis counts it before refusing a write.
                let used = number("used_memory")
                    .unwrap_or(0)
                    .saturating_sub(number("mem_not_counted_for_evict").unwrap_or(0));
                match number("maxmemory").unwrap_or(0) {
                    max if max > 0 && used > max => Memory::Full,
                    _ => Memory::Keeps,
                }
            }
            Some(policy) => Memory::MayEvict {
                policy: policy.to_string(),
            },
        }
    }

    /// Why this server cannot take promises now, in words (`None`: it can).
    pub(crate) fn trouble(&self) -> Option<String> {
        match self {
            Memory::Keeps | Memory::Unknown => None,
            Memory::MayEvict { policy } => Some(format!(
                "redis may evict keys (maxmemory-policy {policy}): admissions refused until \
                 it is noeviction"
            )),
            Memory::Full => Some(
                "redis is out of memory (used_memory above maxmemory): it refuses writes, \
                 admissions included"
                    .to_string(),
            ),
        }
    }

    /// The label `/readyz` gives it.
    pub(crate) fn label(&self) -> &'static str {
        match self {
            Memory::Keeps => "noeviction",
            Memory::MayEvict { .. } => "may_evict",
            Memory::Full => "full",
            Memory::Unknown => "unknown",
        }
    }
}

/// The memory of the server holding `shard`'s keys.
pub(crate) async fn memory(conn: &mut RedisConn, keys: &Keys, shard: Shard) -> RedisResult<Memory> {
    let mut info = redis::cmd("INFO");
    info.arg("memory");
    match on_node_of(conn, keys.stream(shard), info).await {
        Ok(v) => Ok(Memory::of_info(&redis::from_redis_value::<String>(v)?)),
        Err(e)
            if matches!(
                e.kind(),
                redis::ErrorKind::Server(
                    redis::ServerErrorKind::ResponseError | redis::ServerErrorKind::NoPerm
                )
            ) =>
        {
            Ok(Memory::Unknown)
        }
        Err(e) => Err(e),
    }
}

/// Refuses to start on a Redis that may evict keys (see [`Memory::MayEvict`]). One that
/// does not answer is checked by the term watcher once it does: until then, and
/// whenever its policy may evict, admissions are refused and `/readyz` says why.
pub(crate) async fn refuse_eviction(conn: &mut RedisConn, keys: &Keys) -> anyhow::Result<()> {
    for (shard, _) in conn.servers(keys) {
        match memory(conn, keys, shard).await {
            Ok(Memory::MayEvict { policy }) => anyhow::bail!(
                "redis's maxmemory-policy is {policy}: it may evict a sale's stock and \
                 buyers, the order stream or an order-id lease, and a 202 would no longer be \
                 a promise; set maxmemory-policy noeviction (a full Redis then refuses \
                 writes, and grabs get 503)"
            ),
            Ok(Memory::Unknown) => tracing::warn!(
                "cannot read redis's maxmemory-policy (INFO not allowed): make sure it is \
                 noeviction (an evicted sale or lease breaks the service's promises)"
            ),
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(
                    error = %e,
                    "redis not reachable: its maxmemory-policy is checked once it answers"
                );
                return Ok(());
            }
        }
    }
    Ok(())
}

/// Runs `cmd` on the server holding `route_key` (a cluster routes a command without a
/// key anywhere).
pub(crate) async fn on_node_of(
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

/// With replicas to wait for, makes the master holding `route_key` refuse writes while
/// it has fewer than `replicas.n` replicas whose last acknowledgement is at most
/// `replicas.max_lag` old (`min-replicas-to-write`, `min-replicas-max-lag`; stricter
/// settings of the operator's are kept). Redis checks them before a function that may
/// write runs, and answers `NOREPLICAS`: a grab on a master whose replica stalled or is
/// gone (an old primary after a failover) is refused before its unit is taken (`503`,
/// nothing reserved), instead of being taken and answered "unknown". A server that
/// refuses CONFIG (some managed services) is logged: set them there yourself.
pub(crate) async fn require_replicas(
    conn: &mut RedisConn,
    route_key: &str,
    replicas: Replicas,
) -> anyhow::Result<()> {
    if !replicas.waits() {
        return Ok(());
    }
    let lag = replicas.max_lag.as_secs().max(1);
    let mut get = redis::cmd("CONFIG");
    get.arg("GET").arg("min-replicas-*");
    let now: std::collections::HashMap<String, String> = match on_node_of(conn, route_key, get)
        .await
        .and_then(|v| Ok(redis::from_redis_value(v)?))
    {
        Ok(now) => now,
        Err(e) if e.is_io_error() || e.is_connection_refusal() => return Err(e.into()),
        Err(e) => {
            tracing::warn!(
                error = %e,
                wanted = replicas.n,
                max_lag_secs = lag,
                "cannot read redis's min-replicas-to-write: set it (and min-replicas-max-lag) \
                 on every node yourself, or a master whose replicas are gone takes units \
                 it cannot keep"
            );
            return Ok(());
        }
    };
    let number = |name: &str| now.get(name).and_then(|v| v.parse::<u64>().ok());
    let to_write = number("min-replicas-to-write").unwrap_or(0);
    let max_lag = number("min-replicas-max-lag").unwrap_or(u64::MAX);
    if to_write >= replicas.n as u64 && (1..=lag).contains(&max_lag) {
        return Ok(());
    }
    let max_lag = if (1..=lag).contains(&max_lag) {
        max_lag
    } else {
        lag
    };
    set_min_replicas(conn, route_key, to_write.max(replicas.n as u64), max_lag).await
}

/// Sets `min-replicas-to-write` and `min-replicas-max-lag` on the master holding
/// `route_key`; a server that refuses CONFIG is logged.
async fn set_min_replicas(
    conn: &mut RedisConn,
    route_key: &str,
    to_write: u64,
    max_lag: u64,
) -> anyhow::Result<()> {
    let mut set = redis::cmd("CONFIG");
    set.arg("SET")
        .arg("min-replicas-to-write")
        .arg(to_write)
        .arg("min-replicas-max-lag")
        .arg(max_lag);
    match on_node_of(conn, route_key, set).await {
        Ok(_) => {
            tracing::info!(
                replicas = to_write,
                max_lag_secs = max_lag,
                "redis now refuses writes while too few replicas acknowledge"
            );
            Ok(())
        }
        Err(e) if e.is_io_error() || e.is_connection_refusal() => Err(e.into()),
        Err(e) => {
            tracing::warn!(
                error = %e,
                "cannot set redis's min-replicas-to-write: set it (and min-replicas-max-lag) \
                 on every node yourself"
            );
            Ok(())
        }
    }
}

/// Whether each shard's master had its replicas acknowledge lately, as this process
/// sees it (with replicas to wait for). An admission call is not sent to a shard whose
/// gate is shut: its grabs are refused before any unit is taken (`503`, nothing
/// reserved), within a probe's period and timeout of the replicas going silent, where
/// Redis's own `min-replicas-max-lag` counts whole seconds. A call whose acknowledgement
/// fails shuts its shard's gate at once; [`probe_replicas`] opens it again.
#[derive(Debug)]
pub struct ReplicaGate {
    open: Vec<std::sync::atomic::AtomicBool>,
}

impl ReplicaGate {
    /// Every shard open.
    pub(crate) fn new(shards: usize) -> Self {
        Self {
            open: (0..shards)
                .map(|_| std::sync::atomic::AtomicBool::new(true))
                .collect(),
        }
    }

    pub(crate) fn is_open(&self, shard: Shard) -> bool {
        self.open[shard.0 as usize].load(std::sync::atomic::Ordering::Acquire)
    }

    pub(crate) fn set(&self, shard: Shard, open: bool) {
        let was = self.open[shard.0 as usize].swap(open, std::sync::atomic::Ordering::AcqRel);
        if was != open {
            match open {
                true => tracing::info!(shard = shard.0, "replicas acknowledge again: admitting"),
                false => tracing::warn!(
                    shard = shard.0,
                    "replicas did not acknowledge in time: refusing grabs until they do"
                ),
            }
        }
    }
}

/// The error a grab of a shut shard gets: nothing was sent, nothing reserved.
pub(crate) fn replicas_silent() -> redis::RedisError {
    std::io::Error::new(
        std::io::ErrorKind::ConnectionRefused,
        "too few replicas acknowledged lately",
    )
    .into()
}

/// The error a grab gets while Sentinel does not confirm the master in use: nothing was
/// sent, nothing reserved.
pub(crate) fn master_unconfirmed() -> redis::RedisError {
    std::io::Error::new(
        std::io::ErrorKind::ConnectionRefused,
        "Sentinel does not confirm the redis master lately",
    )
    .into()
}

/// How often each master's replicas are probed, and how long a probe waits.
const PROBE_EVERY: Duration = Duration::from_millis(250);

/// Keeps `gate` true to the replicas until `cancel`: every [`PROBE_EVERY`], on a
/// connection of its own (a WAIT holds its connection), a small write and a WAIT for
/// `replicas.n` acknowledgements within `replicas.timeout` on each master; the shards it
/// holds are open while that succeeds.
pub(crate) async fn probe_replicas(
    gate: std::sync::Arc<ReplicaGate>,
    conn: RedisConn,
    keys: Keys,
    replicas: Replicas,
    cancel: tokio_util::sync::CancellationToken,
) {
    if !replicas.waits() {
        return;
    }
    let mut tick = tokio::time::interval(PROBE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        // Every master at once: a silent one's WAIT holds only its own probe.
        let probes = conn.servers(&keys).into_iter().map(|(asked, shards)| {
            let (mut conn, keys) = (conn.clone(), &keys);
            async move { (probe(&mut conn, keys, asked, replicas).await, shards) }
        });
        for (healthy, shards) in futures_util::future::join_all(probes).await {
            for shard in shards {
                gate.set(shard, healthy);
            }
        }
    }
}

/// One probe of the master holding `shard`: whether a write there was acknowledged by
/// enough replicas in time.
async fn probe(conn: &mut RedisConn, keys: &Keys, shard: Shard, replicas: Replicas) -> bool {
    let mut pipe = redis::pipe();
    pipe.cmd("SET")
        .arg(keys.replica_probe(shard))
        .arg(chrono::Utc::now().timestamp_millis())
        .arg("PX")
        .arg(60_000)
        .cmd("WAIT")
        .arg(replicas.n)
        .arg(replicas.timeout.as_millis().max(1) as u64);
    let acked: RedisResult<((), i64)> = match conn {
        RedisConn::Cluster(c) => {
            use redis::cluster_routing::{Route, SingleNodeRoutingInfo, SlotAddr};
            let key = keys.replica_probe(shard);
            let route = Route::new(crate::keys::slot(&key), SlotAddr::Master);
            c.route_pipeline(pipe, 0, 2, SingleNodeRoutingInfo::SpecificNode(route))
                .await
                .and_then(|v| Ok(redis::from_redis_value(redis::Value::Array(v))?))
        }
        other => pipe.query_async(other).await,
    };
    matches!(acked, Ok(((), n)) if n >= replicas.n as i64)
}
