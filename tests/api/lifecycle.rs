//! The order lifecycle: pay, cancel and expiry, each unit returned exactly once to both
//! stores, against the real app, Redis, Postgres and `seckill worker` processes.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{json, Value};
use sqlx::PgPool;

use crate::common::faults::{database_url, Process, Proxy};
use crate::common::{oid, uid, vid, TestApp};
use seckill::domain::OrderId;

/// Grabs as `user` and returns the order id (the grab must succeed).
async fn grab_id(app: &TestApp, voucher: i64, user: i64) -> String {
    let (status, body) = app.grab(voucher, user).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    body["order_id"].as_str().unwrap().to_string()
}

/// Postgres's and Redis's stock of the sale.
async fn stocks(app: &TestApp, voucher: i64) -> (i64, Option<i64>) {
    (
        app.pg_stock(voucher).await as i64,
        app.redis_stock(voucher).await,
    )
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn paying_a_created_order_makes_it_paid_and_paying_again_changes_nothing(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(5).await;
    let id = grab_id(&app, voucher, 1).await;
    app.drain().await;

    let (status, order) = app.get(&format!("/orders/{id}"), Some(&app.token(1))).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(order["status"], "created");
    assert!(order["pay_before"].is_string(), "{order}");
    assert!(order["paid_at"].is_null() && order["closed_at"].is_null());

    let body = json!({"payment_ref": "psp-42"});
    let (status, _, paid) = app
        .order_action(&id, "pay", &app.token(1), Some(&body))
        .await;
    assert_eq!(status, StatusCode::OK, "{paid}");
    assert_eq!(paid["status"], "paid");
    assert_eq!(paid["payment_ref"], "psp-42");
    assert!(paid["paid_at"].is_string());

    let other = json!({"payment_ref": "psp-43"});
    let (status, _, again) = app
        .order_action(&id, "pay", &app.token(1), Some(&other))
        .await;
    assert_eq!(status, StatusCode::OK, "{again}");
    assert_eq!(
        (&again["paid_at"], &again["payment_ref"]),
        (&paid["paid_at"], &paid["payment_ref"]),
        "paying again changes nothing"
    );

    let (status, refused) = app.cancel(&id, 1).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(refused["error"]["code"], "order_paid");
    assert_eq!(app.pg_status(&id).await.as_deref(), Some("paid"));
    assert_eq!(
        stocks(&app, voucher).await,
        (4, Some(4)),
        "a paid unit stays sold"
    );
    // (Checked against the sale row's counts, which paying again did not raise.)
    assert_eq!(app.pg_statuses(voucher).await.get("paid"), Some(&1));
}

/// Redis forgot that user 7 holds an order and admitted them again. The batch holding
/// that second order skips it (the first is active), locks the sale's row, and asks
/// again for what it skipped; the user pays the first order just then, and the payment
/// waits for the batch's lock. Neither may wait for the other: the payment is made,
/// the batch refuses the second order as it refuses any order of a user holding
/// another, and Postgres finds no deadlock.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_payment_meeting_a_batch_with_a_second_order_of_the_payer_under_the_sale_lock_does_not_deadlock(
    db: PgPool,
) {
    use futures::FutureExt;
    use seckill::store::lifecycle::Transition;
    use seckill::store::orders::{persist_batch, NewOrder, Persisted, Rejection};
    use seckill::stream::ReadFrom;

    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(5).await;
    let first: i64 = grab_id(&app, voucher, 7).await.parse().unwrap();
    app.drain().await;
    let _: () = app
        .redis_cmd(
            redis::cmd("HDEL")
                .arg(app.keys.voucher(vid(voucher)))
                .arg("u:7"),
        )
        .await;
    let second: i64 = grab_id(&app, voucher, 7).await.parse().unwrap();
    let reader = app.worker_named("worker-holding");
    reader.ensure_groups().await.unwrap();
    let held = reader
        .read_batch(
            app.keys.shard_of(vid(voucher)),
            ReadFrom::New { block_ms: 1 },
        )
        .await
        .unwrap();
    let orders: Vec<NewOrder> = held.iter().filter_map(|e| e.order().copied()).collect();
    assert_eq!(
        orders.iter().map(|o| (o.id, o.user_id)).collect::<Vec<_>>(),
        [(oid(second), uid(7))]
    );

    // The live check runs under the batch's sale lock, just before the skipped order is
    // inserted again: the payment starts there (the app's own pool, the very call its
    // handler makes), and the check returns once it waits for a sale's row.
    let payment = std::sync::Mutex::new(None);
    let (app_ref, payment_ref) = (&app, &payment);
    let live = move |ids: Vec<OrderId>| {
        async move {
            let started = {
                let mut slot = payment_ref.lock().unwrap();
                let first_call = slot.is_none();
                slot.get_or_insert_with(|| {
                    let (db, mut conn) = (app_ref.state.db.clone(), app_ref.redis.clone());
                    let keys = app_ref.keys.clone();
                    tokio::spawn(async move {
                        seckill::lifecycle::pay(
                            &db,
                            &mut conn,
                            &keys,
                            Default::default(),
                            oid(first),
                            Some("psp-7"),
                        )
                        .await
                    })
                });
                first_call
            };
            if started {
                waiting_for_a_sale_lock(&app_ref.db).await?;
            }
            Ok(ids.into_iter().collect())
        }
        .boxed()
    };
    let batch = persist_batch(&app.db, &orders, &live).await;
    let paid = payment
        .into_inner()
        .unwrap()
        .expect("the payment started")
        .await
        .unwrap();
    let batch = batch.map_err(|e| format!("{e:#}"));
    let paid = paid.map_err(|e| format!("{e:#}"));
    println!("batch: {batch:?}\npayment: {paid:?}");
    assert_eq!(
        batch,
        Ok(vec![Persisted::Rejected(Rejection::UserHoldsOther)]),
        "the batch"
    );
    match paid {
        Ok(Transition::Moved(row)) => {
            assert_eq!((row.id.get(), row.status.as_str()), (first, "paid"));
            assert_eq!(row.payment_ref.as_deref(), Some("psp-7"));
        }
        other => panic!("the payment: {other:?}"),
    }
    let deadlocks: i64 = sqlx::query_scalar(
        "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(&app.db)
    .await
    .unwrap();
    assert_eq!(deadlocks, 0);
    assert_eq!(app.pg_status(&second.to_string()).await, None);
    assert_eq!(app.pg_stock(voucher).await, 4, "one unit sold, once");
    // (Checked against the sale row's counts: the payment counted there too.)
    assert_eq!(app.pg_statuses(voucher).await.get("paid"), Some(&1));
}

/// Waits (up to 10 s) until a session of the test's database waits for a lock on a
/// sale's row.
async fn waiting_for_a_sale_lock(db: &PgPool) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND wait_event_type = 'Lock' AND query LIKE '%seckill_vouchers%'",
        )
        .fetch_one(db)
        .await?;
        if n > 0 {
            return Ok(());
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "nobody waited for the sale's row lock"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn cancelling_returns_the_unit_to_both_stores_once_and_the_buyer_may_grab_again(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(3).await;
    let first = grab_id(&app, voucher, 7).await;
    grab_id(&app, voucher, 8).await;
    app.drain().await;
    assert_eq!(stocks(&app, voucher).await, (1, Some(1)));

    let (status, cancelled) = app.cancel(&first, 7).await;
    assert_eq!(status, StatusCode::OK, "{cancelled}");
    assert_eq!(cancelled["status"], "cancelled");
    assert!(cancelled["closed_at"].is_string());
    assert_eq!(app.pg_statuses(voucher).await.get("cancelled"), Some(&1));
    assert_eq!(
        stocks(&app, voucher).await,
        (2, Some(2)),
        "one unit back in each"
    );
    assert_eq!(app.owed_releases().await, 0, "the release was made at once");

    for _ in 0..3 {
        let (status, again) = app.cancel(&first, 7).await;
        assert_eq!(status, StatusCode::OK, "{again}");
        assert_eq!(again["closed_at"], cancelled["closed_at"]);
    }
    let (status, refused) = app.pay(&first, 7).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(refused["error"]["code"], "order_closed");
    assert_eq!(app.sweep().await.returned, 0, "nothing left to release");
    assert_eq!(
        stocks(&app, voucher).await,
        (2, Some(2)),
        "still exactly once"
    );

    // The same shopper buys again; the new order is written beside the cancelled one.
    let second = grab_id(&app, voucher, 7).await;
    assert_ne!(second, first);
    let (status, dup) = app.grab(voucher, 7).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(dup["error"]["order_id"], second.as_str());
    let report = app.drain().await;
    assert_eq!(report.inserted, 1);
    assert_eq!(app.pg_status(&second).await.as_deref(), Some("created"));
    assert_eq!(stocks(&app, voucher).await, (1, Some(1)));

    let (status, mine) = app.get("/orders", Some(&app.token(7))).await;
    assert_eq!(status, StatusCode::OK);
    let listed: Vec<(&str, &str)> = mine
        .as_array()
        .unwrap()
        .iter()
        .map(|o| {
            (
                o["order_id"].as_str().unwrap(),
                o["status"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        listed,
        [(second.as_str(), "created"), (first.as_str(), "cancelled")]
    );
    let (code, books) = app.cli(&["reconcile", "--voucher", &voucher.to_string()]);
    assert_eq!(code, 0, "{books}");

    // Counted (the recorder is shared by the tests of this binary: present, not exact).
    let metrics = app.metrics_text().await;
    for line in [
        "seckill_order_transitions_total{to=\"cancelled\"}",
        "seckill_units_returned_total{store=\"postgres\"}",
        "seckill_units_returned_total{store=\"redis\"}",
    ] {
        let value = crate::common::metric_value(&metrics, line);
        assert!(value >= Some(1.0), "{line} is {value:?} in /metrics");
    }
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_pending_order_answers_order_pending_with_retry_after_and_changes_nothing(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(2).await;
    let id = grab_id(&app, voucher, 3).await;
    for action in ["pay", "cancel"] {
        let (status, retry, body) = app.order_action(&id, action, &app.token(3), None).await;
        assert_eq!(status, StatusCode::CONFLICT, "{action}: {body}");
        assert_eq!(body["error"]["code"], "order_pending");
        assert_eq!(retry.as_deref(), Some("1"));
        // An administrator sees the same, through the stream.
        let (status, _, body) = app
            .order_action(&id, action, &app.admin_token(), None)
            .await;
        assert_eq!(status, StatusCode::CONFLICT);
        assert_eq!(body["error"]["code"], "order_pending");
    }
    let (status, pending) = app.get(&format!("/orders/{id}"), Some(&app.token(3))).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(pending["status"], "pending");
    assert!(pending["pay_before"].is_string(), "{pending}");
    app.drain().await;
    assert_eq!(app.pg_status(&id).await.as_deref(), Some("created"));
    assert_eq!(stocks(&app, voucher).await, (1, Some(1)));
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn unknown_or_foreign_orders_are_404_and_bad_bodies_are_refused_with_nothing_changed(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(2).await;
    let id = grab_id(&app, voucher, 5).await;
    app.drain().await;

    for action in ["pay", "cancel"] {
        let (status, _, body) = app.order_action(&id, action, &app.token(6), None).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "somebody else's: {body}");
        let (status, _, _) = app
            .order_action("4242424242", action, &app.token(5), None)
            .await;
        assert_eq!(status, StatusCode::NOT_FOUND, "unknown");
        let (status, _, _) = app.order_action("0", action, &app.token(5), None).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "not an id");
    }
    let long = "x".repeat(129);
    for (body, want) in [
        (
            json!({"payment_ref": long}),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (json!({"payment_ref": ""}), StatusCode::UNPROCESSABLE_ENTITY),
        (
            json!({"payment_ref": "   "}),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            json!({"payment_ref": "\u{200B}\u{FEFF}"}),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            json!({"payment_ref": "a\u{0}b"}),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (json!({"payment_ref": 12}), StatusCode::UNPROCESSABLE_ENTITY),
        (
            json!({"payment_ref": "ok", "amount": 1}),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (json!([1]), StatusCode::UNPROCESSABLE_ENTITY),
        // serde reads a struct from an array of its fields: not a body here.
        (json!(["psp-1"]), StatusCode::UNPROCESSABLE_ENTITY),
        (json!([null]), StatusCode::UNPROCESSABLE_ENTITY),
        (json!("psp-1"), StatusCode::UNPROCESSABLE_ENTITY),
    ] {
        let (status, _, err) = app
            .order_action(&id, "pay", &app.token(5), Some(&body))
            .await;
        assert_eq!(status, want, "{body}: {err}");
        assert_eq!(err["error"]["code"], "validation");
    }
    let raw = app
        .client
        .post(app.url(&format!("/orders/{id}/pay")))
        .bearer_auth(app.token(5))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(raw.status(), StatusCode::BAD_REQUEST);
    let no_auth = app
        .client
        .post(app.url(&format!("/orders/{id}/cancel")))
        .send()
        .await
        .unwrap();
    assert_eq!(no_auth.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(app.pg_status(&id).await.as_deref(), Some("created"));
    assert_eq!(stocks(&app, voucher).await, (1, Some(1)), "nothing changed");

    // A 128-character reference is fine, and an administrator may pay anyone's order.
    let body = json!({"payment_ref": "é".repeat(128)});
    let (status, _, paid) = app
        .order_action(&id, "pay", &app.admin_token(), Some(&body))
        .await;
    assert_eq!(status, StatusCode::OK, "{paid}");
    assert_eq!(paid["status"], "paid");
}

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
    for action in ["pay", "cancel"] {
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
async fn an_order_written_after_its_deadline_is_expired_promptly_and_never_paid(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale_paying(5, 1).await;
    let late = grab_id(&app, voucher, 1).await;
    let swept = grab_id(&app, voucher, 2).await;
    // The worker is down past the deadline (an outage), then writes both.
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let (status, body) = app.pay(&late, 1).await;
    assert_eq!(
        (status, &body["error"]["code"]),
        (StatusCode::CONFLICT, &json!("order_pending"))
    );
    assert_eq!(app.drain().await.inserted, 2);
    assert_eq!(stocks(&app, voucher).await, (3, Some(3)));

    // Paying it now is refused, and the refusal expires it on the spot.
    let (status, body) = app.pay(&late, 1).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(body["error"]["code"], "order_closed");
    assert_eq!(app.pg_status(&late).await.as_deref(), Some("expired"));
    assert_eq!(stocks(&app, voucher).await, (4, Some(4)));

    // The other is the sweeper's on its next pass; cancelling it meanwhile also finds
    // it past its deadline: expired, not cancelled.
    let report = app.sweep().await;
    assert_eq!((report.expired, report.returned), (1, 1));
    assert_eq!(app.pg_status(&swept).await.as_deref(), Some("expired"));
    let (status, body) = app.cancel(&swept, 2).await;
    assert_eq!(body["error"]["code"], "order_closed", "{status}");
    assert_eq!(stocks(&app, voucher).await, (5, Some(5)));
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

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_crash_between_the_postgres_commit_and_the_redis_release_releases_once_after_restart(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    // A worker and an API whose Redis is reached through a proxy that will be cut.
    let redis_addr: std::net::SocketAddr = "127.0.0.1:6379".parse().unwrap();
    let proxy = Proxy::start(redis_addr).await;
    let via_proxy = format!("redis://{}", proxy.addr);
    let mut worker = Process::spawn(
        "worker",
        &via_proxy,
        app.keys.prefix(),
        &database_url(&app.db, None),
        &[
            ("EXPIRY_SWEEP_MS", "100".into()),
            ("EXPIRY_BATCH", "3".into()),
        ],
    );
    let (mut api, api_base) = app
        .spawn_server("api", &[("REDIS_URL", via_proxy.clone())])
        .await;

    // Sale `expiring`: ten unpaid orders due in 2 s. Sale `kept`: one order to cancel.
    let expiring = app.open_sale_paying(20, 2).await;
    let kept = app.open_sale(5).await;
    for user in 1..=10 {
        grab_id(&app, expiring, user).await;
    }
    let cancelled = grab_id(&app, kept, 1).await;
    // Written by this drain or by the worker process, whichever reads them first.
    app.drain().await;
    for (sale, n) in [(expiring, 10), (kept, 1)] {
        assert_eq!(
            app.wait_for_orders(sale, n, Duration::from_secs(10)).await,
            n
        );
    }
    assert_eq!(stocks(&app, expiring).await, (10, Some(10)));
    assert_eq!(stocks(&app, kept).await, (4, Some(4)));

    proxy.cut();
    // The cut API commits the cancel in Postgres and cannot make the release: still a
    // 200 (Postgres decided), the release owed.
    let resp = app
        .client
        .post(format!("{api_base}/orders/{cancelled}/cancel"))
        .bearer_auth(app.token(1))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    // The cut worker's sweeper commits the expiries — all of them, three per
    // transaction, within 5 s of the deadline although Redis is down — and cannot make
    // their releases.
    let last_due: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT max(pay_before) FROM voucher_orders WHERE voucher_id = $1")
            .bind(expiring)
            .fetch_one(&app.db)
            .await
            .unwrap();
    while app
        .pg_statuses(expiring)
        .await
        .get("expired")
        .copied()
        .unwrap_or(0)
        < 10
    {
        assert!(
            chrono::Utc::now() < last_due + chrono::Duration::seconds(5),
            "not expired within 5 s of the deadline with Redis down: {:?}",
            app.pg_statuses(expiring).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    worker.kill9();
    api.kill9();
    println!(
        "after the crash: {:?}, owed {}",
        app.pg_statuses(expiring).await,
        app.owed_releases().await
    );
    assert_eq!(app.owed_releases().await, 11, "every release still owed");
    assert_eq!(
        stocks(&app, expiring).await,
        (20, Some(10)),
        "Redis not yet told"
    );
    assert_eq!(stocks(&app, kept).await, (5, Some(4)));

    // The books explain the difference while the releases are owed.
    let (code, books) = app.cli(&["reconcile"]);
    assert_eq!(code, 0, "owed releases are not drift:\n{books}");

    // A new worker makes the owed releases, once.
    proxy.heal();
    let _worker = Process::spawn(
        "worker",
        &app.redis_url,
        app.keys.prefix(),
        &database_url(&app.db, None),
        &[("EXPIRY_SWEEP_MS", "100".into())],
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while app.owed_releases().await > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "releases never made"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(stocks(&app, expiring).await, (20, Some(20)));
    assert_eq!(stocks(&app, kept).await, (5, Some(5)));
    assert_eq!(app.sweep().await.returned, 0);
    let (code, books) = app.cli(&["reconcile"]);
    assert_eq!(code, 0, "{books}");
    // Every shopper is free again: 20 units, 25 shoppers, exactly 20 sold.
    let mut sold = 0;
    for user in 1..=25 {
        if app.grab(expiring, user).await.0 == StatusCode::ACCEPTED {
            sold += 1;
        }
    }
    assert_eq!(sold, 20);
}

/// What a shopper asked for, and what came back.
#[derive(Debug)]
struct Answer {
    order: String,
    action: &'static str,
    status: StatusCode,
    code: Option<String>,
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn cancel_pay_and_expiry_racing_at_the_deadline_with_workers_killed_return_each_unit_once(
    db: PgPool,
) {
    use futures::StreamExt;
    const UNITS: i64 = 300;
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale_paying(UNITS, 4).await;
    let spawn_worker = || {
        Process::spawn(
            "worker",
            &app.redis_url,
            app.keys.prefix(),
            &database_url(&app.db, None),
            &[
                ("EXPIRY_SWEEP_MS", "50".into()),
                ("EXPIRY_BATCH", "16".into()),
                ("WORKER_CLAIM_IDLE_MS", "500".into()),
            ],
        )
    };
    let mut workers: Vec<Process> = (0..3).map(|_| spawn_worker()).collect();
    let grabs = crate::common::press_all(&app, &app.base, voucher, 1..=UNITS, 64).await;
    let orders: Vec<(i64, String)> = grabs
        .into_iter()
        .map(|(user, answer)| {
            let (status, body) = answer.expect("an answer");
            assert_eq!(status, StatusCode::ACCEPTED, "{body}");
            (user, body["order_id"].as_str().unwrap().to_string())
        })
        .collect();
    assert_eq!(
        app.wait_for_orders(voucher, UNITS as usize, Duration::from_secs(30))
            .await,
        UNITS as usize
    );
    let deadline: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT min(pay_before) FROM voucher_orders WHERE voucher_id = $1")
            .bind(voucher)
            .fetch_one(&app.db)
            .await
            .unwrap();
    let until = |offset_ms: i64| {
        let at = deadline + chrono::Duration::milliseconds(offset_ms);
        (at - chrono::Utc::now()).to_std().unwrap_or_default()
    };

    // Around the deadline, per order: pay; cancel; pay and cancel at once; or nothing
    // (it expires). Some shoppers press twice. Meanwhile two workers die by SIGKILL
    // and a new one starts.
    let mut plans = Vec::new();
    for (i, (user, order)) in orders.iter().enumerate() {
        // Spread from 800 ms before to 300 ms after: cancels and expiries of one sale
        // queue on its row lock, so requests near the deadline land a little late.
        let offset = (i as i64 * 37) % 1100 - 800;
        let actions: &[&'static str] = match i % 5 {
            0 => &["pay"],
            1 => &["cancel"],
            2 => &["pay", "cancel"],
            3 => &["pay", "pay"],
            _ => &[],
        };
        for &action in actions {
            plans.push((*user, order.clone(), action, offset));
        }
    }
    let app_ref = &app;
    let requests = futures::stream::iter(plans)
        .map(|(user, order, action, offset)| async move {
            tokio::time::sleep(until(offset)).await;
            let (status, _, body) = app_ref
                .order_action(&order, action, &app_ref.token(user), None)
                .await;
            Answer {
                order,
                action,
                status,
                code: body["error"]["code"].as_str().map(String::from),
            }
        })
        .buffer_unordered(512)
        .collect::<Vec<Answer>>();
    // And a live sale meanwhile: new shoppers keep pressing while units come back.
    let storm = futures::stream::iter(1001..=1000 + 2 * UNITS)
        .map(|user| async move {
            let offset = (user * 53) % 1400 - 450; // from -450 ms to +950 ms
            tokio::time::sleep(until(offset)).await;
            let (status, body) = app_ref.grab(voucher, user).await;
            match status {
                StatusCode::ACCEPTED => Some(body["order_id"].as_str().unwrap().to_string()),
                StatusCode::CONFLICT => None,
                other => panic!("grab during the race: {other} {body}"),
            }
        })
        .buffer_unordered(512)
        .filter_map(|id| async move { id })
        .collect::<Vec<String>>();
    let killer = async {
        tokio::time::sleep(until(150)).await;
        workers[0].kill9();
        tokio::time::sleep(Duration::from_millis(40)).await;
        workers[1].kill9();
        tokio::time::sleep(Duration::from_millis(200)).await;
        workers.push(spawn_worker());
    };
    let (answers, resold, ()) = tokio::join!(requests, storm, killer);

    // Everything settles: every order final (the resold ones expire unpaid in turn),
    // every release made.
    let limit = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let statuses = app.pg_statuses(voucher).await;
        let total: i64 = statuses.values().sum();
        if total == UNITS + resold.len() as i64
            && !statuses.contains_key("created")
            && app.owed_releases().await == 0
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < limit,
            "never settled: {statuses:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let final_status: std::collections::HashMap<String, String> =
        sqlx::query_as::<_, (i64, String)>(
            "SELECT id, status FROM voucher_orders WHERE voucher_id = $1",
        )
        .bind(voucher)
        .fetch_all(&app.db)
        .await
        .unwrap()
        .into_iter()
        .map(|(id, s)| (id.to_string(), s))
        .collect();
    let mut paid_ok = std::collections::HashSet::new();
    let mut cancelled_ok = std::collections::HashSet::new();
    for a in &answers {
        let now = &final_status[&a.order];
        match (a.action, a.status, a.code.as_deref()) {
            ("pay", StatusCode::OK, _) => {
                assert_eq!(now, "paid", "a 200 paid is paid: {a:?}");
                paid_ok.insert(a.order.clone());
            }
            ("cancel", StatusCode::OK, _) => {
                assert_eq!(now, "cancelled", "a 200 cancel is cancelled: {a:?}");
                cancelled_ok.insert(a.order.clone());
            }
            ("pay", StatusCode::CONFLICT, Some("order_closed")) => {
                assert!(now == "cancelled" || now == "expired", "{a:?} but {now}")
            }
            ("cancel", StatusCode::CONFLICT, Some("order_paid")) => assert_eq!(now, "paid"),
            ("cancel", StatusCode::CONFLICT, Some("order_closed")) => assert_eq!(now, "expired"),
            _ => panic!("unexpected answer {a:?} (order now {now})"),
        }
    }
    assert!(
        paid_ok.is_disjoint(&cancelled_ok),
        "paid and cancelled both"
    );
    let statuses = app.pg_statuses(voucher).await;
    let count = |s: &str| statuses.get(s).copied().unwrap_or(0);
    let (paid, cancelled, expired) = (count("paid"), count("cancelled"), count("expired"));
    assert_eq!(
        paid + cancelled + expired,
        UNITS + resold.len() as i64,
        "every order final: {statuses:?}"
    );
    for id in &resold {
        assert_eq!(
            final_status[id], "expired",
            "every 202 of the live sale landed"
        );
    }
    let dead: i64 = app
        .redis_cmd(redis::cmd("XLEN").arg(app.keys.dead_letters(app.keys.shard_of(vid(voucher)))))
        .await;
    assert_eq!(dead, 0, "nothing dead-lettered: no 202 beyond stock");
    assert_eq!(
        paid as usize,
        paid_ok.len(),
        "every paid order was answered 200"
    );
    assert_eq!(cancelled as usize, cancelled_ok.len());
    let (pg_stock, redis_stock) = stocks(&app, voucher).await;
    println!(
        "race at the deadline ({} pay/cancel requests, {} units resold meanwhile, 2 of 3 \
         workers killed mid-way):\n\
         {:>6} {:>10} {:>8} {:>9} {:>11}\n{paid:>6} {cancelled:>10} {expired:>8} {pg_stock:>9} {:>11}",
        answers.len(),
        resold.len(),
        "paid",
        "cancelled",
        "expired",
        "pg_stock",
        "redis_stock",
        redis_stock.unwrap_or(-1),
    );
    assert!(paid > 0 && cancelled > 0 && expired > 0, "{statuses:?}");
    assert_eq!(pg_stock, UNITS - paid, "postgres stock = initial - paid");
    assert_eq!(
        redis_stock,
        Some(UNITS - paid),
        "live stock = initial - paid"
    );
    let (code, books) = app.cli(&["reconcile", "--voucher", &voucher.to_string()]);
    assert_eq!(code, 0, "{books}");

    // The freed units sell again, exactly: to the first shoppers and to new ones.
    let again = crate::common::press_all(&app, &app.base, voucher, 1..=2 * UNITS, 64).await;
    let sold = again
        .iter()
        .filter(|(_, a)| a.as_ref().is_some_and(|(s, _)| *s == StatusCode::ACCEPTED))
        .count() as i64;
    assert_eq!(sold, UNITS - paid);
    let expected = UNITS as usize;
    let limit = tokio::time::Instant::now() + Duration::from_secs(30);
    while app.pg_orders(voucher).await.len() < expected {
        assert!(
            tokio::time::Instant::now() < limit,
            "resold orders never written"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(stocks(&app, voucher).await, (0, Some(0)));
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
    assert_eq!(
        seckill::lifecycle::sweeper::expire_all_due(&db, 100)
            .await
            .unwrap(),
        0
    );
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
