//! Issue 9: the HTTP server's own limits (slow and idle connections, a connection cap,
//! oversized headers), honest answers when the admission store fails mid-call, read
//! paths that fall back to Postgres while Redis is down, and input nits.

mod common;

use common::TestApp;
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
