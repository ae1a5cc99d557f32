//! `scripts/dev`, as a newcomer runs it on a machine whose Redis and Postgres are not
//! running: it starts private ones, serves, prints what to try, and Ctrl-C takes all of
//! it down again.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::common::faults::{free_port, BIN};

mod private_servers;
mod your_servers;

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

/// A directory of the test's own, the script's `TMPDIR`: its private servers keep their
/// data (and, for Redis, their working directory) under it.
fn scratch_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("seckill-dev-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The processes whose working directory or command line names `dir` (a private Redis
/// runs in its directory; a private Postgres is `postgres -D <dir>/...`).
fn processes_under(dir: &std::path::Path) -> Vec<String> {
    let dir = dir.to_string_lossy().to_string();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let pid = entry.file_name().to_string_lossy().to_string();
        if !pid.chars().all(|c| c.is_ascii_digit()) {
            continue;
        }
        let cwd = std::fs::read_link(entry.path().join("cwd"))
            .map(|p| p.to_string_lossy().to_string())
            .unwrap_or_default();
        let cmdline = std::fs::read(entry.path().join("cmdline"))
            .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
            .unwrap_or_default();
        if cwd.starts_with(&dir) || cmdline.contains(&dir) {
            found.push(format!("{pid}: {cmdline} (in {cwd})"));
        }
    }
    found
}

/// The processes under `dir`, once they are gone (a stopping server takes a moment), or
/// those still there after 10 s.
/// No process left running under the script's temporary directory `tmp`, and nothing
/// left in it; then removes it and the script's log.
fn assert_nothing_left(tmp: &std::path::Path, stderr_log: &std::path::Path, said: &str) {
    assert_eq!(processes_left_under(tmp), Vec::<String>::new(), "{said}");
    let left: Vec<_> = std::fs::read_dir(tmp).unwrap().flatten().collect();
    assert!(
        left.is_empty(),
        "left behind in {}: {left:?}\n{said}",
        tmp.display()
    );
    let _ = std::fs::remove_dir_all(tmp);
    let _ = std::fs::remove_file(stderr_log);
}

fn processes_left_under(dir: &std::path::Path) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left = processes_under(dir);
        if left.is_empty() || Instant::now() > deadline {
            return left;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Starts the script on `bind` with dead ports as REDIS_URL and DATABASE_URL, `tmp` as
/// its TMPDIR, standard error to `stderr_log`, in a process group of its own (so that a
/// test can Ctrl-C it as a terminal would: the whole group).
fn start_script(bind: &str, tmp: &std::path::Path, stderr_log: &std::path::Path) -> Script {
    let (dead_redis, dead_postgres) = (free_port(), free_port());
    start_script_with(
        bind,
        tmp,
        stderr_log,
        &format!("redis://127.0.0.1:{dead_redis}"),
        &format!("postgres://postgres@127.0.0.1:{dead_postgres}/postgres"),
        &[],
    )
}

/// [`start_script`] with these REDIS_URL and DATABASE_URL and more variables (its
/// standard output goes to `stderr_log` too).
fn start_script_with(
    bind: &str,
    tmp: &std::path::Path,
    stderr_log: &std::path::Path,
    redis_url: &str,
    database_url: &str,
    more: &[(&str, &str)],
) -> Script {
    start_script_with_args(bind, tmp, stderr_log, redis_url, database_url, more, &[])
}

/// [`start_script_with`], with these arguments.
fn start_script_with_args(
    bind: &str,
    tmp: &std::path::Path,
    stderr_log: &std::path::Path,
    redis_url: &str,
    database_url: &str,
    more: &[(&str, &str)],
    args: &[&str],
) -> Script {
    use std::os::unix::process::CommandExt;
    let mut child = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/dev"));
    child
        .args(args)
        .env("SECKILL_BIN", BIN)
        .env("REDIS_URL", redis_url)
        .env("DATABASE_URL", database_url)
        .env("BIND", bind)
        .env("TMPDIR", tmp)
        .env("RUST_LOG", "warn")
        .env_remove("REDIS_KEY_PREFIX")
        .env_remove("JWT_SECRET")
        .envs(more.iter().copied())
        .stdin(Stdio::null());
    let log = std::fs::File::create(stderr_log).unwrap();
    let child = child
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .process_group(0)
        .spawn()
        .unwrap();
    Script(child)
}

/// The exit code, once it exits within `limit`.
fn exit_code_within(script: &mut Script, limit: Duration, log: &dyn Fn() -> String) -> Option<i32> {
    assert!(
        script.exits_within(limit),
        "still running after {limit:?}:\n{}",
        log()
    );
    script.0.try_wait().unwrap().unwrap().code()
}

/// Whether the Postgres at `url` has a database `name`.
fn database_exists(url: &str, name: &str) -> bool {
    let out = Command::new("psql")
        .args(["-w", url, "-Atqc"])
        .arg(format!(
            "SELECT count(*) FROM pg_database WHERE datname = '{name}'"
        ))
        .output()
        .expect("psql (postgresql-client)");
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout).trim() == "1"
}

/// The keys under `prefix` in the Redis at `url`.
fn keys_under(url: &str, prefix: &str) -> Vec<String> {
    let out = Command::new("redis-cli")
        .args(["-u", url, "--scan", "--pattern", &format!("{prefix}*")])
        .output()
        .expect("redis-cli (redis-tools)");
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}
