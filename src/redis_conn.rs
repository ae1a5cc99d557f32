//! Redis connections: one node, or a Redis Cluster.
//!
//! The API shares one multiplexed, self-reconnecting connection: every request's
//! EVALSHA is pipelined onto it, which beats a pool of checked-out connections. A
//! worker gets a connection of its own, because its blocking XREADGROUP would stall
//! every command queued behind it. In cluster mode the same holds per node: the cluster
//! client keeps one multiplexed connection per node and routes each command by its key.

use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Value};

/// Where Redis is: `REDIS_URL`, or `REDIS_CLUSTER_URLS` when set.
#[derive(Debug, Clone)]
pub(crate) enum RedisTarget {
    Single(String),
    Cluster(Vec<String>),
}

impl RedisTarget {
    pub(crate) fn new(url: &str, cluster_urls: &[String]) -> Self {
        let seeds: Vec<String> = cluster_urls
            .iter()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect();
        if seeds.is_empty() {
            RedisTarget::Single(url.to_string())
        } else {
            RedisTarget::Cluster(seeds)
        }
    }
}

/// A connection to either kind of deployment; cheap to clone.
#[derive(Clone)]
pub enum RedisConn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

/// Response timeout for ordinary commands (the API's hot path).
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(2);

/// Connects to one node lazily, so a process starts (and reports not-ready) while Redis
/// is down.
pub fn connect(url: &str, response_timeout: Duration) -> anyhow::Result<RedisConn> {
    let client = redis::Client::open(url)?;
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
/// waits up to `patience` for it.
pub(crate) async fn connect_to(
    target: &RedisTarget,
    response_timeout: Duration,
    patience: Duration,
) -> anyhow::Result<RedisConn> {
    match target {
        RedisTarget::Single(url) => connect(url, response_timeout),
        RedisTarget::Cluster(seeds) => {
            let client = ClusterClient::builder(seeds.clone())
                .connection_timeout(Duration::from_secs(2))
                .response_timeout(response_timeout)
                .retries(3)
                .build()?;
            let deadline = tokio::time::Instant::now() + patience;
            loop {
                match client.get_async_connection().await {
                    Ok(conn) => return Ok(RedisConn::Cluster(conn)),
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

impl ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            RedisConn::Single(c) => c.req_packed_command(cmd),
            RedisConn::Cluster(c) => c.req_packed_command(cmd),
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
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            RedisConn::Single(c) => c.get_db(),
            RedisConn::Cluster(c) => c.get_db(),
        }
    }
}
