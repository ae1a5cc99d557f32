//! The flash sale end to end: admission over HTTP, the worker, Postgres.

use std::collections::{HashMap, HashSet};

use crate::common::{oid, uid, vid, TestApp};
use chrono::{Duration, Utc};
use reqwest::StatusCode;
use serde_json::Value;
use sqlx::PgPool;

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_thousand_shoppers_storm_a_hundred_units_and_exactly_a_hundred_win(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(100).await;

    // 1000 distinct users, plus 300 of them pressing a second time, all at once.
    let presses: Vec<i64> = (1..=1000).chain(1..=300).collect();
    let start = std::sync::Arc::new(tokio::sync::Barrier::new(presses.len()));
    let mut tasks = Vec::new();
    for user in presses {
        let (client, url, token, start) = (
            app.client.clone(),
            app.url(&format!("/vouchers/{voucher}/seckill")),
            app.token(user),
            start.clone(),
        );
        tasks.push(tokio::spawn(async move {
            start.wait().await;
            let resp = client.post(url).bearer_auth(token).send().await.unwrap();
            let status = resp.status();
            (user, status, resp.json::<Value>().await.unwrap())
        }));
    }
    let mut winners: HashMap<i64, String> = HashMap::new();
    let mut codes: HashMap<String, usize> = HashMap::new();
    let mut repeats: Vec<(i64, String)> = Vec::new();
    for task in tasks {
        let (user, status, body) = task.await.unwrap();
        assert!(!status.is_server_error(), "{status} {body}");
        if status == StatusCode::ACCEPTED {
            assert_eq!(body["status"], "pending");
            let id = body["order_id"]
                .as_str()
                .expect("order id is a string")
                .to_string();
            assert!(id.parse::<i64>().unwrap() > 0);
            assert!(winners.insert(user, id).is_none(), "user {user} won twice");
        } else {
            assert_eq!(status, StatusCode::CONFLICT, "{body}");
            let code = body["error"]["code"].as_str().unwrap().to_string();
            assert!(code == "sold_out" || code == "already_ordered", "{body}");
            if code == "already_ordered" {
                repeats.push((
                    user,
                    body["error"]["order_id"].as_str().unwrap().to_string(),
                ));
            }
            *codes.entry(code).or_default() += 1;
        }
    }
    println!("storm: {} admitted, outcomes {codes:?}", winners.len());
    assert_eq!(winners.len(), 100);
    let ids: HashSet<&String> = winners.values().collect();
    assert_eq!(ids.len(), 100, "order ids are unique");
    for (user, id) in &repeats {
        assert_eq!(
            winners.get(user),
            Some(id),
            "already_ordered carries the user's own order"
        );
    }

    let report = app.drain().await;
    assert_eq!(report.inserted, 100);
    assert_eq!(report.dead_lettered, 0);

    let stored = app.pg_orders(voucher).await;
    let stored_ids: HashSet<String> = stored.iter().map(|(id, _)| id.to_string()).collect();
    let admitted: HashSet<String> = winners.values().cloned().collect();
    assert_eq!(
        stored_ids, admitted,
        "exactly the admitted orders are in postgres"
    );
    let users: HashSet<i64> = stored.iter().map(|(_, u)| *u).collect();
    assert_eq!(users.len(), 100, "no user holds two orders");
    assert_eq!(app.pg_stock(voucher).await, 0);
    let (_, v) = app.get(&format!("/vouchers/{voucher}"), None).await;
    assert_eq!(v["seckill"]["stock"], 0, "{v}");
    assert_eq!(v["stock"], 0);
    assert_eq!(app.pending_count().await, 0);
    println!(
        "storm: postgres holds {} orders from {} users, stock {} (postgres) / {} (live)",
        stored.len(),
        users.len(),
        app.pg_stock(voucher).await,
        v["stock"]
    );

    // Every winner now sees the order as created.
    let (user, id) = winners.iter().next().unwrap();
    let (status, order) = app
        .get(&format!("/orders/{id}"), Some(&app.token(*user)))
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(order["status"], "created");
    assert_eq!(order["user_id"], *user);
    assert_eq!(order["voucher_id"], voucher);
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn grabbing_before_the_sale_opens_says_not_started(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let now = Utc::now();
    let voucher = app
        .create_sale(10, now + Duration::hours(1), now + Duration::hours(2))
        .await;
    let (status, body) = app.grab(voucher, 7).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(body["error"]["code"], "not_started");
    let (_, v) = app.get(&format!("/vouchers/{voucher}"), None).await;
    assert_eq!(v["stock"], 10, "nothing was reserved");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn grabbing_after_the_sale_closes_says_ended(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let now = Utc::now();
    let voucher = app
        .create_sale(
            10,
            now - Duration::hours(1),
            now + Duration::milliseconds(1500),
        )
        .await;
    let (status, _) = app.grab(voucher, 1).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    tokio::time::sleep(std::time::Duration::from_millis(1700)).await;
    let (status, body) = app.grab(voucher, 2).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(body["error"]["code"], "ended");

    // Once the sale's Redis state has expired as well, it still says ended (not 503).
    let _: () = app
        .redis_cmd(redis::cmd("DEL").arg(app.keys.voucher(vid(voucher))))
        .await;
    let (status, body) = app.grab(voucher, 3).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (StatusCode::CONFLICT, Some("ended"))
    );
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn pressing_twice_returns_the_callers_existing_order(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(5).await;
    let (status, first) = app.grab(voucher, 42).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    let (status, second) = app.grab(voucher, 42).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(second["error"]["code"], "already_ordered");
    assert_eq!(second["error"]["order_id"], first["order_id"]);
    // ... and still after the worker has written it.
    app.drain().await;
    let (_, third) = app.grab(voucher, 42).await;
    assert_eq!(third["error"]["order_id"], first["order_id"]);
    assert_eq!(app.pg_stock(voucher).await, 4);
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn the_last_unit_goes_and_the_next_shopper_hears_sold_out(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(1).await;
    assert_eq!(app.grab(voucher, 1).await.0, StatusCode::ACCEPTED);
    let (status, body) = app.grab(voucher, 2).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(body["error"]["code"], "sold_out");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn an_unknown_voucher_is_not_found(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let (status, body) = app.grab(987_654_321, 1).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(body["error"]["code"], "not_found");
    let (status, body) = app.get("/vouchers/987654321", None).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (StatusCode::NOT_FOUND, Some("not_found"))
    );
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_voucher_without_a_flash_sale_cannot_be_grabbed(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let body =
        serde_json::json!({"shop_id": 3, "title": "plain", "pay_value": 100, "actual_value": 200});
    let (status, v) = app
        .post_json("/vouchers", Some(&app.admin_token()), &body)
        .await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(v.get("seckill").is_none());
    let (status, _) = app.grab(v["id"].as_i64().unwrap(), 1).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, list) = app.get("/shops/3/vouchers", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(list.as_array().unwrap().len(), 1);
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn an_order_is_pending_until_the_worker_writes_it_then_created(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(3).await;
    let (_, admitted) = app.grab(voucher, 11).await;
    let id = admitted["order_id"].as_str().unwrap();
    let owner = app.token(11);

    let (status, order) = app.get(&format!("/orders/{id}"), Some(&owner)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(order["status"], "pending");
    assert_eq!(order["order_id"], id);
    let (_, mine) = app.get("/orders", Some(&owner)).await;
    assert_eq!(mine.as_array().unwrap().len(), 1);
    assert_eq!(mine[0]["status"], "pending");

    // Somebody else's order does not exist for you; an admin sees it.
    let (status, _) = app
        .get(&format!("/orders/{id}"), Some(&app.token(12)))
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _) = app
        .get(&format!("/orders/{id}"), Some(&app.admin_token()))
        .await;
    assert_eq!(status, StatusCode::OK);

    app.drain().await;
    let (_, order) = app.get(&format!("/orders/{id}"), Some(&owner)).await;
    assert_eq!(order["status"], "created");
    let (_, mine) = app.get("/orders", Some(&owner)).await;
    assert_eq!(mine.as_array().unwrap().len(), 1);
    assert_eq!(mine[0]["status"], "created");
    let (status, _) = app
        .get(&format!("/orders/{id}"), Some(&app.token(12)))
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (_, others) = app.get("/orders", Some(&app.token(12))).await;
    assert_eq!(others, serde_json::json!([]));
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_sale_whose_redis_state_vanished_fails_closed_then_reloads_from_postgres(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(3).await;
    let (_, first) = app.grab(voucher, 1).await;
    app.drain().await;

    let _: () = app
        .redis_cmd(redis::cmd("DEL").arg(app.keys.voucher(vid(voucher))))
        .await;
    let (status, body) = app.grab(voucher, 2).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(body["error"]["code"], "unavailable");

    // The on-line reload puts back what Postgres holds.
    let mut reloaded = false;
    for _ in 0..50 {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let (_, v) = app.get(&format!("/vouchers/{voucher}"), None).await;
        let live = app.redis_stock(voucher).await;
        if live.is_some() {
            assert_eq!(v["stock"], 2);
            reloaded = true;
            break;
        }
    }
    assert!(reloaded, "sale state was reloaded");
    let (status, again) = app.grab(voucher, 1).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(again["error"]["order_id"], first["order_id"]);
    assert_eq!(app.grab(voucher, 2).await.0, StatusCode::ACCEPTED);
    assert_eq!(app.grab(voucher, 3).await.0, StatusCode::ACCEPTED);
    assert_eq!(app.grab(voucher, 4).await.1["error"]["code"], "sold_out");
    app.drain().await;
    assert_eq!(app.pg_orders(voucher).await.len(), 3);
    assert_eq!(app.pg_stock(voucher).await, 0);
}

/// A process's first look (the term watcher, before it serves) rebuilds a sale whose
/// state is missing and leaves a live one alone, its order in flight included.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn start_up_loading_fills_missing_sales_and_leaves_live_ones_alone(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let live = app.open_sale(5).await;
    let lost = app.open_sale(7).await;
    app.grab(live, 1).await;
    app.grab(lost, 1).await;
    app.drain().await;
    app.grab(live, 2).await; // pending: Redis knows it, Postgres does not yet
    let _: () = app
        .redis_cmd(redis::cmd("DEL").arg(app.keys.voucher(vid(lost))))
        .await;

    let (_api, base) = app.spawn_server("api", &[]).await;
    assert_eq!(
        app.redis_stock(live).await.unwrap(),
        3,
        "live state untouched (one unit still pending)"
    );
    assert_eq!(app.redis_stock(lost).await.unwrap(), 6);
    let again = crate::common::press_all(&app, &base, lost, [1], 1).await;
    assert_eq!(
        again[0].1.as_ref().unwrap().1["error"]["code"],
        "already_ordered"
    );
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn grabs_coalesced_into_one_script_call_are_decided_in_order_each_as_if_alone(db: PgPool) {
    use seckill::admission::{admit_many, Grab, Outcome};
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(1).await;
    let other = app.open_sale(5).await;
    let shard = app.keys.shard_of(vid(voucher));
    let grab = |voucher_id, user_id, order_id| Grab {
        voucher_id: vid(voucher_id),
        user_id: uid(user_id),
        order_id: oid(order_id),
        segment: 0,
        segments: 1,
    };
    let outcomes = admit_many(
        &mut app.redis.clone(),
        &app.keys,
        shard,
        &[
            grab(voucher, 1, 1001),
            grab(voucher, 1, 1002), // the same user again, in the same call
            grab(voucher, 2, 1003), // the unit is gone
            grab(other, 2, 1004),   // another sale of the shard
        ],
        seckill::scripts::Replicas::NONE,
        &Default::default(),
    )
    .await
    .unwrap();
    assert_eq!(
        outcomes,
        [
            Outcome::Admitted {
                order_id: oid(1001)
            },
            Outcome::AlreadyOrdered {
                order_id: oid(1001)
            },
            Outcome::SoldOut,
            Outcome::Admitted {
                order_id: oid(1004)
            },
        ]
    );
    let report = app.drain().await;
    assert_eq!(report.inserted, 2);
    assert_eq!(app.redis_stock(voucher).await, Some(0));
    assert_eq!(app.redis_stock(other).await, Some(4));
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_corrupt_sale_in_a_coalesced_call_reserves_nothing_for_itself_and_spoils_no_other(
    db: PgPool,
) {
    use seckill::admission::{admit_many, Grab, Outcome};
    let app = TestApp::spawn(db).await;
    let sound = app.open_sale(5).await;
    let corrupt = app.open_sale(5).await;
    let _: () = app
        .redis_cmd(
            redis::cmd("HSET")
                .arg(app.keys.voucher(vid(corrupt)))
                .arg("stock")
                .arg("five"),
        )
        .await;
    let grab = |voucher_id, user_id, order_id| Grab {
        voucher_id: vid(voucher_id),
        user_id: uid(user_id),
        order_id: oid(order_id),
        segment: 0,
        segments: 1,
    };
    // The sound sale's grab comes first: its XADD must not be followed by a failure
    // that tells its caller nothing was reserved.
    let outcomes = admit_many(
        &mut app.redis.clone(),
        &app.keys,
        app.keys.shard_of(vid(sound)),
        &[grab(sound, 1, 2001), grab(corrupt, 2, 2002)],
        seckill::scripts::Replicas::NONE,
        &Default::default(),
    )
    .await
    .unwrap();
    assert_eq!(
        outcomes,
        [
            Outcome::Admitted {
                order_id: oid(2001)
            },
            Outcome::Corrupt
        ]
    );
    assert_eq!(app.drain().await.inserted, 1, "the sound sale's order only");

    // Through the API: refused (nothing reserved), the sale repaired from Postgres,
    // then sold as usual.
    let (status, body) = app.grab(corrupt, 3).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let (status, body) = app.grab(corrupt, 3).await;
        if status == StatusCode::ACCEPTED {
            break;
        }
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        assert!(std::time::Instant::now() < deadline, "never repaired");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(app.redis_stock(corrupt).await, Some(4));
}
