//! A store down when the service starts: `seckill serve` starts and listens all the
//! same, `/readyz` names the store that is away, grabs of sales Redis holds are admitted
//! while Postgres is away, and everything catches up by itself when it returns.

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::Value;
use sqlx::PgPool;

use crate::common::faults::{database_url, free_port, postgres_addr, Process, Proxy};
use crate::common::{press_all, TestApp};

/// Where the Redis at `url` listens.
fn redis_addr(url: &str) -> std::net::SocketAddr {
    let parsed = url::Url::parse(url).unwrap();
    let host = match parsed.host_str().unwrap() {
        "localhost" => "127.0.0.1",
        other => other,
    };
    format!("{host}:{}", parsed.port().unwrap_or(6379))
        .parse()
        .unwrap()
}

/// `seckill serve` on a spare port, reaching its stores as `env` says; not waited for.
fn serve(app: &TestApp, env: &[(&str, String)]) -> (Process, String) {
    let port = free_port();
    let mut env = env.to_vec();
    env.push(("BIND", format!("127.0.0.1:{port}")));
    let process = Process::spawn(
        "serve",
        &app.redis_url,
        app.keys.prefix(),
        &database_url(&app.db, None),
        &env,
    );
    (process, format!("http://127.0.0.1:{port}"))
}

/// `GET /readyz`: its status and body, once the process listens (bounded).
async fn readiness(app: &TestApp, base: &str) -> (StatusCode, Value) {
    let began = Instant::now();
    loop {
        if let Ok(resp) = app.client.get(format!("{base}/readyz")).send().await {
            let status = resp.status();
            return (status, resp.json().await.unwrap());
        }
        assert!(
            began.elapsed() < Duration::from_secs(30),
            "{base} does not listen"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits (bounded) until `/readyz` answers 200; how long that took.
async fn until_ready(app: &TestApp, base: &str, limit: Duration) -> Duration {
    let began = Instant::now();
    loop {
        let (status, body) = readiness(app, base).await;
        if status == StatusCode::OK {
            return began.elapsed();
        }
        assert!(began.elapsed() < limit, "not ready after {limit:?}: {body}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn serve_starts_with_postgres_down_admits_what_redis_holds_and_catches_up(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let sale = app.open_sale(50).await;
    let proxy = Proxy::start(postgres_addr(&app.db)).await;
    proxy.cut();
    let started = Instant::now();
    let (mut server, base) = serve(
        &app,
        &[("DATABASE_URL", database_url(&app.db, Some(proxy.addr)))],
    );
    let (status, body) = readiness(&app, &base).await;
    let listening = started.elapsed();
    println!("listening {listening:?} after the start, postgres away: {body}");
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(body["checks"]["postgres"], "down", "{body}");
    assert_eq!(body["checks"]["migrations"], "pending", "{body}");
    assert_eq!(body["checks"]["redis"], "up", "{body}");

    // Admission needs only Redis: the sale Redis holds sells on.
    let answers = crate::recovery::rollback::press_through_503s(&app, &base, sale, 1..=20).await;
    let won = crate::recovery::rollback::won(&answers);
    assert_eq!(won.len(), 20, "{answers:?}");
    assert!(app.pg_orders(sale).await.is_empty(), "postgres is away");

    proxy.heal();
    let ready_in = until_ready(&app, &base, Duration::from_secs(60)).await;
    assert_eq!(
        app.wait_for_orders(sale, 20, Duration::from_secs(60)).await,
        20,
        "the worker catches up"
    );
    let orders: std::collections::HashSet<i64> = app
        .pg_orders(sale)
        .await
        .into_iter()
        .map(|(o, _)| o)
        .collect();
    assert!(
        won.values().all(|o| orders.contains(o)),
        "every 202 written"
    );
    println!("ready {ready_in:?} after postgres came back; the 20 orders written");

    // Told to stop while Postgres is away, it stops at once.
    proxy.cut();
    server.sigterm();
    let stopped = server.wait_exit(Duration::from_secs(15)).await;
    assert!(stopped.is_some(), "still running 15 s after SIGTERM");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn serve_starts_with_redis_down_and_admits_once_it_answers(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let sale = app.open_sale(10).await;
    let proxy = Proxy::start(redis_addr(&app.redis_url)).await;
    proxy.cut();
    let (_server, base) = serve(&app, &[("REDIS_URL", format!("redis://{}", proxy.addr))]);
    let (status, body) = readiness(&app, &base).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(body["checks"]["redis"], "down", "{body}");
    assert_eq!(body["checks"]["postgres"], "up", "{body}");
    let away = press_all(&app, &base, sale, [1], 1).await;
    let (status, body) = away[0].1.clone().unwrap();
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(
        body["error"]["outcome"],
        Value::Null,
        "nothing reserved: {body}"
    );

    proxy.heal();
    let ready_in = until_ready(&app, &base, Duration::from_secs(60)).await;
    let answers = crate::recovery::rollback::press_through_503s(&app, &base, sale, 1..=10).await;
    assert_eq!(
        crate::recovery::rollback::won(&answers).len(),
        10,
        "{answers:?}"
    );
    println!("ready {ready_in:?} after redis came back; 10 of 10 admitted");
}
