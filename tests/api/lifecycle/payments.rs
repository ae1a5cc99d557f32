//! Payments confirmed by the payment provider's signed notification, never by the
//! shopper: forgeries and replays change nothing, a payment for an order not yet
//! written waits for it, a late one is kept and sent to `refunding`, and none is lost
//! or doubled when payments race the expiry sweepers at the deadline.

use super::*;
use crate::common::{notification, PAYMENT_SECRET};

/// The price of the tests' sales (`pay_value`).
const PRICE: i64 = 5000;

/// Sends `raw` to the notification endpoint with `signature` as its header, if any.
async fn post_raw(app: &TestApp, raw: &[u8], signature: Option<String>) -> (StatusCode, Value) {
    let mut req = app
        .client
        .post(app.url("/payments/notifications"))
        .header("content-type", "application/json")
        .body(raw.to_vec());
    if let Some(signature) = signature {
        req = req.header("seckill-signature", signature);
    }
    app.send(req).await
}

fn sign(secret: &str, at: i64, raw: &[u8]) -> String {
    seckill::lifecycle::signature::sign(&secret.into(), at, raw)
}

async fn recorded_events(app: &TestApp) -> Vec<(String, String)> {
    sqlx::query_as("SELECT event_id, outcome FROM payment_events ORDER BY received_at, event_id")
        .fetch_all(&app.db)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn forged_stale_altered_or_malformed_notifications_are_refused_and_change_nothing(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(3).await;
    let id = grab_id(&app, voucher, 21).await;
    app.drain().await;
    let now = chrono::Utc::now().timestamp();
    let event = notification("payment.succeeded", &id, PRICE);
    let raw = serde_json::to_vec(&event).unwrap();

    let mut tampered = event.clone();
    tampered["amount"] = json!(1);
    let altered = serde_json::to_vec(&tampered).unwrap();
    let cases: Vec<(&str, Vec<u8>, Option<String>)> = vec![
        ("no signature", raw.clone(), None),
        (
            "another secret",
            raw.clone(),
            Some(sign("not-the-secret", now, &raw)),
        ),
        (
            "stale",
            raw.clone(),
            Some(sign(PAYMENT_SECRET, now - 301, &raw)),
        ),
        (
            "from the future",
            raw.clone(),
            Some(sign(PAYMENT_SECRET, now + 301, &raw)),
        ),
        // Signed, then the amount changed on the way.
        ("altered", altered, Some(sign(PAYMENT_SECRET, now, &raw))),
        ("garbage header", raw.clone(), Some("t=abc,v1=xyz".into())),
        (
            "re-signed under a new time without the secret",
            raw.clone(),
            Some(sign(PAYMENT_SECRET, now, &raw).replacen(
                &format!("t={now}"),
                &format!("t={}", now + 5),
                1,
            )),
        ),
    ];
    for (what, body, signature) in cases {
        let (status, err) = post_raw(&app, &body, signature).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{what}: {err}");
        assert_eq!(err["error"]["code"], "bad_signature", "{what}");
    }
    // Signed right, but not a notification: 400 naming what is wrong.
    for (what, body) in [
        ("not JSON", b"{not json".to_vec()),
        ("unknown type", serde_json::to_vec(&json!({"id": "e1", "type": "payment.failed", "order_id": id, "amount": PRICE, "currency": "CNY", "transaction_id": "t1"})).unwrap()),
        ("order id as a number", serde_json::to_vec(&json!({"id": "e2", "type": "payment.succeeded", "order_id": 5, "amount": PRICE, "currency": "CNY", "transaction_id": "t2"})).unwrap()),
        ("negative amount", serde_json::to_vec(&json!({"id": "e3", "type": "payment.succeeded", "order_id": id, "amount": -1, "currency": "CNY", "transaction_id": "t3"})).unwrap()),
    ] {
        let (status, err) = post_raw(&app, &body, Some(sign(PAYMENT_SECRET, now, &body))).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{what}: {err}");
        assert_eq!(err["error"]["code"], "validation", "{what}");
    }
    assert!(recorded_events(&app).await.is_empty(), "nothing recorded");

    // Signed right, but not the order's price: refused, recorded, the order unchanged;
    // its replay answers the same.
    let cheap = notification("payment.succeeded", &id, PRICE - 1);
    let mut dollars = notification("payment.succeeded", &id, PRICE);
    dollars["currency"] = json!("USD");
    for wrong in [&cheap, &dollars, &cheap] {
        let (status, err) = app.notify(wrong).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{err}");
        assert_eq!(err["error"]["code"], "validation");
    }
    let outcomes: Vec<String> = recorded_events(&app)
        .await
        .into_iter()
        .map(|(_, o)| o)
        .collect();
    assert_eq!(outcomes, ["amount_mismatch", "amount_mismatch"]);
    assert_eq!(app.pg_status(&id).await.as_deref(), Some("created"));
    assert_eq!(stocks(&app, voucher).await, (2, Some(2)), "nothing changed");

    // A refund confirmation for an order nobody asked to refund changes nothing either.
    let (status, err) = app
        .notify(&notification("refund.succeeded", &id, PRICE))
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{err}");
    assert_eq!(err["error"]["code"], "not_refundable");
    assert_eq!(app.pg_status(&id).await.as_deref(), Some("created"));

    // Then the real payment goes through.
    let (status, paid) = app.notify(&event).await;
    assert_eq!((status, &paid["outcome"]), (StatusCode::OK, &json!("paid")));
    let metrics = app.metrics_text().await;
    for line in [
        "seckill_payment_notifications_total{outcome=\"bad_signature\"}",
        "seckill_payment_notifications_total{outcome=\"malformed\"}",
        "seckill_payment_notifications_total{outcome=\"amount_mismatch\"}",
        "seckill_payment_notifications_total{outcome=\"paid\"}",
    ] {
        let value = crate::common::metric_value(&metrics, line);
        assert!(value >= Some(1.0), "{line} is {value:?} in /metrics");
    }
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_payment_for_an_order_not_yet_written_waits_for_it_and_counts_as_in_time(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale_paying(3, 2).await;
    let id = grab_id(&app, voucher, 22).await;
    // Paid while only Redis knows the order: recorded, applied once it is written.
    let (status, waiting) = app.provider_pays(&id, PRICE).await;
    assert_eq!(status, StatusCode::OK, "{waiting}");
    assert_eq!(waiting["outcome"], "awaiting_order");
    // The worker is away past the deadline (an outage), then writes it.
    tokio::time::sleep(Duration::from_millis(2300)).await;
    assert_eq!(app.drain().await.inserted, 1);
    let report = app.sweep().await;
    assert_eq!(report.expired, 0, "the payment came in time: {report:?}");
    assert_eq!(app.pg_status(&id).await.as_deref(), Some("paid"));
    let (_, order) = app
        .get(&format!("/orders/{id}"), Some(&app.token(22)))
        .await;
    assert_eq!(order["payment"]["provider"], "provider");
    assert!(order["redeem_code"].is_string(), "{order}");
    assert_eq!(stocks(&app, voucher).await, (2, Some(2)));
    let outcomes: Vec<String> = recorded_events(&app)
        .await
        .into_iter()
        .map(|(_, o)| o)
        .collect();
    assert_eq!(outcomes, ["paid"], "the waiting payment, applied");

    // A payment for an order id nobody was ever admitted with is kept too.
    let (status, unknown) = app.provider_pays("4242424242", PRICE).await;
    assert_eq!(
        (status, &unknown["outcome"]),
        (StatusCode::OK, &json!("awaiting_order"))
    );
    let (status, page) = app
        .get("/payments?outcome=awaiting_order", Some(&app.admin_token()))
        .await;
    assert_eq!(status, StatusCode::OK, "{page}");
    assert_eq!(page["items"][0]["order_id"], "4242424242");
    let (status, _) = app.get("/payments", Some(&app.token(22))).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "operators only");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_late_payment_is_kept_sent_to_refunding_and_takes_no_unit_again(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale_paying(2, 1).await;
    let late = grab_id(&app, voucher, 23).await;
    app.drain().await;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(app.sweep().await.expired, 1);
    assert_eq!(
        stocks(&app, voucher).await,
        (2, Some(2)),
        "its unit is back"
    );
    // Sold again meanwhile.
    let other = grab_id(&app, voucher, 24).await;
    app.drain().await;

    let (status, kept) = app.provider_pays(&late, PRICE).await;
    assert_eq!(
        (status, &kept["outcome"]),
        (StatusCode::OK, &json!("late_payment")),
        "{kept}"
    );
    let (_, order) = app
        .get(&format!("/orders/{late}"), Some(&app.token(23)))
        .await;
    assert_eq!(order["status"], "refunding");
    assert_eq!(order["refund_reason"], "late_payment");
    assert!(
        order["closed_at"].is_string() && order["redeem_code"].is_null(),
        "{order}"
    );
    assert_eq!(
        stocks(&app, voucher).await,
        (1, Some(1)),
        "no unit taken again"
    );
    // The shopper may still buy while the sale lasts: the refunding order holds nothing.
    grab_id(&app, voucher, 23).await;
    app.drain().await;
    assert_eq!(stocks(&app, voucher).await, (0, Some(0)));

    // Operators find it, and the provider's refund closes it without a unit moving.
    let (_, page) = app
        .get("/payments?outcome=late_payment", Some(&app.admin_token()))
        .await;
    assert_eq!(page["items"][0]["order_id"], late.as_str(), "{page}");
    let (status, refunded) = app
        .notify(&notification("refund.succeeded", &late, PRICE))
        .await;
    assert_eq!(
        (status, &refunded["outcome"]),
        (StatusCode::OK, &json!("refunded"))
    );
    assert_eq!(app.pg_status(&late).await.as_deref(), Some("refunded"));
    assert_eq!(app.pg_status(&other).await.as_deref(), Some("created"));
    assert_eq!(stocks(&app, voucher).await, (0, Some(0)), "nothing moved");
    let statuses = app.pg_statuses(voucher).await;
    assert_eq!(statuses.get("refunded"), Some(&1), "{statuses:?}");
    let (code, books) = app.cli(&["reconcile", "--voucher", &voucher.to_string()]);
    assert_eq!(code, 0, "{books}");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn payments_racing_the_expiry_sweepers_at_the_deadline_end_paid_or_refunding_never_lost_or_doubled(
    db: PgPool,
) {
    use futures::StreamExt;
    const ORDERS: i64 = 120;
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale_paying(ORDERS, 3).await;
    let url = database_url(&app.db, None);
    let sweepers: Vec<Process> = (0..2)
        .map(|_| {
            Process::spawn(
                "worker",
                &app.redis_url,
                app.keys.prefix(),
                &url,
                &[
                    ("EXPIRY_SWEEP_MS", "20".into()),
                    ("EXPIRY_BATCH", "8".into()),
                ],
            )
        })
        .collect();
    let grabs = crate::common::press_all(&app, &app.base, voucher, 1..=ORDERS, 64).await;
    let orders: Vec<String> = grabs
        .into_iter()
        .map(|(_, a)| a.unwrap().1["order_id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        app.wait_for_orders(voucher, ORDERS as usize, Duration::from_secs(30))
            .await,
        ORDERS as usize
    );
    let deadline: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT min(pay_before) FROM voucher_orders WHERE voucher_id = $1")
            .bind(voucher)
            .fetch_one(&app.db)
            .await
            .unwrap();
    // Every order paid once, from 300 ms before its sale's first deadline to 300 ms
    // after; one in four notified twice (the provider retries), one in six also by a
    // second transaction (the shopper paid twice).
    let app_ref = &app;
    let answers: Vec<(String, String)> = futures::stream::iter(orders.iter().enumerate())
        .map(|(i, id)| async move {
            let at = deadline + chrono::Duration::milliseconds((i as i64 * 17) % 600 - 300);
            tokio::time::sleep((at - chrono::Utc::now()).to_std().unwrap_or_default()).await;
            let event = notification("payment.succeeded", id, PRICE);
            let mut sent = vec![event.clone()];
            if i % 4 == 0 {
                sent.push(event);
            }
            if i % 6 == 0 {
                sent.push(notification("payment.succeeded", id, PRICE));
            }
            let mut outcomes = Vec::new();
            for e in &sent {
                let (status, body) = app_ref.notify(e).await;
                assert_eq!(status, StatusCode::OK, "{body}");
                outcomes.push(body["outcome"].as_str().unwrap().to_string());
            }
            (id.clone(), outcomes.join(","))
        })
        .buffer_unordered(64)
        .collect()
        .await;
    // The sweepers finish (their releases too).
    let limit = tokio::time::Instant::now() + Duration::from_secs(20);
    while app.pg_statuses(voucher).await.contains_key("created") || app.owed_releases().await > 0 {
        assert!(tokio::time::Instant::now() < limit, "never settled");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(sweepers);

    let mut paid = 0;
    let mut late = 0;
    for (id, outcomes) in &answers {
        let status = app.pg_status(id).await.unwrap();
        let first = outcomes.split(',').next().unwrap();
        match (first, status.as_str()) {
            ("paid", "paid") => paid += 1,
            ("late_payment", "refunding") => late += 1,
            other => panic!("order {id}: answered {outcomes} but {other:?}"),
        }
        for again in outcomes.split(',').skip(1) {
            assert!(
                again == first || again == "already_paid",
                "order {id}: {outcomes}"
            );
        }
    }
    println!("{ORDERS} orders paid around their deadline: {paid} paid, {late} late (refunding)");
    assert_eq!(paid + late, ORDERS);
    assert!(paid > 0 && late > 0, "both sides of the deadline were met");
    // Each late payment's unit went back once; each paid unit stays sold.
    assert_eq!(stocks(&app, voucher).await, (late, Some(late)));
    let events: i64 = sqlx::query_scalar("SELECT count(*) FROM payment_events")
        .fetch_one(&app.db)
        .await
        .unwrap();
    let second_transactions = (0..ORDERS).filter(|i| i % 6 == 0).count() as i64;
    assert_eq!(
        events,
        ORDERS + second_transactions,
        "each transaction recorded once"
    );
    let (code, books) = app.cli(&["reconcile", "--voucher", &voucher.to_string()]);
    assert_eq!(code, 0, "{books}");
}

/// A notification as the provider sends it, for `order_id` with these ids.
fn notification_with(
    kind: &str,
    event: &str,
    order_id: &str,
    transaction: &str,
    amount: i64,
) -> Value {
    json!({"id": event, "type": kind, "order_id": order_id, "amount": amount,
           "currency": "CNY", "transaction_id": transaction})
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_notification_whose_ids_another_order_holds_is_refused_recorded_and_counted_never_a_replay(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(3).await;
    let a = grab_id(&app, voucher, 31).await;
    let b = grab_id(&app, voucher, 32).await;
    app.drain().await;
    let paid_a = notification_with("payment.succeeded", "evt_a", &a, "tx_a", PRICE);
    let (status, first) = app.notify(&paid_a).await;
    assert_eq!(
        (status, &first["outcome"]),
        (StatusCode::OK, &json!("paid"))
    );

    // B under A's transaction (a new event id), then under A's event id (a new
    // transaction): refused, each kept once however often the provider retries.
    let by_transaction = notification_with("payment.succeeded", "evt_b1", &b, "tx_a", PRICE);
    let by_event = notification_with("payment.succeeded", "evt_a", &b, "tx_b1", PRICE);
    for (what, sent) in [
        ("transaction", &by_transaction),
        ("event id", &by_event),
        ("transaction", &by_transaction),
    ] {
        let (status, err) = app.notify(sent).await;
        println!("B under A's {what}: {status} {err}");
        assert_eq!(status, StatusCode::CONFLICT, "{what}: {err}");
        assert_eq!(err["error"]["code"], "id_conflict", "{what}: {err}");
        let message = err["error"]["message"].as_str().unwrap();
        assert!(message.contains(&a) && message.contains(&b), "{message}");
    }
    assert_eq!(app.pg_status(&b).await.as_deref(), Some("created"));
    let (_, page) = app
        .get("/payments?outcome=id_conflict", Some(&app.admin_token()))
        .await;
    let kept: Vec<(&str, &str)> = page["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["event_id"].as_str().unwrap(),
                e["order_id"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        kept,
        [("evt_a", b.as_str()), ("evt_b1", b.as_str())],
        "{page}"
    );
    let conflicts = crate::common::metric_value(
        &app.metrics_text().await,
        "seckill_payment_notifications_total{outcome=\"id_conflict\"}",
    );
    assert_eq!(conflicts, Some(2.0), "each conflict counted once");

    // A's own retries are replays; B's real payment goes through.
    let retried = notification_with("payment.succeeded", "evt_a2", &a, "tx_a", PRICE);
    for again in [&paid_a, &retried] {
        let (status, replay) = app.notify(again).await;
        assert_eq!(status, StatusCode::OK, "{replay}");
        assert_eq!(
            (&replay["outcome"], &replay["replay"]),
            (&json!("paid"), &json!(true))
        );
        assert_eq!(replay["order_id"], a.as_str());
    }
    let paid_b = notification_with("payment.succeeded", "evt_b2", &b, "tx_b2", PRICE);
    let (status, paid) = app.notify(&paid_b).await;
    assert_eq!(
        (status, &paid["outcome"], &paid["replay"]),
        (StatusCode::OK, &json!("paid"), &json!(false))
    );
    assert_eq!(app.pg_status(&b).await.as_deref(), Some("paid"));
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_corrected_notification_after_an_amount_mismatch_is_judged_afresh_and_the_mismatch_is_money_to_give_back(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(3).await;
    let id = grab_id(&app, voucher, 33).await;
    app.drain().await;
    let wrong = notification_with("payment.succeeded", "evt_1", &id, "tx_1", PRICE - 1);
    let (status, err) = app.notify(&wrong).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{err}");
    // Its replay is still a replay.
    let (status, _) = app.notify(&wrong).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    // The provider corrects it under the same transaction (a new event).
    let corrected = notification_with("payment.succeeded", "evt_2", &id, "tx_1", PRICE);
    let (status, paid) = app.notify(&corrected).await;
    println!("corrected after a mismatch: {status} {paid}");
    assert_eq!(
        (status, &paid["outcome"]),
        (StatusCode::OK, &json!("paid")),
        "{paid}"
    );
    assert_eq!(paid["replay"], false);
    assert_eq!(app.pg_status(&id).await.as_deref(), Some("paid"));
    let recorded: Vec<(String, String)> = recorded_events(&app).await;
    assert_eq!(
        recorded,
        [
            ("evt_1".to_string(), "amount_mismatch".to_string()),
            ("evt_2".to_string(), "paid".to_string())
        ]
    );
    // Listed with the money to give back (the corrected payment is not).
    let (status, owed) = app
        .get("/payments?money_back=true", Some(&app.admin_token()))
        .await;
    assert_eq!(status, StatusCode::OK, "{owed}");
    let listed: Vec<&str> = owed["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["event_id"].as_str().unwrap())
        .collect();
    assert_eq!(listed, ["evt_1"], "{owed}");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_manually_paid_order_refunded_by_an_admin_completes_its_refund_and_returns_its_unit_once(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(2).await;
    let id = grab_id(&app, voucher, 34).await;
    app.drain().await;
    let admin = app.admin_token();
    let (status, _, paid) = app
        .order_action(
            &id,
            "pay",
            &admin,
            Some(&json!({"reason": "paid at the counter"})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{paid}");
    assert_eq!(paid["payment"]["amount"], PRICE, "{paid}");
    let (status, _, refunding) = app.order_action(&id, "refund", &admin, None).await;
    assert_eq!(
        (status, &refunding["status"]),
        (StatusCode::OK, &json!("refunding")),
        "{refunding}"
    );
    assert_eq!(stocks(&app, voucher).await, (1, Some(1)));
    let refund = notification("refund.succeeded", &id, PRICE);
    for (i, sent) in [&refund, &refund].into_iter().enumerate() {
        let (status, done) = app.notify(sent).await;
        println!("the provider's refund of a manual payment: {status} {done}");
        assert_eq!(
            (status, &done["outcome"]),
            (StatusCode::OK, &json!("refunded")),
            "{done}"
        );
        assert_eq!(done["replay"], i == 1);
    }
    assert_eq!(app.pg_status(&id).await.as_deref(), Some("refunded"));
    let limit = tokio::time::Instant::now() + Duration::from_secs(10);
    while stocks(&app, voucher).await != (2, Some(2)) {
        assert!(
            tokio::time::Instant::now() < limit,
            "{:?}",
            stocks(&app, voucher).await
        );
        app.sweep().await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (code, books) = app.cli(&["reconcile", "--voucher", &voucher.to_string()]);
    assert_eq!(code, 0, "{books}");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn the_payments_list_pages_by_its_own_cursor_and_refuses_an_unknown_one(db: PgPool) {
    let app = TestApp::spawn(db).await;
    for order in ["4242424201", "4242424202", "4242424203"] {
        let (status, body) = app.provider_pays(order, PRICE).await;
        assert_eq!(status, StatusCode::OK, "{body}");
    }
    let admin = app.admin_token();
    let (status, first) = app.get("/payments?limit=2", Some(&admin)).await;
    assert_eq!(status, StatusCode::OK, "{first}");
    let next = first["next"].as_str().unwrap().to_string();
    let (status, rest) = app
        .get(&format!("/payments?limit=2&after={next}"), Some(&admin))
        .await;
    assert_eq!(status, StatusCode::OK, "{rest}");
    let orders: Vec<&str> = first["items"]
        .as_array()
        .unwrap()
        .iter()
        .chain(rest["items"].as_array().unwrap())
        .map(|e| e["order_id"].as_str().unwrap())
        .collect();
    assert_eq!(orders, ["4242424203", "4242424202", "4242424201"]);
    assert!(rest["next"].is_null(), "{rest}");
    for bad in ["999999", "evt_nope", "0", "-1", ""] {
        let (status, err) = app
            .get(&format!("/payments?after={bad}"), Some(&admin))
            .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "after={bad}: {err}");
        assert_eq!(err["error"]["code"], "validation");
        assert!(
            err["error"]["message"].as_str().unwrap().contains("after"),
            "{err}"
        );
    }
}
