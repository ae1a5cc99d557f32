//! Real faults during a sale: workers killed with SIGKILL, Postgres cut off behind a
//! proxy, Redis flushed, SIGTERM under load. After each: every admitted order persisted
//! exactly once, Postgres stock = initial - orders, no user twice, nothing left pending.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use crate::common::faults::{self, PrivateRedis, Process, Proxy};
use crate::common::{press_all, TestApp};
use reqwest::StatusCode;
use serde_json::Value;
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

/// The order ids of the 202 answers, by user; panics on any 5xx.
fn admitted(results: &[(i64, Option<(StatusCode, Value)>)]) -> HashMap<i64, i64> {
    let mut ids = HashMap::new();
    for (user, answer) in results {
        if let Some((status, body)) = answer {
            assert!(!status.is_server_error(), "user {user}: {status} {body}");
            if *status == StatusCode::ACCEPTED {
                ids.insert(*user, body["order_id"].as_str().unwrap().parse().unwrap());
            }
        }
    }
    ids
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn orders_admitted_while_only_the_api_runs_survive_workers_killed_mid_drain(db: PgPool) {
    let app = TestApp::spawn(db.clone()).await;
    let prefix = app.keys.prefix().to_string();
    let url = faults::database_url(&db, None);
    let (_api, base) = app.spawn_server("api", &[]).await;

    let stock = 3000;
    let voucher = app.open_sale(stock).await;
    let results = press_all(&app, &base, voucher, 1..=stock, 64).await;
    let winners = admitted(&results);
    assert_eq!(winners.len(), stock as usize);
    assert!(
        app.pg_orders(voucher).await.is_empty(),
        "nothing persisted without a worker"
    );

    let worker_env = [
        ("WORKER_BATCH_SIZE", "20".to_string()),
        // One lane drains slowly enough that most kills land with work left.
        ("WORKER_CONCURRENCY", "1".to_string()),
        ("WORKER_BLOCK_MS", "100".to_string()),
        ("WORKER_CLAIM_IDLE_MS", "300".to_string()),
        // Each kill re-delivers a batch; this test is about kills, not the poison bound.
        ("WORKER_MAX_DELIVERIES", "100".to_string()),
    ];
    // Each worker is killed as soon as it has written something: mid-drain, most
    // likely mid-batch. How far a worker gets before its kill depends on the
    // machine, so the kills stop once the drain is done.
    let mut progress = vec![0];
    while progress.len() <= 5 && *progress.last().unwrap() < stock as usize {
        let mut worker = Process::spawn("worker", &app.redis_url, &prefix, &url, &worker_env);
        let seen = *progress.last().unwrap();
        app.wait_for_orders(voucher, seen + 1, Duration::from_secs(10))
            .await;
        worker.kill9();
        progress.push(app.pg_order_count(voucher).await);
    }
    println!("orders persisted after each kill -9: {progress:?}");
    assert!(
        progress.windows(2).all(|w| w[0] < w[1]),
        "every worker wrote something"
    );
    let mid_drain = progress[1..]
        .iter()
        .filter(|&&n| n < stock as usize)
        .count();
    assert!(
        mid_drain >= 3,
        "at least three kills left orders unwritten: {progress:?}"
    );

    // (Serving its figures: up, so the stop below is asked of a started worker.)
    let port = faults::free_port();
    let mut env = worker_env.to_vec();
    env.push(("METRICS_BIND", format!("127.0.0.1:{port}")));
    let mut last = Process::spawn("worker", &app.redis_url, &prefix, &url, &env);
    let persisted = app
        .wait_for_orders(voucher, stock as usize, Duration::from_secs(60))
        .await;
    assert_eq!(persisted, stock as usize);
    let deadline = Instant::now() + Duration::from_secs(30);
    while app
        .client
        .get(format!("http://127.0.0.1:{port}/healthz"))
        .send()
        .await
        .is_err()
    {
        assert!(Instant::now() < deadline, "the last worker never started");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for _ in 0..100 {
        if app.pending_count().await == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    last.sigterm();
    assert_eq!(
        last.wait_exit(Duration::from_secs(10))
            .await
            .and_then(|s| s.code()),
        Some(0)
    );

    let stored = app.assert_consistent(voucher, stock).await;
    assert_eq!(stored, winners.values().copied().collect::<HashSet<_>>());
    assert_eq!(app.pg_stock(voucher).await, 0);
    assert_eq!(app.pending_count().await, 0);
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_postgres_outage_during_a_sale_loses_and_doubles_nothing(db: PgPool) {
    let opts = db.connect_options().as_ref().clone();
    let target = tokio::net::lookup_host((opts.get_host(), opts.get_port()))
        .await
        .unwrap()
        .next()
        .unwrap();
    let proxy = Proxy::start(target).await;
    let behind_proxy = PgPoolOptions::new()
        .max_connections(5)
        .acquire_timeout(Duration::from_secs(1))
        .connect_lazy_with(opts.host("127.0.0.1").port(proxy.addr.port()));
    // API and worker both reach Postgres only through the proxy.
    let app = TestApp::spawn(behind_proxy.clone()).await;
    let stock = 1000;
    let voucher = app.open_sale(stock).await;
    let cancel = CancellationToken::new();
    let worker = tokio::spawn(
        app.worker_on(behind_proxy, "worker-outage")
            .run(cancel.clone()),
    );

    let mut winners = admitted(&press_all(&app, &app.base, voucher, 1..=200, 32).await);
    proxy.cut();
    // Admission needs only Redis: the sale goes on.
    let during = admitted(&press_all(&app, &app.base, voucher, 201..=500, 32).await);
    assert_eq!(during.len(), 300);
    winners.extend(during);
    let (status, ready) = app.get("/readyz", None).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(ready["checks"]["postgres"], "down", "{ready}");
    assert_eq!(ready["checks"]["redis"], "up");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        app.pending_count().await > 0,
        "the worker kept its entries pending"
    );
    proxy.heal();

    let winners = winners.values().copied().collect();
    all_written(&app, voucher, stock, &winners, Duration::from_secs(30)).await;
    cancel.cancel();
    worker.await.unwrap();
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_flushall_during_a_sale_fails_closed_and_recovers_from_postgres(db: PgPool) {
    let redis = PrivateRedis::start();
    let app = TestApp::spawn_with(db, redis.url.clone(), true).await;
    let stock = 100;
    let voucher = app.open_sale(stock).await;
    let cancel = CancellationToken::new();
    let worker = tokio::spawn(app.worker_named("worker-flush").run(cancel.clone()));

    let before = admitted(&press_all(&app, &app.base, voucher, 1..=40, 16).await);
    assert_eq!(before.len(), 40);
    assert_eq!(
        app.wait_for_orders(voucher, 40, Duration::from_secs(20))
            .await,
        40
    );

    redis.flushall();

    // Until the sale is reloaded admission fails closed with 503; then earlier winners
    // are recognised and the rest of the stock sells, and no more.
    let mut unavailable = 0;
    let mut after: HashMap<i64, (StatusCode, Value)> = HashMap::new();
    for user in 1..=200i64 {
        loop {
            let (status, body) = app.grab(voucher, user).await;
            if status == StatusCode::SERVICE_UNAVAILABLE {
                assert_eq!(body["error"]["code"], "unavailable");
                unavailable += 1;
                assert!(unavailable < 1000, "the sale was never reloaded");
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
            after.insert(user, (status, body));
            break;
        }
    }
    println!("503 answers while the sale was reloaded: {unavailable}");
    for user in 1..=40 {
        let (status, body) = &after[&user];
        assert_eq!(*status, StatusCode::CONFLICT);
        assert_eq!(body["error"]["code"], "already_ordered");
        assert_eq!(body["error"]["order_id"], before[&user].to_string());
    }
    let mut winners = before.clone();
    for (user, (status, body)) in &after {
        if *status == StatusCode::ACCEPTED {
            winners.insert(*user, body["order_id"].as_str().unwrap().parse().unwrap());
        } else {
            assert_eq!(*status, StatusCode::CONFLICT, "{body}");
        }
    }
    assert_eq!(
        winners.len(),
        stock as usize,
        "the rest of the stock sold, no more"
    );

    let winners = winners.values().copied().collect();
    all_written(&app, voucher, stock, &winners, Duration::from_secs(20)).await;
    cancel.cancel();
    worker.await.unwrap();
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn sigterm_under_load_finishes_in_flight_requests_and_exits_zero(db: PgPool) {
    let app = TestApp::spawn(db.clone()).await;
    let (mut server, base) = app
        .spawn_server("serve", &[("WORKER_BLOCK_MS", "200".to_string())])
        .await;
    // More presses than the server answers in the 400 ms before SIGTERM, on a fast
    // machine too.
    let stock = 20_000;
    let voucher = app.open_sale(stock).await;

    let load = {
        let app_base = base.clone();
        let app = &app;
        async move { press_all(app, &app_base, voucher, 1..=20_000, 64).await }
    };
    let stop = async {
        tokio::time::sleep(Duration::from_millis(400)).await;
        server.sigterm();
        server.wait_exit(Duration::from_secs(10)).await
    };
    let (results, exit) = tokio::join!(load, stop);
    assert_eq!(
        exit.and_then(|s| s.code()),
        Some(0),
        "exit 0 within 10 s of SIGTERM"
    );
    let winners = admitted(&results);
    let unanswered = results.iter().filter(|(_, a)| a.is_none()).count();
    println!(
        "under load: {} admitted, {unanswered} refused after shutdown",
        winners.len()
    );
    assert!(
        !winners.is_empty() && unanswered > 0,
        "SIGTERM came mid-load"
    );

    // What the stopped worker had not read yet stays in the stream for the next one.
    app.drain().await;
    let live = app.redis_stock(voucher).await.unwrap();
    let stored = app.assert_consistent(voucher, stock).await;
    assert_eq!(
        stored.len() as i64,
        stock - live,
        "every admission persisted once"
    );
    assert!(winners.values().all(|id| stored.contains(id)));
    assert_eq!(app.pending_count().await, 0);
}

/// Every one of `winners` written (waiting up to `limit`), exactly they, the stock's
/// arithmetic holding and nothing left pending.
async fn all_written(
    app: &TestApp,
    voucher: i64,
    stock: i64,
    winners: &HashSet<i64>,
    limit: Duration,
) {
    assert_eq!(
        app.wait_for_orders(voucher, winners.len(), limit).await,
        winners.len()
    );
    assert_eq!(&app.assert_consistent(voucher, stock).await, winners);
    assert_eq!(app.pending_count().await, 0);
}
