//! `seckill demo` against the real `seckill serve`: the outcome table it prints adds up,
//! and Postgres holds exactly the orders it says were admitted.

use std::collections::HashMap;
use std::process::Command;

use sqlx::PgPool;

use crate::common::faults::BIN;
use crate::common::{TestApp, SECRET};

/// Runs `seckill demo --url base <args>`; returns the exit code, standard output and
/// standard error.
async fn demo(base: &str, args: &[&str]) -> (Option<i32>, String, String) {
    let mut cmd = Command::new(BIN);
    cmd.args(["demo", "--url", base])
        .args(args)
        .env("JWT_SECRET", SECRET)
        .env("PAYMENT_WEBHOOK_SECRETS", crate::common::PAYMENT_SECRET)
        .env_remove("BIND");
    let out = tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    println!("$ seckill demo {}\n{stdout}\n{stderr}", args.join(" "));
    (out.status.code(), stdout, stderr)
}

/// The `name number` rows of the printed table, and the voucher of the first line.
fn parse(stdout: &str) -> (i64, HashMap<String, i64>) {
    let voucher = stdout
        .strip_prefix("voucher ")
        .and_then(|rest| rest.split(':').next())
        .and_then(|id| id.parse().ok())
        .unwrap_or_else(|| panic!("no voucher line: {stdout}"));
    let rows = stdout
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            let name = words.next()?;
            let n = words.next()?.parse().ok()?;
            Some((name.to_string(), n))
        })
        .collect();
    (voucher, rows)
}

#[sqlx::test(migrations = false)]
async fn the_demo_sells_exactly_the_stock_and_every_admitted_order_reaches_postgres(db: PgPool) {
    // The binary applies the migrations itself; the app lends its key space and helpers.
    let app = TestApp::spawn(db.clone()).await;
    let (_server, base) = app
        .spawn_server("serve", &[("WORKER_BLOCK_MS", "100".to_string())])
        .await;

    let (code, stdout, stderr) = demo(
        &base,
        &[
            "--shoppers",
            "50",
            "--stock",
            "7",
            "--seconds",
            "1",
            "--concurrency",
            "8",
        ],
    )
    .await;
    assert_eq!(code, Some(0), "{stderr}");
    let (voucher, t) = parse(&stdout);
    assert_eq!(t["admitted"], 7, "{stdout}");
    assert_eq!(t["admitted"] + t["sold_out"], 50, "{stdout}");
    for none in ["already_ordered", "rate_limited", "errors"] {
        assert_eq!(t[none], 0, "{none}: {stdout}");
    }
    assert_eq!(t["total"], 50, "{stdout}");
    assert_eq!(t["persisted"], t["admitted"], "{stdout}");
    assert_eq!(t["stock_left"], 0, "{stdout}");
    // The stand-in provider pays for half of them (7 × 50%), each exactly once.
    assert_eq!(t["paid"], 3, "{stdout}");
    assert_eq!(app.pg_statuses(voucher).await.get("paid"), Some(&3));
    // Not on a terminal: plain progress lines, no carriage returns.
    assert!(stderr.contains("demo: 50/50 answered"), "{stderr}");
    assert!(!stderr.contains('\r'), "{stderr}");

    // Postgres agrees: exactly the stock, one order per user, none left.
    app.assert_consistent(voucher, 7).await;
    assert_eq!(app.pg_orders(voucher).await.len(), 7);
    assert_eq!(app.pg_stock(voucher).await, 0);

    // The same shoppers again at the same sale: the winners hear already_ordered.
    let (code, stdout, stderr) = demo(
        &base,
        &[
            "--shoppers",
            "50",
            "--seconds",
            "0",
            "--voucher",
            &voucher.to_string(),
        ],
    )
    .await;
    assert_eq!(code, Some(0), "{stderr}");
    let (again, t) = parse(&stdout);
    assert_eq!(again, voucher);
    assert_eq!(
        (t["admitted"], t["already_ordered"], t["sold_out"]),
        (0, 7, 43),
        "{stdout}"
    );
    assert_eq!(app.pg_orders(voucher).await.len(), 7);
}

#[test]
fn the_demo_refuses_bad_input_with_a_message_instead_of_a_panic() {
    let run = |args: &[&str]| {
        let out = Command::new(BIN)
            .arg("demo")
            .args(args)
            .env("JWT_SECRET", SECRET)
            .env_remove("BIND")
            .output()
            .unwrap();
        let stderr = String::from_utf8(out.stderr).unwrap();
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        (out.status.code(), stderr)
    };
    // clap's own refusals: exit 2, naming the flag.
    for (args, names) in [
        (&["--shoppers", "0"][..], "--shoppers"),
        (&["--seconds=-1"][..], "--seconds"),
        (&["--seconds", "soon"][..], "--seconds"),
        (&["--stock", "5", "--voucher", "1"][..], "--voucher"),
        (&["--concurrency", "0"][..], "--concurrency"),
        (&["--first-user", "0"][..], "--first-user"),
    ] {
        let (code, stderr) = run(args);
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(names), "{args:?}: {stderr}");
    }
    // The demo's own: exit 2 with `error: ...`.
    let port = crate::common::faults::free_port();
    let nobody = format!("http://127.0.0.1:{port}");
    for (args, says) in [
        (&["--url", "localhost:8080"][..], "http:// or https://"),
        (&["--url", &nobody][..], "cannot reach the API"),
        (
            &["--first-user", "9223372036854775800", "--shoppers", "100"][..],
            "overflows",
        ),
    ] {
        let (code, stderr) = run(args);
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
    let out = Command::new(BIN)
        .arg("demo")
        .env_remove("JWT_SECRET")
        .output()
        .unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("set JWT_SECRET"), "{stderr}");
}

#[sqlx::test(migrations = false)]
async fn a_server_that_disappears_mid_demo_is_a_failure_exit_1_with_the_table_not_bad_input(
    db: PgPool,
) {
    let app = TestApp::spawn(db.clone()).await;
    let (mut server, base) = app
        .spawn_server("serve", &[("WORKER_BLOCK_MS", "100".to_string())])
        .await;

    // 40 presses over 4 s; the server is killed after the first second: the later
    // presses get no answer, and the orders cannot be read back.
    let demo = tokio::spawn({
        let base = base.clone();
        async move {
            demo(
                &base,
                &[
                    "--shoppers",
                    "40",
                    "--stock",
                    "100",
                    "--seconds",
                    "4",
                    "--persist-timeout",
                    "2",
                ],
            )
            .await
        }
    });
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    server.kill9();
    let (code, stdout, stderr) = tokio::time::timeout(std::time::Duration::from_secs(60), demo)
        .await
        .expect("the demo ends within 60 s")
        .unwrap();

    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(code, Some(1), "{stdout}\n{stderr}");
    let (_, t) = parse(&stdout);
    assert_eq!(t["total"], 40, "{stdout}");
    assert!(t["admitted"] > 0 && t["errors"] > 0, "{stdout}");
    // What is known is still printed: the table, then the persisted line.
    assert!(stdout.contains("persisted"), "{stdout}");
    assert!(stdout.contains("stock_left"), "{stdout}");
    assert!(stderr.contains("is the server still running?"), "{stderr}");
}

#[sqlx::test(migrations = false)]
async fn a_demo_whose_every_press_is_rate_limited_warns_and_exits_1(db: PgPool) {
    let app = TestApp::spawn(db.clone()).await;
    // One grab a second per shopper, no burst beyond it.
    let (_server, base) = app
        .spawn_server(
            "serve",
            &[
                ("RATE_LIMIT_PER_USER", "1".to_string()),
                ("RATE_LIMIT_PER_USER_BURST", "1".to_string()),
            ],
        )
        .await;
    let voucher = app.open_sale(10).await;
    // The demo's three shoppers have each just pressed: their next second's grab is used.
    for user in 500..503 {
        let status = app
            .client
            .post(format!("{base}/vouchers/{voucher}/seckill"))
            .bearer_auth(app.token(user))
            .send()
            .await
            .unwrap()
            .status();
        assert_eq!(status.as_u16(), 202);
    }
    let (code, stdout, stderr) = demo(
        &base,
        &[
            "--voucher",
            &voucher.to_string(),
            "--shoppers",
            "3",
            "--first-user",
            "500",
            "--seconds",
            "0",
        ],
    )
    .await;
    assert!(!stderr.contains("panicked"), "{stderr}");
    let (_, t) = parse(&stdout);
    assert_eq!((t["rate_limited"], t["total"]), (3, 3), "{stdout}");
    assert!(stderr.contains("every press was rate_limited"), "{stderr}");
    assert_eq!(code, Some(1), "{stdout}\n{stderr}");
}
