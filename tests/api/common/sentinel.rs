//! A Redis Sentinel deployment of the test's own: a primary, one replica whose
//! replication link runs through a cuttable [`Proxy`] (to make it lag, then heal it), and
//! three sentinels (quorum 2) that fail the primary over within seconds of its death.
//! Every process listens on a spare loopback port with its own directory; all are killed
//! and the directories removed on drop.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tokio::time::Instant;

use super::faults::{free_port, PrivateRedis, Proxy};
use super::tls::{redis_tls_args, Certs};

/// The name the sentinels monitor the primary under (`REDIS_SENTINEL_MASTER`).
pub const MASTER: &str = "seckill";

/// How long anything here may take on a loaded two-core machine before it is a failure.
const PATIENCE: Duration = Duration::from_secs(60);

pub struct PrivateSentinel {
    primary: Option<Child>,
    replica: Option<Child>,
    sentinels: Vec<Child>,
    pub primary_port: u16,
    pub replica_port: u16,
    pub sentinel_ports: Vec<u16>,
    /// The replica's way to the primary.
    link: Proxy,
    dir: PathBuf,
    /// The test's CA when every process speaks TLS only (and replicates over TLS).
    ca: Option<Vec<u8>>,
}

impl PrivateSentinel {
    pub async fn start() -> Self {
        Self::start_with(None).await
    }

    /// Every node and sentinel speaks TLS only (to clients and to each other).
    pub async fn start_tls(certs: &Certs) -> Self {
        Self::start_with(Some(certs)).await
    }

    /// Starts the processes one after another, each waited for, so that a failed start
    /// names what failed (and drop kills what was started).
    async fn start_with(certs: Option<&Certs>) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "seckill-sentinel-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let primary_port = free_port();
        let mut setup = Self {
            primary: Some(redis_node(&dir, "primary", primary_port, certs, &[])),
            replica: None,
            sentinels: Vec::new(),
            primary_port,
            replica_port: free_port(),
            sentinel_ports: Vec::new(),
            link: Proxy::start(([127, 0, 0, 1], primary_port).into()).await,
            dir,
            ca: certs.map(|c| std::fs::read(&c.ca).unwrap()),
        };
        setup.wait_answers(primary_port).await;
        // The replica replicates through the proxy but announces its own port, so the
        // sentinels (which learn of it from the primary) reach it directly.
        let upstream = setup.link.addr.port().to_string();
        let replicaof = ["--replicaof", "127.0.0.1", &upstream];
        setup.replica = Some(redis_node(
            &setup.dir,
            "replica",
            setup.replica_port,
            certs,
            &replicaof,
        ));
        setup.wait_replica_in_sync().await;
        for _ in 0..3 {
            let port = free_port();
            setup
                .sentinels
                .push(sentinel_process(&setup.dir, port, primary_port, certs));
            setup.sentinel_ports.push(port);
            setup.wait_answers(port).await;
        }
        setup.wait_sentinels_agree().await;
        setup
    }

    /// `REDIS_SENTINEL_URLS`.
    pub fn sentinel_urls(&self) -> String {
        self.sentinel_ports
            .iter()
            .map(|p| self.url(*p))
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn url(&self, port: u16) -> String {
        let scheme = if self.ca.is_some() { "rediss" } else { "redis" };
        format!("{scheme}://127.0.0.1:{port}")
    }

    /// The URL of the node the sentinels now name as master.
    pub async fn master_url(&self) -> String {
        let (host, port) = self.named_master(self.sentinel_ports[0]).await.unwrap();
        self.url_of(&host, port)
    }

    fn url_of(&self, host: &str, port: u16) -> String {
        let scheme = if self.ca.is_some() { "rediss" } else { "redis" };
        format!("{scheme}://{host}:{port}")
    }

    /// A client of the node on `port` (trusting the test's CA when TLS is on).
    pub fn client(&self, port: u16) -> redis::Client {
        match &self.ca {
            None => redis::Client::open(self.url(port)).unwrap(),
            Some(ca) => redis::Client::build_with_tls(
                self.url(port),
                redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(ca.clone()),
                },
            )
            .unwrap(),
        }
    }

    /// Runs `cmd` on the node on `port`, each step bounded (a stopped node must not hang
    /// the test).
    pub async fn query<T: redis::FromRedisValue>(
        &self,
        port: u16,
        cmd: &redis::Cmd,
    ) -> redis::RedisResult<T> {
        let mut conn = super::faults::bounded_connection(&self.client(port)).await?;
        // Named, to tell the test's connections from the server's in CLIENT LIST.
        redis::cmd("CLIENT")
            .arg("SETNAME")
            .arg("seckill-test")
            .exec_async(&mut conn)
            .await?;
        cmd.query_async(&mut conn).await
    }

    /// Clients of the node on `port` that are neither the test's, nor sentinels, nor
    /// replicas (which all name themselves or are of another type): the server's.
    pub async fn unnamed_clients(&self, port: u16) -> Option<usize> {
        let list: String = self
            .query(
                port,
                redis::cmd("CLIENT").arg("LIST").arg("TYPE").arg("normal"),
            )
            .await
            .ok()?;
        Some(
            list.lines()
                .filter(|l| l.split(' ').any(|f| f == "name="))
                .count(),
        )
    }

    /// `ROLE`'s first word on the node on `port`: `master` or `slave`.
    pub async fn role(&self, port: u16) -> Option<String> {
        let role: redis::Value = self.query(port, &redis::cmd("ROLE")).await.ok()?;
        match role {
            redis::Value::Array(parts) => redis::from_redis_value_ref(parts.first()?).ok(),
            _ => None,
        }
    }

    /// Waits until the node on `port` says `ROLE` `role`.
    pub async fn wait_role(&self, port: u16, role: &str) {
        let began = Instant::now();
        while self.role(port).await.as_deref() != Some(role) {
            assert!(
                began.elapsed() < PATIENCE,
                "redis {port} not {role} within {PATIENCE:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The master's address as the sentinel on `port` names it.
    async fn named_master(&self, port: u16) -> Option<(String, u16)> {
        let cmd = redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg(MASTER)
            .clone();
        self.query::<Option<(String, u16)>>(port, &cmd)
            .await
            .ok()
            .flatten()
    }

    /// Kills the primary with SIGKILL: no shutdown, no last words to the replica.
    pub fn kill_primary(&mut self) {
        if let Some(mut primary) = self.primary.take() {
            let _ = primary.kill();
            let _ = primary.wait();
        }
    }

    /// Waits until every sentinel names the replica as master and the replica says
    /// `ROLE` master; how long that took.
    pub async fn wait_replica_promoted(&self) -> Duration {
        let began = Instant::now();
        let promoted =
            |addr: Option<(String, u16)>| addr.is_some_and(|(_, p)| p == self.replica_port);
        loop {
            let mut all = true;
            for &port in &self.sentinel_ports {
                all &= promoted(self.named_master(port).await);
            }
            if all && self.role(self.replica_port).await.as_deref() == Some("master") {
                return began.elapsed();
            }
            assert!(
                began.elapsed() < PATIENCE,
                "the sentinels did not promote the replica within {PATIENCE:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Makes `spare` a replica of the promoted replica, one the sentinels never promote
    /// (`replica-priority 0`): a loaded machine can stall the new master past
    /// down-after, and a second failover to the spare would leave the test watching a
    /// node that is no longer the master.
    pub async fn give_promoted_a_replica(&self, spare: &PrivateRedis) {
        spare.run_command::<()>(
            redis::cmd("CONFIG")
                .arg("SET")
                .arg("replica-priority")
                .arg("0"),
        );
        spare
            .replicate_from(([127, 0, 0, 1], self.replica_port).into())
            .await;
    }

    /// Cuts the replica's replication link: it falls behind the primary from now on.
    pub fn cut_replica_link(&self) {
        self.link.cut();
    }

    /// Lets the replica reconnect; waits until it has caught up.
    pub async fn heal_replica_link(&self) {
        self.link.heal();
        self.wait_replica_in_sync().await;
    }

    /// Waits until the replica's link to the primary is up and it has all the
    /// primary's writes (equal replication offsets).
    pub async fn wait_replica_in_sync(&self) {
        let info = |port| async move {
            let text: String = self
                .query(port, redis::cmd("INFO").arg("replication"))
                .await
                .unwrap_or_default();
            let field = |name: &str| {
                text.lines()
                    .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                    .map(|v| v.trim().to_string())
            };
            (field("master_link_status"), field("master_repl_offset"))
        };
        let began = Instant::now();
        loop {
            let (link, replica_offset) = info(self.replica_port).await;
            let (_, primary_offset) = info(self.primary_port).await;
            if link.as_deref() == Some("up")
                && replica_offset.is_some()
                && replica_offset == primary_offset
            {
                return;
            }
            assert!(
                began.elapsed() < PATIENCE,
                "the replica did not catch up within {PATIENCE:?} (link {link:?})"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until every sentinel knows the two others, names the primary, and sees the
    /// replica at its own port (not the proxy's): a failover then needs nothing more.
    async fn wait_sentinels_agree(&self) {
        let began = Instant::now();
        for &port in &self.sentinel_ports {
            loop {
                if self.sentinel_ready(port).await {
                    break;
                }
                assert!(
                    began.elapsed() < PATIENCE,
                    "sentinel {port} did not learn of its peers and the replica within {PATIENCE:?}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }

    async fn sentinel_ready(&self, port: u16) -> bool {
        let list = |what: &'static str| async move {
            let cmd = redis::cmd("SENTINEL").arg(what).arg(MASTER).clone();
            self.query::<Vec<std::collections::HashMap<String, String>>>(port, &cmd)
                .await
                .unwrap_or_default()
        };
        let peers = list("sentinels").await.len();
        let replica_ok = list("replicas").await.iter().any(|r| {
            r.get("port") == Some(&self.replica_port.to_string())
                && r.get("flags").is_some_and(|f| f == "slave")
        });
        let named = self.named_master(port).await;
        peers == 2 && replica_ok && named.is_some_and(|(_, p)| p == self.primary_port)
    }

    async fn wait_answers(&self, port: u16) {
        let began = Instant::now();
        while self
            .query::<String>(port, &redis::cmd("PING"))
            .await
            .is_err()
        {
            assert!(
                began.elapsed() < PATIENCE,
                "redis {port} did not start within {PATIENCE:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A data node on `port` (TLS only with `certs`, replicating over TLS too), without
/// persistence, in a directory of its own under `dir`.
fn redis_node(
    dir: &std::path::Path,
    name: &str,
    port: u16,
    certs: Option<&Certs>,
    extra: &[&str],
) -> Child {
    let own = dir.join(name);
    std::fs::create_dir_all(&own).unwrap();
    let mut cmd = Command::new("redis-server");
    cmd.args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]);
    match certs {
        Some(c) => {
            cmd.args(redis_tls_args(c, port));
            cmd.args(["--tls-replication", "yes"]);
        }
        None => {
            cmd.args(["--port", &port.to_string()]);
        }
    }
    cmd.args(extra)
        .arg("--dir")
        .arg(&own)
        .stdout(Stdio::null())
        .spawn()
        .expect("redis-server on PATH")
}

/// A sentinel on `port` monitoring the primary: down after a second without an answer,
/// quorum 2, a failover retried after 3 s if it stalls.
fn sentinel_process(
    dir: &std::path::Path,
    port: u16,
    primary: u16,
    certs: Option<&Certs>,
) -> Child {
    let own = dir.join(format!("sentinel-{port}"));
    std::fs::create_dir_all(&own).unwrap();
    let listen = match certs {
        None => format!("port {port}\n"),
        Some(c) => format!(
            "port 0\ntls-port {port}\ntls-replication yes\ntls-auth-clients no\n\
             tls-cert-file {}\ntls-key-file {}\ntls-ca-cert-file {}\n",
            c.server_cert.display(),
            c.server_key.display(),
            c.ca.display()
        ),
    };
    let conf = own.join("sentinel.conf");
    // A long failover-timeout: a sentinel "fixes" a replica replicating from another
    // address than the master's (ours goes through the cuttable proxy) once that long
    // has passed, which would route it around the proxy and leave it in a resync.
    std::fs::write(
        &conf,
        format!(
            "bind 127.0.0.1\n{listen}dir {dir}\n\
             sentinel monitor {MASTER} 127.0.0.1 {primary} 2\n\
             sentinel down-after-milliseconds {MASTER} 1000\n\
             sentinel failover-timeout {MASTER} 60000\n\
             sentinel parallel-syncs {MASTER} 1\n",
            dir = own.display()
        ),
    )
    .unwrap();
    Command::new("redis-server")
        .arg(&conf)
        .arg("--sentinel")
        .stdout(Stdio::null())
        .spawn()
        .expect("redis-server on PATH")
}

impl Drop for PrivateSentinel {
    fn drop(&mut self) {
        let children = self
            .primary
            .iter_mut()
            .chain(self.replica.iter_mut())
            .chain(self.sentinels.iter_mut());
        for child in children {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
