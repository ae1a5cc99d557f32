//! The administrators' API: a sale's orders page by page, and closing a sale.

use std::collections::HashSet;

use crate::common::{oid, press_all, vid, TestApp};
use crate::recovery::rollback::press_through_503s;
use reqwest::StatusCode;
use serde_json::Value;
use sqlx::PgPool;

/// `GET /vouchers/{id}/orders` with `query`, as an admin.
async fn page(app: &TestApp, voucher: i64, query: &str) -> (StatusCode, Value) {
    app.send(
        app.client
            .get(app.url(&format!("/vouchers/{voucher}/orders?{query}")))
            .bearer_auth(app.admin_token()),
    )
    .await
}

/// Walks every page (`limit` per page); returns the ids in the order served.
async fn walk(app: &TestApp, voucher: i64, extra: &str, limit: usize) -> Vec<i64> {
    let mut ids = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let mut query = format!("limit={limit}{extra}");
        if let Some(cursor) = &after {
            query.push_str(&format!("&after={cursor}"));
        }
        let (status, body) = page(app, voucher, &query).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let items = body["items"].as_array().unwrap();
        assert!(items.len() <= limit);
        ids.extend(
            items
                .iter()
                .map(|o| o["order_id"].as_str().unwrap().parse::<i64>().unwrap()),
        );
        match body["next"].as_str() {
            Some(next) => {
                assert_eq!(items.len(), limit, "a next cursor only after a full page");
                after = Some(next.to_string());
            }
            None => return ids,
        }
    }
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn an_admin_pages_through_a_sales_orders_while_it_sells_without_repeats_or_gaps(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(1000).await;
    let other = app.open_sale(100).await;
    for user in 1..=120 {
        app.grab(voucher, user).await;
    }
    app.grab(other, 1).await;
    app.drain().await;
    let before: HashSet<i64> = walk(&app, voucher, "", 1000).await.into_iter().collect();
    assert_eq!(before.len(), 120);

    // Page through 7 at a time while 200 more shoppers buy and their orders are written.
    // (A 503 says try again: a test beside this one may have Redis rebuild every sale.)
    let selling = async {
        for chunk in (121..=320).collect::<Vec<i64>>().chunks(20) {
            let bought = press_through_503s(&app, &app.base, voucher, chunk.iter().copied()).await;
            for (user, (status, body)) in bought {
                assert_eq!(status, StatusCode::ACCEPTED, "user {user}: {body}");
            }
            app.drain().await;
        }
    };
    let (walked, ()) = tokio::join!(walk(&app, voucher, "", 7), selling);
    let unique: HashSet<i64> = walked.iter().copied().collect();
    assert_eq!(unique.len(), walked.len(), "an order served twice");
    assert!(walked.windows(2).all(|w| w[0] > w[1]), "not newest first");
    assert!(
        before.is_subset(&unique),
        "an order that existed all along was skipped"
    );

    // Afterwards every page together is exactly the sale's orders, and no other sale's.
    let all: Vec<i64> = walk(&app, voucher, "", 13).await;
    assert_eq!(all.len(), 320);
    let stored: HashSet<i64> = app
        .pg_orders(voucher)
        .await
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    assert_eq!(all.iter().copied().collect::<HashSet<_>>(), stored);

    // The status filter.
    let cancelled: Vec<i64> = all.iter().copied().take(3).collect();
    for id in &cancelled {
        let user: i64 = sqlx::query_scalar("SELECT user_id FROM voucher_orders WHERE id = $1")
            .bind(id)
            .fetch_one(&app.db)
            .await
            .unwrap();
        assert_eq!(app.cancel(&id.to_string(), user).await.0, StatusCode::OK);
    }
    assert_eq!(walk(&app, voucher, "&status=cancelled", 2).await, cancelled);
    assert_eq!(
        walk(&app, voucher, "&status=created", 1000).await.len(),
        317
    );
    assert!(walk(&app, voucher, "&status=paid", 1000).await.is_empty());
    let (_, body) = page(&app, voucher, "limit=1").await;
    assert_eq!(body["items"][0]["status"], "cancelled");
    assert_eq!(body["items"][0]["voucher_id"], voucher);
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn listing_a_sales_orders_refuses_bad_input_and_non_admins(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(10).await;
    for query in [
        "limit=0",
        "limit=1001",
        "limit=abc",
        "limit=-1",
        "limit=1.5",
        "status=pending",
        "status=bogus",
        "status=PAID",
        "after=abc",
        "after=0",
        "after=-5",
        "after=99999999999999999999",
        "after=",
    ] {
        let (status, body) = page(&app, voucher, query).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{query}: {body}");
        assert_eq!(body["error"]["code"], "validation", "{query}");
    }
    let (status, body) = page(&app, 999_999, "").await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (StatusCode::NOT_FOUND, Some("not_found"))
    );
    let orders = format!("/vouchers/{voucher}/orders");
    let (status, _) = app.get(&orders, Some(&app.token(5))).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let (status, _) = app.get(&orders, None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, body) = page(&app, voucher, "limit=1000&status=").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body, serde_json::json!({"items": [], "next": null}));
}

/// `POST /vouchers/{id}/close` with `token`.
async fn close_as(app: &TestApp, voucher: i64, token: &str) -> (StatusCode, Value) {
    let path = format!("/vouchers/{voucher}/close");
    app.send(app.client.post(app.url(&path)).bearer_auth(token))
        .await
}

/// `POST /vouchers/{id}/close` as an admin.
async fn close(app: &TestApp, voucher: i64) -> (StatusCode, Value) {
    close_as(app, voucher, &app.admin_token()).await
}

/// A close in the middle of a storm: every grab is either admitted (decided before the
/// close, and then written like any other) or told `ended`; after the close nobody gets
/// in, not even after the sale is reloaded from Postgres.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn closing_a_sale_mid_storm_admits_grabs_before_it_and_ends_every_grab_after(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let stock = 1000;
    let voucher = app.open_sale(stock).await;
    let storm = press_all(&app, &app.base, voucher, 1..=600, 4);
    let closer = async {
        // Close once the storm is well under way.
        while app.redis_stock(voucher).await.unwrap_or(stock) > stock - 50 {
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
        close(&app, voucher).await
    };
    let (answers, (status, closed)) = tokio::join!(storm, closer);
    assert_eq!(status, StatusCode::OK, "{closed}");
    let mut admitted = HashSet::new();
    let mut ended = 0;
    for (user, answer) in &answers {
        let (status, body) = answer.as_ref().expect("an answer");
        match (*status, body["error"]["code"].as_str()) {
            (StatusCode::ACCEPTED, _) => {
                admitted.insert(body["order_id"].as_str().unwrap().parse::<i64>().unwrap());
            }
            (StatusCode::CONFLICT, Some("ended")) => ended += 1,
            other => panic!("user {user}: {other:?} {body}"),
        }
    }
    println!(
        "close mid-storm: {} admitted, {ended} ended",
        admitted.len()
    );
    assert!(
        admitted.len() >= 50 && ended > 0,
        "the close did not fall inside the storm"
    );
    assert_eq!(
        app.redis_stock(voucher).await,
        Some(stock - admitted.len() as i64)
    );

    // Postgres ends the sale at the instant Redis did, after every admitted order.
    let end: chrono::DateTime<chrono::Utc> = closed["seckill"]["end_time"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(end <= chrono::Utc::now());
    app.drain().await;
    let stored: HashSet<i64> = app
        .pg_orders(voucher)
        .await
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    assert_eq!(stored, admitted, "every 202 is written, nothing else");
    // Admitted when its id was minted (by Redis's clock; the row is stamped at its writing).
    let latest = admitted
        .iter()
        .map(|&id| seckill::admission::order_id::timestamp_ms(oid(id)))
        .max()
        .and_then(|ms| chrono::DateTime::from_timestamp_millis(ms as i64))
        .unwrap();
    assert!(
        latest <= end,
        "an order admitted after the close: {latest} > {end}"
    );

    // After the close, and after a reload from Postgres: ended, nothing reserved.
    let (status, body) = app.grab(voucher, 10_001).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (StatusCode::CONFLICT, Some("ended"))
    );
    let (code, out) = app.cli(&["reconcile", "--voucher", &voucher.to_string(), "--repair"]);
    assert_eq!(code, 0, "{out}");
    let (status, body) = app.grab(voucher, 10_002).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (StatusCode::CONFLICT, Some("ended"))
    );
    assert_eq!(
        app.redis_stock(voucher).await,
        Some(stock - admitted.len() as i64)
    );
    // Closing again changes nothing.
    let (status, again) = close(&app, voucher).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(again["seckill"]["end_time"], closed["seckill"]["end_time"]);
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_sale_closed_before_it_opens_reads_as_ended_and_closing_needs_a_sale_and_an_admin(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let now = chrono::Utc::now();
    let voucher = app
        .create_sale(
            10,
            now + chrono::Duration::hours(1),
            now + chrono::Duration::hours(2),
        )
        .await;
    let (status, body) = app.grab(voucher, 1).await;
    assert_eq!(body["error"]["code"], "not_started", "{status} {body}");
    let (status, closed) = close(&app, voucher).await;
    assert_eq!(status, StatusCode::OK, "{closed}");
    let begin: chrono::DateTime<chrono::Utc> = closed["seckill"]["begin_time"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    let end: chrono::DateTime<chrono::Utc> = closed["seckill"]["end_time"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(begin < end && end <= chrono::Utc::now(), "{closed}");
    let (status, body) = app.grab(voucher, 1).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (StatusCode::CONFLICT, Some("ended"))
    );

    let (status, body) = close_as(&app, voucher, &app.token(3)).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
    let (status, body) = close(&app, 999_999).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (StatusCode::NOT_FOUND, Some("not_found"))
    );
}

/// A close that reached Redis but whose Postgres commit failed (the process died between
/// the two) is not undone by a reload: the sale stays ended, and closing again writes
/// the same end to Postgres.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_close_that_only_reached_redis_survives_a_repair_and_a_second_close_finishes_it(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(10).await;
    assert_eq!(app.grab(voucher, 1).await.0, StatusCode::ACCEPTED);
    let segment = seckill::keys::SaleSegment::new(vid(voucher), 0, 1);
    let end_ms: i64 = app
        .redis_cmd(
            redis::cmd("FCALL")
                .arg("seckill_close")
                .arg(2)
                .arg(app.keys.segment(segment))
                .arg(app.keys.segment_marker(segment))
                .arg(""),
        )
        .await;
    let (status, body) = app.grab(voucher, 2).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (StatusCode::CONFLICT, Some("ended"))
    );

    let (code, out) = app.cli(&["reconcile", "--voucher", &voucher.to_string(), "--repair"]);
    assert_eq!(code, 0, "{out}");
    let (status, body) = app.grab(voucher, 3).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (StatusCode::CONFLICT, Some("ended")),
        "a repair reopened a closed sale"
    );

    let (status, closed) = close(&app, voucher).await;
    assert_eq!(status, StatusCode::OK);
    let end: chrono::DateTime<chrono::Utc> = closed["seckill"]["end_time"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(
        end.timestamp_millis(),
        end_ms,
        "Postgres ends the sale when Redis did"
    );
}
