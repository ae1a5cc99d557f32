//! Paying and cancelling an order: once each, racing a worker's batch under the sale
//! lock, pending orders, and the 404s and refusals around them.

use super::*;

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_created_order_paid_through_the_provider_is_paid_and_a_replay_changes_nothing(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(5).await;
    let id = grab_id(&app, voucher, 11).await;
    app.drain().await;

    let (status, order) = app
        .get(&format!("/orders/{id}"), Some(&app.token(11)))
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(order["status"], "created");
    assert!(order["pay_before"].is_string(), "{order}");
    assert!(order["paid_at"].is_null() && order["closed_at"].is_null());

    let (status, _, checkout) = app
        .order_action(&id, "checkout", &app.token(11), None)
        .await;
    assert_eq!(status, StatusCode::OK, "{checkout}");
    assert_eq!(checkout["order_id"], id.as_str());
    assert_eq!(checkout["currency"], "CNY");
    assert_eq!(checkout["pay_before"], order["pay_before"]);
    let amount = checkout["amount"].as_i64().unwrap();

    let event = crate::common::notification("payment.succeeded", &id, amount);
    let (status, notified) = app.notify(&event).await;
    assert_eq!(status, StatusCode::OK, "{notified}");
    assert_eq!(
        (&notified["outcome"], &notified["replay"]),
        (&json!("paid"), &json!(false))
    );
    let (_, paid) = app
        .get(&format!("/orders/{id}"), Some(&app.token(11)))
        .await;
    assert_eq!(paid["status"], "paid");
    assert!(paid["paid_at"].is_string());
    assert_eq!(paid["payment"]["provider"], "provider");
    assert_eq!(paid["payment"]["transaction_id"], event["transaction_id"]);
    assert_eq!(paid["payment"]["amount"], amount);
    let code = paid["redeem_code"]
        .as_str()
        .expect("its owner sees the code");
    assert_eq!(code.len(), 16);
    let (_, as_admin) = app
        .get(&format!("/orders/{id}"), Some(&app.admin_token()))
        .await;
    assert!(as_admin["redeem_code"].is_null(), "only its owner sees it");

    // The same notification again, and the same transaction under another event id:
    // the first answer, nothing changed.
    let mut renamed = event.clone();
    renamed["id"] = json!("evt_another");
    for again in [&event, &renamed] {
        let (status, replay) = app.notify(again).await;
        assert_eq!(status, StatusCode::OK, "{replay}");
        assert_eq!(
            (&replay["outcome"], &replay["replay"]),
            (&json!("paid"), &json!(true))
        );
    }
    let (_, still) = app
        .get(&format!("/orders/{id}"), Some(&app.token(11)))
        .await;
    assert_eq!(still, paid, "a replay changes nothing");

    // Another transaction for a paid order is money to give back, not a second payment.
    let (status, twice) = app.provider_pays(&id, amount).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(twice["outcome"], "already_paid");

    for action in ["checkout", "cancel"] {
        let (status, _, refused) = app.order_action(&id, action, &app.token(11), None).await;
        assert_eq!(status, StatusCode::CONFLICT, "{action}");
        assert_eq!(refused["error"]["code"], "order_paid");
    }
    assert_eq!(app.pg_status(&id).await.as_deref(), Some("paid"));
    assert_eq!(
        stocks(&app, voucher).await,
        (4, Some(4)),
        "a paid unit stays sold"
    );
    // (Checked against the sale row's counts, which the replays did not raise.)
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
    use seckill::store::orders::{persist_batch, Persisted, Rejection};

    let app = TestApp::spawn(db).await;
    let (voucher, first, second, orders) = hold_a_second_order_of_the_payer(&app).await;

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
                            seckill::store::lifecycle::Payment::Manual { reason: "psp-7" },
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
            assert_eq!(row.pay_reason.as_deref(), Some("psp-7"));
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

/// User 7's first order written and paid for next; a second order of theirs (Redis
/// forgot the first) read into a batch and held. Returns the sale, both order ids, and
/// the batch's orders.
async fn hold_a_second_order_of_the_payer(
    app: &TestApp,
) -> (i64, i64, i64, Vec<seckill::store::orders::NewOrder>) {
    use seckill::store::orders::NewOrder;
    use seckill::stream::ReadFrom;
    let voucher = app.open_sale(5).await;
    let first: i64 = grab_id(app, voucher, 7).await.parse().unwrap();
    app.drain().await;
    let _: () = app
        .redis_cmd(
            redis::cmd("HDEL")
                .arg(app.keys.voucher(vid(voucher)))
                .arg("u:7"),
        )
        .await;
    let second: i64 = grab_id(app, voucher, 7).await.parse().unwrap();
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
    (voucher, first, second, orders)
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
    let reason = json!({"reason": "paid at the counter"});
    for action in ["checkout", "cancel"] {
        let (status, retry, body) = app.order_action(&id, action, &app.token(3), None).await;
        assert_eq!(status, StatusCode::CONFLICT, "{action}: {body}");
        assert_eq!(body["error"]["code"], "order_pending");
        assert_eq!(retry.as_deref(), Some("1"));
        // An administrator sees the same, through the stream.
        let action = if action == "checkout" { "pay" } else { action };
        let (status, _, body) = app
            .order_action(&id, action, &app.admin_token(), Some(&reason))
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

    for action in ["checkout", "cancel", "refund"] {
        let (status, _, body) = app.order_action(&id, action, &app.token(6), None).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "somebody else's: {body}");
        let (status, _, _) = app
            .order_action("4242424242", action, &app.token(5), None)
            .await;
        assert_eq!(status, StatusCode::NOT_FOUND, "unknown");
        let (status, _, _) = app.order_action("0", action, &app.token(5), None).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "not an id");
    }
    // Shoppers no longer mark their orders paid: the payment provider does.
    let reason = json!({"reason": "paid at the counter"});
    let (status, _, refused) = app
        .order_action(&id, "pay", &app.token(5), Some(&reason))
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{refused}");
    assert_eq!(refused["error"]["code"], "forbidden");

    // An administrator's manual payment needs a reason of 1 to 256 visible characters.
    let long = "x".repeat(257);
    for body in [
        json!({"reason": long}),
        json!({"reason": ""}),
        json!({"reason": "   "}),
        json!({"reason": "\u{200B}\u{FEFF}"}),
        json!({"reason": "a\u{0}b"}),
        json!({"reason": 12}),
        json!({"reason": "ok", "amount": 1}),
        json!({"payment_ref": "psp-1"}),
        json!([1]),
        // serde reads a struct from an array of its fields: not a body here.
        json!(["paid"]),
        json!([null]),
        json!("paid"),
    ] {
        let (status, _, err) = app
            .order_action(&id, "pay", &app.admin_token(), Some(&body))
            .await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}: {err}");
        assert_eq!(err["error"]["code"], "validation");
    }
    let (status, _, err) = app.order_action(&id, "pay", &app.admin_token(), None).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "no body: {err}");
    let raw = app
        .client
        .post(app.url(&format!("/orders/{id}/pay")))
        .bearer_auth(app.admin_token())
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

    // A 256-character reason is fine: the order is paid by hand, the reason recorded.
    let body = json!({"reason": "é".repeat(256)});
    let (status, _, paid) = app
        .order_action(&id, "pay", &app.admin_token(), Some(&body))
        .await;
    assert_eq!(status, StatusCode::OK, "{paid}");
    assert_eq!(paid["status"], "paid");
    assert_eq!(paid["payment"]["provider"], "manual");
    assert_eq!(paid["payment"]["reason"], body["reason"]);
}
