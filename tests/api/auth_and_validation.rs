//! Who may do what, and bad input: every rejection is a JSON 4xx and stores nothing.

use crate::common::TestApp;
use reqwest::StatusCode;
use serde_json::{json, Value};
use sqlx::PgPool;

fn voucher_body() -> Value {
    json!({"shop_id": 1, "title": "50 off 100", "sub_title": "weekdays", "rules": "one per person",
           "pay_value": 5000, "actual_value": 10000,
           "seckill": {"stock": 100, "begin_time": "2026-01-01T00:00:00Z", "end_time": "2099-01-01T00:00:00Z"}})
}

async fn vouchers_stored(app: &TestApp) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM vouchers")
        .fetch_one(&app.db)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn requests_without_a_valid_token_are_unauthorized(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(5).await;
    let url = app.url(&format!("/vouchers/{voucher}/seckill"));
    let foreign = seckill::auth::JwtKeys::new("another-secret")
        .unwrap()
        .mint(5, false, 60)
        .unwrap();
    let expired = {
        let claims = json!({"sub": "5", "exp": chrono::Utc::now().timestamp() - 3600});
        jsonwebtoken::encode(
            &jsonwebtoken::Header::default(),
            &claims,
            &jsonwebtoken::EncodingKey::from_secret(crate::common::SECRET.as_bytes()),
        )
        .unwrap()
    };
    let cases: Vec<(&str, Option<String>)> = vec![
        ("no header", None),
        ("not bearer", Some("Basic dXNlcjpwYXNz".into())),
        ("garbage", Some("Bearer not.a.jwt".into())),
        ("foreign signature", Some(format!("Bearer {foreign}"))),
        ("expired", Some(format!("Bearer {expired}"))),
    ];
    for (what, header) in cases {
        let mut req = app.client.post(&url);
        if let Some(h) = header {
            req = req.header("authorization", h);
        }
        let (status, body) = app.send(req).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{what}: {body}");
        assert_eq!(body["error"]["code"], "unauthorized", "{what}");
    }
    let (status, _) = app.get("/orders", None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (_, v) = app.get(&format!("/vouchers/{voucher}"), None).await;
    assert_eq!(v["stock"], 5, "nothing was reserved");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_shopper_cannot_create_vouchers(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let (status, body) = app
        .post_json("/vouchers", Some(&app.token(9)), &voucher_body())
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert_eq!(body["error"]["code"], "forbidden");
    let (status, _) = app.post_json("/vouchers", None, &voucher_body()).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(vouchers_stored(&app).await, 0);
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn an_admin_creates_a_voucher_and_anyone_can_read_it(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let (status, created) = app
        .post_json("/vouchers", Some(&app.admin_token()), &voucher_body())
        .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    assert_eq!(created["title"], "50 off 100");
    assert_eq!(created["seckill"]["stock"], 100);
    assert_eq!(created["seckill"]["initial_stock"], 100);
    let id = created["id"].as_i64().unwrap();
    let (status, read) = app.get(&format!("/vouchers/{id}"), None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(read, created);
    let (_, list) = app.get("/shops/1/vouchers", None).await;
    assert_eq!(list, json!([created]));
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn every_kind_of_bad_voucher_is_a_4xx_json_error_and_stores_nothing(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let admin = app.admin_token();
    let cases = bad_voucher_bodies();

    for (what, body) in cases {
        let (status, reply) = app.post_json("/vouchers", Some(&admin), &body).await;
        assert!(
            status == StatusCode::BAD_REQUEST || status == StatusCode::UNPROCESSABLE_ENTITY,
            "{what}: {status} {reply}"
        );
        assert_eq!(reply["error"]["code"], "validation", "{what}");
        assert!(reply["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()));
    }

    // Not JSON at all, or not declared as JSON.
    for (content_type, raw) in [
        ("application/json", "{\"shop_id\": 1,"),
        ("text/plain", "{}"),
    ] {
        let req = app
            .client
            .post(app.url("/vouchers"))
            .bearer_auth(&admin)
            .header("content-type", content_type)
            .body(raw);
        let (status, reply) = app.send(req).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{raw}");
        assert_eq!(reply["error"]["code"], "validation");
    }
    // Too large a body.
    let req = app
        .client
        .post(app.url("/vouchers"))
        .bearer_auth(&admin)
        .header("content-type", "application/json")
        .body(format!("{{\"title\": \"{}\"}}", "x".repeat(100_000)));
    let (status, reply) = app.send(req).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(reply["error"]["code"], "validation");

    assert_eq!(vouchers_stored(&app).await, 0);
}

/// Every kind of bad voucher body: (what is wrong, the body).
fn bad_voucher_bodies() -> Vec<(&'static str, Value)> {
    let mut cases: Vec<(&str, Value)> = Vec::new();
    let mut with = |what: &'static str, pointer: &str, value: Value| {
        let mut body = voucher_body();
        *body.pointer_mut(pointer).unwrap() = value;
        cases.push((what, body));
    };
    with("negative stock", "/seckill/stock", json!(-1));
    with("zero stock", "/seckill/stock", json!(0));
    with(
        "stock beyond the column",
        "/seckill/stock",
        json!(3_000_000_000i64),
    );
    with("fractional stock", "/seckill/stock", json!(1.5));
    with("stock as a string", "/seckill/stock", json!("100"));
    with("negative price", "/pay_value", json!(-5));
    with("price beyond 64 bits", "/actual_value", json!(1e30));
    with("zero shop", "/shop_id", json!(0));
    with("shop as a string", "/shop_id", json!("one"));
    with("empty title", "/title", json!(""));
    with("NUL in title", "/title", json!("a\u{0}b"));
    with("huge title", "/title", json!("x".repeat(300)));
    with(
        "end before begin",
        "/seckill/end_time",
        json!("2025-12-31T00:00:00Z"),
    );
    with(
        "end equals begin",
        "/seckill/end_time",
        json!("2026-01-01T00:00:00Z"),
    );
    with("not a time", "/seckill/begin_time", json!("tomorrow"));
    with(
        "unknown field",
        "/seckill",
        json!({"stock": 1, "begin_time": "2026-01-01T00:00:00Z", "end_time": "2099-01-01T00:00:00Z", "limit": 2}),
    );
    // serde would read a struct from an array of its fields.
    with(
        "the sale as an array",
        "/seckill",
        json!([5, "2026-01-01T00:00:00Z", "2099-01-01T00:00:00Z", 900]),
    );
    let mut missing = voucher_body();
    missing.as_object_mut().unwrap().remove("title");
    cases.push(("missing title", missing));
    cases.push(("an array", json!([1, 2])));
    for (what, window) in [
        ("pay window zero", json!(0)),
        ("pay window over a day", json!(86_401)),
        ("pay window as a string", json!("900")),
    ] {
        let mut body = voucher_body();
        body["seckill"]["pay_within_secs"] = window;
        cases.push((what, body));
    }
    let mut whole = voucher_body();
    let fields: Vec<Value> = [
        "shop_id",
        "title",
        "sub_title",
        "rules",
        "pay_value",
        "actual_value",
    ]
    .iter()
    .map(|k| whole[*k].take())
    .collect();
    cases.push((
        "the voucher as an array of its fields",
        Value::Array(fields),
    ));
    cases
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn ids_in_paths_are_parsed_strictly(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let user = app.token(1);
    for id in ["abc", "-1", "0", "1.5", "01", "99999999999999999999", "%20"] {
        let (status, body) = app.get(&format!("/vouchers/{id}"), None).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "voucher {id}: {body}");
        assert_eq!(body["error"]["code"], "validation");
        let (status, body) = app.get(&format!("/orders/{id}"), Some(&user)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "order {id}: {body}");
        let req = app
            .client
            .post(app.url(&format!("/vouchers/{id}/seckill")))
            .bearer_auth(&user);
        let (status, _) = app.send(req).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "seckill {id}");
    }
    let (status, body) = app.get("/no/such/route", None).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (StatusCode::NOT_FOUND, Some("not_found"))
    );
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn health_and_readiness_answer(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let (status, _) = app.get("/healthz", None).await;
    assert_eq!(status, StatusCode::OK);
    let (status, body) = app.get("/readyz", None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(
        body["checks"],
        json!({"redis": "up", "postgres": "up", "migrations": "applied", "redis_memory": "noeviction",
            "order_ids": "leased"})
    );
}

/// An HS256 token of `claims`, signed with `secret`.
fn signed(claims: Value, secret: &str) -> String {
    jsonwebtoken::encode(
        &jsonwebtoken::Header::default(),
        &claims,
        &jsonwebtoken::EncodingKey::from_secret(secret.as_bytes()),
    )
    .unwrap()
}

/// Every way a token can be refused answers 401 `unauthorized` with a message of its
/// own naming the rule that failed, and none of them gives the secret away.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_refused_token_is_told_which_rule_it_broke(db: PgPool) {
    let (issuer, audience) = ("https://idp.test", "seckill");
    let app = TestApp::spawn_with_jwt(
        db,
        seckill::config::JwtArgs {
            jwt_secret: Some(crate::common::SECRET.into()),
            jwt_issuer: Some(issuer.into()),
            jwt_audience: Some(audience.into()),
            ..Default::default()
        },
    )
    .await;
    let now = chrono::Utc::now().timestamp();
    let claims = |change: &dyn Fn(&mut Value)| {
        let mut c = json!({"sub": "5", "exp": now + 600, "iss": issuer, "aud": audience});
        change(&mut c);
        c
    };
    let good = signed(claims(&|_| {}), crate::common::SECRET);
    let (status, body) = app.get("/orders", Some(&good)).await;
    assert_eq!(status, StatusCode::OK, "the good token: {body}");

    let cases = refused_token_cases(claims, now);
    let mut messages: std::collections::BTreeMap<String, &str> = Default::default();
    for (what, header, words) in cases {
        let mut req = app.client.get(app.url("/orders"));
        if let Some(h) = header {
            req = req.header("authorization", h);
        }
        let (status, body) = app.send(req).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{what}: {body}");
        assert_eq!(body["error"]["code"], "unauthorized", "{what}");
        let message = body["error"]["message"].as_str().unwrap().to_string();
        for word in words {
            assert!(message.contains(word), "{what}: {message:?} lacks {word:?}");
        }
        assert!(
            !message.contains(crate::common::SECRET),
            "{what}: {message}"
        );
        // Tokens that break the same rule may share a message; other rules may not.
        let rule = match what {
            w if w.contains("sub") => "sub",
            "not a JWT" | "two parts" => "malformed",
            w => w,
        };
        if let Some(before) = messages.insert(message.clone(), rule) {
            assert_eq!(before, rule, "{what} and {before} both say {message:?}");
        }
    }
}

/// The refused tokens: (what, Authorization header or none, words its message must hold).
fn refused_token_cases(
    claims: impl Fn(&dyn Fn(&mut Value)) -> Value,
    now: i64,
) -> Vec<(&'static str, Option<String>, &'static [&'static str])> {
    let ours = |c: Value| signed(c, crate::common::SECRET);
    // (what, Authorization header or none, words its message must hold)
    let cases: Vec<(&str, Option<String>, &[&str])> = vec![
        ("no header", None, &["missing"]),
        ("not bearer", Some("Basic dXNlcjpwYXNz".into()), &["Bearer"]),
        ("not a JWT", Some("Bearer not.a.jwt".into()), &["malformed"]),
        ("two parts", Some("Bearer abc.def".into()), &["malformed"]),
        (
            "wrong signature",
            Some(format!(
                "Bearer {}",
                signed(claims(&|_| {}), "another-secret")
            )),
            &["signature"],
        ),
        (
            "expired",
            Some(format!(
                "Bearer {}",
                ours(claims(&|c| c["exp"] = json!(now - 3600)))
            )),
            &["expired"],
        ),
        (
            "no exp",
            Some(format!(
                "Bearer {}",
                ours(claims(&|c| drop(c.as_object_mut().unwrap().remove("exp"))))
            )),
            &["exp"],
        ),
        (
            "a sub that is not a number",
            Some(format!(
                "Bearer {}",
                ours(claims(&|c| c["sub"] = json!("auth0|123")))
            )),
            &["sub", "positive"],
        ),
        (
            "a sub of zero",
            Some(format!("Bearer {}", ours(claims(&|c| c["sub"] = json!(0))))),
            &["sub", "positive"],
        ),
        (
            "no sub",
            Some(format!(
                "Bearer {}",
                ours(claims(&|c| drop(c.as_object_mut().unwrap().remove("sub"))))
            )),
            &["sub"],
        ),
        (
            "wrong issuer",
            Some(format!(
                "Bearer {}",
                ours(claims(&|c| c["iss"] = json!("https://elsewhere.test")))
            )),
            &["issuer"],
        ),
        (
            "wrong audience",
            Some(format!(
                "Bearer {}",
                ours(claims(&|c| c["aud"] = json!("billing")))
            )),
            &["audience"],
        ),
    ];
    cases
}

/// A sale time without a zone or offset cannot be placed in time: the answer names the
/// field and says an offset is needed, not serde's "premature end of input".
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_time_without_a_zone_is_refused_naming_the_field_and_asking_for_an_offset(db: PgPool) {
    let app = TestApp::spawn(db).await;
    for field in ["begin_time", "end_time"] {
        let mut body = voucher_body();
        body["seckill"][field] = json!("2098-12-01T10:00:00");
        let (status, reply) = app
            .post_json("/vouchers", Some(&app.admin_token()), &body)
            .await;
        assert!(status.is_client_error(), "{field}: {status} {reply}");
        assert_eq!(reply["error"]["code"], "validation", "{field}");
        let message = reply["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(&format!("seckill.{field}")),
            "{field}: {message}"
        );
        assert!(
            message.contains("offset") && message.contains("RFC 3339"),
            "{field}: {message}"
        );
        assert!(!message.contains("premature"), "{field}: {message}");
    }
    assert_eq!(vouchers_stored(&app).await, 0);
    // With an offset, or Z, the same times are fine.
    for time in ["2098-12-01T10:00:00Z", "2098-12-01T10:00:00+08:00"] {
        let mut body = voucher_body();
        body["seckill"]["end_time"] = json!(time);
        let (status, reply) = app
            .post_json("/vouchers", Some(&app.admin_token()), &body)
            .await;
        assert_eq!(status, StatusCode::CREATED, "{time}: {reply}");
    }
}

/// A voucher that costs more than it is worth is a typing error: 400 `validation`
/// naming both fields, nothing stored. Paying exactly its worth is allowed.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_price_above_the_vouchers_worth_is_refused_naming_both(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let mut body = voucher_body();
    body["pay_value"] = json!(10_001);
    body["actual_value"] = json!(10_000);
    let (status, reply) = app
        .post_json("/vouchers", Some(&app.admin_token()), &body)
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{reply}");
    assert_eq!(reply["error"]["code"], "validation");
    let message = reply["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("pay_value") && message.contains("actual_value"),
        "{message}"
    );
    assert_eq!(vouchers_stored(&app).await, 0);
    body["pay_value"] = json!(10_000);
    let (status, reply) = app
        .post_json("/vouchers", Some(&app.admin_token()), &body)
        .await;
    assert_eq!(status, StatusCode::CREATED, "{reply}");
}

/// A title a shopper cannot see (zero-width spaces and joiners, a byte-order mark, a
/// word joiner, a soft hyphen, alone or among spaces) is refused as a blank one is.
/// Invisible characters between visible ones are the title's business.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_title_of_only_invisible_characters_is_refused_like_a_blank_one(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let admin = app.admin_token();
    let mut blank = voucher_body();
    blank["title"] = json!("   ");
    let (status, blank_reply) = app.post_json("/vouchers", Some(&admin), &blank).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{blank_reply}");
    for title in [
        "\u{200B}",
        "\u{FEFF}",
        "\u{2060}",
        "\u{200C}\u{200D}",
        "\u{00AD}",
        " \u{200B} \u{FEFF}\t",
    ] {
        let mut body = voucher_body();
        body["title"] = json!(title);
        let (status, reply) = app.post_json("/vouchers", Some(&admin), &body).await;
        assert_eq!(
            status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{title:?}: {reply}"
        );
        assert_eq!(reply["error"], blank_reply["error"], "{title:?}");
    }
    assert_eq!(vouchers_stored(&app).await, 0);
    let mut body = voucher_body();
    body["title"] = json!("50\u{200B}off");
    let (status, reply) = app.post_json("/vouchers", Some(&admin), &body).await;
    assert_eq!(status, StatusCode::CREATED, "{reply}");
}
