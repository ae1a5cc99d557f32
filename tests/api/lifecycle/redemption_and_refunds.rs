//! A paid coupon's life at the shop: redeemed by the staff of its voucher's shop with
//! its owner's code, once; refunded at its owner's (or an administrator's) request,
//! its unit back on sale once while the sale is open; refund against redemption
//! through two server processes, exactly one wins.

use super::*;
use crate::common::notification;

const PRICE: i64 = 5000;

/// A sale of `shop`'s, open for `open_secs` more, refundable or not.
async fn open_shop_sale(
    app: &TestApp,
    shop: i64,
    stock: i64,
    refundable: bool,
    open_secs: i64,
) -> i64 {
    let now = chrono::Utc::now();
    let body = json!({
        "shop_id": shop, "title": "coupon", "pay_value": PRICE, "actual_value": 10000,
        "refundable": refundable,
        "seckill": {"stock": stock, "begin_time": now - chrono::Duration::minutes(1),
                    "end_time": now + chrono::Duration::seconds(open_secs)},
    });
    let (status, voucher) = app
        .post_json("/vouchers", Some(&app.admin_token()), &body)
        .await;
    assert_eq!(status, StatusCode::CREATED, "{voucher}");
    assert_eq!(voucher["refundable"], refundable);
    voucher["id"].as_i64().unwrap()
}

/// A paid order of `user`'s: its id and redemption code.
async fn paid_order(app: &TestApp, voucher: i64, user: i64) -> (String, String) {
    let id = grab_id(app, voucher, user).await;
    app.drain().await;
    let (status, order) = app.pay(&id, user).await;
    assert_eq!(status, StatusCode::OK, "{order}");
    assert_eq!(order["status"], "paid");
    let code = order["redeem_code"].as_str().unwrap().to_string();
    (id, code)
}

fn staff(app: &TestApp, user: i64, shop: i64) -> String {
    app.staff_token(user, shop)
}

async fn redeem(app: &TestApp, id: &str, token: &str, code: &str) -> (StatusCode, Value) {
    let (status, _, body) = app
        .order_action(id, "redeem", token, Some(&json!({ "code": code })))
        .await;
    (status, body)
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn shop_staff_redeem_their_shops_paid_coupons_once_with_the_owners_code(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = open_shop_sale(&app, 7, 3, false, 3600).await;
    let (id, code) = paid_order(&app, voucher, 31).await;
    let (other, other_code) = paid_order(&app, voucher, 32).await;
    let unpaid = grab_id(&app, voucher, 33).await;
    app.drain().await;
    let (ours, theirs) = (staff(&app, 900, 7), staff(&app, 901, 8));

    let refusals = [
        (
            "a shopper",
            app.token(31),
            code.clone(),
            StatusCode::FORBIDDEN,
            "forbidden",
        ),
        (
            "staff of another shop",
            theirs.clone(),
            code.clone(),
            StatusCode::FORBIDDEN,
            "forbidden",
        ),
        (
            "a wrong code",
            ours.clone(),
            "0000000000000000".into(),
            StatusCode::UNPROCESSABLE_ENTITY,
            "validation",
        ),
        (
            "another order's code",
            ours.clone(),
            other_code.clone(),
            StatusCode::UNPROCESSABLE_ENTITY,
            "validation",
        ),
    ];
    for (who, token, code, status, error) in refusals {
        let (got, body) = redeem(&app, &id, &token, &code).await;
        assert_eq!(
            (got, &body["error"]["code"]),
            (status, &json!(error)),
            "{who}: {body}"
        );
    }
    let (status, body) = redeem(&app, &unpaid, &ours, "0000000000000000").await;
    assert_eq!(
        (status, &body["error"]["code"]),
        (StatusCode::CONFLICT, &json!("order_unpaid")),
        "{body}"
    );
    assert_eq!(
        app.pg_status(&id).await.as_deref(),
        Some("paid"),
        "nothing changed"
    );

    // The owner's code, as staff may type it (lower case, dashes): used, once.
    let typed = format!("{}-{}", &code[..8], &code[8..]).to_lowercase();
    let (status, used) = redeem(&app, &id, &ours, &typed).await;
    assert_eq!(status, StatusCode::OK, "{used}");
    assert_eq!(used["status"], "used");
    assert!(
        used["used_at"].is_string() && used["redeem_code"].is_null(),
        "{used}"
    );
    let (status, again) = redeem(&app, &id, &ours, &code).await;
    assert_eq!(
        (status, &again["error"]["code"]),
        (StatusCode::CONFLICT, &json!("order_used"))
    );
    for action in ["cancel", "refund", "checkout"] {
        let (status, _, body) = app.order_action(&id, action, &app.token(31), None).await;
        assert_eq!(status, StatusCode::CONFLICT, "{action}: {body}");
    }
    // An administrator redeems too.
    let (status, body) = redeem(&app, &other, &app.admin_token(), &other_code).await;
    assert_eq!((status, &body["status"]), (StatusCode::OK, &json!("used")));
    assert_eq!(
        stocks(&app, voucher).await,
        (0, Some(0)),
        "used coupons keep their units"
    );

    // The shop's listing: its staff and administrators, never the codes.
    let (status, page) = app.get("/shops/7/orders?status=used", Some(&ours)).await;
    assert_eq!(status, StatusCode::OK, "{page}");
    let listed: Vec<&str> = page["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["order_id"].as_str().unwrap())
        .collect();
    assert_eq!(listed.len(), 2);
    assert!(listed.contains(&id.as_str()) && listed.contains(&other.as_str()));
    assert!(page["items"][0]["redeem_code"].is_null());
    let (status, page) = app
        .get("/shops/7/orders?limit=1", Some(&app.admin_token()))
        .await;
    assert_eq!(
        (status, page["items"].as_array().unwrap().len()),
        (StatusCode::OK, 1)
    );
    assert!(page["next"].is_string(), "{page}");
    for token in [theirs.clone(), app.token(31)] {
        let (status, _) = app.get("/shops/7/orders", Some(&token)).await;
        assert_eq!(status, StatusCode::FORBIDDEN);
    }
    let (status, _) = app.get("/shops/7/orders?status=bogus", Some(&ours)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);

    // Guessing codes at speed is cut short.
    let mut limited = 0;
    for _ in 0..30 {
        let (status, _) = redeem(&app, &unpaid, &theirs, "AAAAAAAAAAAAAAAA").await;
        limited += (status == StatusCode::TOO_MANY_REQUESTS) as usize;
    }
    assert!(limited > 0, "no attempt was rate limited");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_refund_racing_a_redemption_has_exactly_one_winner(db: PgPool) {
    use futures::StreamExt;
    const COUPONS: i64 = 30;
    let app = TestApp::spawn(db).await;
    let voucher = open_shop_sale(&app, 7, COUPONS, true, 3600).await;
    let mut coupons = Vec::new();
    for user in 1..=COUPONS {
        coupons.push((user + 100, paid_order(&app, voucher, user + 100).await));
    }
    // The owners ask through one `seckill api` process, the staff redeem through
    // another: only Postgres's row lock stands between them.
    let (_owners_api, owners) = app.spawn_server("api", &[]).await;
    let (_shops_api, shops) = app.spawn_server("api", &[]).await;
    let app_ref = &app;
    let (owners, shops) = (&owners, &shops);
    let results: Vec<(String, StatusCode, StatusCode, String)> = futures::stream::iter(coupons)
        .map(|(user, (id, code))| {
            // A staff member per counter (one member's pace is limited).
            let ours = staff(app_ref, 900 + user, 7);
            async move {
                let refund = app_ref
                    .client
                    .post(format!("{owners}/orders/{id}/refund"))
                    .bearer_auth(app_ref.token(user))
                    .send();
                // The refund has a longer way to its row lock (the voucher's rules):
                // the redemption starts a little later on some, so both sides win.
                let redemption = async {
                    tokio::time::sleep(Duration::from_millis((user % 5) as u64 * 5)).await;
                    app_ref
                        .client
                        .post(format!("{shops}/orders/{id}/redeem"))
                        .bearer_auth(&ours)
                        .json(&json!({ "code": code }))
                        .send()
                        .await
                };
                let (refund, redeemed) = tokio::join!(refund, redemption);
                let now = app_ref.pg_status(&id).await.unwrap();
                (
                    id,
                    refund.unwrap().status(),
                    redeemed.unwrap().status(),
                    now,
                )
            }
        })
        .buffer_unordered(COUPONS as usize)
        .collect()
        .await;
    let (mut used, mut refunding) = (0, 0);
    for (id, refund, redeemed, now) in &results {
        match (*refund, *redeemed, now.as_str()) {
            (StatusCode::OK, StatusCode::CONFLICT, "refunding") => refunding += 1,
            (StatusCode::CONFLICT, StatusCode::OK, "used") => used += 1,
            other => panic!("order {id}: {other:?}"),
        }
    }
    println!("{COUPONS} refunds racing redemptions: {used} used, {refunding} refunding");
    assert_eq!(used + refunding, COUPONS);
    let statuses = app.pg_statuses(voucher).await;
    assert_eq!(statuses.get("used").copied().unwrap_or(0), used);
    assert_eq!(statuses.get("refunding").copied().unwrap_or(0), refunding);
    assert_eq!(
        stocks(&app, voucher).await,
        (0, Some(0)),
        "no unit back before the refund is confirmed"
    );
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_refunded_coupons_unit_goes_back_on_sale_once_while_the_sale_is_open(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = open_shop_sale(&app, 7, 1, true, 3600).await;
    let (id, _) = paid_order(&app, voucher, 41).await;
    let (status, _, asked) = app.order_action(&id, "refund", &app.token(41), None).await;
    assert_eq!(status, StatusCode::OK, "{asked}");
    assert_eq!(
        (&asked["status"], &asked["refund_reason"]),
        (&json!("refunding"), &json!("requested"))
    );
    let (status, _, again) = app.order_action(&id, "refund", &app.token(41), None).await;
    assert_eq!(
        (status, &again["status"]),
        (StatusCode::OK, &json!("refunding")),
        "asking again"
    );
    assert_eq!(
        stocks(&app, voucher).await,
        (0, Some(0)),
        "held until the refund is confirmed"
    );

    let confirmation = notification("refund.succeeded", &id, PRICE);
    for _ in 0..3 {
        let (status, body) = app.notify(&confirmation).await;
        assert_eq!(
            (status, &body["outcome"]),
            (StatusCode::OK, &json!("refunded")),
            "{body}"
        );
    }
    let (_, order) = app
        .get(&format!("/orders/{id}"), Some(&app.token(41)))
        .await;
    assert_eq!(order["status"], "refunded");
    assert!(
        order["refunded_at"].is_string() && order["closed_at"].is_string(),
        "{order}"
    );
    assert_eq!(
        stocks(&app, voucher).await,
        (1, Some(1)),
        "the unit back once, in both stores"
    );
    // A second refund by another transaction is refused: nothing is refunding.
    let (status, body) = app
        .notify(&notification("refund.succeeded", &id, PRICE))
        .await;
    assert_eq!(
        (status, &body["error"]["code"]),
        (StatusCode::CONFLICT, &json!("not_refundable"))
    );

    // Sold again, exactly once.
    let results = crate::common::press_all(&app, &app.base, voucher, 200..=260, 16).await;
    let sold = results
        .iter()
        .filter(|(_, a)| a.as_ref().is_some_and(|(s, _)| *s == StatusCode::ACCEPTED))
        .count();
    assert_eq!(sold, 1);
    app.drain().await;
    assert_eq!(stocks(&app, voucher).await, (0, Some(0)));
    let (code, books) = app.cli(&["reconcile", "--voucher", &voucher.to_string()]);
    assert_eq!(code, 0, "{books}");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_coupon_refunded_after_its_sale_ended_gives_no_unit_back(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = open_shop_sale(&app, 7, 2, false, 3).await;
    let (id, _) = paid_order(&app, voucher, 51).await;
    // Not refundable: its owner cannot ask, an administrator can.
    let (status, _, body) = app.order_action(&id, "refund", &app.token(51), None).await;
    assert_eq!(
        (status, &body["error"]["code"]),
        (StatusCode::CONFLICT, &json!("not_refundable"))
    );
    let (status, _, body) = app
        .order_action(&id, "refund", &app.admin_token(), None)
        .await;
    assert_eq!(
        (status, &body["refund_reason"]),
        (StatusCode::OK, &json!("admin")),
        "{body}"
    );
    let until_end = app.pg_stock(voucher).await; // (read before the end)
    tokio::time::sleep(Duration::from_millis(3200)).await;
    let (status, body) = app
        .notify(&notification("refund.succeeded", &id, PRICE))
        .await;
    assert_eq!(
        (status, &body["outcome"]),
        (StatusCode::OK, &json!("refunded")),
        "{body}"
    );
    assert_eq!(app.pg_status(&id).await.as_deref(), Some("refunded"));
    assert_eq!(
        app.pg_stock(voucher).await,
        until_end,
        "the sale ended: no unit back"
    );
    assert_eq!(app.owed_releases().await, 0);
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn refunds_of_unpaid_or_closed_orders_and_checkout_by_others_are_refused(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = open_shop_sale(&app, 7, 3, true, 3600).await;
    let unpaid = grab_id(&app, voucher, 61).await;
    app.drain().await;
    let (status, _, body) = app
        .order_action(&unpaid, "refund", &app.token(61), None)
        .await;
    assert_eq!(
        (status, &body["error"]["code"]),
        (StatusCode::CONFLICT, &json!("not_refundable")),
        "{body}"
    );
    // An administrator sees the order but does not check it out: only its owner pays.
    let (status, _, _) = app
        .order_action(&unpaid, "checkout", &app.admin_token(), None)
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _, _) = app
        .order_action(&unpaid, "cancel", &app.token(61), None)
        .await;
    assert_eq!(status, StatusCode::OK);
    let (status, _, body) = app
        .order_action(&unpaid, "refund", &app.token(61), None)
        .await;
    assert_eq!(
        (status, &body["error"]["code"]),
        (StatusCode::CONFLICT, &json!("order_closed")),
        "{body}"
    );
    assert_eq!(app.pg_status(&unpaid).await.as_deref(), Some("cancelled"));
    assert_eq!(stocks(&app, voucher).await, (3, Some(3)));
}
