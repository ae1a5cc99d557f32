//! Unpaid orders expiring: within the window, written after the deadline, replayed
//! entries, units returned while Redis lacks the sale, and the lifecycle migration.

use super::*;

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn an_unpaid_order_expires_within_the_window_and_its_unit_sells_again(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale_paying(3, 1).await;
    let mut ids = Vec::new();
    for user in 1..=3 {
        ids.push(grab_id(&app, voucher, user).await);
    }
    let (status, sold_out) = app.grab(voucher, 4).await;
    assert_eq!(
        (status, &sold_out["error"]["code"]),
        (StatusCode::CONFLICT, &json!("sold_out"))
    );

    // A real worker process: it writes the orders, and its sweeper expires them.
    let _worker = Process::spawn(
        "worker",
        &app.redis_url,
        app.keys.prefix(),
        &database_url(&app.db, None),
        &[("EXPIRY_SWEEP_MS", "200".into())],
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut last: Value = Value::Null;
    for id in &ids {
        loop {
            let (_, order) = app
                .get(&format!("/orders/{id}"), Some(&app.admin_token()))
                .await;
            if order["status"] == "expired" {
                last = order;
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "never expired: {order}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let pay_before: chrono::DateTime<chrono::Utc> =
        serde_json::from_value(last["pay_before"].clone()).unwrap();
    let closed_at: chrono::DateTime<chrono::Utc> =
        serde_json::from_value(last["closed_at"].clone()).unwrap();
    let late = closed_at - pay_before;
    println!("expired {} ms after its deadline", late.num_milliseconds());
    assert!(
        late >= chrono::Duration::zero(),
        "never before the deadline"
    );
    assert!(late < chrono::Duration::seconds(5), "within 5 s: {late}");

    // Released in Redis too (the worker's sweeper makes the release).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while stocks(&app, voucher).await != (3, Some(3)) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{:?}",
            stocks(&app, voucher).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for action in ["checkout", "cancel"] {
        let (status, _, body) = app.order_action(&ids[0], action, &app.token(1), None).await;
        assert_eq!(status, StatusCode::CONFLICT);
        assert_eq!(body["error"]["code"], "order_closed", "{action}");
    }
    // The freed units sell again: to the same shoppers and to a new one, exactly three.
    let mut sold = 0;
    for user in [1, 2, 4, 5] {
        if app.grab(voucher, user).await.0 == StatusCode::ACCEPTED {
            sold += 1;
        }
    }
    assert_eq!(sold, 3);
    assert_eq!(app.redis_stock(voucher).await, Some(0));
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn an_order_written_after_an_outage_longer_than_its_window_still_gets_the_whole_window(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale_paying(5, 2).await;
    let paid = grab_id(&app, voucher, 1).await;
    let unpaid = grab_id(&app, voucher, 2).await;
    // The worker is down longer than the window (an outage), then writes both.
    tokio::time::sleep(Duration::from_millis(2300)).await;
    let (status, body) = app.pay(&paid, 1).await;
    assert_eq!(
        (status, &body["error"]["code"]),
        (StatusCode::CONFLICT, &json!("order_pending"))
    );
    assert_eq!(app.drain().await.inserted, 2);
    assert_eq!(stocks(&app, voucher).await, (3, Some(3)));

    // Each deadline runs from the order's writing, by Postgres's clock: nothing is due.
    let (to_pay, age): (f64, f64) = sqlx::query_as(
        "SELECT extract(epoch FROM min(pay_before - created_at))::float8, \
                extract(epoch FROM max(now() - created_at))::float8 \
         FROM voucher_orders WHERE voucher_id = $1",
    )
    .bind(voucher)
    .fetch_one(&app.db)
    .await
    .unwrap();
    assert_eq!(to_pay, 2.0);
    assert!(age < 1.0, "written {age} s ago");
    assert_eq!(app.sweep().await, Default::default(), "nothing due yet");
    let (status, body) = app.pay(&paid, 1).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["status"], "paid");

    // The other is due once its own deadline passed: a cancel then finds it expired.
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let (status, body) = app.cancel(&unpaid, 2).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(body["error"]["code"], "order_closed");
    assert_eq!(app.pg_status(&unpaid).await.as_deref(), Some("expired"));
    assert_eq!(stocks(&app, voucher).await, (4, Some(4)));
    assert_eq!(app.sweep().await, Default::default(), "nothing twice");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_replayed_entry_never_resurrects_a_cancelled_order_nor_does_a_reload_count_it(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(10).await;
    let id = grab_id(&app, voucher, 1).await;
    grab_id(&app, voucher, 2).await;

    // A worker commits the batch and dies before XACK: the entries stay pending.
    app.commit_without_ack("dies-before-ack", app.keys.shard_of(vid(voucher)))
        .await;
    assert_eq!(app.pending_count().await, 2);

    let (status, body) = app.cancel(&id, 1).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(stocks(&app, voucher).await, (9, Some(9)));

    // A reload while the cancelled order's entry is still unacknowledged must not count
    // it in flight (it is written, and its unit is back).
    let (code, out) = app.cli(&["reconcile", "--voucher", &voucher.to_string(), "--repair"]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(stocks(&app, voucher).await, (9, Some(9)));

    let report = app.worker_named("dies-before-ack").drain().await.unwrap();
    assert_eq!((report.inserted, report.already_there), (0, 2));
    assert_eq!(app.pg_status(&id).await.as_deref(), Some("cancelled"));
    assert_eq!(
        stocks(&app, voucher).await,
        (9, Some(9)),
        "no unit taken again"
    );
    // The shopper is free to buy again.
    grab_id(&app, voucher, 1).await;
    let (code, out) = app.cli(&["reconcile", "--voucher", &voucher.to_string()]);
    assert_eq!(code, 0, "{out}");
}

#[sqlx::test(migrations = false)]
async fn the_lifecycle_migration_keeps_orders_written_before_it_as_paid_purchases(db: PgPool) {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/migrations");
    let mut files: Vec<std::path::PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    let at = files
        .iter()
        .position(|f| f.to_string_lossy().contains("order_lifecycle"))
        .unwrap();
    for f in &files[..at] {
        sqlx::raw_sql(&std::fs::read_to_string(f).unwrap())
            .execute(&db)
            .await
            .unwrap();
    }
    // A sale of 10 with two orders, written by the previous version.
    sqlx::raw_sql(
        "INSERT INTO vouchers (id, shop_id, title, pay_value, actual_value) VALUES (1, 1, 't', 1, 2); \
         INSERT INTO seckill_vouchers (voucher_id, initial_stock, stock, begin_time, end_time) \
             VALUES (1, 10, 8, now() - interval '1 day', now() + interval '1 day'); \
         INSERT INTO voucher_orders (id, user_id, voucher_id, created_at) VALUES \
             (101, 7, 1, now() - interval '2 hours'), (102, 8, 1, now() - interval '1 hour');",
    )
    .execute(&db)
    .await
    .unwrap();
    sqlx::raw_sql(&std::fs::read_to_string(&files[at]).unwrap())
        .execute(&db)
        .await
        .unwrap();

    let rows: Vec<(i64, String, bool, bool)> = sqlx::query_as(
        "SELECT id, status, paid_at = persisted_at, \
                pay_before = created_at + interval '900 seconds' \
         FROM voucher_orders ORDER BY id",
    )
    .fetch_all(&db)
    .await
    .unwrap();
    assert_eq!(
        rows,
        [
            (101, "paid".to_string(), true, true),
            (102, "paid".to_string(), true, true)
        ]
    );
    let (stock, pay_within): (i32, i32) =
        sqlx::query_as("SELECT stock, pay_within_secs FROM seckill_vouchers")
            .fetch_one(&db)
            .await
            .unwrap();
    assert_eq!((stock, pay_within), (8, 900), "no unit given back");
    // Nothing for the sweeper, and the same user still cannot hold a second order.
    let due: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM voucher_orders WHERE status = 'created' AND pay_before <= now()",
    )
    .fetch_one(&db)
    .await
    .unwrap();
    assert_eq!(due, 0);
    let second = sqlx::query(
        "INSERT INTO voucher_orders (id, user_id, voucher_id, created_at, pay_before) \
         VALUES (103, 7, 1, now(), now())",
    )
    .execute(&db)
    .await;
    assert!(second.is_err(), "one active order per user and voucher");

    // The later migrations count those orders on the sale's row for the live view.
    for f in &files[at + 1..] {
        sqlx::raw_sql(&std::fs::read_to_string(f).unwrap())
            .execute(&db)
            .await
            .unwrap();
    }
    let counts: (i32, i32, i32) =
        sqlx::query_as("SELECT paid, cancelled, expired FROM seckill_vouchers")
            .fetch_one(&db)
            .await
            .unwrap();
    assert_eq!(counts, (2, 0, 0), "both orders counted as paid");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_unit_returned_while_the_sale_is_missing_from_redis_comes_back_through_the_reload(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(3).await;
    let first = grab_id(&app, voucher, 1).await;
    grab_id(&app, voucher, 2).await;
    app.drain().await;
    // Redis loses the sale's state; the cancel is decided by Postgres alone, and its
    // release finds nothing to release.
    let _: i64 = app
        .redis_cmd(redis::cmd("DEL").arg(app.keys.voucher(vid(voucher))))
        .await;
    let (status, body) = app.cancel(&first, 1).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(app.owed_releases().await, 0);
    assert_eq!(stocks(&app, voucher).await, (2, None));

    // The next grab finds the sale missing (503, nothing reserved) and the reload
    // counts the returned unit: Postgres's stock, Postgres's active buyers.
    let (status, _) = app.grab(voucher, 3).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while app.redis_stock(voucher).await.is_none() {
        assert!(tokio::time::Instant::now() < deadline, "never reloaded");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(stocks(&app, voucher).await, (2, Some(2)));
    let (status, dup) = app.grab(voucher, 2).await;
    assert_eq!(dup["error"]["code"], "already_ordered", "{status}");
    grab_id(&app, voucher, 1).await;
    grab_id(&app, voucher, 3).await;
    let (status, body) = app.grab(voucher, 4).await;
    assert_eq!(
        (status, &body["error"]["code"]),
        (StatusCode::CONFLICT, &json!("sold_out"))
    );
    app.drain().await;
    assert_eq!(stocks(&app, voucher).await, (0, Some(0)));
}

/// A payment received before the deadline while the order was still only in Redis (the
/// worker paused) is in time: shoppers polling checkout (and one cancelling) past the
/// deadline, the worker resumed under them, and the sweeper all leave it to be paid.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn an_in_time_payment_waiting_for_its_order_is_closed_by_neither_checkout_cancel_nor_the_sweeper(
    db: PgPool,
) {
    const SHOPPERS: i64 = 8;
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale_paying(SHOPPERS, 2).await;
    // The sweeper's rounds are seconds apart: the shoppers' requests, every 20 ms, meet
    // the orders before its next one (or after it: they must hear the same).
    let worker = Process::spawn(
        "worker",
        &app.redis_url,
        app.keys.prefix(),
        &database_url(&app.db, None),
        &[("EXPIRY_SWEEP_MS", "4000".into())],
    );
    worker.freeze(true);
    let mut ids = Vec::new();
    for user in 1..=SHOPPERS {
        let id = grab_id(&app, voucher, user).await;
        let (status, waiting) = app.provider_pays(&id, 5000).await;
        assert_eq!(status, StatusCode::OK, "{waiting}");
        assert_eq!(waiting["outcome"], "awaiting_order", "{waiting}");
        ids.push(id);
    }
    // Past every deadline while the worker is away.
    tokio::time::sleep(Duration::from_millis(3000)).await;
    worker.freeze(false);
    // Shoppers 1-3 poll checkout, shopper 4 cancels, until the order is written.
    let app_ref = &app;
    let answers = futures::future::join_all(ids.iter().take(4).enumerate().map(|(i, id)| {
        let user = i as i64 + 1;
        let action = if user == 4 { "cancel" } else { "checkout" };
        async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
            loop {
                let (status, _, body) = app_ref
                    .order_action(id, action, &app_ref.token(user), None)
                    .await;
                if body["error"]["code"] != "order_pending" {
                    return (user, action, status, body);
                }
                assert!(tokio::time::Instant::now() < deadline, "never written");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }))
    .await;
    for (user, action, status, body) in &answers {
        println!("shopper {user}'s {action} once the order was written: {status} {body}");
        assert_eq!(
            (*status, &body["error"]["code"]),
            (StatusCode::CONFLICT, &json!("order_paid")),
            "shopper {user}'s {action} of an order paid in time: {body}"
        );
    }
    // The others are settled by a sweep, which expires nothing.
    assert_eq!(
        app.wait_for_orders(voucher, SHOPPERS as usize, Duration::from_secs(20))
            .await,
        SHOPPERS as usize
    );
    let report = app.sweep().await;
    assert_eq!(report.expired, 0, "{report:?}");
    for id in &ids {
        assert_eq!(app.pg_status(id).await.as_deref(), Some("paid"), "{id}");
    }
    let outcomes: Vec<String> =
        sqlx::query_scalar("SELECT outcome FROM payment_events ORDER BY seq")
            .fetch_all(&app.db)
            .await
            .unwrap();
    assert_eq!(outcomes, vec!["paid"; SHOPPERS as usize], "no late payment");
    assert_eq!(
        stocks(&app, voucher).await,
        (0, Some(0)),
        "no unit came back"
    );
    drop(worker);
}
