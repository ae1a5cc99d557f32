//! A connection to the master that Redis Sentinel names, followed across failovers.
//!
//! redis-rs's `ConnectionManager` reconnects to one fixed address and its
//! `SentinelClient` answers one address once, so neither follows a failover. This keeps
//! one multiplexed connection to the master, as `ConnectionManager` does, and replaces it
//! by asking the sentinels again whenever it shows the master may have moved: the
//! connection drops or times out, or the node answers `READONLY` (demoted) or `MASTERDOWN`.
//! A node is used only once it says `ROLE` master itself: a sentinel's answer can be stale.
//!
//! Errors do not show every failover: after a handover (`SENTINEL FAILOVER`, or a
//! partition that heals) the old master accepts writes until Sentinel demotes it, seconds
//! later, and its resync then discards them. So a watcher also asks the sentinels ten
//! times a second, and moves to the master most of them name as soon as it is another
//! one. Each answer also says whether most sentinels name the node in use with nothing
//! amiss (not subjectively or objectively down, no failover in progress), and whether
//! one leads a failover: admission asks that first ([`SentinelConn::master_confirmed`]),
//! so an instance stops taking units on a master the sentinels are about to replace,
//! before a replica is promoted, instead of having its grabs acknowledged by a replica
//! that will follow another primary.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::{BoxFuture, FutureExt, Shared};
use redis::aio::{
    ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection,
};
use redis::{AsyncConnectionConfig, Cmd, Pipeline, RedisError, RedisFuture, RedisResult, Value};
use tokio::time::Instant;

/// How long a sentinel gets to answer, and a master to accept a connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// The first pause between two lookups that found no master; doubled up to the cap.
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(1);
/// How often the watcher asks the sentinels which node is the master.
const WATCH_EVERY: Duration = Duration::from_millis(100);
/// How long a confirmation by the sentinels lasts: a few looks.
const CONFIRMED_FOR: Duration = Duration::from_millis(500);
/// How long a look waits for a sentinel: one that is frozen or cut off must not hold
/// the others' answers past a confirmation's life (its connection's own timeout is
/// [`CONNECT_TIMEOUT`]).
const ASK_TIMEOUT: Duration = Duration::from_millis(200);

/// A master's address as Sentinel gives it.
type Addr = (String, u16);

/// The master named `master` in the sentinels at `sentinels`; cheap to clone, every clone
/// pipelines onto the same connection.
#[derive(Clone)]
pub struct SentinelConn(Arc<Follower>);

/// What a lookup needs (kept apart from [`State`], which holds lookups in flight).
struct Resolver {
    /// One self-reconnecting connection per sentinel (their addresses do not move).
    sentinels: Vec<ConnectionManager>,
    name: String,
    /// A sentinel's URL (scheme, credentials, database), for the master's address.
    template: url::Url,
    certs: Option<redis::TlsCertificates>,
    config: AsyncConnectionConfig,
    /// What to check when TLS fails, naming the settings.
    tls_hint: String,
}

struct Follower {
    resolver: Arc<Resolver>,
    state: Mutex<State>,
    /// The link (by generation) most sentinels named lately with nothing amiss, and
    /// until when: a confirmation is of one link, not of whichever replaces it.
    confirmed: Mutex<(u64, Instant)>,
}

/// A lookup's outcome: the master's connection and address (shared: every command
/// clones it).
type Link = Shared<BoxFuture<'static, RedisResult<(MultiplexedConnection, Arc<Addr>)>>>;

struct State {
    /// Which link this is: an error on an older one must not replace a newer one.
    generation: u64,
    link: Link,
    /// When the link's lookup began (the next one waits out the backoff from there).
    started: Instant,
    /// Lookups in a row that found no master.
    failures: u32,
}

impl SentinelConn {
    /// Starts looking the master up in the background and returns at once: a process
    /// starts (and reports not ready) while Sentinel or Redis is down.
    pub(crate) fn new(
        sentinels: &[String],
        name: &str,
        certs: Option<redis::TlsCertificates>,
        response_timeout: Duration,
        tls_hint: String,
    ) -> anyhow::Result<Self> {
        let to_sentinels = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(CONNECT_TIMEOUT))
            .set_response_timeout(Some(CONNECT_TIMEOUT))
            .set_number_of_retries(0);
        let clients = sentinels
            .iter()
            .map(|url| {
                let client = match &certs {
                    Some(c) => redis::Client::build_with_tls(url.as_str(), c.clone()),
                    None => redis::Client::open(url.as_str()),
                };
                client
                    .and_then(|c| ConnectionManager::new_lazy_with_config(c, to_sentinels.clone()))
                    .map_err(|e| anyhow::anyhow!("REDIS_SENTINEL_URLS: {e}"))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let template = url::Url::parse(&sentinels[0])
            .map_err(|e| anyhow::anyhow!("REDIS_SENTINEL_URLS: {e}"))?;
        let resolver = Arc::new(Resolver {
            sentinels: clients,
            name: name.to_string(),
            template,
            certs,
            config: AsyncConnectionConfig::new()
                .set_connection_timeout(Some(CONNECT_TIMEOUT))
                .set_response_timeout(Some(response_timeout)),
            tls_hint,
        });
        let now = Instant::now();
        let link = lookup(resolver.clone(), now);
        let follower = Arc::new(Follower {
            resolver,
            state: Mutex::new(State {
                generation: 0,
                link,
                started: now,
                failures: 0,
            }),
            // (The first lookup takes the node most sentinels name.)
            confirmed: Mutex::new((0, now + CONFIRMED_FOR)),
        });
        tokio::spawn(watch(Arc::downgrade(&follower)));
        Ok(Self(follower))
    }

    /// The current link to the master, and its generation. While the last lookup's
    /// failure is fresh (within the backoff) its error comes back at once: a request
    /// then fails fast, and knows nothing was sent.
    fn link(&self) -> RedisResult<(u64, Link)> {
        let mut state = self.0.state.lock().unwrap_or_else(|e| e.into_inner());
        match state.link.peek() {
            Some(Ok(_)) => state.failures = 0,
            Some(Err(e)) if Instant::now() < state.retry_at() => return Err(e.clone()),
            Some(Err(_)) => {
                state.renew(&self.0.resolver);
                state.failures = state.failures.saturating_add(1);
            }
            None => {}
        }
        Ok((state.generation, state.link.clone()))
    }

    /// After `error` on the link of `generation`: looks the master up again if the
    /// error says it may have moved (and no newer link has replaced that one yet).
    fn check(&self, generation: u64, error: &RedisError) {
        if !master_may_have_moved(error) {
            return;
        }
        let mut state = self.0.state.lock().unwrap_or_else(|e| e.into_inner());
        if state.generation == generation {
            tracing::warn!(%error, master = %self.0.resolver.name, "redis master lost; asking Sentinel again");
            state.renew(&self.0.resolver);
        }
    }

    /// The URL of the master in use (for a connection of another kind: pub/sub).
    pub(crate) async fn master_url(&self) -> RedisResult<String> {
        let (_, link) = self.link()?;
        let (_, addr) = link.await?;
        self.0
            .resolver
            .master_url(&addr.0, addr.1)
            .map_err(no_master)
    }

    async fn master(&self) -> RedisResult<(u64, MultiplexedConnection)> {
        let (generation, link) = self.link()?;
        Ok((generation, link.await?.0))
    }

    /// Whether most sentinels named the node in use lately with nothing amiss (see the
    /// module's note): else a grab is refused before it is sent.
    pub(crate) fn master_confirmed(&self) -> bool {
        let generation = self
            .0
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .generation;
        let (of, until) = *self.0.confirmed.lock().unwrap_or_else(|e| e.into_inner());
        of == generation && Instant::now() < until
    }
}

/// Each second, while any clone of the connection lives: retries a failed lookup once
/// its backoff is over (so a process turns ready without waiting for a request), and
/// moves to the master the sentinels name when that is not the node in use.
async fn watch(follower: std::sync::Weak<Follower>) {
    loop {
        tokio::time::sleep(WATCH_EVERY).await;
        let Some(follower) = follower.upgrade() else {
            return;
        };
        let Ok((generation, link)) = SentinelConn(follower.clone()).link() else {
            continue;
        };
        let Some(Ok((_, used))) = link.peek().cloned() else {
            continue;
        };
        let views = follower.resolver.ask_all().await;
        let sound = views
            .iter()
            .filter(|v| matches!(v, Ok(v) if v.sound && v.named == *used))
            .count();
        // Only the sentinel leading a failover says so, and it promotes a replica a
        // moment later: one is enough to stop at once.
        let failing_over = views.iter().any(|v| matches!(v, Ok(v) if v.failing_over));
        let mut confirmed = follower.confirmed.lock().unwrap_or_else(|e| e.into_inner());
        if failing_over {
            *confirmed = (generation, Instant::now());
        } else if sound * 2 > follower.resolver.sentinels.len() {
            *confirmed = (generation, Instant::now() + CONFIRMED_FOR);
        }
        drop(confirmed);
        let (named, _) = tally(&follower.resolver.name, views);
        // Only a clear plurality: a tie (one sentinel behind) is no reason to move.
        let clear = match named.as_slice() {
            [(addr, _)] => Some(addr),
            [(addr, first), (_, second), ..] if first > second => Some(addr),
            _ => None,
        };
        if let Some(addr) = clear.filter(|addr| *addr != used.as_ref()) {
            let mut state = follower.state.lock().unwrap_or_else(|e| e.into_inner());
            if state.generation == generation {
                tracing::warn!(master = %follower.resolver.name, from = ?used, to = ?addr,
                    "Sentinel names another redis master; moving to it");
                state.renew(&follower.resolver);
            }
        }
    }
}

impl State {
    /// When a new lookup may begin: lookups start at least the backoff apart.
    fn retry_at(&self) -> Instant {
        self.started + backoff(self.failures)
    }

    /// Replaces the link by a new lookup, which waits out the backoff first (a node that
    /// accepts connections and then drops them cannot make this a hot loop).
    fn renew(&mut self, resolver: &Arc<Resolver>) {
        let start = self.retry_at().max(Instant::now());
        self.generation += 1;
        self.started = start;
        self.link = lookup(resolver.clone(), start);
    }
}

/// The pause before a lookup after `failures` lookups in a row found no master.
fn backoff(failures: u32) -> Duration {
    BACKOFF_MIN
        .saturating_mul(1 << failures.min(16))
        .min(BACKOFF_MAX)
}

/// A lookup that begins at `start`, driven by a task of its own so that it completes
/// even when every request waiting for it gives up.
fn lookup(resolver: Arc<Resolver>, start: Instant) -> Link {
    let link = async move {
        tokio::time::sleep_until(start).await;
        resolver.connect().await.map_err(|e| {
            tracing::warn!(error = %e, master = %resolver.name, "no redis master yet");
            e
        })
    }
    .boxed()
    .shared();
    tokio::spawn(link.clone());
    link
}

/// Errors after which the node may no longer be the master, or the connection no longer
/// usable: a dropped or timed-out connection, a node demoted to replica (`READONLY`, or
/// `MASTERDOWN` once it has lost its new master too).
fn master_may_have_moved(e: &RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    e.is_io_error()
        || e.is_unrecoverable_error()
        || matches!(
            e.kind(),
            ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
        )
}

/// An error for "no master to send to": a connection refusal, so that callers know the
/// command never ran.
fn no_master(detail: String) -> RedisError {
    std::io::Error::new(std::io::ErrorKind::ConnectionRefused, detail).into()
}

/// One sentinel's answer: the master's address it names, and whether it sees that
/// master with nothing amiss (not subjectively or objectively down, no failover in
/// progress).
struct View {
    named: Addr,
    sound: bool,
    /// This sentinel leads a failover of the master now.
    failing_over: bool,
}

/// The addresses named, the most named first (a sentinel cut off from the others may
/// name an old one), and what the others said instead.
fn tally(name: &str, views: Vec<Result<View, String>>) -> (Vec<(Addr, usize)>, Vec<String>) {
    let mut named: Vec<(Addr, usize)> = Vec::new();
    let mut errors = Vec::new();
    for view in views {
        match view {
            Ok(View { named: addr, .. }) => match named.iter_mut().find(|(a, _)| *a == addr) {
                Some((_, votes)) => *votes += 1,
                None => named.push((addr, 1)),
            },
            Err(e) => errors.push(format!("master {name:?}: {e}")),
        }
    }
    named.sort_by_key(|(_, votes)| std::cmp::Reverse(*votes));
    (named, errors)
}

impl Resolver {
    /// Tries the addresses the sentinels name, the most named first, until one node says
    /// it is the master.
    async fn connect(&self) -> RedisResult<(MultiplexedConnection, Arc<Addr>)> {
        let (named, mut errors) = tally(&self.name, self.ask_all().await);
        for ((host, port), _) in named {
            match self.connect_master(&host, port).await {
                Ok(conn) => {
                    tracing::info!(master = %self.name, %host, port, "following the redis master");
                    return Ok((conn, Arc::new((host, port))));
                }
                Err(e) => errors.push(format!("{host}:{port}: {e}")),
            }
        }
        Err(no_master(format!(
            "no redis master {:?} found through Sentinel: {}",
            self.name,
            errors.join("; ")
        )))
    }

    /// Asks every sentinel at once, in one round trip each, where the master is and how
    /// it sees it; a sentinel that does not answer within [`ASK_TIMEOUT`] counts as
    /// silent.
    async fn ask_all(&self) -> Vec<Result<View, String>> {
        let ask = |sentinel: &ConnectionManager| {
            let mut conn = sentinel.clone();
            async move {
                let mut pipe = redis::pipe();
                pipe.cmd("SENTINEL")
                    .arg("get-master-addr-by-name")
                    .arg(&self.name)
                    .cmd("SENTINEL")
                    .arg("MASTER")
                    .arg(&self.name);
                let asked = pipe
                    .query_async::<(Option<Addr>, std::collections::HashMap<String, String>)>(
                        &mut conn,
                    );
                let (named, master) = match tokio::time::timeout(ASK_TIMEOUT, asked).await {
                    Err(_) => return Err("a sentinel did not answer in time".to_string()),
                    Ok(Err(e)) => return Err(e.to_string()),
                    Ok(Ok((None, _))) => return Err("a sentinel knows no such master".into()),
                    Ok(Ok((Some(named), master))) => (named, master),
                };
                // (The address `SENTINEL MASTER` gives moves at the end of a failover;
                // the one asked for first, as soon as the replica is promoted.)
                let at: Option<Addr> = master
                    .get("ip")
                    .zip(master.get("port").and_then(|p| p.parse().ok()))
                    .map(|(ip, port)| (ip.clone(), port));
                let flags = master.get("flags").map_or("", |f| f.as_str());
                let flagged = |f: &str| flags.split(',').any(|g| g == f);
                let failing_over = flagged("failover_in_progress");
                let amiss =
                    flags.is_empty() || failing_over || flagged("s_down") || flagged("o_down");
                let sound = at.as_ref() == Some(&named) && !amiss;
                Ok(View {
                    named,
                    sound,
                    failing_over,
                })
            }
        };
        futures_util::future::join_all(self.sentinels.iter().map(ask)).await
    }

    /// A connection to `host:port`, kept only if the node says it is the master.
    async fn connect_master(&self, host: &str, port: u16) -> Result<MultiplexedConnection, String> {
        let url = self.master_url(host, port)?;
        let client = match &self.certs {
            Some(c) => redis::Client::build_with_tls(url, c.clone()),
            None => redis::Client::open(url),
        }
        .map_err(|e| e.to_string())?;
        let checked = async {
            let mut conn = client
                .get_multiplexed_async_connection_with_config(&self.config)
                .await?;
            let role: redis::Role = redis::cmd("ROLE").query_async(&mut conn).await?;
            Ok::<_, RedisError>((conn, role))
        };
        match checked.await {
            Ok((conn, redis::Role::Primary { .. })) => Ok(conn),
            Ok((_, role)) => Err(format!("not the master (ROLE: {role:?})")),
            Err(e) => match super::tls_failure_text(&e) {
                Some(tls) => Err(format!("TLS failed: {tls}; {}", self.tls_hint)),
                None => Err(e.to_string()),
            },
        }
    }

    /// The master's URL: a sentinel's, with the master's host and port.
    fn master_url(&self, host: &str, port: u16) -> Result<String, String> {
        let mut url = self.template.clone();
        let set = match host.parse::<std::net::IpAddr>() {
            Ok(ip) => url.set_ip_host(ip),
            Err(_) => url.set_host(Some(host)).map_err(|_| ()),
        };
        set.and_then(|()| url.set_port(Some(port)))
            .map_err(|()| format!("Sentinel named an unusable address {host}:{port}"))?;
        Ok(url.into())
    }
}

impl ConnectionLike for SentinelConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let (generation, mut conn) = self.master().await?;
            let result = conn.send_packed_command(cmd).await;
            if let Err(e) = &result {
                self.check(generation, e);
            }
            result
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let (generation, mut conn) = self.master().await?;
            let result = conn.send_packed_commands(cmd, offset, count).await;
            if let Err(e) = &result {
                self.check(generation, e);
            }
            result
        })
    }

    fn get_db(&self) -> i64 {
        self.0
            .resolver
            .template
            .path()
            .trim_start_matches('/')
            .parse()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use redis::{ErrorKind, ServerErrorKind};

    #[test]
    fn a_lost_or_demoted_master_is_looked_up_again_but_a_command_error_is_not() {
        let server = |kind| RedisError::from((ErrorKind::Server(kind), "reply"));
        let io = |kind| RedisError::from(std::io::Error::new(kind, "io"));
        assert!(master_may_have_moved(&server(ServerErrorKind::ReadOnly)));
        assert!(master_may_have_moved(&server(ServerErrorKind::MasterDown)));
        assert!(master_may_have_moved(&io(std::io::ErrorKind::TimedOut)));
        assert!(master_may_have_moved(&io(
            std::io::ErrorKind::ConnectionReset
        )));
        assert!(master_may_have_moved(&no_master("none".into())));
        assert!(!master_may_have_moved(&server(
            ServerErrorKind::ResponseError
        )));
        assert!(!master_may_have_moved(&server(ServerErrorKind::NoScript)));
        assert!(!master_may_have_moved(&server(
            ServerErrorKind::BusyLoading
        )));
    }

    #[test]
    fn no_master_is_a_refusal_so_callers_know_nothing_ran() {
        assert!(no_master("none".into()).is_connection_refusal());
    }

    #[test]
    fn lookups_back_off_from_a_tenth_of_a_second_to_a_second() {
        let waits: Vec<u64> = (0..6).map(|n| backoff(n).as_millis() as u64).collect();
        assert_eq!(waits, [100, 200, 400, 800, 1000, 1000]);
        assert_eq!(backoff(u32::MAX), BACKOFF_MAX);
    }
}
