//! Bounds on connections: header and idle timeouts, clients that stop reading, the
//! concurrency limit and the connection cap.

use super::*;

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_client_trickling_its_headers_is_cut_off_after_the_header_read_timeout(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let (_server, base) = app
        .spawn_server("api", &[("HTTP_HEADER_READ_TIMEOUT_SECS", "2".into())])
        .await;
    let slow = trickle(&addr_of(&base), Duration::from_millis(500)).await;
    let closed_after = tokio::time::timeout(Duration::from_secs(20), slow)
        .await
        .unwrap()
        .unwrap()
        .expect("the server kept the trickling connection open");
    assert!(
        closed_after >= Duration::from_millis(1500) && closed_after < Duration::from_secs(4),
        "closed after {closed_after:?}, want about 2 s"
    );
    // Fresh clients are served as ever.
    let mut fresh = TcpStream::connect(addr_of(&base)).await.unwrap();
    assert!(healthz_on(&mut fresh).await.starts_with("HTTP/1.1 200"));
}

/// An idle keep-alive connection is closed after the idle timeout, which is longer than
/// the header deadline: the wait between requests is not a slow header.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn an_idle_keep_alive_connection_is_closed_after_the_idle_timeout(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let env = [
        ("HTTP_HEADER_READ_TIMEOUT_SECS", "1".to_string()),
        ("HTTP_KEEPALIVE_IDLE_SECS", "3".to_string()),
    ];
    let (_server, base) = app.spawn_server("api", &env).await;
    let mut conn = TcpStream::connect(addr_of(&base)).await.unwrap();
    assert!(healthz_on(&mut conn).await.starts_with("HTTP/1.1 200"));
    // Idle for longer than the header deadline, then reused: still open.
    tokio::time::sleep(Duration::from_millis(1800)).await;
    assert!(healthz_on(&mut conn).await.starts_with("HTTP/1.1 200"));
    let idle_from = std::time::Instant::now();
    until_closed(&mut conn, Duration::from_secs(10))
        .await
        .expect("the idle connection was never closed");
    let idle = idle_from.elapsed();
    assert!(
        idle >= Duration::from_millis(2500) && idle < Duration::from_secs(5),
        "closed after {idle:?} idle, want about 3 s"
    );
}

/// A client that stops reading its answers (a dead phone, a stuck `/live/events` page)
/// loses its connection once the writes have stalled for the idle timeout, instead of
/// holding it and the answers buffered for it forever.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_client_that_stops_reading_its_answers_is_cut_off_after_the_idle_timeout(db: PgPool) {
    const TIMES: usize = 8;
    let app = TestApp::spawn(db).await;
    let env = [("HTTP_KEEPALIVE_IDLE_SECS", "3".to_string())];
    let (_server, base) = app.spawn_server("api", &env).await;
    let whole = bundle_len(&base).await * TIMES;
    let mut stuck = stop_reading(&addr_of(&base), TIMES).await;
    // Others are served meanwhile.
    let mut fresh = TcpStream::connect(addr_of(&base)).await.unwrap();
    assert!(healthz_on(&mut fresh).await.starts_with("HTTP/1.1 200"));
    // Stalled for longer than the idle timeout: reading now finds the connection
    // closed before all the answers (a server that kept it would hand them all over).
    tokio::time::sleep(Duration::from_secs(6)).await;
    let got = until_closed(&mut stuck, Duration::from_secs(20))
        .await
        .unwrap_or_else(|got| panic!("still open after {} bytes", got.len()));
    assert!(
        got.len() < whole,
        "all {} bytes were delivered: the stalled connection was kept",
        got.len()
    );
    println!(
        "a client that stopped reading: cut off after {} of {whole} bytes",
        got.len()
    );
}

/// Shutdown does not wait on clients that stopped reading: answers still being sent get
/// a second to make progress.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_client_that_stops_reading_cannot_hold_the_process_at_shutdown(db: PgPool) {
    let app = TestApp::spawn(db).await;
    // The default idle timeout (75 s): only the shutdown rule can close it soon.
    let (mut server, base) = app.spawn_server("api", &[]).await;
    let _stuck = stop_reading(&addr_of(&base), 8).await;
    let mut page = TcpStream::connect(addr_of(&base)).await.unwrap();
    let request = format!(
        "GET /live/events HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {}\r\n\r\n",
        crate::common::admin_bearer()
    );
    page.write_all(request.as_bytes()).await.unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let stopping = std::time::Instant::now();
    server.sigterm();
    let status = server
        .wait_exit(Duration::from_secs(15))
        .await
        .expect("the process waited on a client that does not read");
    assert!(status.success(), "{status}");
    println!(
        "stopped in {:?} with a client not reading",
        stopping.elapsed()
    );
}

/// `MAX_CONCURRENT_REQUESTS` counts the process's requests, whatever their route: with
/// two closes waiting on a held row lock and a limit of 2, a read of another route is
/// shed at once, and served again once they finish. `/metrics` is outside it: a full
/// process is exactly when Prometheus must still see it (and the shedding).
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn the_concurrency_limit_is_one_for_all_routes_and_never_blinds_metrics(db: PgPool) {
    let app = TestApp::spawn(db.clone()).await;
    let env = [("MAX_CONCURRENT_REQUESTS", "2".to_string())];
    let (_server, base) = app.spawn_server("api", &env).await;
    let http = reqwest::Client::new();
    let voucher = crate::common::open_sale_at(&http, &base, 5).await;

    let mut lock = db.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM seckill_vouchers WHERE voucher_id = $1 FOR UPDATE")
        .bind(voucher)
        .execute(&mut *lock)
        .await
        .unwrap();
    let closes: Vec<_> = (0..2)
        .map(|_| {
            let req = http
                .post(format!("{base}/vouchers/{voucher}/close"))
                .bearer_auth(app.admin_token());
            tokio::spawn(async move { req.send().await.unwrap().status() })
        })
        .collect();
    // Both closes wait on the lock (Postgres shows them waiting).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND wait_event_type = 'Lock'",
        )
        .fetch_one(&db)
        .await
        .unwrap();
        if waiting >= 2 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the closes never waited"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let resp = http
        .get(format!("{base}/vouchers/{voucher}"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["code"], "unavailable", "{body}");
    let resp = http
        .get(format!("{base}/metrics"))
        .bearer_auth(crate::common::admin_bearer())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK, "a scrape at the limit");
    let text = resp.text().await.unwrap();
    let shed = text
        .lines()
        .find_map(|l| l.strip_prefix("seckill_http_shed_total "))
        .and_then(|n| n.parse::<f64>().ok());
    assert!(shed.is_some_and(|n| n >= 1.0), "shed counted: {shed:?}");

    lock.rollback().await.unwrap();
    for close in closes {
        assert_eq!(close.await.unwrap(), StatusCode::OK);
    }
    let resp = http
        .get(format!("{base}/vouchers/{voucher}"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
}

/// The incident: slowloris clients held every descriptor and `/healthz` could not even
/// be accepted. With the process's descriptor limit at 128 and more slow clients than
/// that, the connection cap keeps descriptors free and the header deadline frees
/// slots: a fresh client is answered.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn slow_clients_beyond_the_connection_cap_do_not_stop_healthz_from_answering(db: PgPool) {
    use crate::common::faults;
    let app = TestApp::spawn(db).await;
    let port = faults::free_port();
    let mut cmd = std::process::Command::new("sh");
    cmd.args(["-c", "ulimit -n 128 && exec \"$0\" api", faults::BIN])
        .env("DATABASE_URL", faults::database_url(&app.db, None))
        .env("DATABASE_MAX_CONNECTIONS", "4")
        .env("REDIS_URL", &app.redis_url)
        .env("REDIS_KEY_PREFIX", app.keys.prefix())
        .env("JWT_SECRET", crate::common::SECRET)
        .env("BIND", format!("127.0.0.1:{port}"))
        .env("HTTP_HEADER_READ_TIMEOUT_SECS", "1")
        .env("HTTP_MAX_CONNECTIONS", "32")
        .env("RUST_LOG", "error")
        .stdout(std::process::Stdio::null());
    let _server = faults::Process {
        child: cmd.spawn().unwrap(),
    };
    let base = format!("http://127.0.0.1:{port}");
    faults::wait_ready(&base).await;

    let mut slow = Vec::new();
    for _ in 0..140 {
        slow.push(trickle(&addr_of(&base), Duration::from_millis(300)).await);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = std::time::Instant::now();
    let mut fresh = TcpStream::connect(addr_of(&base)).await.unwrap();
    let answer = healthz_within(&mut fresh, Duration::from_secs(15)).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    eprintln!("healthz answered after {:?}", started.elapsed());
    for task in slow {
        task.abort();
    }
}
