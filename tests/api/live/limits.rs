//! Limits on viewers and sales: refused pages logged at debug, truncated snapshots, the
//! viewer cap, vanished peers, headers, and which sales a limit keeps.

use super::*;

/// Refusing a page for too many viewers is expected back-pressure (thousands of
/// refused pages retrying must not read like an outage): a debug line each, no warning
/// and no error (tower_http's trace layer logs its 5xx at debug too).
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn pages_refused_for_too_many_viewers_are_logged_at_debug_not_as_warnings(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let (mut server, base, log) = spawn_logged(
        &app,
        &[
            ("LIVE_MAX_VIEWERS", "1".to_string()),
            ("RUST_LOG", "warn,seckill::http=debug".to_string()),
        ],
    )
    .await;
    let client = reqwest::Client::new();
    let _watching = Events::open(&client, &base).await;
    for _ in 0..20 {
        let resp = client
            .get(format!("{base}/live/events"))
            .bearer_auth(crate::common::admin_bearer())
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            resp.headers()["retry-after"],
            "3",
            "as long as the page first waits"
        );
        let body: Value = resp.json().await.unwrap();
        assert_eq!(body["error"]["code"], "unavailable", "{body}");
    }
    server.sigterm();
    server.wait_exit(WAIT).await.expect("stopped");
    let log = log.join().unwrap();
    let refusals: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("too many pages"))
        .collect();
    assert_eq!(refusals.len(), 20, "one line per refusal:\n{log}");
    assert!(
        refusals.iter().all(|l| l.contains("DEBUG")),
        "refusals logged above debug:\n{log}"
    );
    assert!(
        !log.lines()
            .any(|l| l.contains("WARN") && l.contains("request failed")),
        "{log}"
    );
    assert!(
        !log.lines().any(|l| l.contains("ERROR")),
        "an error logged for a refusal:\n{log}"
    );
}

/// The page shows at most `LIVE_MAX_SALES` sales, and says so: every snapshot counts
/// the sales that qualify and marks itself truncated when some were left out.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn sales_beyond_the_limit_are_counted_and_the_snapshot_says_it_is_truncated(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let (_api, base) = app
        .spawn_server("api", &[("LIVE_MAX_SALES", "2".to_string())])
        .await;
    let now = chrono::Utc::now();
    let mut open = Vec::new();
    for _ in 0..3 {
        open.push(app.open_sale(5).await);
    }
    let upcoming = app
        .create_sale(
            5,
            now + chrono::Duration::hours(1),
            now + chrono::Duration::hours(2),
        )
        .await;
    let client = reqwest::Client::new();
    let mut events = Events::open(&client, &base).await;
    let snapshot = events.next(WAIT).await;
    assert_eq!(snapshot["open_total"], 4, "{snapshot}");
    assert_eq!(snapshot["truncated"], true, "{snapshot}");
    let shown: Vec<i64> = snapshot["sales"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_i64().unwrap())
        .collect();
    assert_eq!(shown.len(), 2, "{snapshot}");
    assert!(
        !shown.contains(&upcoming),
        "open sales come first: {snapshot}"
    );

    // Within the limit: everything shown, not truncated.
    let mut events = Events::open(&app.client, &app.base).await;
    let snapshot = events.next(WAIT).await;
    assert_eq!(snapshot["open_total"], 4, "{snapshot}");
    assert_eq!(snapshot["truncated"], false, "{snapshot}");
    assert_eq!(snapshot["sales"].as_array().unwrap().len(), 4, "{snapshot}");

    // Out of range: refused at start-up, naming the setting.
    let out = std::process::Command::new(crate::common::faults::BIN)
        .arg("api")
        .env("LIVE_MAX_SALES", "0")
        .env("DATABASE_URL", "postgres://unused")
        .env("JWT_SECRET", "x")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("live-max-sales"), "{stderr}");
}

/// A page whose phone vanished without a FIN must not hold its viewer slot for minutes:
/// the server's side of a `/live/events` connection runs TCP keep-alive (and, not
/// visible to `ss`, TCP_USER_TIMEOUT; see `http::server::detect_dead_peers`).
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn the_servers_side_of_a_live_stream_probes_for_a_vanished_peer(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let port = app.base.rsplit(':').next().unwrap().to_string();
    let client = reqwest::Client::new();
    let mut events = Events::open(&client, &app.base).await;
    events.next(WAIT).await;
    let out = std::process::Command::new("ss")
        .args(["-tnoH", "state", "established"])
        .arg(format!("( sport = :{port} )"))
        .output()
        .expect("ss (iproute2)");
    let sockets = String::from_utf8_lossy(&out.stdout);
    assert!(!sockets.trim().is_empty(), "no server socket found");
    assert!(
        sockets.lines().all(|l| l.contains("timer:(keepalive")),
        "{sockets}"
    );
}

/// Pages watching can never take every connection: `LIVE_MAX_VIEWERS` is lowered to half
/// the connection cap at start-up, with a warning saying so.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn viewers_are_capped_at_half_the_connections_with_a_warning(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let (mut server, base, log) = spawn_logged(
        &app,
        &[
            ("LIVE_MAX_VIEWERS", "100".to_string()),
            ("HTTP_MAX_CONNECTIONS", "6".to_string()),
            ("RUST_LOG", "warn".to_string()),
        ],
    )
    .await;
    let client = reqwest::Client::new();
    let mut pages = Vec::new();
    for _ in 0..3 {
        pages.push(Events::open(&client, &base).await);
    }
    let resp = client
        .get(format!("{base}/live/events"))
        .bearer_auth(crate::common::admin_bearer())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    // Shoppers still get in.
    let (status, _) = app.send(client.get(format!("{base}/vouchers/1"))).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    drop(resp);
    drop(pages);
    server.sigterm();
    server.wait_exit(WAIT).await.expect("stopped");
    let log = log.join().unwrap();
    assert!(
        log.lines().any(|l| l.contains("WARN")
            && l.contains("LIVE_MAX_VIEWERS exceeds half the connection cap")
            && l.contains("using=3")),
        "{log}"
    );
}

/// The page, its assets and the stream carry the headers that keep them safe and live:
/// a strict CSP and nosniff on the page's files; on the stream no caching and no proxy
/// buffering (nginx holds a response back unless told `X-Accel-Buffering: no`).
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn the_page_and_its_stream_carry_csp_nosniff_and_no_buffering_headers(db: PgPool) {
    let app = TestApp::spawn(db).await;
    for path in ["/live", "/live/app.js", "/live/app.css"] {
        let resp = (app.client.get(format!("{}{path}", app.admin_base)))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::OK, "{path}");
        let h = resp.headers();
        let csp = h["content-security-policy"].to_str().unwrap();
        assert!(csp.contains("default-src 'none'"), "{path}: {csp}");
        assert!(csp.contains("script-src 'self'"), "{path}: {csp}");
        assert_eq!(h["x-content-type-options"], "nosniff", "{path}");
    }
    let resp = app
        .client
        .get(format!("{}/live/events", app.admin_base))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let h = resp.headers();
    assert_eq!(h["content-type"], "text/event-stream");
    assert_eq!(h["x-accel-buffering"], "no");
    assert_eq!(h["cache-control"], "no-cache");
    assert_eq!(h["x-content-type-options"], "nosniff");
}

/// Mid-sale the page lists the sale still selling first, then the upcoming one, then
/// the open ones with nothing left (sold out, by Redis's stock: one whose order is still
/// in flight too), then the ended one, the soonest ending first within each; and when it
/// cannot show every sale the selling one is never the one left out, not even for a
/// sale Postgres still counts units of.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn the_selling_sale_comes_first_and_the_limit_never_leaves_it_out_for_a_sold_out_one(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let (sold, in_flight, selling, upcoming, ended) = sales_mid_sale(&app).await;
    let mut events = Events::open(&app.client, &app.base).await;
    let snapshot = events.next(WAIT).await;
    let open = |id| (id, true, "open".to_string());
    assert_eq!(
        order_of(&snapshot),
        vec![
            (selling, false, "open".to_string()),
            (upcoming, false, "upcoming".to_string()),
            open(sold[0]),
            open(sold[1]),
            open(sold[2]),
            open(in_flight),
            (ended, false, "ended".to_string()),
        ],
        "{snapshot}"
    );

    // One sale shown: the selling one, although Postgres still counts a unit of the
    // sale whose order is in flight, and that sale ends sooner.
    for limit in ["1", "2"] {
        let (_api, base) = app
            .spawn_server("api", &[("LIVE_MAX_SALES", limit.to_string())])
            .await;
        let mut events = Events::open(&app.client, &base).await;
        let snapshot = events.next(WAIT).await;
        let shown: Vec<i64> = order_of(&snapshot).iter().map(|s| s.0).collect();
        assert_eq!(shown[0], selling, "LIVE_MAX_SALES={limit}: {snapshot}");
        assert_eq!(snapshot["truncated"], true, "{snapshot}");
        assert_eq!(snapshot["open_total"], 7, "{snapshot}");
        if limit == "2" {
            assert_eq!(shown, [selling, upcoming], "{snapshot}");
        }
    }
}

/// `/metrics`, `/live` and `/live/events` tell every sale and the worker's lag: on the
/// API port only an administrator reads them; the internal listener (`ADMIN_BIND`,
/// loopback by default) serves them to operators and Prometheus without a token, and
/// nothing else.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn the_metrics_and_the_live_view_are_not_reachable_anonymously_on_the_api_port(db: PgPool) {
    let app = TestApp::spawn(db).await;
    app.open_sale(5).await;
    for path in ["/metrics", "/live", "/live/events"] {
        let public = app.url(path);
        let (status, body) = app.send(app.client.get(&public)).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{path}: {body}");
        assert_eq!(body["error"]["code"], "unauthorized");
        let (status, _) = app
            .send(app.client.get(&public).bearer_auth(app.token(5)))
            .await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{path}: a shopper");
        let (status, _) = app
            .send(app.client.get(&public).bearer_auth(app.staff_token(6, 1)))
            .await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{path}: a shop's staff");
        for req in [
            app.client.get(&public).bearer_auth(app.admin_token()),
            app.client.get(format!("{}{path}", app.admin_base)),
        ] {
            let resp = req.send().await.unwrap();
            assert_eq!(resp.status(), StatusCode::OK, "{path}");
        }
    }
    // The internal listener serves those alone.
    let (status, _) = app
        .send(app.client.get(format!("{}/vouchers/1", app.admin_base)))
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    // The page's script and style hold no data: they stay public.
    let resp = app
        .client
        .get(app.url("/live/app.js"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
}
