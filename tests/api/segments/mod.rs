//! Segmented sales: one sale's stock split over several segments (`seckill.segments`),
//! behaving exactly as one sale. In process on one Redis here (the segments share a node:
//! what is tested is the behaviour); on a 3-master cluster with real processes in
//! `cluster.rs`.

use std::collections::{HashMap, HashSet};

use chrono::Utc;
use reqwest::StatusCode;
use serde_json::{json, Value};
use sqlx::PgPool;

use crate::common::{press_all, vid, TestApp};
use seckill::keys::SaleSegment;

mod cluster;
mod lost_writes;
pub(crate) mod moves;
mod restart;

/// Creates a sale of `stock` open now for an hour, split over `segments`; its id.
async fn segmented_sale_at(
    http: &reqwest::Client,
    base: &str,
    admin: &str,
    stock: i64,
    segments: i64,
) -> i64 {
    let now = Utc::now();
    let resp = http
        .post(format!("{base}/vouchers"))
        .bearer_auth(admin)
        .json(&json!({
            "shop_id": 1, "title": "hot coupons", "pay_value": 0, "actual_value": 500,
            "seckill": {"stock": stock, "segments": segments,
                        "begin_time": now - chrono::Duration::minutes(1),
                        "end_time": now + chrono::Duration::hours(1)},
        }))
        .send()
        .await
        .unwrap();
    let status = resp.status();
    let body: Value = resp.json().await.unwrap();
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(body["seckill"]["segments"], segments, "{body}");
    assert_eq!(body["seckill"]["stock"], stock, "{body}");
    body["id"].as_i64().unwrap()
}

async fn segmented_sale(app: &TestApp, stock: i64, segments: i64) -> i64 {
    segmented_sale_at(&app.client, &app.base, &app.admin_token(), stock, segments).await
}

/// An instance that does not finish moves by itself: each test finishes (or voids) its
/// half-done move when it means to.
async fn app_without_finisher(db: PgPool) -> TestApp {
    let settings = seckill::config::Settings {
        finish_moves_every: None,
        ..Default::default()
    };
    TestApp::spawn_with_settings(db, settings).await
}

/// Takes `units` out of `from` for segment `to` as move `id`, as a mover does before it
/// records the move in Postgres (and as it leaves the sale when killed right after).
async fn take(app: &TestApp, from: SaleSegment, to: u8, id: i64, units: i64) -> i64 {
    app.redis_cmd(
        redis::cmd("FCALL")
            .arg("seckill_take")
            .arg(3)
            .arg(app.keys.segment(from))
            .arg(app.keys.moves_out(from))
            .arg(app.keys.segment_marker(from))
            .arg(id)
            .arg(units)
            .arg(to),
    )
    .await
}

/// Records a move in Postgres as a mover's record step does (its allotments shifted),
/// in `tx`, which holds the sale's lock.
async fn record_by_hand(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    voucher: i64,
    (id, from, to, units): (i64, i16, i16, i32),
) {
    sqlx::query(
        "INSERT INTO seckill_segment_moves (id, voucher_id, from_segment, to_segment, units) \
         VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(id)
    .bind(voucher)
    .bind(from)
    .bind(to)
    .bind(units)
    .execute(&mut **tx)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE seckill_segments SET allotted = allotted + CASE segment WHEN $2 THEN -$4 ELSE $4 END \
         WHERE voucher_id = $1 AND segment IN ($2, $3)",
    )
    .bind(voucher)
    .bind(from)
    .bind(to)
    .bind(units)
    .execute(&mut **tx)
    .await
    .unwrap();
}

/// A transaction holding the sale's row lock, as a mover's does.
async fn lock_sale(app: &TestApp, voucher: i64) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut tx = app.db.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM seckill_vouchers WHERE voucher_id = $1 FOR NO KEY UPDATE")
        .bind(voucher)
        .execute(&mut *tx)
        .await
        .unwrap();
    tx
}

/// Each user's order id among 202 answers; every other answer must be `sold_out`.
fn winners(answers: &[(i64, Option<(StatusCode, Value)>)]) -> HashMap<i64, String> {
    let mut won = HashMap::new();
    for (user, answer) in answers {
        let (status, body) = answer.as_ref().expect("every press is answered");
        match *status {
            StatusCode::ACCEPTED => {
                won.insert(*user, body["order_id"].as_str().unwrap().to_string());
            }
            _ => assert_eq!(body["error"]["code"], "sold_out", "{status} {body}"),
        }
    }
    won
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_sale_in_three_segments_admits_exactly_its_stock_one_order_per_user(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = segmented_sale(&app, 300, 3).await;
    let answers = press_all(&app, &app.base, voucher, 1..=360, 64).await;
    let won = winners(&answers);
    assert_eq!(
        won.len(),
        300,
        "exactly the stock admitted, none stranded in a segment"
    );
    let ids: HashSet<&String> = won.values().collect();
    assert_eq!(ids.len(), 300, "no order id twice");

    // Winners pressing again hear their own order, whichever segment holds it.
    for (user, order) in won.iter().take(30) {
        let (status, body) = app.grab(voucher, *user).await;
        assert_eq!(status, StatusCode::CONFLICT, "{body}");
        assert_eq!(body["error"]["code"], "already_ordered", "{body}");
        assert_eq!(body["error"]["order_id"].as_str(), Some(order.as_str()));
    }
    let (_, shown) = app.get(&format!("/vouchers/{voucher}"), None).await;
    assert_eq!(shown["seckill"]["stock"], 0, "{shown}");
    assert_eq!(shown["stock"], 0, "{shown}");

    app.drain().await;
    let stored: Vec<(i64, i64)> =
        sqlx::query_as("SELECT id, user_id FROM voucher_orders WHERE voucher_id = $1")
            .bind(voucher)
            .fetch_all(&app.db)
            .await
            .unwrap();
    let stored: HashMap<i64, String> = stored
        .into_iter()
        .map(|(id, u)| (u, id.to_string()))
        .collect();
    assert_eq!(stored, won, "every 202 in Postgres, as answered");
    assert_eq!(app.pg_stock(voucher).await, 0);
    let (code, books) = app.cli(&["reconcile", "--voucher", &voucher.to_string()]);
    assert_eq!(code, 0, "{books}");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_unit_cancelled_after_the_sell_out_goes_to_a_shopper_of_any_segment(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = segmented_sale(&app, 6, 3).await;
    let answers = press_all(&app, &app.base, voucher, 1..=12, 4).await;
    let won = winners(&answers);
    assert_eq!(won.len(), 6);
    app.drain().await;
    // Each cancel in turn, and a fresh shopper of every segment takes the unit back.
    let segments = |user: i64| seckill::keys::home_segment(crate::common::uid(user), 3);
    let mut fresh = 1000;
    for (user, order) in won.iter().take(3) {
        let (status, body) = app.cancel(order, *user).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        // A shopper whose home is not the canceller's segment.
        while segments(fresh) == segments(*user) {
            fresh += 1;
        }
        let (status, body) = app.grab(voucher, fresh).await;
        assert_eq!(
            status,
            StatusCode::ACCEPTED,
            "user {fresh} of segment {}, unit back in segment {}: {body}",
            segments(fresh),
            segments(*user)
        );
        fresh += 1;
        let (status, body) = app.grab(voucher, fresh + 5000).await;
        assert_eq!(body["error"]["code"], "sold_out", "{status} {body}");
    }
    app.drain().await;
    let (code, books) = app.cli(&["reconcile", "--voucher", &voucher.to_string()]);
    assert_eq!(code, 0, "{books}");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn segments_out_of_range_or_above_the_stock_are_refused(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let now = Utc::now();
    for (stock, segments, says) in [
        (10, 0, "seckill.segments must be between 1 and 64"),
        (100, 65, "seckill.segments must be between 1 and 64"),
        (2, 3, "must not exceed seckill.stock"),
    ] {
        let body = json!({
            "shop_id": 1, "title": "t", "pay_value": 0, "actual_value": 1,
            "seckill": {"stock": stock, "segments": segments, "begin_time": now,
                        "end_time": now + chrono::Duration::hours(1)},
        });
        let (status, answer) = app
            .post_json("/vouchers", Some(&app.admin_token()), &body)
            .await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{answer}");
        let message = answer["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{message}");
    }
    let vouchers: i64 = sqlx::query_scalar("SELECT count(*) FROM vouchers")
        .fetch_one(&app.db)
        .await
        .unwrap();
    assert_eq!(vouchers, 0, "nothing created");
}
