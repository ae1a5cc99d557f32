//! `scripts/dev` on servers you name: refusals, your Redis key prefix, and dropping
//! its database and keys at exit unless kept.

use super::*;

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
        wait_for_the_banner(&mut script, log);
        let said = log();
        let (database, prefix) = database_and_prefix_it_names(&said, keep);

        the_printed_curl_grabs(&said);
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

fn wait_for_the_banner(script: &mut Script, log: impl Fn() -> String) {
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
}

/// The database and the key prefix the banner names as the run's own.
fn database_and_prefix_it_names(said: &str, keep: bool) -> (String, String) {
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
    (database, prefix)
}

fn the_printed_curl_grabs(said: &str) {
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
}
