//! Clumsy input: each mistake a caller can make answers a 4xx `validation` (or
//! `not_found`) error that says what is wrong in the API's words, not Rust's, and
//! changes nothing.

use crate::common::TestApp;
use reqwest::StatusCode;
use serde_json::{json, Value};
use sqlx::PgPool;

/// What the one order-id pattern is: 1 to 19 digits, no leading zero.
const ORDER_ID: &str = "^[1-9][0-9]{0,18}$";

fn voucher_body() -> Value {
    json!({
        "shop_id": 1, "title": "50 off 100", "pay_value": 5000, "actual_value": 10000,
        "seckill": {"stock": 10, "begin_time": "2026-01-01T00:00:00Z",
                    "end_time": "2098-01-01T00:00:00Z", "pay_within_secs": 900}
    })
}

async fn vouchers_stored(app: &TestApp) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM vouchers")
        .fetch_one(&app.db)
        .await
        .unwrap()
}

/// Asserts a `validation` error of `status` and returns its message.
fn refused(status: StatusCode, reply: &Value, wanted: StatusCode, what: &str) -> String {
    assert_eq!(status, wanted, "{what}: {reply}");
    assert_eq!(reply["error"]["code"], "validation", "{what}: {reply}");
    reply["error"]["message"].as_str().unwrap().to_string()
}

/// Every string under a `key` anywhere in `doc`.
fn strings_under<'a>(doc: &'a Value, key: &str, found: &mut Vec<&'a str>) {
    match doc {
        Value::Object(map) => {
            for (k, v) in map {
                match v.as_str() {
                    Some(s) if k == key => found.push(s),
                    _ => strings_under(v, key, found),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| strings_under(v, key, found)),
        _ => {}
    }
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn every_order_id_pattern_in_the_document_is_the_same_nineteen_digits(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let (status, doc) = app.get("/openapi.json", None).await;
    assert_eq!(status, StatusCode::OK);
    let mut patterns = Vec::new();
    strings_under(&doc, "pattern", &mut patterns);
    let digits: Vec<&str> = patterns
        .into_iter()
        .filter(|p| p.starts_with("^[1-9][0-9]{"))
        .collect();
    assert!(digits.len() >= 4, "{digits:?}");
    assert!(digits.iter().all(|p| *p == ORDER_ID), "{digits:?}");
    // The listing's cursor, in and out, is one of them.
    let params = &doc["paths"]["/vouchers/{id}/orders"]["get"]["parameters"];
    let after = params
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "after")
        .unwrap();
    assert_eq!(after["schema"]["pattern"], ORDER_ID, "{after}");
    let next = &doc["components"]["schemas"]["OrderPage"]["properties"]["next"];
    assert_eq!(next["pattern"], ORDER_ID, "{next}");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn the_document_describes_in_plain_text_without_rustdoc_links(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let (_, doc) = app.get("/openapi.json", None).await;
    let mut descriptions = Vec::new();
    strings_under(&doc, "description", &mut descriptions);
    assert!(descriptions.len() > 50);
    for d in descriptions {
        assert!(!d.contains("[`"), "a rustdoc link: {d}");
    }
}

/// Each body's mistake, and the whole message it answers: the field's path, what JSON
/// was expected and what came, never `i64`, axum's "Failed to ..." or a float for a
/// long integer.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_body_of_the_wrong_types_is_refused_naming_the_field_in_json_words(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let admin = app.admin_token();
    let i64_range = "a whole number from -9223372036854775808 to 9223372036854775807";
    let cases: Vec<(&str, Value, String)> = vec![
        (
            "/shop_id",
            json!("1"),
            r#"shop_id: expected an integer, not the string "1""#.into(),
        ),
        (
            "/shop_id",
            serde_json::from_str("99999999999999999999999").unwrap(),
            format!("shop_id: out of range: expected {i64_range}"),
        ),
        (
            "/pay_value",
            json!(10_000_000_000_000_000_000u64),
            format!("pay_value: out of range: expected {i64_range}"),
        ),
        (
            "/seckill/stock",
            json!(1.5),
            "seckill.stock: expected an integer, not the number 1.5".into(),
        ),
        (
            "/title",
            json!(5),
            "title: expected a string, not the number 5".into(),
        ),
        (
            "/title",
            json!(null),
            "title: expected a string, not null".into(),
        ),
        (
            "/seckill",
            json!("soon"),
            r#"seckill: expected an object, not the string "soon""#.into(),
        ),
        (
            "/seckill/pay_within_secs",
            json!(true),
            "seckill.pay_within_secs: expected an integer, not true".into(),
        ),
    ];
    for (pointer, value, wanted) in cases {
        let mut body = voucher_body();
        *body.pointer_mut(pointer).unwrap() = value.clone();
        let (status, reply) = app.post_json("/vouchers", Some(&admin), &body).await;
        let what = format!("{pointer} = {value}");
        let message = refused(status, &reply, StatusCode::UNPROCESSABLE_ENTITY, &what);
        assert_eq!(message, wanted, "{what}");
    }
    // Not JSON at all: a 400 that says so, with where.
    let req = app
        .client
        .post(app.url("/vouchers"))
        .bearer_auth(&admin)
        .header("content-type", "application/json")
        .body(r#"{"shop_id": 1,"#);
    let (status, reply) = app.send(req).await;
    let message = refused(status, &reply, StatusCode::BAD_REQUEST, "cut short");
    assert!(
        message.starts_with("the body is not valid JSON: EOF while parsing a value at line 1"),
        "{message}"
    );
    assert_eq!(vouchers_stored(&app).await, 0);
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_body_too_large_is_refused_saying_the_limit(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let req = app
        .client
        .post(app.url("/vouchers"))
        .bearer_auth(app.admin_token())
        .header("content-type", "application/json")
        .body(format!("{{\"title\": \"{}\"}}", "x".repeat(100_000)));
    let (status, reply) = app.send(req).await;
    let message = refused(status, &reply, StatusCode::PAYLOAD_TOO_LARGE, "100 kB");
    assert_eq!(message, "request body too large: at most 64 KiB");
    assert_eq!(vouchers_stored(&app).await, 0);
}

/// A misspelt filter must not list every order, and of two `limit`s neither is guessed.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn an_unknown_or_repeated_parameter_of_the_orders_listing_is_refused_by_name(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(5).await;
    let list = |query: String| {
        app.send(
            app.client
                .get(app.url(&format!("/vouchers/{voucher}/orders?{query}")))
                .bearer_auth(app.admin_token()),
        )
    };
    let cases = [
        (
            "stauts=paid",
            "unknown query parameter `stauts`: this list takes `status`, `limit`, `after`",
        ),
        (
            "status=paid&Limit=5",
            "unknown query parameter `Limit`: this list takes `status`, `limit`, `after`",
        ),
        (
            "limit=5&limit=500",
            "query parameter `limit` is given more than once",
        ),
        (
            "status=paid&status=created",
            "query parameter `status` is given more than once",
        ),
    ];
    for (query, wanted) in cases {
        let (status, reply) = list(query.into()).await;
        let message = refused(status, &reply, StatusCode::BAD_REQUEST, query);
        assert_eq!(message, wanted, "{query}");
    }
    let (status, reply) = list("status=paid&limit=5".into()).await;
    assert_eq!(status, StatusCode::OK, "{reply}");
    // A route that takes no parameters lets a cache-buster through, as before.
    let (status, reply) = app.get(&format!("/vouchers/{voucher}?_=17"), None).await;
    assert_eq!(status, StatusCode::OK, "{reply}");
}

/// `voucher N not found` when there is no voucher; `has no flash sale` for a plain one,
/// from the grab's first press (Postgres asked) and its next (the edge's memory) alike,
/// and from a close.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_grab_or_close_of_a_missing_voucher_says_not_found_and_of_a_plain_one_no_sale(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let mut plain = voucher_body();
    plain.as_object_mut().unwrap().remove("seckill");
    let (status, created) = app
        .post_json("/vouchers", Some(&app.admin_token()), &plain)
        .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    let plain = created["id"].as_i64().unwrap();
    let missing = plain + 1000;
    for (voucher, wanted) in [
        (missing, format!("voucher {missing} not found")),
        (plain, format!("voucher {plain} has no flash sale")),
    ] {
        for press in 1..=2 {
            let (status, reply) = app.grab(voucher, 7).await;
            assert_eq!(status, StatusCode::NOT_FOUND, "press {press}: {reply}");
            assert_eq!(reply["error"]["code"], "not_found");
            assert_eq!(reply["error"]["message"], wanted, "press {press}");
        }
        let close = app
            .client
            .post(app.url(&format!("/vouchers/{voucher}/close")));
        let (status, reply) = app.send(close.bearer_auth(app.admin_token())).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "close: {reply}");
        assert_eq!(reply["error"]["message"], wanted, "close");
    }
    assert_eq!(vouchers_stored(&app).await, 1);
}
