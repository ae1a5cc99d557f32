//! Real faults for tests: a TCP proxy that can be cut, a private Redis server that can
//! be flushed, and the real binary that can be killed.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;

/// A loopback TCP proxy in front of a server. `cut` drops every connection and refuses
/// new ones until `heal`: to a client it is the server going away. `freeze` keeps every
/// connection open but drops what passes either way: a silent partition, which the
/// client does not notice.
pub struct Proxy {
    pub addr: SocketAddr,
    up: Arc<AtomicBool>,
    frozen: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<AbortHandle>>>,
    accept: AbortHandle,
}

impl Proxy {
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let up = Arc::new(AtomicBool::new(true));
        let frozen = Arc::new(AtomicBool::new(false));
        let conns: Arc<Mutex<Vec<AbortHandle>>> = Arc::default();
        let (up2, conns2, frozen2) = (up.clone(), conns.clone(), frozen.clone());
        let accept = tokio::spawn(async move {
            loop {
                let Ok((inbound, _)) = listener.accept().await else {
                    continue;
                };
                if !up2.load(Ordering::SeqCst) {
                    drop(inbound);
                    continue;
                }
                let frozen = frozen2.clone();
                let task = tokio::spawn(async move {
                    if let Ok(outbound) = TcpStream::connect(target).await {
                        let (from_client, to_client) = inbound.into_split();
                        let (from_server, to_server) = outbound.into_split();
                        tokio::select! {
                            _ = pass(from_client, to_server, frozen.clone()) => {}
                            _ = pass(from_server, to_client, frozen) => {}
                        }
                    }
                });
                conns2.lock().unwrap().push(task.abort_handle());
            }
        })
        .abort_handle();
        Self {
            addr,
            up,
            frozen,
            conns,
            accept,
        }
    }

    /// Drops every byte either way from now on, connections left open.
    pub fn freeze(&self) {
        self.frozen.store(true, Ordering::SeqCst);
    }

    pub fn cut(&self) {
        self.up.store(false, Ordering::SeqCst);
        for c in self.conns.lock().unwrap().drain(..) {
            c.abort();
        }
    }

    pub fn heal(&self) {
        self.up.store(true, Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

/// Copies one direction of a proxied connection until either side closes, dropping
/// the bytes while `frozen`.
async fn pass(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    frozen: Arc<AtomicBool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if !frozen.load(Ordering::SeqCst) && to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// A connection to one node, each step bounded by 5 s (a killed or stalled node must not
/// hang the test, nor block its runtime).
pub async fn bounded_connection(
    client: &redis::Client,
) -> redis::RedisResult<redis::aio::MultiplexedConnection> {
    let config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(5)))
        .set_response_timeout(Some(Duration::from_secs(5)));
    client
        .get_multiplexed_async_connection_with_config(&config)
        .await
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A Redis server of the test's own (so FLUSHALL hurts nobody else), without persistence
/// unless asked for (`save`, or `with_aof`): it can be killed and started again on the
/// same port, loading what it persisted, as after a crash or a restart from an older copy.
pub struct PrivateRedis {
    child: Child,
    pub url: String,
    port: u16,
    dir: std::path::PathBuf,
    /// How it persists (`--appendonly ...`), again on a restart.
    persistence: Vec<String>,
}

impl PrivateRedis {
    /// Its process id (to stop it with SIGSTOP, say).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its address, for a proxy in front of it.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// Sends one command to it.
    pub fn run_command<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> T {
        self.command(cmd)
    }

    pub fn start() -> Self {
        Self::start_persisting(&["--appendonly", "no"])
    }

    /// A server without persistence on `port` (one a process was told of before it
    /// listened: Redis down at that process's start), with settings of its own.
    pub fn start_on(port: u16, settings: &[&str]) -> Self {
        let settings: Vec<&str> = ["--appendonly", "no"]
            .into_iter()
            .chain(settings.iter().copied())
            .collect();
        Self::launch(port, &settings)
    }

    /// A server with an append-only file synced as `appendfsync` says (`everysec`,
    /// `always`).
    pub fn with_aof(appendfsync: &str) -> Self {
        Self::start_persisting(&["--appendonly", "yes", "--appendfsync", appendfsync])
    }

    fn start_persisting(persistence: &[&str]) -> Self {
        Self::launch(free_port(), persistence)
    }

    fn launch(port: u16, settings: &[&str]) -> Self {
        let dir = std::env::temp_dir().join(format!("seckill-redis-{port}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let url = format!("redis://127.0.0.1:{port}");
        let persistence: Vec<String> = settings.iter().map(|s| s.to_string()).collect();
        let child = Self::run(port, &dir, &url, &persistence);
        Self {
            child,
            url,
            port,
            dir,
            persistence,
        }
    }

    /// Makes it a replica of the server at `master` and waits until it is in sync.
    pub async fn replicate_from(&self, master: SocketAddr) {
        self.run_command::<()>(
            redis::cmd("REPLICAOF")
                .arg(master.ip().to_string())
                .arg(master.port()),
        );
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let info: String = self.run_command(redis::cmd("INFO").arg("replication"));
            if info.contains("master_link_status:up") {
                return;
            }
            assert!(Instant::now() < deadline, "replica never synced:\n{info}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn run(port: u16, dir: &std::path::Path, url: &str, persistence: &[String]) -> Child {
        let mut child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
            .args(["--save", ""])
            .args(persistence)
            .arg("--dir")
            .arg(dir)
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server on PATH");
        if !answers_within(url, Duration::from_secs(10)) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("private redis did not start");
        }
        child
    }

    /// One command on a fresh connection (it works across a restart).
    pub fn command<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> T {
        self.try_command(cmd).unwrap()
    }

    /// One command on a fresh connection, its error returned.
    pub fn try_command<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> redis::RedisResult<T> {
        let mut conn = redis::Client::open(self.url.as_str())?.get_connection()?;
        cmd.query(&mut conn)
    }

    pub fn flushall(&self) {
        self.command::<()>(&redis::cmd("FLUSHALL"));
    }

    /// Writes a snapshot (`dump.rdb` in its directory) now.
    pub fn save(&self) {
        self.command::<()>(&redis::cmd("SAVE"));
    }

    /// Kills the server (SIGKILL) and starts it again on the same port: it loads what it
    /// persisted (its append-only file, else its last snapshot), losing every write
    /// since.
    pub fn crash_and_restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.child = Self::run(self.port, &self.dir, &self.url, &self.persistence);
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Whether the Redis at `url` answers PING within `limit`.
pub fn answers_within(url: &str, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        let ok = redis::Client::open(url)
            .and_then(|c| c.get_connection())
            .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
            .is_ok();
        if ok {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

pub const BIN: &str = env!("CARGO_BIN_EXE_seckill");

/// Where the test's Postgres listens (to put a proxy before it).
pub fn postgres_addr(db: &sqlx::PgPool) -> SocketAddr {
    let opts = db.connect_options();
    let host = match opts.get_host() {
        "localhost" => "127.0.0.1",
        other => other,
    };
    format!("{host}:{}", opts.get_port()).parse().unwrap()
}

/// The URL of a test's own database (`DATABASE_URL` names the server), optionally
/// reached through another address (a proxy).
pub fn database_url(db: &sqlx::PgPool, via: Option<SocketAddr>) -> String {
    let opts = db.connect_options();
    let name = opts.get_database().unwrap();
    let user = opts.get_username();
    let (host, port) = match via {
        Some(addr) => (addr.ip().to_string(), addr.port()),
        None => (opts.get_host().to_string(), opts.get_port()),
    };
    format!("postgres://{user}@{host}:{port}/{name}")
}

/// A `seckill` process, killed when dropped. Its Redis key space belongs to the
/// [`super::TestApp`] whose prefix it was given, which cleans it up.
pub struct Process {
    pub child: Child,
}

impl Process {
    /// Starts `seckill <subcommand>` with the given environment on top of the basics.
    pub fn spawn(
        subcommand: &str,
        redis_url: &str,
        prefix: &str,
        database_url: &str,
        env: &[(&str, String)],
    ) -> Self {
        let mut cmd = Command::new(BIN);
        cmd.arg(subcommand)
            .env("DATABASE_URL", database_url)
            .env("REDIS_URL", redis_url)
            .env("REDIS_KEY_PREFIX", prefix)
            .env("JWT_SECRET", super::SECRET)
            .env("PAYMENT_WEBHOOK_SECRETS", super::PAYMENT_SECRET)
            // Many instances on one host: each its own internal listener.
            .env("ADMIN_BIND", "127.0.0.1:0")
            .env(
                "RUST_LOG",
                std::env::var("SECKILL_TEST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdout(Stdio::null());
        for (k, v) in env {
            cmd.env(k, v);
        }
        Self {
            child: cmd.spawn().unwrap(),
        }
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill(); // SIGKILL
        let _ = self.child.wait();
    }

    /// SIGSTOP (`true`) or SIGCONT (`false`).
    pub fn freeze(&self, frozen: bool) {
        let signal = if frozen { "-STOP" } else { "-CONT" };
        let status = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    pub fn sigterm(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Waits for the exit; `None` if it takes longer than `limit`.
    pub async fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            if Instant::now() > deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until `base` answers `/healthz` (it listens; ready or not).
pub async fn wait_listening(base: &str) {
    let http = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if http.get(format!("{base}/healthz")).send().await.is_ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{base} never listened");
}

/// Waits until `GET {base}/readyz` answers 200.
pub async fn wait_ready(base: &str) {
    let http = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if let Ok(r) = http.get(format!("{base}/readyz")).send().await {
            if r.status() == reqwest::StatusCode::OK {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{base} never became ready");
}

/// Where Debian's libfaketime lives (`/usr/lib/<triplet>/faketime/`): a process started
/// with it in `LD_PRELOAD` runs on a clock `FAKETIME` (or the file
/// `FAKETIME_TIMESTAMP_FILE`) sets off. The test scripts install it.
pub fn libfaketime() -> String {
    std::fs::read_dir("/usr/lib")
        .unwrap()
        .filter_map(Result::ok)
        .map(|d| d.path().join("faketime/libfaketime.so.1"))
        .find(|p| p.exists())
        .expect("libfaketime (Debian's faketime; scripts/test installs it)")
        .display()
        .to_string()
}
