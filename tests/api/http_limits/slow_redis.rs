//! Bounds on Redis and Postgres calls: timeouts answered as unknown outcomes, read
//! paths while Redis hangs, values Postgres cannot store, and abandoned grabs.

use super::*;

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
    let minted = app.state.admission.ids.next().unwrap();
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
        Outcome::of(second, minted),
        Outcome::Admitted { order_id: minted }
    );
    assert_eq!(app.redis_stock(voucher).await, Some(4), "one unit, once");
    // Another request of the same user (another minted id) is told about the order.
    let (status, body) = app.grab(voucher, 42).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(body["error"]["order_id"], minted.to_string());
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
    let orders = seckill::admission::orders_of(
        &mut app.redis.clone(),
        &app.keys,
        uid(7),
        &[(vid(voucher), 1)],
    )
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

/// A grab whose request gave up while it waited for its shard's call (the client went
/// away, the request timed out) is not sent afterwards: a grab never sent admits
/// nothing, batched or not.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_grab_abandoned_while_queued_behind_a_slow_call_is_never_sent(db: PgPool) {
    use crate::common::grab_of;
    use seckill::admission::{batcher::Batcher, Outcome};
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
        Duration::from_millis(1),
        seckill::scripts::Replicas::NONE,
        Default::default(),
        Default::default(),
    ));

    let blocked = block_redis(&redis.url, 1_000).await;
    let in_flight = {
        let batcher = batcher.clone();
        tokio::spawn(async move { batcher.admit(grab_of(voucher, 7, 7007)).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let abandoned = tokio::time::timeout(
        Duration::from_millis(100),
        batcher.admit(grab_of(voucher, 8, 8008)),
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
