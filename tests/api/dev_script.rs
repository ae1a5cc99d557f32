//! `scripts/dev`, as a newcomer runs it on a machine whose Redis and Postgres are not
//! running: it starts private ones, serves, prints what to try, and Ctrl-C takes all of
//! it down again.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::common::faults::{free_port, BIN};

fn port_open(port: u16) -> bool {
    std::net::TcpStream::connect_timeout(
        &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_millis(500),
    )
    .is_ok()
}

/// The port of the `scheme://host:port/...` URL that starts `line`.
fn port_of(line: &str) -> u16 {
    let url = line.split_whitespace().next().unwrap();
    let authority = url.split("://").nth(1).unwrap().split('/').next().unwrap();
    authority.rsplit(':').next().unwrap().parse().unwrap()
}

/// The script, sent SIGINT when the test ends (also when it fails half-way), so that
/// its servers never outlive the test.
struct Script(std::process::Child);

impl Script {
    fn signal(&self, name: &str) {
        let _ = Command::new("kill")
            .args([name, &self.0.id().to_string()])
            .status();
    }

    fn interrupt(&self) {
        self.signal("-INT");
    }

    /// Whether it exited within `limit`.
    fn exits_within(&mut self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while matches!(self.0.try_wait(), Ok(None)) {
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        true
    }
}

impl Drop for Script {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            self.interrupt();
            if !self.exits_within(Duration::from_secs(30)) {
                self.signal("-TERM");
                self.exits_within(Duration::from_secs(10));
            }
        }
    }
}

#[test]
fn scripts_dev_starts_private_servers_serves_and_ctrl_c_stops_everything_it_started() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/dev");
    let port = free_port();
    // Nothing listens on these: the script must start servers of its own.
    let (dead_redis, dead_postgres) = (free_port(), free_port());
    let stderr_log = std::env::temp_dir().join(format!("seckill-dev-test-{port}.log"));
    let child = Command::new(script)
        .env("SECKILL_BIN", BIN)
        .env("REDIS_URL", format!("redis://127.0.0.1:{dead_redis}"))
        .env(
            "DATABASE_URL",
            format!("postgres://postgres@127.0.0.1:{dead_postgres}/postgres"),
        )
        .env("BIND", format!("127.0.0.1:{port}"))
        .env("RUST_LOG", "warn")
        .env_remove("REDIS_KEY_PREFIX")
        .env_remove("JWT_SECRET")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&stderr_log).unwrap())
        .spawn()
        .unwrap();
    let mut child = Script(child);
    let log = || std::fs::read_to_string(&stderr_log).unwrap_or_default();

    // Its output, line by line, until the closing "Ctrl-C stops ..." line.
    let (tx, rx) = mpsc::channel();
    let stdout = child.0.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut lines = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(180);
    while !lines.iter().any(|l: &String| l.starts_with("Ctrl-C stops")) {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => lines.push(line),
            Err(_) => {
                panic!("no banner within 180 s:\n{}\n{}", lines.join("\n"), log());
            }
        }
    }
    let out = lines.join("\n");
    println!("{out}");
    let field = |name: &str| {
        lines
            .iter()
            .find_map(|l| l.trim().strip_prefix(name))
            .unwrap_or_else(|| panic!("no {name} line:\n{out}"))
            .trim()
            .to_string()
    };
    let base = format!("http://127.0.0.1:{port}");
    assert_eq!(field("live "), format!("{base}/live"));
    assert_eq!(field("docs "), format!("{base}/docs"));
    let redis = field("Redis ");
    let postgres = field("Postgres ");
    assert!(redis.contains("(private, in "), "{redis}");
    assert!(postgres.contains("(private, in "), "{postgres}");
    let (redis_port, postgres_port) = (port_of(&redis), port_of(&postgres));
    assert!(redis_port >= 63800 && postgres_port >= 54340, "{out}");
    let dir = redis
        .split("(private, in ")
        .nth(1)
        .unwrap()
        .trim_end_matches(')');
    assert!(std::path::Path::new(dir).is_dir(), "{dir}");
    assert!(field("admin token").contains('.') && field("shopper token").contains('.'));

    // The service answers, and the printed curl opens a sale and grabs from it.
    let health = Command::new("curl")
        .args(["-fsS", &format!("{base}/healthz")])
        .output()
        .unwrap();
    assert!(health.status.success(), "{health:?}");
    let start = lines
        .iter()
        .position(|l| l.ends_with("(paste into a shell):"))
        .expect("a curl to paste");
    let block: Vec<&str> = lines[start + 2..]
        .iter()
        .take_while(|l| !l.is_empty())
        .map(String::as_str)
        .collect();
    let grab = Command::new("bash")
        .args(["-euo", "pipefail", "-c", &block.join("\n")])
        .output()
        .unwrap();
    let answer = String::from_utf8_lossy(&grab.stdout);
    assert!(grab.status.success(), "{answer} {grab:?}");
    assert!(answer.contains(r#""status":"pending""#), "{answer}");
    assert!(field("JWT_SECRET=").contains(" demo --url "), "{out}");

    // Ctrl-C: exit 130, everything it started gone.
    child.interrupt();
    let deadline = Instant::now() + Duration::from_secs(60);
    let code = loop {
        if let Some(status) = child.0.try_wait().unwrap() {
            break status.code();
        }
        if Instant::now() > deadline {
            panic!("still running 60 s after SIGINT:\n{}", log());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(code, Some(130), "{}", log());
    for (what, port) in [
        ("seckill", port),
        ("redis", redis_port),
        ("postgres", postgres_port),
    ] {
        assert!(!port_open(port), "{what} still listens on {port}");
    }
    assert!(!std::path::Path::new(dir).exists(), "{dir} left behind");
    let _ = std::fs::remove_file(&stderr_log);
}
