//! Running it in front of real traffic: limits, request ids, metrics, the API document.

use crate::common::TestApp;
use reqwest::StatusCode;
use seckill::config::{LimitArgs, Settings};
use serde_json::Value;
use sqlx::PgPool;

fn settings(limits: LimitArgs) -> Settings {
    Settings {
        limits,
        ..Settings::default()
    }
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_user_pressing_too_fast_is_told_to_wait_and_nothing_is_reserved(db: PgPool) {
    let app = TestApp::spawn_with_settings(
        db,
        settings(LimitArgs {
            rate_limit_per_user: 1,
            rate_limit_per_user_burst: 3,
            ..LimitArgs::default()
        }),
    )
    .await;
    let voucher = app.open_sale(10).await;
    let mut statuses = Vec::new();
    for _ in 0..3 {
        statuses.push(app.grab(voucher, 5).await.0);
    }
    assert_eq!(
        statuses,
        [
            StatusCode::ACCEPTED,
            StatusCode::CONFLICT,
            StatusCode::CONFLICT
        ]
    );
    let resp = app
        .client
        .post(app.url(&format!("/vouchers/{voucher}/seckill")))
        .bearer_auth(app.token(5))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(resp.headers()["retry-after"], "1");
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["code"], "rate_limited");
    // Another user is not slowed down, and the limited press took no unit.
    assert_eq!(app.grab(voucher, 6).await.0, StatusCode::ACCEPTED);
    let (_, v) = app.get(&format!("/vouchers/{voucher}"), None).await;
    assert_eq!(v["stock"], 8);
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn the_per_ip_limit_is_off_by_default_and_holds_when_set(db: PgPool) {
    // Default: 200 distinct users from one address all get through.
    let app = TestApp::spawn(db.clone()).await;
    let voucher = app.open_sale(500).await;
    for user in 1..=200 {
        assert_eq!(app.grab(voucher, user).await.0, StatusCode::ACCEPTED);
    }
    drop(app);
    let app = TestApp::spawn_with_settings(
        db,
        settings(LimitArgs {
            rate_limit_per_ip: 1,
            rate_limit_per_ip_burst: 5,
            ..LimitArgs::default()
        }),
    )
    .await;
    let voucher = app.open_sale(500).await;
    let mut limited = 0;
    for user in 1000..1010 {
        let (status, body) = app.grab(voucher, user).await;
        if status == StatusCode::TOO_MANY_REQUESTS {
            assert_eq!(body["error"]["code"], "rate_limited");
            limited += 1;
        }
    }
    assert_eq!(limited, 5, "a burst of 5 from one address, then 429");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn beyond_the_concurrency_limit_requests_are_shed_with_503_at_once(db: PgPool) {
    let app = TestApp::spawn_with_settings(
        db,
        settings(LimitArgs {
            max_concurrent_requests: 1,
            ..LimitArgs::default()
        }),
    )
    .await;
    // /readyz holds its slot for a Postgres and a Redis round trip; many at once overflow.
    let replies = futures::future::join_all((0..50).map(|_| app.get("/readyz", None))).await;
    let shed: Vec<&Value> = replies
        .iter()
        .filter(|(s, _)| *s == StatusCode::SERVICE_UNAVAILABLE)
        .map(|(_, b)| b)
        .collect();
    assert!(!shed.is_empty(), "some were shed");
    assert!(
        replies.iter().any(|(s, _)| *s == StatusCode::OK),
        "some got through"
    );
    for body in shed {
        assert_eq!(body["error"]["code"], "unavailable", "{body}");
    }
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn every_answer_carries_a_request_id_and_keeps_the_callers(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let resp = app.client.get(app.url("/healthz")).send().await.unwrap();
    let made = resp.headers()["x-request-id"].to_str().unwrap().to_string();
    assert_eq!(made.len(), 36, "a UUID: {made}");
    let resp = app
        .client
        .get(app.url("/vouchers/1"))
        .header("x-request-id", "trace-me-42")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    assert_eq!(resp.headers()["x-request-id"], "trace-me-42");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn metrics_show_the_sale_the_worker_and_the_http_traffic(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(2).await;
    for user in 1..=3 {
        app.grab(voucher, user).await;
    }
    app.drain().await;
    let text = app.metrics_text().await;
    // Counted (the recorder is shared by the tests of this binary: at least, not exactly).
    for series in [
        "seckill_admissions_total{outcome=\"admitted\"}",
        "seckill_admissions_total{outcome=\"sold_out\"}",
        "seckill_admission_duration_seconds_count",
        "seckill_http_requests_total{route=\"/vouchers/{id}/seckill\",status=\"202\"}",
        "seckill_http_request_duration_seconds_count{route=\"/vouchers/{id}/seckill\",status=\"202\"}",
        "seckill_worker_orders_total{result=\"inserted\"}",
        "seckill_worker_batch_size_count",
        "seckill_worker_commit_seconds_count",
    ] {
        let value = crate::common::metric_value(&text, series);
        assert!(value >= Some(1.0), "{series} is {value:?} in\n{text}");
    }
    for series in [
        "seckill_stream_pending{shard=\"0\"} 0",
        "seckill_stream_lag{shard=\"0\"} 0",
        "seckill_dead_letters{shard=\"0\"} 0",
    ] {
        assert!(text.contains(series), "{series} missing from\n{text}");
    }
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn the_api_document_and_its_docs_page_are_served(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let (status, doc) = app.get("/openapi.json", None).await;
    assert_eq!(status, StatusCode::OK);
    assert!(doc["openapi"].as_str().unwrap().starts_with("3.1"));
    assert!(doc["paths"]["/vouchers/{id}/seckill"]["post"]["responses"]["429"].is_object());
    let page = app.client.get(app.url("/docs")).send().await.unwrap();
    assert_eq!(page.status(), StatusCode::OK);
    assert!(page.text().await.unwrap().contains("/openapi.json"));
}

/// A browser front-end on an allowed origin can call the API: its preflight is answered
/// with the Authorization header allowed, and the real answer carries the CORS headers.
/// Another origin gets no CORS headers (the browser refuses the answer), and a server
/// with no origins configured answers a preflight as any other unknown method.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn cors_allows_the_configured_origins_and_nothing_else(db: PgPool) {
    let allowed = "https://shop.example.com";
    let app = TestApp::spawn_with_settings(
        db.clone(),
        Settings {
            cors_allowed_origins: vec![allowed.into(), "http://localhost:3000".into()],
            ..Settings::default()
        },
    )
    .await;
    let voucher = app.open_sale(5).await;
    let preflight = |origin: &str| {
        app.client
            .request(
                reqwest::Method::OPTIONS,
                app.url(&format!("/vouchers/{voucher}/seckill")),
            )
            .header("Origin", origin)
            .header("Access-Control-Request-Method", "POST")
            .header(
                "Access-Control-Request-Headers",
                "authorization,content-type",
            )
    };

    let ok = preflight(allowed).send().await.unwrap();
    assert!(ok.status().is_success(), "{}", ok.status());
    let h = ok.headers();
    assert_eq!(h["access-control-allow-origin"], allowed);
    let allow_headers = h["access-control-allow-headers"]
        .to_str()
        .unwrap()
        .to_lowercase();
    assert!(allow_headers.contains("authorization"), "{allow_headers}");
    assert!(h["access-control-allow-methods"]
        .to_str()
        .unwrap()
        .contains("POST"));

    // The grab itself, from the allowed origin: answered, with the CORS header.
    let grab = app
        .client
        .post(app.url(&format!("/vouchers/{voucher}/seckill")))
        .bearer_auth(app.token(42))
        .header("Origin", allowed)
        .send()
        .await
        .unwrap();
    assert_eq!(grab.status(), StatusCode::ACCEPTED);
    assert_eq!(grab.headers()["access-control-allow-origin"], allowed);
    let exposed = grab.headers()["access-control-expose-headers"]
        .to_str()
        .unwrap()
        .to_lowercase();
    assert!(
        exposed.contains("x-request-id") && exposed.contains("retry-after"),
        "{exposed}"
    );

    // Another origin: no CORS headers on the preflight or on the answer.
    let other = preflight("https://evil.example.net").send().await.unwrap();
    assert!(other.headers().get("access-control-allow-origin").is_none());
    let answer = app
        .client
        .get(app.url(&format!("/vouchers/{voucher}")))
        .header("Origin", "https://evil.example.net")
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), StatusCode::OK);
    assert!(answer
        .headers()
        .get("access-control-allow-origin")
        .is_none());

    // No origins configured: no CORS at all; a preflight is a 405 in our JSON.
    let plain = TestApp::spawn(db).await;
    let resp = plain
        .client
        .request(
            reqwest::Method::OPTIONS,
            plain.url(&format!("/vouchers/{voucher}/seckill")),
        )
        .header("Origin", allowed)
        .header("Access-Control-Request-Method", "POST")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::METHOD_NOT_ALLOWED);
    assert!(resp.headers().get("access-control-allow-origin").is_none());
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["code"], "validation");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_wrong_method_is_a_405_in_our_json_on_every_route_metrics_included(db: PgPool) {
    let app = TestApp::spawn(db).await;
    for (method, path) in [
        (reqwest::Method::POST, "/metrics"),
        (reqwest::Method::DELETE, "/vouchers/1"),
        (reqwest::Method::POST, "/healthz"),
    ] {
        let resp = app
            .client
            .request(method.clone(), app.url(path))
            .send()
            .await
            .unwrap();
        assert_eq!(
            resp.status(),
            StatusCode::METHOD_NOT_ALLOWED,
            "{method} {path}"
        );
        let body: Value = resp.json().await.unwrap();
        assert_eq!(
            body["error"]["code"], "validation",
            "{method} {path}: {body}"
        );
    }
}
