//! `scripts/dev` with its own private servers: start, serve and Ctrl-C, a bind address
//! in use, Ctrl-C during Postgres start, and a missing cargo.

use super::*;

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

    let lines = lines_until_ctrl_c_banner(&mut child, log);
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
    // The live view is on the internal listener, a loopback port of its own.
    let live = field("live ");
    assert!(
        live.starts_with("http://127.0.0.1:")
            && live.ends_with("/live")
            && live != format!("{base}/live"),
        "{live}"
    );
    assert_eq!(field("metrics "), live.replace("/live", "/metrics"));
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
    // The helper's `notify` and `demo` go to this server, not to 8080.
    let helper = field("helper ");
    assert!(
        helper.starts_with(&format!(
            "seckill() {{ BIND=127.0.0.1:{port} JWT_SECRET=dev-{key} "
        )),
        "{helper}"
    );

    the_service_answers_and_the_printed_curl_grabs(&lines, &base, &out, field);

    let code = exit_code_after_ctrl_c(&mut child, log);
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

/// The script's output, line by line, until its banner's last line.
fn lines_until_ctrl_c_banner(child: &mut Script, log: impl Fn() -> String) -> Vec<String> {
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
    lines
}

fn the_service_answers_and_the_printed_curl_grabs(
    lines: &[String],
    base: &str,
    out: &str,
    field: impl Fn(&str) -> String,
) {
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
}

fn exit_code_after_ctrl_c(child: &mut Script, log: impl Fn() -> String) -> Option<i32> {
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
    code
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
