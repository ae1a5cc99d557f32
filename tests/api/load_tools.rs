//! The load tools users bring, run for real against the real binary: k6's open-loop
//! opening (`load/k6/opening.js`, with the k6 `scripts/k6` provides), its thresholds,
//! and its answers checked in Postgres by `load/k6/opening-check`.

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
