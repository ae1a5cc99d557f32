//! `seckill reconcile` and `seckill dead-letters`, run as the real binary.

use std::process::Command;

use crate::common::faults::{database_url, BIN};
use crate::common::{vid, TestApp};
use reqwest::StatusCode;
use sqlx::PgPool;

/// Runs `seckill <args>` against the test's database and key space.
fn seckill(app: &TestApp, args: &[&str]) -> (i32, String) {
    app.cli(args)
}

fn row(table: &str, voucher: i64) -> &str {
    table
        .lines()
        .find(|l| l.split_whitespace().next() == Some(&voucher.to_string()))
        .unwrap_or_else(|| panic!("no row for voucher {voucher} in\n{table}"))
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn books_balance_with_orders_in_flight_and_after_the_worker_ran(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(50).await;
    for user in 1..=10 {
        assert_eq!(app.grab(voucher, user).await.0, StatusCode::ACCEPTED);
    }
    let (code, table) = seckill(&app, &["reconcile"]);
    assert_eq!(code, 0);
    // voucher initial pg_stock pg_orders redis_stock redis_buyers in_flight ...
    let cols: Vec<&str> = row(&table, voucher).split_whitespace().collect();
    assert_eq!(&cols[1..8], ["50", "50", "0", "40", "10", "10", "0"]);
    assert!(table.contains("books balance"));

    app.drain().await;
    let (code, table) = seckill(&app, &["reconcile", "--voucher", &voucher.to_string()]);
    assert_eq!(code, 0);
    let cols: Vec<&str> = row(&table, voucher).split_whitespace().collect();
    assert_eq!(&cols[1..8], ["50", "40", "10", "40", "10", "0", "0"]);
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn drift_is_reported_with_a_failing_exit_and_repair_rebuilds_redis(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(20).await;
    let (_, first) = app.grab(voucher, 1).await;
    app.grab(voucher, 2).await;
    app.drain().await;
    app.grab(voucher, 3).await; // in flight
                                // Somebody tampered with Redis: five phantom units, and user 1's purchase forgotten.
    let _: () = app
        .redis_cmd(
            redis::cmd("HINCRBY")
                .arg(app.keys.voucher(vid(voucher)))
                .arg("stock")
                .arg(5),
        )
        .await;
    let _: () = app
        .redis_cmd(
            redis::cmd("HDEL")
                .arg(app.keys.voucher(vid(voucher)))
                .arg("u:1"),
        )
        .await;

    let (code, table) = seckill(&app, &["reconcile"]);
    assert_eq!(code, 1);
    assert!(row(&table, voucher).ends_with("DRIFT"), "{table}");

    let (code, table) = seckill(&app, &["reconcile", "--repair"]);
    assert_eq!(code, 0, "{table}");
    assert!(table.contains("books balance"));
    let live = app.redis_stock(voucher).await.unwrap();
    assert_eq!(live, 17, "20 - 2 written - 1 in flight");
    let (status, again) = app.grab(voucher, 1).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(again["error"]["order_id"], first["order_id"]);
    assert_eq!(
        app.grab(voucher, 3).await.1["error"]["code"],
        "already_ordered"
    );
    app.drain().await;
    app.assert_consistent(voucher, 20).await;
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn an_open_sale_missing_from_redis_is_reported_and_repaired(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(5).await;
    let _: () = app
        .redis_cmd(redis::cmd("DEL").arg(app.keys.voucher(vid(voucher))))
        .await;
    let (code, table) = seckill(&app, &["reconcile"]);
    assert_eq!(code, 1);
    assert!(row(&table, voucher).ends_with("MISSING"));
    let (code, _) = seckill(
        &app,
        &["reconcile", "--voucher", &voucher.to_string(), "--repair"],
    );
    assert_eq!(code, 0);
    assert_eq!(app.grab(voucher, 9).await.0, StatusCode::ACCEPTED);
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn dead_letters_are_listed_with_their_reason(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(5).await;
    let stream = app.keys.stream(app.keys.shard_of(vid(voucher)));
    let _: String = app
        .redis_cmd(
            redis::cmd("XADD")
                .arg(stream)
                .arg("*")
                .arg("order_id")
                .arg("nope"),
        )
        .await;
    app.drain().await;
    let (code, listing) = seckill(&app, &["dead-letters"]);
    assert_eq!(code, 0);
    assert!(
        listing.contains("reason=malformed: missing or non-numeric fields"),
        "{listing}"
    );
    assert!(listing.contains("orig.order_id=nope"));
    assert!(listing.contains("1 dead letter(s) in all"));
    let metrics = app.metrics_text().await;
    let gauge = metrics
        .lines()
        .find(|l| l.starts_with("seckill_dead_letters{"))
        .unwrap_or_else(|| panic!("no dead-letter gauge in\n{metrics}"));
    assert!(gauge.ends_with(" 1"), "{gauge}");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_phantom_order_waiting_to_be_buried_is_no_drift_before_or_after(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(10).await;
    app.grab(voucher, 5).await;
    app.drain().await;
    // Redis forgets the buyer; their next press is a phantom the worker will bury.
    let _: () = app
        .redis_cmd(
            redis::cmd("HDEL")
                .arg(app.keys.voucher(vid(voucher)))
                .arg("u:5"),
        )
        .await;
    assert_eq!(app.grab(voucher, 5).await.0, StatusCode::ACCEPTED);
    let (code, table) = seckill(&app, &["reconcile", "--voucher", &voucher.to_string()]);
    assert_eq!(
        code, 0,
        "the phantom's record and unit are accounted for:\n{table}"
    );
    app.drain().await;
    let (code, table) = seckill(&app, &["reconcile", "--voucher", &voucher.to_string()]);
    assert_eq!(code, 0, "{table}");
    let cols: Vec<&str> = row(&table, voucher).split_whitespace().collect();
    // initial pg_stock pg_orders redis_stock redis_buyers in_flight dead_letters
    assert_eq!(&cols[1..8], ["10", "9", "1", "9", "1", "0", "1"]);
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn reconcile_into_a_closed_pipe_exits_quietly_instead_of_panicking(db: PgPool) {
    let app = TestApp::spawn(db).await;
    for _ in 0..3 {
        app.open_sale(5).await;
    }
    // `seckill reconcile | head -0`: the reader is gone before the first line.
    let mut child = Command::new(BIN)
        .arg("reconcile")
        .env("DATABASE_URL", database_url(&app.db, None))
        .env("REDIS_URL", &app.redis_url)
        .env("REDIS_KEY_PREFIX", app.keys.prefix())
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(out.status.code(), Some(0), "{stderr}");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_sale_with_three_hundred_thousand_buyers_is_repaired_in_chunks(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let buyers: i64 = 300_000;
    let voucher = app.open_sale(buyers + 5).await;
    // The orders of a huge sale, written straight into Postgres.
    sqlx::query(
        "INSERT INTO voucher_orders (id, user_id, voucher_id, status, created_at, pay_before) \
         SELECT 1000000 + g, g, $1, 'created', now(), now() + interval '1 hour' \
         FROM generate_series(1, $2) g",
    )
    .bind(voucher)
    .bind(buyers)
    .execute(&app.db)
    .await
    .unwrap();
    sqlx::query("UPDATE seckill_vouchers SET stock = stock - $2 WHERE voucher_id = $1")
        .bind(voucher)
        .bind(buyers as i32)
        .execute(&app.db)
        .await
        .unwrap();
    let _: () = app
        .redis_cmd(redis::cmd("DEL").arg(app.keys.voucher(vid(voucher))))
        .await;

    let started = std::time::Instant::now();
    let (code, out) = seckill(
        &app,
        &["reconcile", "--voucher", &voucher.to_string(), "--repair"],
    );
    println!(
        "repair of {buyers} buyers: {:.1} s",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(code, 0, "{out}");
    assert_eq!(app.redis_stock(voucher).await, Some(5));
    let fields: i64 = app
        .redis_cmd(redis::cmd("HLEN").arg(app.keys.voucher(vid(voucher))))
        .await;
    assert_eq!(
        fields,
        buyers + 6,
        "every buyer, and stock, begin, end, term, gen, epoch"
    );
    assert_eq!(
        app.grab(voucher, 123_456).await.1["error"]["order_id"],
        (1_000_000 + 123_456).to_string()
    );
    assert_eq!(app.grab(voucher, buyers + 1).await.0, StatusCode::ACCEPTED);
}
