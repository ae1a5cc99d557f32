//! A real Redis Cluster of the test's own: `redis-server --cluster-enabled yes` nodes on
//! spare loopback ports, joined by `redis-cli --cluster create`.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct PrivateCluster {
    nodes: Vec<Child>,
    pub ports: Vec<u16>,
    dir: std::path::PathBuf,
}

/// A port free both for clients and for the cluster bus (port + 10000).
fn cluster_port() -> u16 {
    loop {
        let port = 20_000 + (rand::random::<u16>() % 20_000);
        let free = |p: u16| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok();
        if free(port) && free(port + 10_000) {
            return port;
        }
    }
}

impl PrivateCluster {
    pub fn start(masters: usize) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "seckill-cluster-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let mut ports = Vec::new();
        let mut nodes = Vec::new();
        for _ in 0..masters {
            let port = cluster_port();
            let node_dir = dir.join(port.to_string());
            std::fs::create_dir_all(&node_dir).unwrap();
            nodes.push(
                Command::new("redis-server")
                    .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
                    .args([
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                    ])
                    .args(["--cluster-node-timeout", "5000"])
                    .args(["--save", "", "--appendonly", "no"])
                    .arg("--dir")
                    .arg(&node_dir)
                    .stdout(Stdio::null())
                    .spawn()
                    .expect("redis-server on PATH"),
            );
            ports.push(port);
        }
        let cluster = Self { nodes, ports, dir };
        for &port in &cluster.ports {
            cluster.wait_for(port, |c| redis::cmd("PING").query::<String>(c).is_ok());
        }
        let addrs: Vec<String> = cluster
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .expect("redis-cli on PATH");
        assert!(
            out.status.success(),
            "cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        for &port in &cluster.ports {
            cluster.wait_for(port, |c| {
                redis::cmd("CLUSTER")
                    .arg("INFO")
                    .query::<String>(c)
                    .is_ok_and(|info| info.contains("cluster_state:ok"))
            });
        }
        cluster
    }

    fn wait_for(&self, port: u16, ready: impl Fn(&mut redis::Connection) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ok = redis::Client::open(format!("redis://127.0.0.1:{port}"))
                .and_then(|c| c.get_connection())
                .is_ok_and(|mut c| ready(&mut c));
            if ok {
                return;
            }
            assert!(Instant::now() < deadline, "redis node {port} not ready");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `REDIS_CLUSTER_URLS`.
    pub fn urls(&self) -> String {
        self.ports
            .iter()
            .map(|p| format!("redis://127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The keys matching `pattern` that each node holds.
    pub fn keys_per_node(&self, pattern: &str) -> Vec<usize> {
        self.ports
            .iter()
            .map(|p| {
                let mut c = redis::Client::open(format!("redis://127.0.0.1:{p}"))
                    .unwrap()
                    .get_connection()
                    .unwrap();
                redis::cmd("KEYS")
                    .arg(pattern)
                    .query::<Vec<String>>(&mut c)
                    .unwrap()
                    .len()
            })
            .collect()
    }
}

impl Drop for PrivateCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            let _ = node.kill();
            let _ = node.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
