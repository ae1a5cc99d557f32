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
    // The binary is the one named, not a build of the script's.
    let up = lines
        .iter()
        .find(|l| l.starts_with("seckill is up"))
        .unwrap_or_else(|| panic!("no 'seckill is up' line:\n{out}"));
    assert!(
        up.ends_with(&format!("the binary from SECKILL_BIN: {BIN})")),
        "{up}"
    );
    assert!(!up.contains("build"), "{up}");
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
    // No fixed secret: this run's own, random, and the demo line uses it.
    let secret = field("secret ");
    let key = secret
        .strip_prefix("JWT_SECRET=dev-")
        .and_then(|s| s.split(' ').next())
        .unwrap_or_else(|| panic!("{secret}"));
    assert!(
        key.len() == 32 && key.bytes().all(|b| b.is_ascii_hexdigit()),
        "{secret}"
    );
    assert!(out.contains(&format!("JWT_SECRET=dev-{key} ")), "{out}");

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

#[test]
fn scripts_dev_refuses_a_bind_address_already_in_use_and_leaves_nothing_running() {
    // Something else holds BIND (the compose stack on 8080, say): it accepts connections
    // and never answers, so a /readyz against it must not pass for ours.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let bind = taken.local_addr().unwrap().to_string();
    let tmp = scratch_dir("bind-in-use");
    let stderr_log = tmp.with_extension("log");
    let log = || std::fs::read_to_string(&stderr_log).unwrap_or_default();
    let mut script = start_script(&bind, &tmp, &stderr_log);

    let code = exit_code_within(&mut script, Duration::from_secs(60), &log);
    let said = log();
    assert_eq!(code, Some(1), "{said}");
    assert!(said.contains(&format!("BIND {bind} is in use")), "{said}");
    assert!(!said.contains("starting a private"), "{said}");
    assert!(!said.contains("panicked"), "{said}");
    assert_nothing_left(&tmp, &stderr_log, &said);
}

#[test]
fn ctrl_c_while_the_private_postgres_starts_stops_it_and_leaves_nothing_running() {
    let tmp = scratch_dir("interrupted");
    let stderr_log = tmp.with_extension("log");
    let log = || std::fs::read_to_string(&stderr_log).unwrap_or_default();
    let bind = format!("127.0.0.1:{}", free_port());
    let mut script = start_script(&bind, &tmp, &stderr_log);

    // SIGINT to the script alone (as `kill -INT` would; a terminal's Ctrl-C also reaches
    // pg_ctl, and a postmaster in the same group would stop by itself) as soon as the
    // script says Postgres is starting: pg_ctl is then still waiting for it, and the
    // postmaster runs in a session of its own.
    let deadline = Instant::now() + Duration::from_secs(120);
    while !log().contains("starting a private Postgres") {
        assert!(
            Instant::now() < deadline,
            "no 'starting a private Postgres' within 120 s:\n{}",
            log()
        );
        assert!(
            matches!(script.0.try_wait(), Ok(None)),
            "exited before starting Postgres:\n{}",
            log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    script.interrupt();

    let code = exit_code_within(&mut script, Duration::from_secs(60), &log);
    let said = log();
    assert_eq!(code, Some(130), "{said}");
    assert!(!said.contains("seckill is up"), "{said}");
    assert_nothing_left(&tmp, &stderr_log, &said);
}

#[test]
fn scripts_dev_stops_with_the_refusal_when_a_server_you_named_answers_but_refuses_it() {
    let bind = format!("127.0.0.1:{}", free_port());

    // A Redis that wants a password, named in REDIS_URL without one.
    let port = free_port();
    let redis_dir = scratch_dir("redis-password");
    struct Killed(std::process::Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let redis = Command::new("redis-server")
        .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
        .args([
            "--save",
            "",
            "--appendonly",
            "no",
            "--requirepass",
            "sekrit",
        ])
        .arg("--dir")
        .arg(&redis_dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server on PATH");
    let redis = Killed(redis);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !port_open(port) {
        assert!(Instant::now() < deadline, "the test's Redis did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let tmp = scratch_dir("redis-refuses");
    let stderr_log = tmp.with_extension("log");
    let log = || std::fs::read_to_string(&stderr_log).unwrap_or_default();
    let dead_postgres = free_port();
    let mut script = start_script_with(
        &bind,
        &tmp,
        &stderr_log,
        &format!("redis://127.0.0.1:{port}"),
        &format!("postgres://postgres@127.0.0.1:{dead_postgres}/postgres"),
        &[],
    );
    let code = exit_code_within(&mut script, Duration::from_secs(60), &log);
    drop(redis);
    let _ = std::fs::remove_dir_all(&redis_dir);
    let said = log();
    assert_eq!(code, Some(1), "{said}");
    assert!(said.contains("answers but refuses us: NOAUTH"), "{said}");
    assert!(said.contains("fix REDIS_URL"), "{said}");
    assert!(!said.contains("starting a private"), "{said}");
    assert!(std::fs::read_dir(&tmp).unwrap().next().is_none(), "{said}");

    // A Postgres that refuses the role named in DATABASE_URL (a private Redis is started
    // first, and must be stopped again).
    let server = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let host_port = server
        .split('@')
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .unwrap_or("127.0.0.1:5432")
        .to_string();
    let dead_redis = free_port();
    let mut script = start_script_with(
        &bind,
        &tmp,
        &stderr_log,
        &format!("redis://127.0.0.1:{dead_redis}"),
        &format!("postgres://no_such_role_seckill:pw@{host_port}/postgres"),
        &[],
    );
    let code = exit_code_within(&mut script, Duration::from_secs(60), &log);
    let said = log();
    assert_eq!(code, Some(1), "{said}");
    assert!(said.contains("answers but refuses us: "), "{said}");
    assert!(said.contains("no_such_role_seckill"), "{said}");
    assert!(said.contains("fix DATABASE_URL"), "{said}");
    // Its password is not printed.
    assert!(!said.contains(":pw@"), "{said}");
    assert!(said.contains("starting a private Redis"), "{said}");
    assert!(!said.contains("starting a private Postgres"), "{said}");
    assert_nothing_left(&tmp, &stderr_log, &said);
}

#[test]
fn scripts_dev_says_to_install_rust_with_rustup_when_cargo_is_missing_or_too_old() {
    let tmp = scratch_dir("rust-check");
    let bin = tmp.with_extension("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let stderr_log = tmp.with_extension("log");
    // Bounded: a script that went on past the check would serve until interrupted.
    let run = |path: &str| {
        let child = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/dev"))
            .env("PATH", path)
            .env("TMPDIR", &tmp)
            .env("BIND", format!("127.0.0.1:{}", free_port()))
            .env_remove("SECKILL_BIN")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr_log).unwrap())
            .spawn()
            .unwrap();
        let mut script = Script(child);
        let log = || std::fs::read_to_string(&stderr_log).unwrap_or_default();
        let code = exit_code_within(&mut script, Duration::from_secs(30), &log);
        (code, log())
    };
    let want = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("rust-version = "))
        .unwrap()
        .trim_matches('"')
        .to_string();

    // No cargo at all.
    let (code, said) = run("/usr/bin:/bin");
    assert_eq!(code, Some(1), "{said}");
    assert!(
        said.contains(&format!("install Rust >= {want} with rustup")),
        "{said}"
    );

    // A cargo and rustc older than Cargo.toml's rust-version.
    for tool in ["cargo", "rustc"] {
        let path = bin.join(tool);
        std::fs::write(
            &path,
            format!("#!/bin/sh\necho '{tool} 1.70.0 (90c541806 2023-05-31)'\n"),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let (code, said) = run(&format!("{}:/usr/bin:/bin", bin.display()));
    assert_eq!(code, Some(1), "{said}");
    assert!(
        said.contains(&format!(
            "rustc 1.70.0 is older than Cargo.toml's rust-version {want}: rustup update"
        )),
        "{said}"
    );
    assert!(!said.contains("starting a private"), "{said}");
    assert!(std::fs::read_dir(&tmp).unwrap().next().is_none(), "{said}");
    let _ = std::fs::remove_dir_all(&tmp);
    let _ = std::fs::remove_dir_all(&bin);
    let _ = std::fs::remove_file(&stderr_log);
}

#[test]
fn your_redis_key_prefix_gets_the_runs_own_suffix_beside_a_private_postgres() {
    // Your Redis (the one the tests use), a private Postgres: REDIS_KEY_PREFIX of yours
    // still gets this run's suffix, and its keys are deleted at exit.
    let redis_url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let tmp = scratch_dir("prefix");
    let stderr_log = tmp.with_extension("log");
    let log = || std::fs::read_to_string(&stderr_log).unwrap_or_default();
    let dead_postgres = free_port();
    let mut script = start_script_with(
        &format!("127.0.0.1:{}", free_port()),
        &tmp,
        &stderr_log,
        &redis_url,
        &format!("postgres://postgres@127.0.0.1:{dead_postgres}/postgres"),
        &[("REDIS_KEY_PREFIX", "devtest-mine:")],
    );
    let deadline = Instant::now() + Duration::from_secs(120);
    while !log().contains("Ctrl-C stops") {
        assert!(
            Instant::now() < deadline,
            "no banner within 120 s:\n{}",
            log()
        );
        assert!(
            matches!(script.0.try_wait(), Ok(None)),
            "exited:\n{}",
            log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let said = log();
    let redis_line = said
        .lines()
        .find(|l| l.trim_start().starts_with("Redis "))
        .unwrap_or_else(|| panic!("no Redis line:\n{said}"));
    assert!(
        redis_line.contains("(yours, keys under devtest-mine:dev-"),
        "{redis_line}"
    );
    script.interrupt();
    let code = exit_code_within(&mut script, Duration::from_secs(60), &log);
    assert_eq!(code, Some(130), "{}", log());
    assert_eq!(
        processes_left_under(&tmp),
        Vec::<String>::new(),
        "{}",
        log()
    );
    let left = Command::new("redis-cli")
        .args([
            "-u",
            &redis_url,
            "--scan",
            "--pattern",
            "devtest-mine:dev-*",
        ])
        .output()
        .unwrap();
    assert!(left.status.success(), "{left:?}");
    assert_eq!(
        String::from_utf8_lossy(&left.stdout).trim(),
        "",
        "keys left"
    );
    let _ = std::fs::remove_dir_all(&tmp);
    let _ = std::fs::remove_file(&stderr_log);
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

/// On servers of yours (the ones the tests use) the script makes a database and a Redis
/// key prefix of its own, serves from them, and at Ctrl-C drops the database and deletes
/// the keys; with `--keep` it leaves both and says where they are.
#[test]
fn on_your_servers_scripts_dev_drops_its_database_and_deletes_its_keys_at_exit_unless_kept() {
    let redis_url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let database_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    for keep in [false, true] {
        let tmp = scratch_dir(if keep { "yours-kept" } else { "yours" });
        let stderr_log = tmp.with_extension("log");
        let log = || std::fs::read_to_string(&stderr_log).unwrap_or_default();
        let args: &[&str] = if keep { &["--keep"] } else { &[] };
        let mut script = start_script_with_args(
            &format!("127.0.0.1:{}", free_port()),
            &tmp,
            &stderr_log,
            &redis_url,
            &database_url,
            &[],
            args,
        );
        let deadline = Instant::now() + Duration::from_secs(120);
        while !log().contains("Ctrl-C stops") {
            assert!(
                Instant::now() < deadline,
                "no banner within 120 s:\n{}",
                log()
            );
            assert!(
                matches!(script.0.try_wait(), Ok(None)),
                "exited:\n{}",
                log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let said = log();
        let line = |name: &str| {
            said.lines()
                .find(|l| l.trim_start().starts_with(name))
                .unwrap_or_else(|| panic!("no {name} line:\n{said}"))
                .trim()
                .to_string()
        };
        let (redis, postgres) = (line("Redis "), line("Postgres "));
        let at_exit = if keep { "kept" } else { "dropped" };
        let database = postgres
            .split("(yours, database ")
            .nth(1)
            .and_then(|rest| rest.strip_suffix(&format!(" {at_exit} at exit)")))
            .unwrap_or_else(|| panic!("{postgres}"))
            .to_string();
        assert!(database.starts_with("seckill_dev_"), "{postgres}");
        assert!(
            postgres
                .split_whitespace()
                .nth(1)
                .unwrap()
                .ends_with(&format!("/{database}")),
            "served from its own database: {postgres}"
        );
        let at_exit = if keep { "kept" } else { "deleted" };
        let prefix = redis
            .split("(yours, keys under ")
            .nth(1)
            .and_then(|rest| rest.strip_suffix(&format!(" {at_exit} at exit)")))
            .unwrap_or_else(|| panic!("{redis}"))
            .to_string();
        assert!(
            prefix.starts_with("dev-") && prefix.ends_with(':'),
            "{redis}"
        );

        // The printed curl: a sale and a grab, in its database and under its prefix.
        let lines: Vec<&str> = said.lines().collect();
        let start = lines
            .iter()
            .position(|l| l.ends_with("(paste into a shell):"))
            .expect("a curl to paste");
        let block: Vec<&str> = lines[start + 2..]
            .iter()
            .take_while(|l| !l.is_empty())
            .copied()
            .collect();
        let grab = Command::new("bash")
            .args(["-euo", "pipefail", "-c", &block.join("\n")])
            .output()
            .unwrap();
        let answer = String::from_utf8_lossy(&grab.stdout);
        assert!(
            answer.contains(r#""status":"pending""#),
            "{answer} {grab:?}"
        );
        assert!(database_exists(&database_url, &database));
        assert!(!keys_under(&redis_url, &prefix).is_empty());

        script.interrupt();
        let code = exit_code_within(&mut script, Duration::from_secs(60), &log);
        let said = log();
        assert_eq!(code, Some(130), "{said}");
        assert_eq!(processes_left_under(&tmp), Vec::<String>::new(), "{said}");
        if keep {
            assert!(database_exists(&database_url, &database), "{said}");
            assert!(!keys_under(&redis_url, &prefix).is_empty(), "{said}");
            assert!(
                said.contains(&format!("kept the database {database}")),
                "{said}"
            );
            assert!(
                said.contains(&format!("kept the keys under {prefix}")),
                "{said}"
            );
            // The test's own cleanup.
            let dropped = Command::new("psql")
                .args(["-w", &database_url, "-qc"])
                .arg(format!("DROP DATABASE \"{database}\" WITH (FORCE)"))
                .status()
                .unwrap();
            assert!(dropped.success());
            for key in keys_under(&redis_url, &prefix) {
                let _ = Command::new("redis-cli")
                    .args(["-u", &redis_url, "del", &key])
                    .output();
            }
        } else {
            assert!(!database_exists(&database_url, &database), "{said}");
            assert_eq!(
                keys_under(&redis_url, &prefix),
                Vec::<String>::new(),
                "{said}"
            );
        }
        let _ = std::fs::remove_dir_all(&tmp);
        let _ = std::fs::remove_file(&stderr_log);
    }
}
