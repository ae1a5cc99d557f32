//! The Redis deployment of a campaign: three nodes (a primary, two replicas) and three
//! sentinels (quorum 2, down after 1 s), each node behind an owner-aware proxy. Nodes
//! announce their proxy's address (`replica-announce-*`) and the sentinels monitor the
//! primary's proxy, so replication, Sentinel's own links and the service's discovery
//! all pass through the proxies and can be cut link by link.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::FromRedisValue;
use tokio::time::Instant;

use super::proxy::{Links, OwnedProxy, Owner, Target};

mod steering;

/// The name the sentinels know the primary by (`REDIS_SENTINEL_MASTER`).
pub const MASTER: &str = "nemesis";

static HANDED_OUT: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());

/// A free loopback port never handed out before in this process, in 64000-65499:
/// above Linux's ephemeral range (32768-60999), so no client's outgoing connection
/// takes it while a killed server waits to start again on it, and clear of the
/// clusters' 61000-62999.
pub fn port() -> u16 {
    let free = |p: u16| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok();
    for _ in 0..10_000 {
        let p = 64_000 + rand::random::<u16>() % 1_500;
        let mut taken = HANDED_OUT.lock().unwrap();
        if !taken.contains(&p) && free(p) {
            taken.insert(p);
            return p;
        }
    }
    panic!("no free port in 64000-65499");
}

/// One command to the server on `port`, directly (not through its proxy), every step
/// bounded: a stopped or killed server must never hang the harness.
pub async fn query<T: FromRedisValue>(port: u16, cmd: &redis::Cmd) -> Result<T, String> {
    let attempt = async {
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}"))?;
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(2)))
            .set_response_timeout(Some(Duration::from_secs(2)));
        let mut conn = client
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        cmd.query_async::<T>(&mut conn).await
    };
    match tokio::time::timeout(Duration::from_secs(3), attempt).await {
        Ok(result) => result.map_err(|e| e.to_string()),
        Err(_) => Err(format!("redis {port}: no answer within 3 s")),
    }
}

/// A child process slot: the process, if running, and how many times it was started.
#[derive(Default)]
pub struct Slot {
    child: Mutex<Option<Child>>,
}

impl Slot {
    pub fn pid(&self) -> Option<u32> {
        self.child.lock().unwrap().as_ref().map(Child::id)
    }

    pub fn is_running(&self) -> bool {
        self.child.lock().unwrap().is_some()
    }

    pub fn set(&self, child: Child) {
        *self.child.lock().unwrap() = Some(child);
    }

    /// SIGKILL and reap; the pid it had.
    pub fn kill9(&self) -> Option<u32> {
        let mut child = self.child.lock().unwrap().take()?;
        let _ = child.kill();
        let _ = child.wait();
        Some(child.id())
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Sends `signal` (`STOP`, `CONT`) to `pid`.
pub fn signal(pid: u32, signal: &str) -> bool {
    Command::new("kill")
        .args([format!("-{signal}"), pid.to_string()])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

pub struct Node {
    pub index: u8,
    pub port: u16,
    pub proxy: OwnedProxy,
    dir: PathBuf,
    pub slot: Slot,
}

impl Node {
    /// Starts the server, a replica of the node behind `replicaof` (a proxy port) if
    /// given; it loads `dump.rdb` if one lies in its directory.
    fn spawn(&self, replicaof: Option<u16>, links: &Links) {
        let mut cmd = Command::new("redis-server");
        cmd.args(["--bind", "127.0.0.1", "--port", &self.port.to_string()])
            .args([
                "--save",
                "",
                "--appendonly",
                "no",
                "--dbfilename",
                "dump.rdb",
            ])
            .args(["--replica-announce-ip", "127.0.0.1"])
            .args(["--replica-announce-port", &self.proxy.port.to_string()])
            .arg("--dir")
            .arg(&self.dir)
            .arg("--logfile")
            .arg(self.dir.join("redis.log"))
            .stdout(Stdio::null());
        if let Some(upstream) = replicaof {
            cmd.args(["--replicaof", "127.0.0.1", &upstream.to_string()]);
        }
        let child = cmd.spawn().expect("redis-server on PATH");
        links.register(child.id(), Owner::Node(self.index));
        self.slot.set(child);
    }

    fn snapshot(&self) -> PathBuf {
        self.dir.join("snapshot.rdb")
    }
}

pub struct Sentinel {
    pub index: u8,
    pub port: u16,
    conf: PathBuf,
    pub slot: Slot,
}

impl Sentinel {
    /// Starts it from its configuration file, which it rewrites as it learns (so a
    /// restarted sentinel knows the current primary, its replicas and its peers).
    fn spawn(&self, links: &Links) {
        let child = Command::new("redis-server")
            .arg(&self.conf)
            .arg("--sentinel")
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server on PATH");
        links.register(child.id(), Owner::Sentinel(self.index));
        self.slot.set(child);
    }
}

pub struct Redis {
    pub nodes: Vec<Node>,
    pub sentinels: Vec<Sentinel>,
    links: Arc<Links>,
}

/// How long a step of the deployment may take on a loaded two-core machine.
const PATIENCE: Duration = Duration::from_secs(60);

impl Redis {
    pub async fn start(dir: &Path, links: Arc<Links>) -> Self {
        let mut nodes = Vec::new();
        for index in 0..3u8 {
            let (port, proxy_port) = (port(), port());
            let server = ([127, 0, 0, 1], port).into();
            let proxy =
                OwnedProxy::start(links.clone(), proxy_port, Target::Node(index), server).await;
            let dir = dir.join(format!("redis-{index}"));
            std::fs::create_dir_all(&dir).unwrap();
            nodes.push(Node {
                index,
                port,
                proxy,
                dir,
                slot: Slot::default(),
            });
        }
        let primary_proxy = nodes[0].proxy.port;
        let mut redis = Self {
            nodes,
            sentinels: Vec::new(),
            links,
        };
        for node in &redis.nodes {
            node.spawn((node.index > 0).then_some(primary_proxy), &redis.links);
            wait_answers(node.port).await;
        }
        for index in 0..3u8 {
            redis.sentinels.push(sentinel(dir, index, primary_proxy));
        }
        for s in &redis.sentinels {
            s.spawn(&redis.links);
            wait_answers(s.port).await;
        }
        redis.wait_sentinels_agree().await;
        redis
    }

    /// `REDIS_SENTINEL_URLS`: the sentinels' own ports (the service asks them directly).
    pub fn sentinel_urls(&self) -> String {
        let urls: Vec<String> = self
            .sentinels
            .iter()
            .map(|s| format!("redis://127.0.0.1:{}", s.port))
            .collect();
        urls.join(",")
    }

    fn by_proxy(&self, proxy_port: u16) -> Option<u8> {
        self.nodes
            .iter()
            .find(|n| n.proxy.port == proxy_port)
            .map(|n| n.index)
    }

    /// The node each answering sentinel names as the primary.
    pub async fn named(&self) -> Vec<u8> {
        let cmd = redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg(MASTER)
            .clone();
        let asks = self
            .sentinels
            .iter()
            .map(|s| query::<Option<(String, u16)>>(s.port, &cmd));
        futures::future::join_all(asks)
            .await
            .into_iter()
            .filter_map(|a| a.ok().flatten())
            .filter_map(|(_, port)| self.by_proxy(port))
            .collect()
    }

    /// The primary most sentinels name (of those that answer).
    pub async fn master(&self) -> Option<u8> {
        let named = self.named().await;
        (0..3u8)
            .max_by_key(|i| named.iter().filter(|n| *n == i).count())
            .filter(|i| named.contains(i))
    }

    /// The nodes other than the primary, in port order.
    pub async fn replicas(&self) -> Vec<u8> {
        let master = self.master().await;
        let mut others: Vec<&Node> = self
            .nodes
            .iter()
            .filter(|n| Some(n.index) != master)
            .collect();
        others.sort_by_key(|n| n.port);
        others.into_iter().map(|n| n.index).collect()
    }

    /// Kills node `i` with SIGKILL; its pid.
    pub fn kill_node(&self, i: u8) -> Option<u32> {
        let pid = self.nodes[i as usize].slot.kill9()?;
        self.links.forget(pid);
        Some(pid)
    }

    /// Starts node `i` again, empty, as a replica of `upstream`'s proxy (never as an
    /// empty primary: its replicas would copy the emptiness).
    pub async fn restart_replica(&self, i: u8, upstream: u8) {
        let node = &self.nodes[i as usize];
        let _ = std::fs::remove_file(node.dir.join("dump.rdb"));
        node.spawn(Some(self.nodes[upstream as usize].proxy.port), &self.links);
        wait_answers(node.port).await;
    }

    /// Starts node `i` again, never empty as a primary (its replicas would copy the
    /// emptiness): as a replica of the primary the sentinels name; or, while they still
    /// name `i` itself (Sentinel could promote no one: sentinels in TILT after a pause,
    /// no replica good enough), as the primary with a copy of the most advanced other
    /// node's data, as an operator would bring it back. How, for the log.
    pub async fn bring_back(&self, i: u8) -> String {
        if let Some(m) = self.master().await.filter(|m| *m != i) {
            self.restart_replica(i, m).await;
            return format!("as a replica of redis {m}");
        }
        let Some(source) = self.most_advanced(i).await else {
            self.restart_replica(i, (i + 1) % 3).await;
            return format!(
                "as a replica of redis {}: no other node answers",
                (i + 1) % 3
            );
        };
        match self.restart_from_copy(i, source).await {
            Ok(()) => format!("as the primary, from a copy of redis {source}'s data (the sentinels promoted no one)"),
            Err(e) => {
                self.restart_replica(i, source).await;
                format!("as a replica of redis {source} (a copy of its data failed: {e})")
            }
        }
    }

    /// The running node other than `except` that has processed the most of the
    /// replication stream.
    async fn most_advanced(&self, except: u8) -> Option<u8> {
        let mut best: Option<(u64, u8)> = None;
        for n in self
            .nodes
            .iter()
            .filter(|n| n.index != except && n.slot.is_running())
        {
            let info: String = query(n.port, redis::cmd("INFO").arg("replication"))
                .await
                .unwrap_or_default();
            let offset = info
                .lines()
                .find_map(|l| l.strip_prefix("master_repl_offset:"))
                .and_then(|v| v.trim().parse::<u64>().ok());
            if let Some(offset) = offset.filter(|o| best.is_none_or(|(b, _)| *o > b)) {
                best = Some((offset, n.index));
            }
        }
        best.map(|(_, i)| i)
    }

    /// `SAVE` on node `source`, its snapshot copied to node `i`, which starts from it as
    /// a primary.
    async fn restart_from_copy(&self, i: u8, source: u8) -> Result<(), String> {
        let (node, from) = (&self.nodes[i as usize], &self.nodes[source as usize]);
        query::<()>(from.port, &redis::cmd("SAVE")).await?;
        let dump = from.dir.join("dump.rdb");
        std::fs::copy(&dump, node.dir.join("dump.rdb")).map_err(|e| e.to_string())?;
        let _ = std::fs::remove_file(dump);
        node.spawn(None, &self.links);
        wait_answers(node.port).await;
        Ok(())
    }

    /// Waits until the sentinels name a primary other than `i`; which, if any in time.
    pub async fn wait_master_other_than(&self, i: u8, limit: Duration) -> Option<u8> {
        let began = Instant::now();
        while began.elapsed() < limit {
            if let Some(m) = self.master().await.filter(|m| *m != i) {
                return Some(m);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        None
    }

    /// `SAVE` on node `i`, kept aside as its snapshot.
    pub async fn save_snapshot(&self, i: u8) -> Result<(), String> {
        let node = &self.nodes[i as usize];
        query::<()>(node.port, &redis::cmd("SAVE")).await?;
        std::fs::rename(node.dir.join("dump.rdb"), node.snapshot()).map_err(|e| e.to_string())
    }

    /// Kills node `i` and starts it at once, as a primary, from its snapshot.
    pub async fn restart_from_snapshot(&self, i: u8) -> Result<(), String> {
        let node = &self.nodes[i as usize];
        if !node.snapshot().exists() {
            return Err("no snapshot".into());
        }
        self.kill_node(i);
        std::fs::copy(node.snapshot(), node.dir.join("dump.rdb")).map_err(|e| e.to_string())?;
        node.spawn(None, &self.links);
        wait_answers(node.port).await;
        Ok(())
    }

    /// Waits until every sentinel knows its two peers and both replicas and names node
    /// 0: a failover then needs nothing more.
    async fn wait_sentinels_agree(&self) {
        let began = Instant::now();
        for s in &self.sentinels {
            loop {
                let list = |what: &'static str| {
                    let cmd = redis::cmd("SENTINEL").arg(what).arg(MASTER).clone();
                    async move {
                        query::<Vec<std::collections::HashMap<String, String>>>(s.port, &cmd)
                            .await
                            .unwrap_or_default()
                    }
                };
                let (peers, replicas) =
                    (list("sentinels").await.len(), list("replicas").await.len());
                if peers == 2 && replicas == 2 && self.master().await == Some(0) {
                    break;
                }
                assert!(
                    began.elapsed() < PATIENCE,
                    "sentinel {} did not learn its peers ({peers}) and replicas ({replicas})",
                    s.index
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Sentinel `index`'s directory and configuration, monitoring the primary's proxy.
fn sentinel(dir: &Path, index: u8, primary_proxy: u16) -> Sentinel {
    let own = dir.join(format!("sentinel-{index}"));
    std::fs::create_dir_all(&own).unwrap();
    let port = port();
    let conf = own.join("sentinel.conf");
    // failover-timeout 4 s: Sentinel starts no new failover of a primary within twice
    // that of the last one, and faults come every few seconds.
    std::fs::write(
        &conf,
        format!(
            "bind 127.0.0.1\nport {port}\ndir {dir}\nlogfile {dir}/sentinel.log\n\
             sentinel monitor {MASTER} 127.0.0.1 {primary_proxy} 2\n\
             sentinel down-after-milliseconds {MASTER} 1000\n\
             sentinel failover-timeout {MASTER} 4000\n\
             sentinel parallel-syncs {MASTER} 1\n",
            dir = own.display()
        ),
    )
    .unwrap();
    Sentinel {
        index,
        port,
        conf,
        slot: Slot::default(),
    }
}

impl Redis {
    /// Starts sentinel `i` again from its configuration.
    pub async fn restart_sentinel(&self, i: u8) {
        let s = &self.sentinels[i as usize];
        s.spawn(&self.links);
        wait_answers(s.port).await;
    }

    pub fn kill_sentinel(&self, i: u8) -> Option<u32> {
        let pid = self.sentinels[i as usize].slot.kill9()?;
        self.links.forget(pid);
        Some(pid)
    }
}

/// Waits (bounded) until the server on `port` answers PING.
pub async fn wait_answers(port: u16) {
    let began = Instant::now();
    while query::<String>(port, &redis::cmd("PING")).await.is_err() {
        if began.elapsed() > Duration::from_secs(20) {
            eprintln!("redis {port} did not answer within 20 s");
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
