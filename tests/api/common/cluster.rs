//! A real Redis Cluster of the test's own: `redis-server --cluster-enabled yes` nodes on
//! spare loopback ports, joined by `redis-cli --cluster create`.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct PrivateCluster {
    nodes: Vec<Child>,
    pub ports: Vec<u16>,
    dir: std::path::PathBuf,
    /// The CA that signed the nodes' certificates when they speak TLS only.
    tls_ca: Option<std::path::PathBuf>,
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
        Self::start_with(masters, None)
    }

    /// Nodes that speak TLS only, to clients and to each other (`--tls-cluster yes`).
    pub fn start_tls(masters: usize, certs: &super::tls::Certs) -> Self {
        Self::start_with(masters, Some(certs))
    }

    fn start_with(masters: usize, tls: Option<&super::tls::Certs>) -> Self {
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
                    .args(["--bind", "127.0.0.1"])
                    .args(match tls {
                        None => vec!["--port".to_string(), port.to_string()],
                        Some(certs) => {
                            let mut args = super::tls::redis_tls_args(certs, port);
                            args.extend(["--tls-cluster".into(), "yes".into()]);
                            args
                        }
                    })
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
        let cluster = Self {
            nodes,
            ports,
            dir,
            tls_ca: tls.map(|c| c.ca.clone()),
        };
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
            let ok = self
                .client(port)
                .get_connection()
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
