//! A buyer Redis forgot restored from Postgres, and a worker writing through one
//! consumer per lane whose kill loses nothing.

use super::*;

/// Redis forgot a buyer whose order Postgres holds (a hand edit, a
/// lossy restore). Their presses must not keep producing phantom 202s that each take a
/// unit: at most the first one, which the worker then resolves to the Postgres order,
/// giving the unit back.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_buyer_redis_forgot_is_restored_from_postgres_and_gets_no_more_phantom_orders(
    db: PgPool,
) {
    let _run_time = RunTime::start();
    let app = TestApp::spawn(db).await;
    let stock = 100;
    let voucher = app.open_sale(stock).await;
    let (_serve, base) = app
        .spawn_server("serve", &[("WORKER_BLOCK_MS", "100".into())])
        .await;
    let winners = admitted(&press_all(&app, &base, voucher, 1..=20, 8).await);
    assert_eq!(winners.len(), 20);
    assert_eq!(
        app.wait_for_orders(voucher, 20, Duration::from_secs(20))
            .await,
        20
    );
    assert!(wait_drained(&app, &app.keys, Duration::from_secs(20)).await);

    let user = 7;
    let pg_order = winners[&user];
    let sale = app.keys.voucher(vid(voucher));
    let _: i64 = app
        .redis_cmd(redis::cmd("HDEL").arg(&sale).arg(format!("u:{user}")))
        .await;
    let stock_before = app.redis_stock(voucher).await;

    let mut answers = Vec::new();
    for _ in 0..6 {
        answers.push(press(&app, &base, voucher, user).await);
        // Let the worker deal with whatever the press admitted.
        assert!(wait_drained(&app, &app.keys, Duration::from_secs(10)).await);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let phantoms = answers
        .iter()
        .filter(|(s, _)| *s == StatusCode::ACCEPTED)
        .count();
    let buyer: Option<String> = app
        .redis_cmd(redis::cmd("HGET").arg(&sale).arg(format!("u:{user}")))
        .await;
    let live = app.redis_stock(voucher).await;
    let pg_stock = app.pg_stock(voucher).await;
    let dead = dead_letters(&app, &app.keys).await;
    println!(
        "answers to the forgotten buyer's six presses: {:?}; redis stock {stock_before:?} \
         before, {live:?} after; pg stock {pg_stock}; buyer record {buyer:?} (postgres \
         order {pg_order}); dead letters {dead}",
        answers
            .iter()
            .map(|(s, b)| format!("{} {}", s.as_u16(), b))
            .collect::<Vec<_>>(),
    );
    let stored = app.assert_consistent(voucher, stock).await;
    assert_eq!(stored.len(), 20, "the phantom orders were written");
    assert!(
        phantoms <= 1,
        "{phantoms} phantom 202s for a buyer who holds an order"
    );
    for (i, (status, body)) in answers.iter().enumerate().skip(1) {
        assert_eq!(*status, StatusCode::CONFLICT, "press {}: {body}", i + 1);
        assert_eq!(body["error"]["code"], "already_ordered", "press {}", i + 1);
        assert_eq!(
            body["error"]["order_id"],
            pg_order.to_string(),
            "press {}",
            i + 1
        );
    }
    assert_eq!(buyer, Some(pg_order.to_string()), "buyer record restored");
    assert_eq!(live, Some(pg_stock as i64), "redis stock vs postgres stock");
}

/// One worker process writes with `WORKER_CONCURRENCY` consumers of its own, several
/// batches in flight. Killed with -9 in the middle of a backlog, whatever its lanes held
/// is taken over by another worker and written exactly once.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_worker_writes_through_one_consumer_per_lane_and_a_kill_loses_nothing_any_lane_held(
    db: PgPool,
) {
    let _run_time = RunTime::start();
    let app = TestApp::spawn(db.clone()).await;
    let n = 20_000;
    let voucher = app.open_sale(n).await;
    let stream = app.keys.stream(app.keys.shard_of(vid(voucher))).to_string();
    xadd_orders(&app, &stream, voucher, 1, n, 60_000_000).await;
    let url = faults::database_url(&db, None);
    let count = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM voucher_orders")
            .fetch_one(&app.db)
            .await
            .unwrap()
    };
    let lanes = [
        ("WORKER_CONSUMER", "lanes".to_string()),
        ("WORKER_CONCURRENCY", "3".to_string()),
        ("WORKER_BATCH_SIZE", "200".to_string()),
    ];
    let mut first = Process::spawn("worker", &app.redis_url, app.keys.prefix(), &url, &lanes);
    let deadline = Instant::now() + Duration::from_secs(60);
    while count().await < n / 4 {
        assert!(Instant::now() < deadline, "the worker wrote nothing");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    first.kill9();
    let written_by_first = count().await;
    let consumers: Vec<HashMap<String, redis::Value>> = app
        .redis_cmd(
            redis::cmd("XINFO")
                .arg("CONSUMERS")
                .arg(&stream)
                .arg(seckill::stream::GROUP),
        )
        .await;
    let mut held = Vec::new();
    for c in &consumers {
        let name: String = redis::from_redis_value(c["name"].clone()).unwrap();
        let pending: i64 = redis::from_redis_value(c["pending"].clone()).unwrap();
        held.push((name, pending));
    }
    held.sort();
    println!("killed after {written_by_first} of {n} orders; held by its lanes: {held:?}");
    let names: Vec<&str> = held.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(names, ["lanes", "lanes/1", "lanes/2"]);
    assert!(
        written_by_first < n,
        "the whole backlog was written before the kill"
    );

    let _second = Process::spawn(
        "worker",
        &app.redis_url,
        app.keys.prefix(),
        &url,
        &[("WORKER_CLAIM_IDLE_MS", "300".to_string())],
    );
    assert!(wait_drained(&app, &app.keys, Duration::from_secs(90)).await);
    let distinct: i64 = sqlx::query_scalar("SELECT count(DISTINCT user_id) FROM voucher_orders")
        .fetch_one(&app.db)
        .await
        .unwrap();
    assert_eq!((count().await, distinct), (n, n));
    assert_eq!(app.pg_stock(voucher).await, 0);
    assert_eq!(dead_letters(&app, &app.keys).await, 0);
}
