//! The tools users bring, run for real against the real binary: k6's open-loop
//! opening (`load/k6/opening.js`, with the k6 `scripts/k6` provides), its thresholds,
//! and its answers checked in Postgres by `load/k6/opening-check`; docker-compose.yml
//! checked by compose itself and its services run natively (`scripts/check-compose`).

use sqlx::PgPool;

use crate::common::faults::database_url;
use crate::common::{TestApp, SECRET};

/// Runs `program` with `args` (and `env`); whether it succeeded and what it printed.
async fn run(program: &str, args: &[&str], env: &[(&str, String)]) -> (bool, String) {
    let out = tokio::process::Command::new(program)
        .args(args)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .await
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[sqlx::test(migrations = "./migrations")]
async fn k6s_open_loop_opening_sells_exactly_the_stock_and_postgres_holds_every_202(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let (_server, base) = app.spawn_server("serve", &[]).await;
    let answers = std::env::temp_dir().join(format!(
        "seckill-k6-answers-{}-{:08x}.log",
        std::process::id(),
        rand::random::<u32>()
    ));
    let answers_arg = format!("--console-output={}", answers.display());
    let env = |pair: &str| ["-e".to_string(), pair.to_string()];
    let mut args: Vec<String> = vec!["run".into(), "--quiet".into(), answers_arg];
    for pair in [
        format!("BASE={base}"),
        format!("JWT_SECRET={SECRET}"),
        "RATE=300".into(),
        "DURATION=2s".into(),
        "STOCK=100".into(),
        "VUS=50".into(),
    ] {
        args.extend(env(&pair));
    }
    args.push("load/k6/opening.js".into());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (ok, said) = run("scripts/k6", &args, &[]).await;
    println!("{said}");
    assert!(ok, "k6's thresholds were crossed, or it failed:\n{said}");
    assert!(said.contains("admitted 100, sold_out "), "{said}");
    assert!(said.contains("dropped 0"), "{said}");

    let database = [("DATABASE_URL", database_url(&app.db, None))];
    let log = answers.to_str().unwrap();
    let (ok, said) = run("load/k6/opening-check", &[log], &database).await;
    assert!(ok, "{said}");
    assert!(
        said.contains("100 answered 202, 100 orders in postgres (100 buyers), stock 100, left 0"),
        "{said}"
    );

    // The check fails where Postgres disagrees: an answer naming an id that is no order.
    let text = std::fs::read_to_string(&answers).unwrap();
    let (at, line) = text
        .lines()
        .enumerate()
        .find(|(_, l)| l.contains("msg=\"admitted "))
        .unwrap();
    let said_id = line.split("msg=\"admitted ").nth(1).unwrap();
    let id = said_id.split_whitespace().nth(1).unwrap();
    let forged: Vec<String> = text
        .lines()
        .enumerate()
        .map(|(i, l)| match i == at {
            true => l.replacen(id, "4242", 1),
            false => l.to_string(),
        })
        .collect();
    std::fs::write(&answers, forged.join("\n")).unwrap();
    let (ok, said) = run("load/k6/opening-check", &[log], &database).await;
    std::fs::remove_file(&answers).unwrap();
    assert!(!ok, "{said}");
    assert!(
        said.contains("1 answered order ids are not orders"),
        "{said}"
    );
}

#[tokio::test]
async fn compose_accepts_every_profile_and_each_service_runs_by_its_own_command_until_healthy_and_selling(
) {
    let bin = [("SECKILL_BIN", env!("CARGO_BIN_EXE_seckill").to_string())];
    let (ok, said) = run("scripts/check-compose", &[], &bin).await;
    println!("{said}");
    assert!(ok, "{said}");
    for profile in ["default", "cluster", "durable", "observability"] {
        assert!(
            said.contains(&format!("config: profile {profile}: accepted")),
            "{said}"
        );
    }
    // Each deployment's API: ready, a sale, a grab's 202, its order in that deployment's
    // Postgres (the cluster's through its workers, the durable one waiting on a replica).
    for api in [
        "seckill",
        "seckill-cluster-api",
        "seckill-cluster-api-2",
        "seckill-durable",
    ] {
        assert!(
            said.contains(&format!("check-compose: {api}: ready; sale ")),
            "{said}"
        );
    }
    for one_shot in [
        "redis-cluster-init",
        "seckill-cluster-db",
        "seckill-cluster-migrate",
        "seckill-durable-db",
    ] {
        assert!(
            said.contains(&format!("completed {one_shot} (exit 0)")),
            "{said}"
        );
    }
    for healthy in [
        "postgres",
        "redis",
        "redis-sentinel-3",
        "seckill-cluster-worker-2",
    ] {
        assert!(said.contains(&format!("healthy {healthy} (")), "{said}");
    }
}

#[tokio::test]
async fn compose_refuses_a_broken_copy_of_the_file() {
    let file = std::fs::read_to_string("docker-compose.yml").unwrap();
    let dir = std::env::temp_dir().join(format!(
        "seckill-compose-broken-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let misspelt = file.replacen("    command: [\"serve\"]", "    commnd: [\"serve\"]", 1);
    let dangling = file.replacen(
        "redis-cluster-init: { condition: service_completed_successfully }",
        "redis-cluster-start: { condition: service_completed_successfully }",
        1,
    );
    let cases = [
        ("as it is", file.clone(), None),
        (
            "an option misspelt",
            misspelt,
            Some("Unsupported config option for services.seckill: 'commnd'"),
        ),
        (
            "a dependency on no service",
            dangling,
            Some("depends on service 'redis-cluster-start' which is undefined"),
        ),
    ];
    for (case, text, refusal) in cases {
        assert_ne!(
            text == file,
            refusal.is_some(),
            "{case}: the copy is broken"
        );
        let path = dir.join("docker-compose.yml");
        std::fs::write(&path, text).unwrap();
        let (ok, said) = run(
            "scripts/check-compose",
            &["--config-only", path.to_str().unwrap()],
            &[],
        )
        .await;
        match refusal {
            None => assert!(ok, "{case}: {said}"),
            Some(message) => {
                assert!(!ok, "{case}: {said}");
                assert!(
                    said.contains("REFUSED") && said.contains(message),
                    "{case}: {said}"
                );
            }
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
