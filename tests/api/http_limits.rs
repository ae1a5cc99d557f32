//! The HTTP server's own limits (slow and idle connections, a connection cap,
//! oversized headers), honest answers when the admission store fails mid-call, read
//! paths that fall back to Postgres while Redis is down, and input nits.

use std::time::Duration;

use crate::common::{oid, uid, vid, TestApp};
use reqwest::StatusCode;
use serde_json::json;
use sqlx::PgPool;

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_begin_time_postgres_cannot_store_is_a_422_validation_error(db: PgPool) {
    let app = TestApp::spawn(db).await;
    for (begin, end) in [
        ("-262143-01-01T00:00:00Z", "2099-01-01T00:00:00Z"),
        ("2026-01-01T00:00:00Z", "+262142-12-31T00:00:00Z"),
    ] {
        let body = json!({"shop_id": 1, "title": "t", "pay_value": 1, "actual_value": 2,
            "seckill": {"stock": 5, "begin_time": begin, "end_time": end}});
        let (status, answer) = app
            .post_json("/vouchers", Some(&app.admin_token()), &body)
            .await;
        assert_eq!(
            status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{begin}..{end}: {answer}"
        );
        assert_eq!(answer["error"]["code"], "validation", "{answer}");
    }
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM vouchers")
        .fetch_one(&app.db)
        .await
        .unwrap();
    assert_eq!(stored, 0);
}

/// The cluster client may re-send the script after a dropped connection: the second run
/// finds the buyer record the first wrote, with this request's own order id. That is
/// the request's admission (202), not somebody's earlier order (409).
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_script_run_twice_for_one_request_answers_202_with_the_order_it_minted(db: PgPool) {
    use seckill::admission::{admit, Outcome};
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(5).await;
    let minted = app.state.ids.next().unwrap();
    let mut conn = app.redis.clone();
    let first = admit(&mut conn, &app.keys, vid(voucher), uid(42), minted)
        .await
        .unwrap();
    assert_eq!(first, Outcome::Admitted { order_id: minted });
    let second = admit(&mut conn, &app.keys, vid(voucher), uid(42), minted).await;
    assert_eq!(
        second.as_ref().unwrap(),
        &Outcome::AlreadyOrdered { order_id: minted }
    );
    assert_eq!(
        seckill::http::seckill::answer(second, minted).unwrap(),
        minted
    );
    assert_eq!(app.redis_stock(voucher).await, Some(4), "one unit, once");
    // Another request of the same user (another minted id) is told about the order.
    let (status, body) = app.grab(voucher, 42).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(body["error"]["order_id"], minted.to_string());
}

/// Blocks a Redis server for `millis` with a busy script (no DEBUG command needed):
/// commands sent meanwhile wait in its socket buffers and run afterwards.
pub(crate) async fn block_redis(url: &str, millis: u64) -> tokio::task::JoinHandle<()> {
    let client = redis::Client::open(url).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let task = tokio::spawn(async move {
        let busy = "local t = redis.call('TIME') local start = t[1] * 1000 + t[2] / 1000 \
                    while true do t = redis.call('TIME') \
                    if t[1] * 1000 + t[2] / 1000 - start > tonumber(ARGV[1]) then return 1 end end";
        let _: redis::RedisResult<i64> = redis::cmd("EVAL")
            .arg(busy)
            .arg(0)
            .arg(millis)
            .query_async(&mut conn)
            .await;
    });
    // Let the script start before anything else is sent.
    tokio::time::sleep(Duration::from_millis(200)).await;
    task
}

/// Redis takes the grab but answers after the API's command timeout: the script ran
/// and the order exists, so the 503 must not say that nothing was reserved. A retry
/// once Redis answers tells the truth.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_grab_whose_redis_call_times_out_says_the_outcome_is_unknown_and_a_retry_tells(
    db: PgPool,
) {
    let redis = crate::common::faults::PrivateRedis::start();
    let app = TestApp::spawn_with(db, redis.url.clone(), false).await;
    let voucher = app.open_sale(5).await;
    // A first grab loads the script into this new Redis (else EVALSHA finds no script).
    assert_eq!(app.grab(voucher, 6).await.0, StatusCode::ACCEPTED);
    // Longer than the API's Redis command timeout (2 s).
    let blocked = block_redis(&redis.url, 3_500).await;
    let started = std::time::Instant::now();
    let (status, body) = app.grab(voucher, 7).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "answered while Redis was blocked"
    );
    assert_eq!(body["error"]["code"], "unavailable", "{body}");
    assert_eq!(body["error"]["outcome"], "unknown", "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(!message.contains("nothing was reserved"), "{message}");
    assert!(
        message.contains("already_ordered"),
        "says how to find out: {message}"
    );
    tokio::time::timeout(Duration::from_secs(10), blocked)
        .await
        .unwrap()
        .unwrap();

    // The grab did go through once Redis woke up; the retry says so, with the order id.
    let (status, body) = app.grab(voucher, 7).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(body["error"]["code"], "already_ordered", "{body}");
    let order_id: i64 = body["error"]["order_id"].as_str().unwrap().parse().unwrap();
    assert_eq!(app.redis_stock(voucher).await, Some(3));
    let orders =
        seckill::admission::orders_of(&mut app.redis.clone(), &app.keys, uid(7), &[vid(voucher)])
            .await
            .unwrap();
    assert_eq!(
        orders.iter().map(|o| o.order_id).collect::<Vec<_>>(),
        [oid(order_id)]
    );
}

/// With Redis gone, read paths answer from Postgres within a second instead of paying
/// reconnect attempts per sale until the request times out.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn read_paths_answer_from_postgres_within_a_second_while_redis_is_down(db: PgPool) {
    let redis = crate::common::faults::PrivateRedis::start();
    let app = TestApp::spawn_with(db, redis.url.clone(), false).await;
    let mut sales = Vec::new();
    for _ in 0..25 {
        sales.push(app.open_sale(3).await);
    }
    assert_eq!(app.grab(sales[0], 9).await.0, StatusCode::ACCEPTED);
    app.drain().await;
    drop(redis); // killed

    let timed = |path: String, token: Option<String>| {
        let app = &app;
        async move {
            let started = std::time::Instant::now();
            let mut req = app.client.get(app.url(&path));
            if let Some(t) = token {
                req = req.bearer_auth(t);
            }
            let resp = tokio::time::timeout(Duration::from_secs(8), req.send())
                .await
                .unwrap_or_else(|_| panic!("{path}: no answer in 8 s"))
                .unwrap();
            let fallback = resp.headers().get("x-seckill-fallback").cloned();
            let status = resp.status();
            let body: serde_json::Value = resp.json().await.unwrap();
            let took = started.elapsed();
            // Generous for a slow CI; the deadline is 500 ms.
            assert!(took < Duration::from_secs(3), "{path} took {took:?}");
            (status, fallback, body)
        }
    };
    let (status, fallback, list) = timed("/shops/1/vouchers".into(), None).await;
    assert_eq!(status, StatusCode::OK, "{list}");
    assert_eq!(fallback.unwrap(), "postgres");
    let list = list.as_array().unwrap();
    assert_eq!(list.len(), 25);
    let first = list.iter().find(|v| v["id"] == sales[0]).unwrap();
    assert_eq!(
        first["stock"], 2,
        "Postgres's count, the written order taken off"
    );

    let (status, fallback, voucher) = timed(format!("/vouchers/{}", sales[1]), None).await;
    assert_eq!(status, StatusCode::OK, "{voucher}");
    assert_eq!(fallback.unwrap(), "postgres");
    assert_eq!(voucher["stock"], 3);

    let (status, fallback, orders) = timed("/orders".into(), Some(app.token(9))).await;
    assert_eq!(status, StatusCode::OK, "{orders}");
    assert_eq!(fallback.unwrap(), "postgres");
    assert_eq!(orders.as_array().unwrap().len(), 1, "{orders}");

    // Not in Postgres: only Redis could say whether it is pending, so 503, quickly.
    let (status, _, body) = timed("/orders/123456789".into(), Some(app.token(9))).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(body["error"]["code"], "unavailable");
}

// --- The server's own limits, against the real binary. ---

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn addr_of(base: &str) -> String {
    base.trim_start_matches("http://").to_string()
}

/// Reads from `stream` until the server closes it (EOF or reset); `Err` if it is still
/// open after `limit`. Whatever it sent before is returned.
async fn until_closed(stream: &mut TcpStream, limit: Duration) -> Result<Vec<u8>, Vec<u8>> {
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + limit;
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) => return Err(got),
            Ok(Ok(0)) | Ok(Err(_)) => return Ok(got),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

/// Sends `GET /healthz` on `stream` and reads its whole (small) answer within `limit`.
async fn healthz_within(stream: &mut TcpStream, limit: Duration) -> String {
    let deadline = tokio::time::Instant::now() + limit;
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n")
        .await
        .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains("\"ok\"}") {
        let n = tokio::time::timeout_at(deadline, stream.read(&mut buf))
            .await
            .unwrap_or_else(|_| panic!("no answer within {limit:?}"))
            .unwrap();
        assert!(
            n > 0,
            "closed before answering: {}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&got).into_owned()
}

async fn healthz_on(stream: &mut TcpStream) -> String {
    healthz_within(stream, Duration::from_secs(5)).await
}

/// Opens a connection that starts a request and then sends one more header byte every
/// `every`, as a slowloris client does, until the server closes it.
async fn trickle(addr: &str, every: Duration) -> tokio::task::JoinHandle<Option<Duration>> {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    tokio::spawn(async move {
        let started = std::time::Instant::now();
        if stream
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: test\r\nX-Slow: ")
            .await
            .is_err()
        {
            return Some(started.elapsed());
        }
        let mut buf = [0u8; 64];
        while started.elapsed() < Duration::from_secs(60) {
            tokio::select! {
                read = stream.read(&mut buf) => match read {
                    Ok(0) | Err(_) => return Some(started.elapsed()),
                    Ok(_) => {}
                },
                _ = tokio::time::sleep(every) => {
                    if stream.write_all(b"a").await.is_err() {
                        return Some(started.elapsed());
                    }
                }
            }
        }
        None
    })
}

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

/// Opens a connection with a small receive buffer, asks for the Swagger UI bundle
/// (about 1.5 MB) `times` over in one go, and never reads: the server's writes stall.
async fn stop_reading(addr: &str, times: usize) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stream = socket.connect(addr.parse().unwrap()).await.unwrap();
    let request = b"GET /docs/swagger-ui-bundle.js HTTP/1.1\r\nHost: test\r\n\r\n";
    stream.write_all(&request.repeat(times)).await.unwrap();
    stream
}

async fn bundle_len(base: &str) -> usize {
    let resp = reqwest::get(format!("{base}/docs/swagger-ui-bundle.js"))
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    resp.bytes().await.unwrap().len()
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
    page.write_all(b"GET /live/events HTTP/1.1\r\nHost: test\r\n\r\n")
        .await
        .unwrap();
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
    let resp = http.get(format!("{base}/metrics")).send().await.unwrap();
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

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn oversized_headers_get_a_431_in_the_json_error_format(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let (_server, base) = app.spawn_server("api", &[]).await;
    let client = reqwest::Client::new();
    let big = client
        .get(format!("{base}/healthz"))
        .header("x-big", "a".repeat(40 * 1024));
    let mut many = client.get(format!("{base}/healthz"));
    for i in 0..150 {
        many = many.header(format!("x-h{i}"), "1");
    }
    for (what, req) in [("40 KiB header", big), ("150 headers", many)] {
        let resp = req.send().await.unwrap();
        assert_eq!(
            resp.status(),
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "{what}"
        );
        let body: serde_json::Value = resp.json().await.expect("a JSON body");
        assert_eq!(body["error"]["code"], "validation", "{what}: {body}");
    }
    // Ordinary requests pass.
    let ok = client.get(format!("{base}/healthz")).send().await.unwrap();
    assert_eq!(ok.status(), StatusCode::OK);
}

/// Sends `request` on a new connection and reads the answer until the server closes
/// it: its head (lower-cased) and body.
async fn raw_answer(addr: &str, request: &[u8], what: &str) -> (String, String) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(request).await.unwrap();
    let answer = until_closed(&mut stream, Duration::from_secs(5))
        .await
        .unwrap_or_else(|got| panic!("{what}: still open after {got:?}"));
    let answer = String::from_utf8(answer).unwrap();
    let (head, body) = answer
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("{what}: {answer}"));
    (head.to_ascii_lowercase(), body.to_string())
}

/// Asserts an answer of `status` in the JSON error format, code `validation`, whose
/// message holds `says`.
fn assert_json_error(what: &str, (head, body): &(String, String), status: u16, says: &str) {
    assert!(
        head.starts_with(&format!("http/1.1 {status} ")),
        "{what}: {head}"
    );
    assert!(
        head.contains("\r\ncontent-type: application/json\r\n"),
        "{what}: {head}"
    );
    assert!(
        head.contains(&format!("\r\ncontent-length: {}\r\n", body.len())),
        "{what}: {head}"
    );
    let body: serde_json::Value = serde_json::from_str(body).expect("a JSON body");
    assert_eq!(body["error"]["code"], "validation", "{what}: {body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains(says), "{what}: {message}");
}

/// A URL over 32 KiB is a 414 in the JSON error format: refused by the server's own
/// middleware up to hyper's limit (64 KiB), and by hyper above it, whose bare answer the
/// server rewrites.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_url_too_long_gets_a_414_in_the_json_error_format(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let (_server, base) = app.spawn_server("api", &[]).await;
    let addr = addr_of(&base);
    for kib in [40, 70, 200] {
        let request = format!(
            "GET /vouchers/1?q={} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n",
            "a".repeat(kib * 1024)
        );
        let what = format!("{kib} KiB");
        let answer = raw_answer(&addr, request.as_bytes(), &what).await;
        assert_json_error(&what, &answer, 414, "URL");
    }
    // A long URL below the limit is served.
    let url = format!("{base}/healthz?q={}", "a".repeat(30 * 1024));
    let resp = reqwest::get(url).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
}

/// What hyper refuses before the router sees it (more headers than its parser takes, a
/// request line that is not HTTP) is answered in the JSON error format too, and the
/// connection is closed.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn requests_hyper_refuses_itself_get_the_json_error_format_too(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let (_server, base) = app.spawn_server("api", &[]).await;
    let addr = addr_of(&base);
    let many: String = (0..450).map(|i| format!("x-h{i}: 1\r\n")).collect();
    for (what, request, status, says) in [
        (
            "450 headers",
            format!("GET /healthz HTTP/1.1\r\nHost: test\r\n{many}\r\n"),
            431,
            "headers",
        ),
        (
            "not HTTP",
            "G@T /healthz HTTP/1.1\r\nHost: test\r\n\r\n".to_string(),
            400,
            "HTTP",
        ),
    ] {
        let answer = raw_answer(&addr, request.as_bytes(), what).await;
        assert_json_error(what, &answer, status, says);
    }
}

/// A grab whose request gave up while it waited for its shard's call (the client went
/// away, the request timed out) is not sent afterwards: a grab never sent admits
/// nothing, batched or not.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_grab_abandoned_while_queued_behind_a_slow_call_is_never_sent(db: PgPool) {
    use seckill::admission::{batcher::Batcher, Grab, Outcome};
    let redis = crate::common::faults::PrivateRedis::start();
    let app = TestApp::spawn_with(db, redis.url.clone(), false).await;
    let voucher = app.open_sale(5).await;
    // Loads the script into this new Redis.
    assert_eq!(app.grab(voucher, 6).await.0, StatusCode::ACCEPTED);
    let conn = seckill::redis_conn::connect(&redis.url, Duration::from_secs(5)).unwrap();
    let batcher = std::sync::Arc::new(Batcher::start(
        conn,
        app.keys.clone(),
        128,
        seckill::scripts::Replicas::NONE,
    ));

    let blocked = block_redis(&redis.url, 1_000).await;
    let in_flight = {
        let batcher = batcher.clone();
        tokio::spawn(async move {
            batcher
                .admit(Grab {
                    voucher_id: vid(voucher),
                    user_id: uid(7),
                    order_id: oid(7007),
                })
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let abandoned = tokio::time::timeout(
        Duration::from_millis(100),
        batcher.admit(Grab {
            voucher_id: vid(voucher),
            user_id: uid(8),
            order_id: oid(8008),
        }),
    )
    .await;
    assert!(abandoned.is_err(), "still queued behind the slow call");
    assert_eq!(
        in_flight.await.unwrap().unwrap(),
        Outcome::Admitted {
            order_id: oid(7007)
        }
    );
    blocked.await.unwrap();
    let record: Option<i64> = app
        .redis_cmd(
            redis::cmd("HGET")
                .arg(app.keys.voucher(vid(voucher)))
                .arg("u:8"),
        )
        .await;
    assert_eq!(record, None, "the abandoned grab was not sent");
    assert_eq!(app.redis_stock(voucher).await, Some(3));
}
