//! A real Redis Cluster of the test's own: `redis-server --cluster-enabled yes` nodes on
//! spare loopback ports, joined by `redis-cli --cluster create`; masters only, or each
//! master with a replica, whose nodes can be killed and started again to fail over.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long anything here may take on a loaded two-core machine before it is a failure.
const PATIENCE: Duration = Duration::from_secs(60);

pub struct PrivateCluster {
    /// Each node's process, in the order of `ports`; `None` while killed.
    nodes: Vec<Option<Child>>,
    pub ports: Vec<u16>,
    /// Each node's command line, to start it again as it was.
    args: Vec<Vec<String>>,
    dir: PathBuf,
    /// The CA that signed the nodes' certificates when they speak TLS only.
    tls_ca: Option<PathBuf>,
}

/// Node and bus ports handed out in this test process (tests start clusters at once).
static HANDED_OUT: std::sync::Mutex<std::collections::BTreeSet<u16>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

/// A port for a node and one for its cluster bus (`--cluster-port`), free and never
/// handed out before here. Both lie above Linux's ephemeral range (32768-60999 by
/// default): a client's outgoing connection cannot take one between this look and the
/// node's bind, nor while a killed node waits to start again on it.
fn cluster_ports() -> (u16, u16) {
    let free = |p: u16| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok();
    for _ in 0..10_000 {
        let port = 61_000 + rand::random::<u16>() % 1_000;
        let bus = port + 1_000;
        let mut taken = HANDED_OUT.lock().unwrap();
        if !taken.contains(&port) && !taken.contains(&bus) && free(port) && free(bus) {
            taken.extend([port, bus]);
            return (port, bus);
        }
    }
    panic!("no free pair of ports in 61000-62999");
}

/// One line of `CLUSTER NODES`: a node as the node asked sees it.
#[derive(Debug, Clone)]
struct NodeLine {
    id: String,
    port: u16,
    flags: Vec<String>,
    /// The id of its master, for a replica.
    master: Option<String>,
    /// The slot ranges it serves, for a master.
    slots: Vec<(u16, u16)>,
}

impl NodeLine {
    fn is_master(&self) -> bool {
        self.flags.iter().any(|f| f == "master")
    }

    /// Failing, or not yet (or no longer) known for sure.
    fn unsettled(&self) -> bool {
        self.flags
            .iter()
            .any(|f| matches!(f.as_str(), "fail" | "fail?" | "handshake" | "noaddr"))
    }
}

fn parse_nodes(text: &str) -> Vec<NodeLine> {
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() < 8 {
                return None;
            }
            // `ip:port@busport[,hostname]`
            let port = fields[1]
                .split('@')
                .next()?
                .rsplit(':')
                .next()?
                .parse()
                .ok()?;
            let slots = fields[8..]
                .iter()
                .filter(|s| !s.starts_with('['))
                .filter_map(|s| match s.split_once('-') {
                    Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                    None => s.parse().ok().map(|n| (n, n)),
                })
                .collect();
            Some(NodeLine {
                id: fields[0].to_string(),
                port,
                flags: fields[2].split(',').map(str::to_string).collect(),
                master: (fields[3] != "-").then(|| fields[3].to_string()),
                slots,
            })
        })
        .collect()
}

/// A field of an `INFO` reply.
fn info_field(text: &str, name: &str) -> Option<String> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .map(|v| v.trim().to_string())
}

impl PrivateCluster {
    pub fn start(masters: usize) -> Self {
        Self::start_with(masters, 0, None)
    }

    /// Nodes that speak TLS only, to clients and to each other (`--tls-cluster yes`).
    pub fn start_tls(masters: usize, certs: &super::tls::Certs) -> Self {
        Self::start_with(masters, 0, Some(certs))
    }

    /// `masters` masters, each with one replica, failing over within seconds: a master
    /// unreachable for 2 s is failed, and its replica promoted, by the other masters.
    pub fn start_with_replicas(masters: usize) -> Self {
        Self::start_with(masters, 1, None)
    }

    fn start_with(masters: usize, replicas: usize, tls: Option<&super::tls::Certs>) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "seckill-cluster-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let node_timeout = if replicas > 0 { "2000" } else { "5000" };
        let mut cluster = Self {
            nodes: Vec::new(),
            ports: Vec::new(),
            args: Vec::new(),
            dir,
            tls_ca: tls.map(|c| c.ca.clone()),
        };
        for _ in 0..masters * (1 + replicas) {
            let (port, bus) = cluster_ports();
            let node_dir = cluster.dir.join(port.to_string());
            std::fs::create_dir_all(&node_dir).unwrap();
            let mut args: Vec<String> = vec!["--bind".into(), "127.0.0.1".into()];
            match tls {
                None => args.extend(["--port".into(), port.to_string()]),
                Some(certs) => {
                    args.extend(super::tls::redis_tls_args(certs, port));
                    args.extend(["--tls-cluster".into(), "yes".into()]);
                    args.extend(["--tls-replication".into(), "yes".into()]);
                }
            }
            for (k, v) in [
                ("--cluster-enabled", "yes"),
                ("--cluster-config-file", "nodes.conf"),
                ("--cluster-port", &bus.to_string()),
                ("--cluster-node-timeout", node_timeout),
                ("--save", ""),
                ("--appendonly", "no"),
                // A node that rejoins as a replica is synced at once, not after the 5 s
                // Redis waits by default for more replicas to share the transfer.
                ("--repl-diskless-sync-delay", "0"),
                ("--dir", &node_dir.display().to_string()),
            ] {
                args.extend([k.to_string(), v.to_string()]);
            }
            cluster.nodes.push(Some(spawn_node(&args)));
            cluster.args.push(args);
            cluster.ports.push(port);
        }
        for &port in &cluster.ports {
            cluster.wait_for(port, |c| redis::cmd("PING").query::<String>(c).is_ok());
        }
        let addrs: Vec<String> = cluster
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        let mut create = Command::new("redis-cli");
        if let Some(ca) = &cluster.tls_ca {
            create.arg("--tls").arg("--cacert").arg(ca);
        }
        let out = create
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .expect("redis-cli on PATH");
        assert!(
            out.status.success(),
            "cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let nodes = cluster.ports.len();
        for &port in &cluster.ports {
            // Every node knows every other, the slots are served, and a replica holds
            // its master's data (a grab waiting for a replica could not succeed before).
            cluster.wait_for(port, |c| {
                let ok = redis::cmd("CLUSTER")
                    .arg("INFO")
                    .query::<String>(c)
                    .is_ok_and(|info| info.contains("cluster_state:ok"));
                let known = redis::cmd("CLUSTER")
                    .arg("NODES")
                    .query::<String>(c)
                    .is_ok_and(|text| {
                        let seen = parse_nodes(&text);
                        seen.len() == nodes && !seen.iter().any(NodeLine::unsettled)
                    });
                let synced = redis::cmd("INFO")
                    .arg("replication")
                    .query::<String>(c)
                    .is_ok_and(|info| {
                        info_field(&info, "role").as_deref() == Some("master")
                            || info_field(&info, "master_link_status").as_deref() == Some("up")
                    });
                ok && known && synced
            });
        }
        cluster
    }

    fn wait_for(&self, port: u16, ready: impl Fn(&mut redis::Connection) -> bool) {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let ok = self
                .client(port)
                .get_connection_with_timeout(Duration::from_secs(5))
                .is_ok_and(|mut c| {
                    let _ = c.set_read_timeout(Some(Duration::from_secs(5)));
                    ready(&mut c)
                });
            if ok {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "redis node {port} not ready:\n{}",
                self.describe(port)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// What a node says of the cluster and of its replication, for a failure's message.
    fn describe(&self, port: u16) -> String {
        let Ok(mut c) = self
            .client(port)
            .get_connection_with_timeout(Duration::from_secs(5))
        else {
            return "(no connection)".into();
        };
        let _ = c.set_read_timeout(Some(Duration::from_secs(5)));
        ["CLUSTER INFO", "CLUSTER NODES", "INFO replication"]
            .iter()
            .map(|line| {
                let mut cmd = redis::Cmd::new();
                line.split(' ').for_each(|w| {
                    cmd.arg(w);
                });
                let answer = cmd
                    .query::<String>(&mut c)
                    .unwrap_or_else(|e| e.to_string());
                format!("{line}:\n{answer}")
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// `REDIS_CLUSTER_URLS`.
    pub fn urls(&self) -> String {
        self.ports
            .iter()
            .map(|p| self.url(*p))
            .collect::<Vec<_>>()
            .join(",")
    }

    fn url(&self, port: u16) -> String {
        let scheme = if self.tls_ca.is_some() {
            "rediss"
        } else {
            "redis"
        };
        format!("{scheme}://127.0.0.1:{port}")
    }

    /// A client of one node (trusting the test's CA when the nodes speak TLS).
    fn client(&self, port: u16) -> redis::Client {
        match &self.tls_ca {
            None => redis::Client::open(self.url(port)).unwrap(),
            Some(ca) => redis::Client::build_with_tls(
                self.url(port),
                redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(std::fs::read(ca).unwrap()),
                },
            )
            .unwrap(),
        }
    }

    /// Runs `cmd` on the node on `port`, each step bounded (a killed or stalled node
    /// must not hang the test, nor block its runtime).
    pub async fn query<T: redis::FromRedisValue>(
        &self,
        port: u16,
        cmd: &redis::Cmd,
    ) -> redis::RedisResult<T> {
        let mut conn = super::faults::bounded_connection(&self.client(port)).await?;
        cmd.query_async(&mut conn).await
    }

    /// The keys matching `pattern` that each node holds.
    pub fn keys_per_node(&self, pattern: &str) -> Vec<usize> {
        self.ports
            .iter()
            .map(|p| {
                let mut c = self.client(*p).get_connection().unwrap();
                redis::cmd("KEYS")
                    .arg(pattern)
                    .query::<Vec<String>>(&mut c)
                    .unwrap()
                    .len()
            })
            .collect()
    }

    /// A node that runs, to ask about the cluster.
    fn live_port(&self) -> u16 {
        let i = self.nodes.iter().position(Option::is_some).unwrap();
        self.ports[i]
    }

    /// The cluster's nodes as the node on `port` sees them.
    async fn nodes_seen_by(&self, port: u16) -> Option<Vec<NodeLine>> {
        let text: String = self
            .query(port, redis::cmd("CLUSTER").arg("NODES"))
            .await
            .ok()?;
        Some(parse_nodes(&text))
    }

    /// The port of the master serving `key`'s slot.
    pub async fn master_of(&self, key: &str) -> u16 {
        let port = self.live_port();
        let slot: u16 = self
            .query(port, redis::cmd("CLUSTER").arg("KEYSLOT").arg(key))
            .await
            .unwrap();
        let nodes = self.nodes_seen_by(port).await.unwrap();
        nodes
            .iter()
            .find(|n| {
                n.is_master()
                    && !n.unsettled()
                    && n.slots.iter().any(|&(a, b)| (a..=b).contains(&slot))
            })
            .unwrap_or_else(|| panic!("no master serves slot {slot}: {nodes:?}"))
            .port
    }

    /// The port of the replica of the master on `master`.
    pub async fn replica_of(&self, master: u16) -> u16 {
        let nodes = self.nodes_seen_by(master).await.unwrap();
        let id = &nodes.iter().find(|n| n.port == master).unwrap().id;
        nodes
            .iter()
            .find(|n| n.master.as_ref() == Some(id))
            .unwrap_or_else(|| panic!("master {master} has no replica: {nodes:?}"))
            .port
    }

    /// Kills the node on `port` with SIGKILL: no last words to its replica or peers.
    pub fn kill(&mut self, port: u16) {
        let i = self.index(port);
        if let Some(mut node) = self.nodes[i].take() {
            let _ = node.kill();
            let _ = node.wait();
        }
    }

    /// Starts the killed node on `port` again, on its port and directory: its
    /// `nodes.conf` makes it rejoin the cluster (as a replica, if its master was failed
    /// over meanwhile). Waits until it answers.
    pub async fn restart(&mut self, port: u16) {
        let i = self.index(port);
        assert!(self.nodes[i].is_none(), "node {port} is running");
        self.nodes[i] = Some(spawn_node(&self.args[i]));
        let began = Instant::now();
        while self
            .query::<String>(port, &redis::cmd("PING"))
            .await
            .is_err()
        {
            assert!(
                began.elapsed() < PATIENCE,
                "redis node {port} did not start again within {PATIENCE:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until the node on `replica` says it is a master and every running node says
    /// `cluster_state:ok` (knows the promotion: all slots served); how long it took.
    pub async fn wait_promoted(&self, replica: u16) -> Duration {
        let began = Instant::now();
        loop {
            let role: Option<String> = self
                .query::<String>(replica, redis::cmd("INFO").arg("replication"))
                .await
                .ok()
                .and_then(|info| info_field(&info, "role"));
            if role.as_deref() == Some("master") && self.all_ok().await {
                return began.elapsed();
            }
            assert!(
                began.elapsed() < PATIENCE,
                "replica {replica} not promoted within {PATIENCE:?} (role {role:?})"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until the node on `port` replicates the master on `master` with its link up
    /// (holding the master's data), and every running node says `cluster_state:ok`.
    pub async fn wait_replicating(&self, port: u16, master: u16) -> Duration {
        let began = Instant::now();
        loop {
            let info = self
                .query::<String>(port, redis::cmd("INFO").arg("replication"))
                .await
                .unwrap_or_default();
            let replicating = info_field(&info, "role").as_deref() == Some("slave")
                && info_field(&info, "master_port") == Some(master.to_string())
                && info_field(&info, "master_link_status").as_deref() == Some("up");
            if replicating && self.all_ok().await {
                return began.elapsed();
            }
            assert!(
                began.elapsed() < PATIENCE,
                "node {port} not replicating {master} within {PATIENCE:?}:\n{info}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Whether every running node says `cluster_state:ok`.
    async fn all_ok(&self) -> bool {
        for (i, &port) in self.ports.iter().enumerate() {
            if self.nodes[i].is_none() {
                continue;
            }
            let ok = self
                .query::<String>(port, redis::cmd("CLUSTER").arg("INFO"))
                .await
                .is_ok_and(|info| info.contains("cluster_state:ok"));
            if !ok {
                return false;
            }
        }
        true
    }

    fn index(&self, port: u16) -> usize {
        self.ports
            .iter()
            .position(|&p| p == port)
            .unwrap_or_else(|| panic!("no node on {port}"))
    }
}

fn spawn_node(args: &[String]) -> Child {
    Command::new("redis-server")
        .args(args)
        .stdout(Stdio::null())
        .spawn()
        .expect("redis-server on PATH")
}

impl Drop for PrivateCluster {
    fn drop(&mut self) {
        for node in self.nodes.iter_mut().flatten() {
            let _ = node.kill();
            let _ = node.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
