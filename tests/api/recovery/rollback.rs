//! Redis handing the service an OLDER copy of itself: a restart from an older snapshot
//! (or, in `sentinel.rs` and `cluster.rs`, a failover to a replica that lagged). Nobody
//! runs anything; within seconds every promise holds again.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use futures::StreamExt;
use reqwest::StatusCode;
use serde_json::Value;
use sqlx::PgPool;

use crate::common::faults::PrivateRedis;
use crate::common::{metric_value, metrics_at, open_sale_at, vid, TestApp};

/// Presses "grab" once per user against `base`, pressing again while the answer is 503
/// (the sale being rebuilt), for at most a minute each. Each user's final answer.
pub(crate) async fn press_through_503s(
    app: &TestApp,
    base: &str,
    voucher: i64,
    users: impl IntoIterator<Item = i64>,
) -> HashMap<i64, (StatusCode, Value)> {
    futures::stream::iter(users)
        .map(|user| async move {
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let resp = app
                    .client
                    .post(format!("{base}/vouchers/{voucher}/seckill"))
                    .bearer_auth(app.token(user))
                    .send()
                    .await
                    .unwrap();
                let status = resp.status();
                let body: Value = resp.json().await.unwrap();
                if status != StatusCode::SERVICE_UNAVAILABLE {
                    return (user, (status, body));
                }
                assert_eq!(body["error"]["code"], "unavailable", "{body}");
                assert!(Instant::now() < deadline, "user {user}: 503 for a minute");
                // (Under the default limit of 5 grabs a second per user: a new term may
                // hold a sale for seconds.)
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        })
        .buffer_unordered(32)
        .collect()
        .await
}

/// The order ids of the 202s among `answers`.
pub(crate) fn won(answers: &HashMap<i64, (StatusCode, Value)>) -> HashMap<i64, i64> {
    answers
        .iter()
        .filter(|(_, (status, _))| *status == StatusCode::ACCEPTED)
        .map(|(user, (_, body))| (*user, body["order_id"].as_str().unwrap().parse().unwrap()))
        .collect()
}

/// `seckill reconcile` (compare only) until it says the books balance; how long it took.
async fn until_reconcile_is_clean(app: &TestApp, limit: Duration) -> Duration {
    let started = Instant::now();
    loop {
        let (code, out) = app.cli(&["reconcile"]);
        if code == 0 {
            assert!(out.contains("books balance"), "{out}");
            return started.elapsed();
        }
        assert!(
            started.elapsed() < limit,
            "reconcile still out of balance after {limit:?}:\n{out}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_restart_from_an_older_snapshot_mid_sale_heals_itself_and_sells_exactly_the_units_left(
    db: PgPool,
) {
    let mut redis = PrivateRedis::start();
    let app = TestApp::spawn_with(db, redis.url.clone(), true).await;
    // A real `seckill serve` (API and worker) on the Redis that will come back older.
    let (_server, base) = app.spawn_server("serve", &[]).await;
    let stock = 500;
    let sale = open_sale_at(&app.client, &base, stock).await;
    let closing = open_sale_at(&app.client, &base, 100).await;

    let (first, _early) = winners_written_before_the_snapshot(&app, &base, sale, closing).await;
    redis.save();

    // After the snapshot, all of it in Postgres: 150 winners, 5 cancels, a close.
    let second = won(&press_through_503s(&app, &base, sale, 301..=450).await);
    assert_eq!(second.len(), 150);
    assert_eq!(
        app.wait_for_orders(sale, 450, Duration::from_secs(30))
            .await,
        450
    );
    for user in 1..=5 {
        let (status, body) = app.cancel(&first[&user].to_string(), user).await;
        assert_eq!(status, StatusCode::OK, "{body}");
    }
    let close = app
        .client
        .post(app.url(&format!("/vouchers/{closing}/close")))
        .bearer_auth(app.admin_token());
    let (status, body) = app.send(close).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(app.owed_releases().await, 0, "releases made in Redis");

    // The bad night: Redis killed and started again from the snapshot. Nobody runs
    // anything; shoppers keep pressing.
    redis.crash_and_restart();
    let restarted = Instant::now();
    let again = press_through_503s(&app, &base, sale, 1..=450).await;
    let healed_in = restarted.elapsed();
    let crowd = press_through_503s(&app, &base, sale, 1001..=1200).await;
    let closed = press_through_503s(&app, &base, closing, 11..=20).await;

    let (cancelled_won, fresh) =
        check_the_answers_after_the_restart(&again, &crowd, &closed, &first, &second);

    let all: Vec<i64> = [&first, &second, &cancelled_won, &fresh]
        .iter()
        .flat_map(|m| m.values().copied())
        .collect();
    let cancelled: HashSet<i64> = (1..=5).map(|u| first[&u]).collect();
    let reconciled_in =
        the_books_after_the_restart(&app, &base, sale, stock, &all, &cancelled).await;
    println!(
        "restart from an older snapshot: 202s {} for {stock} units, 202s lost 0, oversold 0; \
         first answers again after {:.1} s, reconcile clean {:.1} s later",
        all.len(),
        healed_in.as_secs_f64(),
        reconciled_in.as_secs_f64(),
    );
}

/// What must hold once the shoppers pressed through a restart and `sale` sold out: no
/// order id handed out twice (`all`: every 202), all `stock` units in Postgres, the
/// active orders exactly the 202s not `cancelled`, `reconcile` clean, the rollback
/// counted by the server at `base` and no order dead-lettered for want of a unit. How
/// long `reconcile` took to come clean.
pub(crate) async fn the_books_after_the_restart(
    app: &TestApp,
    base: &str,
    sale: i64,
    stock: i64,
    all: &[i64],
    cancelled: &HashSet<i64>,
) -> Duration {
    let distinct: HashSet<i64> = all.iter().copied().collect();
    assert_eq!(
        distinct.len(),
        all.len(),
        "an order id was handed out twice"
    );
    assert_eq!(
        app.wait_for_orders(sale, stock as usize, Duration::from_secs(30))
            .await,
        stock as usize
    );
    let stored = app.assert_consistent(sale, stock).await;
    let active: HashSet<i64> = distinct.difference(cancelled).copied().collect();
    assert_eq!(
        stored, active,
        "the active orders are exactly the 202s not cancelled"
    );
    let reconciled_in = until_reconcile_is_clean(app, Duration::from_secs(30)).await;

    let metrics = metrics_at(&app.client, base).await;
    let healed = metric_value(&metrics, "seckill_redis_rollbacks_healed_total").unwrap();
    let no_stock = metric_value(&metrics, "seckill_dead_lettered_total{kind=\"no_stock\"}");
    assert!(healed >= 1.0, "the rollback was counted: {healed}");
    assert_eq!(no_stock, Some(0.0), "no 202 beyond the stock");
    reconciled_in
}

/// 300 winners of `sale` and 10 of `closing`, written to Postgres; returns their orders.
async fn winners_written_before_the_snapshot(
    app: &TestApp,
    base: &str,
    sale: i64,
    closing: i64,
) -> (HashMap<i64, i64>, HashMap<i64, i64>) {
    // 300 winners, written to Postgres; then the snapshot.
    let first = won(&press_through_503s(app, base, sale, 1..=300).await);
    assert_eq!(first.len(), 300);
    let early = won(&press_through_503s(app, base, closing, 1..=10).await);
    assert_eq!(early.len(), 10);
    assert_eq!(
        app.wait_for_orders(sale, 300, Duration::from_secs(30))
            .await,
        300
    );
    assert_eq!(
        app.wait_for_orders(closing, 10, Duration::from_secs(30))
            .await,
        10
    );
    (first, early)
}

/// Checks what the shoppers heard after the restart; returns the orders the cancelled
/// buyers won again and those the crowd won.
fn check_the_answers_after_the_restart(
    again: &HashMap<i64, (StatusCode, Value)>,
    crowd: &HashMap<i64, (StatusCode, Value)>,
    closed: &HashMap<i64, (StatusCode, Value)>,
    first: &HashMap<i64, i64>,
    second: &HashMap<i64, i64>,
) -> (HashMap<i64, i64>, HashMap<i64, i64>) {
    // Earlier winners still hold their orders, the cancelled ones could grab again.
    let mut cancelled_won = HashMap::new();
    for (user, (status, body)) in again {
        let held = first.get(user).or(second.get(user)).unwrap();
        if *user <= 5 {
            assert_eq!(
                *status,
                StatusCode::ACCEPTED,
                "cancelled buyer {user}: {body}"
            );
            cancelled_won.insert(
                *user,
                body["order_id"].as_str().unwrap().parse::<i64>().unwrap(),
            );
        } else {
            assert_eq!(*status, StatusCode::CONFLICT, "user {user}: {body}");
            assert_eq!(body["error"]["code"], "already_ordered");
            assert_eq!(body["error"]["order_id"], held.to_string(), "user {user}");
        }
    }
    // Exactly the units Postgres had left were sold: 500 - 445 active - 5 again.
    let fresh = won(crowd);
    assert_eq!(fresh.len(), 50, "the units left, no more");
    for (status, body) in crowd.values() {
        if *status != StatusCode::ACCEPTED {
            assert_eq!(body["error"]["code"], "sold_out", "{body}");
        }
    }
    // The close held.
    for (status, body) in closed.values() {
        assert_eq!(*status, StatusCode::CONFLICT, "{body}");
        assert_eq!(body["error"]["code"], "ended", "{body}");
    }
    (cancelled_won, fresh)
}

/// A server that was a replica for a moment and is a master again (as after a partial
/// resync and a second promotion) keeps its Lua state, so its term, while it may have
/// taken another master's data meanwhile. Its identity changed: the watch draws a new
/// term, and the sale is rebuilt from Postgres and sells on.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_server_promoted_again_under_the_same_term_gets_a_new_one_and_its_sales_are_rebuilt(
    db: PgPool,
) {
    let redis = PrivateRedis::start();
    let app = TestApp::spawn_with(db, redis.url.clone(), true).await;
    let sale = app.open_sale(10).await;
    let (status, body) = app.grab(sale, 1).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let term_of_sale = || {
        let cmd = redis::cmd("HGET")
            .arg(app.keys.voucher(vid(sale)))
            .arg("term")
            .clone();
        let app = &app;
        async move { app.redis_cmd::<Option<String>>(&cmd).await }
    };
    let built_in = term_of_sale().await.unwrap();

    // A replica of a master it never reaches (its data and Lua state stay as they
    // were), then a master again: a new replication id under the same term.
    redis.run_command::<()>(redis::cmd("REPLICAOF").arg("127.0.0.1").arg(1));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    redis.run_command::<()>(redis::cmd("REPLICAOF").arg("NO").arg("ONE"));

    let began = Instant::now();
    while term_of_sale().await.as_deref() == Some(built_in.as_str()) {
        assert!(
            began.elapsed() < Duration::from_secs(30),
            "the sale was not rebuilt in a new term"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let answers = press_through_503s(&app, &app.base, sale, [1, 2]).await;
    assert_eq!(answers[&1].0, StatusCode::CONFLICT, "{:?}", answers[&1]);
    assert_eq!(answers[&2].0, StatusCode::ACCEPTED, "{:?}", answers[&2]);
    println!(
        "promoted again under the same term: the sale rebuilt in a new term {:.1} s later",
        began.elapsed().as_secs_f64()
    );
}
