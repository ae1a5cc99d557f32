//! One clock: an instance whose own clock is minutes off (libfaketime, behind and
//! ahead) answers as one whose clock is right. Its decisions take Redis's time (windows,
//! draws, a held press's wait, a token's expiry, a new sale's times) or Postgres's (every
//! stored time and every judgement of one), never its own.

use std::collections::BTreeSet;
use std::time::Duration;

use chrono::Utc;
use reqwest::StatusCode;
use serde_json::{json, Value};
use sqlx::PgPool;

use crate::common::faults::{self, Process};
use crate::common::{metric_value, metrics_at, TestApp};
use crate::lottery::{press_together, until_after_begin, Pressed};

/// The clocks the skewed instances run on, in seconds from the right time: one five
/// minutes behind, one four ahead.
const BEHIND: i64 = -300;
const AHEAD: i64 = 240;
const PAY_WITHIN_SECS: i64 = 8;

/// The environment that runs a process with its wall clock `secs` off (ahead when
/// positive); its monotonic clock stays true, as NTP leaves it.
pub(crate) fn clock_off_by(secs: i64) -> Vec<(&'static str, String)> {
    vec![
        ("LD_PRELOAD", faults::libfaketime()),
        ("FAKETIME", format!("{secs:+}")),
        ("FAKETIME_DONT_FAKE_MONOTONIC", "1".into()),
    ]
}

/// A `seckill serve` (its worker and sweeper too) whose clock is `secs` off, once it
/// reports that skew (so the fault is real, and it has heard Redis's clock); the
/// process and its base URL.
async fn serve_with_clock_off(app: &TestApp, secs: i64) -> (Process, String) {
    let (process, base) = app.spawn_server("serve", &clock_off_by(secs)).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let text = metrics_at(&app.client, &base).await;
        let skew = metric_value(&text, "seckill_clock_skew_seconds");
        if skew.is_some_and(|s| (s - secs as f64).abs() < 5.0) {
            return (process, base);
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the instance never reported its clock {secs} s off: {skew:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The instances a test presses through: one behind, one ahead (each its own `serve`)
/// and the harness's, whose clock is right; the processes (killed when dropped) and the
/// base URLs in that order.
async fn three_clocks(app: &TestApp) -> (Vec<Process>, [String; 3]) {
    let (behind, behind_base) = serve_with_clock_off(app, BEHIND).await;
    let (ahead, ahead_base) = serve_with_clock_off(app, AHEAD).await;
    (vec![behind, ahead], [behind_base, ahead_base, app.url("")])
}

/// A sale created through the instance at `base` (its validation judges the times by
/// Redis's clock: through one four minutes ahead, a sale ending in three minutes would
/// be "in the past"), opening in two seconds, ending in three minutes; its voucher.
async fn sale_through(app: &TestApp, base: &str, stock: i64, seckill: Value) -> Value {
    let begin = Utc::now() + chrono::Duration::seconds(2);
    let mut fields = json!({
        "stock": stock, "begin_time": begin, "end_time": begin + chrono::Duration::minutes(3),
        "pay_within_secs": PAY_WITHIN_SECS,
    });
    fields
        .as_object_mut()
        .unwrap()
        .extend(seckill.as_object().unwrap().clone());
    let body = json!({
        "shop_id": 1, "title": "on time", "pay_value": 100, "actual_value": 200,
        "seckill": fields,
    });
    let (status, voucher) = app
        .send(
            app.client
                .post(format!("{base}/vouchers"))
                .bearer_auth(app.admin_token())
                .json(&body),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{voucher}");
    voucher
}

/// The winners among `answers` (user, order id, the instance that answered); any
/// answer but a 202 or `sold_out`, or one later than `within`, fails the test.
fn winners(answers: &[Pressed], within: Duration) -> Vec<(i64, String)> {
    let mut won = Vec::new();
    for (user, answer, took) in answers {
        let (status, body) = answer.as_ref().expect("every press is answered");
        assert!(
            *took <= within,
            "user {user} was answered after {took:?}: {body}"
        );
        match status.as_u16() {
            202 => won.push((*user, body["order_id"].as_str().unwrap().to_owned())),
            409 => assert_eq!(body["error"]["code"], "sold_out", "user {user}: {body}"),
            _ => panic!("user {user}: {status} {body}"),
        }
    }
    won
}

/// Once the workers wrote them: every order of `voucher` was given the whole time to
/// pay, from its writing by Postgres's clock (not minutes off, not already past).
async fn deadlines_run_from_postgres(app: &TestApp, voucher: i64, orders: usize) {
    assert_eq!(
        app.wait_for_orders(voucher, orders, Duration::from_secs(30))
            .await,
        orders,
        "every winner's order is written"
    );
    let rows: Vec<(i64, f64, f64)> = sqlx::query_as(
        "SELECT id, extract(epoch FROM pay_before - created_at)::float8, \
                extract(epoch FROM now() - created_at)::float8 \
         FROM voucher_orders WHERE voucher_id = $1",
    )
    .bind(voucher)
    .fetch_all(&app.db)
    .await
    .unwrap();
    for (id, to_pay, age) in rows {
        assert_eq!(to_pay, PAY_WITHIN_SECS as f64, "order {id}");
        assert!(
            (0.0..60.0).contains(&age),
            "order {id} was stamped {age} s ago by postgres's clock"
        );
    }
}

/// Checkout of `order` as `user` through the instance at `base`.
async fn checkout_through(
    app: &TestApp,
    base: &str,
    order: &str,
    user: i64,
) -> (StatusCode, Value) {
    app.send(
        app.client
            .post(format!("{base}/orders/{order}/checkout"))
            .bearer_auth(app.token(user)),
    )
    .await
}

/// Each winner checks out through each instance: accepted while the deadline Postgres
/// set is ahead, refused (`order_closed`, the order expired) once it is past, whatever
/// the instance's clock says.
async fn checkout_keeps_postgres_deadline(
    app: &TestApp,
    bases: &[String; 3],
    won: &[(i64, String)],
) {
    for (user, order) in won {
        for base in bases {
            let (status, body) = checkout_through(app, base, order, *user).await;
            assert_eq!(status, StatusCode::OK, "{base}: {body}");
        }
    }
    let deadline: chrono::DateTime<Utc> =
        sqlx::query_scalar("SELECT max(pay_before) FROM voucher_orders WHERE id = ANY($1)")
            .bind(
                won.iter()
                    .map(|(_, o)| o.parse::<i64>().unwrap())
                    .collect::<Vec<_>>(),
            )
            .fetch_one(&app.db)
            .await
            .unwrap();
    let past = (deadline - Utc::now()).to_std().unwrap_or_default() + Duration::from_millis(300);
    tokio::time::sleep(past).await;
    for (user, order) in won {
        for base in bases {
            let (status, body) = checkout_through(app, base, order, *user).await;
            assert_eq!(status, StatusCode::CONFLICT, "{base}: {body}");
            assert_eq!(body["error"]["code"], "order_closed", "{base}: {body}");
        }
    }
}

#[sqlx::test(migrations = "./migrations")]
async fn instances_whose_clocks_are_minutes_off_sell_a_first_come_sale_as_a_right_one_does(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let (_processes, bases) = three_clocks(&app).await;
    let (stock, users) = (9, 30);
    let voucher = sale_through(&app, &bases[1], stock, json!({})).await;
    let id = voucher["id"].as_i64().unwrap();

    // Before the opening, by Redis's clock: not started, through every instance (the
    // one ahead would think it open).
    let early = press_together(&app, &bases, id, 1..=3).await;
    for (user, answer, _) in &early {
        let (status, body) = answer.as_ref().expect("answered");
        assert_eq!(*status, StatusCode::CONFLICT, "user {user}: {body}");
        assert_eq!(body["error"]["code"], "not_started", "user {user}: {body}");
    }
    until_after_begin(&voucher, 100).await;

    let answers = press_together(&app, &bases, id, 1..=users).await;
    let won = winners(&answers, Duration::from_secs(5));
    assert_eq!(won.len(), stock as usize, "exactly the stock is sold");
    deadlines_run_from_postgres(&app, id, stock as usize).await;
    checkout_keeps_postgres_deadline(&app, &bases, &won[..3]).await;
}

/// A lottery in `segments` segments (window 2 s) pressed through the three instances:
/// every held press answered within the window + 500 ms by the right clock, exactly the
/// stock drawn, the winners' deadlines from Postgres.
async fn a_lottery_through_three_clocks(db: PgPool, segments: u8) {
    let app = TestApp::spawn(db).await;
    let (_processes, bases) = three_clocks(&app).await;
    let (stock, users, window_ms) = (5, 30, 2_000);
    let opening =
        json!({"opening": {"mode": "lottery", "window_ms": window_ms}, "segments": segments});
    let voucher = sale_through(&app, &bases[1], stock, opening).await;
    let id = voucher["id"].as_i64().unwrap();
    until_after_begin(&voucher, 100).await;

    let answers = press_together(&app, &bases, id, 1..=users).await;
    let won = winners(&answers, Duration::from_millis(window_ms + 500));
    assert_eq!(won.len(), stock as usize, "exactly the stock is drawn");
    let (status, draw) = app.get(&format!("/vouchers/{id}/draw"), None).await;
    assert_eq!(status, StatusCode::OK, "{draw}");
    let drawn: BTreeSet<i64> = serde_json::from_value(draw["winners"].clone()).unwrap();
    assert_eq!(drawn, won.iter().map(|(u, _)| *u).collect());
    deadlines_run_from_postgres(&app, id, stock as usize).await;
    checkout_keeps_postgres_deadline(&app, &bases, &won[..2]).await;
}

#[sqlx::test(migrations = "./migrations")]
async fn instances_whose_clocks_are_minutes_off_answer_a_lottery_in_its_window_as_a_right_one_does(
    db: PgPool,
) {
    a_lottery_through_three_clocks(db, 1).await;
}

#[sqlx::test(migrations = "./migrations")]
async fn instances_whose_clocks_are_minutes_off_answer_a_segmented_lottery_as_a_right_one_does(
    db: PgPool,
) {
    a_lottery_through_three_clocks(db, 3).await;
}
