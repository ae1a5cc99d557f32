//! Redis connections: one node, a Redis Cluster, or the master Redis Sentinel names.
//!
//! The API shares one multiplexed, self-reconnecting connection: every request's
//! EVALSHA is pipelined onto it, which beats a pool of checked-out connections. A
//! worker gets a connection of its own, because its blocking XREADGROUP would stall
//! every command queued behind it. In cluster mode the same holds per node: the cluster
//! client keeps one multiplexed connection per node and routes each command by its key.
//! With Sentinel, one multiplexed connection to the master, replaced when it fails over
//! (see [`sentinel`]).

mod sentinel;
mod target;

use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Value};

use crate::keys::{Keys, Shard};

pub use sentinel::SentinelConn;
use target::redacted;
pub(crate) use target::{RedisNodes, RedisTarget, SentinelArgs};

/// Where an API instance subscribes to announcements (see `admission::edge`): one node
/// at a time. A single node's URL; in a cluster any node (every node hears every
/// PUBLISH), the next seed after a failure; with Sentinel, the master it names.
/// `REDIS_PUBSUB_URL` names a node of its own (a replica hears its master's PUBLISHes).
pub struct Subscriber {
    urls: Vec<String>,
    sentinel: Option<SentinelConn>,
    certs: Option<redis::TlsCertificates>,
    next: std::sync::atomic::AtomicUsize,
}

impl Subscriber {
    pub(crate) fn new(target: &RedisTarget, conn: &RedisConn, url: Option<&str>) -> Self {
        let (urls, sentinel) = match (url, &target.nodes, conn) {
            (Some(url), _, _) => (vec![url.to_string()], None),
            (None, RedisNodes::Sentinel { .. }, RedisConn::Sentinel(s)) => {
                (Vec::new(), Some(s.clone()))
            }
            (None, nodes, _) => (nodes.urls().to_vec(), None),
        };
        Self {
            urls,
            sentinel,
            certs: target.certificates(),
            next: Default::default(),
        }
    }

    /// A subscriber to the node `url` names (tests).
    pub fn single(url: &str) -> Self {
        Self::new(
            &RedisTarget::single(url),
            &connect(url, COMMAND_TIMEOUT).expect("a redis URL"),
            None,
        )
    }

    /// A pub/sub connection to the current node.
    pub(crate) async fn connect(&self) -> redis::RedisResult<redis::aio::PubSub> {
        let url = match &self.sentinel {
            Some(s) => s.master_url().await?,
            None => {
                let i = self.next.load(std::sync::atomic::Ordering::Relaxed);
                self.urls[i % self.urls.len().max(1)].clone()
            }
        };
        let client = match &self.certs {
            Some(c) => redis::Client::build_with_tls(url, c.clone())?,
            None => redis::Client::open(url)?,
        };
        tokio::time::timeout(Duration::from_secs(2), client.get_async_pubsub())
            .await
            .map_err(|_| timed_out("connecting for pub/sub"))?
    }

    /// Moves on to the next node (after a failure).
    pub(crate) fn next_node(&self) {
        self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// No answer in time: an I/O error of kind `TimedOut` (what a lost reply reads as).
pub(crate) fn timed_out(what: &str) -> redis::RedisError {
    std::io::Error::new(std::io::ErrorKind::TimedOut, format!("{what} timed out")).into()
}

/// A connection to any kind of deployment; cheap to clone.
#[derive(Clone)]
pub enum RedisConn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
    Sentinel(SentinelConn),
}

impl RedisConn {
    /// The shards to ask about their server, each with the shards on the same server:
    /// one server holds every shard unless this is a cluster.
    pub(crate) fn servers(&self, keys: &Keys) -> Vec<(Shard, Vec<Shard>)> {
        match self {
            RedisConn::Cluster(_) => keys.shards().map(|s| (s, vec![s])).collect(),
            _ => vec![(Shard(0), keys.shards().collect())],
        }
    }

    /// Whether the master in use is confirmed by Sentinel lately (most sentinels name
    /// it, none amiss): always, without Sentinel.
    pub(crate) fn master_confirmed(&self) -> bool {
        match self {
            RedisConn::Sentinel(s) => s.master_confirmed(),
            _ => true,
        }
    }
}

/// Response timeout for ordinary commands (the API's hot path).
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(2);

/// Connects to one node lazily, so a process starts (and reports not-ready) while Redis
/// is down.
pub fn connect(url: &str, response_timeout: Duration) -> anyhow::Result<RedisConn> {
    connect_single(&RedisTarget::single(url), url, response_timeout)
}

fn connect_single(
    target: &RedisTarget,
    url: &str,
    response_timeout: Duration,
) -> anyhow::Result<RedisConn> {
    crate::tls::install_crypto();
    let client = match target.certificates() {
        Some(certs) => redis::Client::build_with_tls(url, certs)?,
        None => redis::Client::open(url)?,
    };
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(2)))
        .set_response_timeout(Some(response_timeout))
        .set_number_of_retries(2)
        .set_max_delay(Duration::from_millis(500));
    Ok(RedisConn::Single(ConnectionManager::new_lazy_with_config(
        client, config,
    )?))
}

/// Connects to `target`. A cluster must answer (its slot map is read at once): this
/// waits up to `patience` for it. A single node or Sentinel's master is not waited for
/// (a process starts while Redis is down). Either way one node (or sentinel) is probed
/// first (see [`probe`]), so that a TLS failure stops the start with an error that names
/// the setting to fix.
pub(crate) async fn connect_to(
    target: &RedisTarget,
    response_timeout: Duration,
    patience: Duration,
) -> anyhow::Result<RedisConn> {
    probe(target).await?;
    match &target.nodes {
        RedisNodes::Single(url) => connect_single(target, url, response_timeout),
        RedisNodes::Sentinel { sentinels, master } => {
            crate::tls::install_crypto();
            Ok(RedisConn::Sentinel(SentinelConn::new(
                sentinels,
                master,
                target.certificates(),
                response_timeout,
                target.tls_hint(),
            )?))
        }
        RedisNodes::Cluster(seeds) => {
            crate::tls::install_crypto();
            let mut builder = ClusterClient::builder(seeds.clone())
                .connection_timeout(Duration::from_secs(2))
                .response_timeout(response_timeout)
                .retries(3);
            if let Some(certs) = target.certificates() {
                builder = builder.certs(certs);
            }
            let client = builder.build()?;
            let deadline = tokio::time::Instant::now() + patience;
            loop {
                match client.get_async_connection().await {
                    Ok(conn) => return Ok(RedisConn::Cluster(conn)),
                    // (The cluster client keeps only the text of a node's error.)
                    Err(e) if tls_failure_text(&e).is_some() => return Err(tls_error(target, &e)),
                    Err(e) if tokio::time::Instant::now() < deadline => {
                        tracing::warn!(error = %e, "redis cluster not reachable yet, retrying");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        }
    }
}

/// How long the probe waits for a node's PONG.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// Asks the first node that answers (the URL, or each seed or sentinel in turn) for a
/// PING, with the target's TLS settings: a failed handshake or certificate check is an
/// error naming the setting; a node that is down is only logged. Each URL is probed once per process
/// (a worker's lanes and sweeper connect one after another), again only after a failure.
async fn probe(target: &RedisTarget) -> anyhow::Result<()> {
    use std::collections::HashSet;
    use std::sync::{Mutex, OnceLock};
    static PROBED: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
    let probed = PROBED.get_or_init(Mutex::default);
    let urls = target.nodes.urls();
    let known = |url: &String| {
        probed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(url)
    };
    if urls.iter().any(known) {
        return Ok(());
    }
    crate::tls::install_crypto();
    for url in urls {
        let client = match target.certificates() {
            Some(certs) => redis::Client::build_with_tls(url.as_str(), certs)?,
            None => redis::Client::open(url.as_str())?,
        };
        let ping = async {
            let mut conn = client.get_multiplexed_async_connection().await?;
            redis::cmd("PING").query_async::<()>(&mut conn).await
        };
        let tls = url.starts_with("rediss://");
        let error = match tokio::time::timeout(PROBE_TIMEOUT, ping).await {
            Ok(Ok(())) => {
                probed
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(url.clone());
                return Ok(());
            }
            Ok(Err(e)) if tls_failure_text(&e).is_some() => return Err(tls_error(target, &e)),
            Ok(Err(e)) if e.is_connection_refusal() => {
                tracing::warn!(error = %e, node = %redacted(url), "redis not reachable yet");
                continue;
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no PONG within {}s", PROBE_TIMEOUT.as_secs()),
        };
        // The two ways a scheme that does not match the port shows: a plain port reads a
        // TLS hello as a command that never ends; a TLS port drops plain RESP.
        let hint = match tls {
            true => "if this is a plain (non-TLS) port, the URL must be redis:// or name the server's tls-port",
            false => "if this port speaks only TLS, the URL must be rediss://",
        };
        tracing::warn!(
            %error,
            node = %redacted(url),
            "redis not reachable yet; if it stays so, check {}: {hint}",
            target.setting()
        );
    }
    Ok(())
}

/// The TLS failure in `e`: its causes, or else its text (the cluster client and some
/// connection paths keep only that). rustls's messages start with these.
fn tls_failure_text(e: &redis::RedisError) -> Option<String> {
    if let Some(found) = crate::tls::failure(e) {
        return Some(found);
    }
    const RUSTLS: [&str; 6] = [
        "invalid peer certificate",
        "received fatal alert",
        "received corrupt message",
        "peer is incompatible",
        "peer misbehaved",
        "the peer failed to provide",
    ];
    let text = e.to_string();
    RUSTLS
        .iter()
        .find_map(|m| text.find(m).map(|at| text[at..].to_string()))
}

fn tls_error(target: &RedisTarget, e: &redis::RedisError) -> anyhow::Error {
    let cause = tls_failure_text(e).unwrap_or_else(|| e.to_string());
    anyhow::anyhow!("TLS with Redis failed: {cause}; {}", target.tls_hint())
}

impl ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            RedisConn::Single(c) => c.req_packed_command(cmd),
            RedisConn::Cluster(c) => c.req_packed_command(cmd),
            RedisConn::Sentinel(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            RedisConn::Single(c) => c.req_packed_commands(cmd, offset, count),
            RedisConn::Cluster(c) => c.req_packed_commands(cmd, offset, count),
            RedisConn::Sentinel(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            RedisConn::Single(c) => c.get_db(),
            RedisConn::Cluster(c) => c.get_db(),
            RedisConn::Sentinel(c) => c.get_db(),
        }
    }
}

#[cfg(test)]
mod tests;
