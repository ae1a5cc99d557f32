//! A 202 Redis lost with every copy (a primary back from an older snapshot before
//! anything wrote its orders) is still kept by the instance that gave it: admitted again
//! into the rebuilt sale under its own id, even when that instance was killed meanwhile
//! and started again on its promises file.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::Value;
use sqlx::PgPool;

use crate::common::faults::PrivateRedis;
use crate::common::{metric_value, metrics_at, open_sale_at, press_all, TestApp};
use crate::recovery::rollback::{press_through_503s, won};

/// A directory of the test's own, removed when dropped.
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn new() -> Self {
        let dir =
            std::env::temp_dir().join(format!("seckill-promises-{:016x}", rand::random::<u64>()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_202_redis_lost_is_kept_by_the_instance_that_gave_it_even_after_its_kill_9(db: PgPool) {
    let mut redis = PrivateRedis::start();
    let app = TestApp::spawn_with(db, redis.url.clone(), true).await;
    let scratch = Scratch::new();
    let file = scratch.0.join("promises").display().to_string();
    let on_file = [("PROMISES_FILE", file.clone())];

    // An API instance alone: nothing writes its orders to Postgres yet.
    let (mut first, base) = app.spawn_server("api", &on_file).await;
    let stock = 20;
    let sale = open_sale_at(&app.client, &base, stock).await;
    redis.save();
    let promised = won(&press_through_503s(&app, &base, sale, 1..=10).await);
    assert_eq!(promised.len(), 10);
    let written = std::fs::read_to_string(&file).unwrap();
    for order in promised.values() {
        assert!(
            written.contains(&format!(" {order} ")),
            "{order} in {written}"
        );
    }

    // The instance killed, then Redis back from its snapshot: no copy of the 10 orders
    // is left anywhere but in the instance's promises file.
    first.kill9();
    redis.crash_and_restart();
    let lost: i64 = redis.command(redis::cmd("XLEN").arg(app.keys.stream(seckill::keys::Shard(0))));
    assert_eq!(lost, 0, "the snapshot holds no admission");

    // Started again on the same file, with a worker this time.
    let (_second, base) = app.spawn_server("serve", &on_file).await;
    let again = press_through_503s(&app, &base, sale, 1..=10).await;
    hold_their_first_orders(&again, &promised);
    let crowd = won(&press_through_503s(&app, &base, sale, 101..=140).await);
    assert_eq!(crowd.len(), 10, "the units the promises left, no more");

    assert_eq!(
        app.wait_for_orders(sale, stock as usize, Duration::from_secs(30))
            .await,
        stock as usize
    );
    let stored = app.assert_consistent(sale, stock).await;
    let answered: HashMap<i64, i64> = promised.into_iter().chain(crowd).collect();
    assert_eq!(
        stored,
        answered.values().copied().collect(),
        "every 202 is an order, under the id it was answered with"
    );
    let metrics = metrics_at(&app.client, &base).await;
    let broken = metric_value(&metrics, "seckill_promises_broken_total");
    assert!(
        broken.unwrap_or(0.0) == 0.0,
        "no promise broken: {broken:?}"
    );
    println!("a 202 redis lost, across a kill -9 of its instance: 10 promised, 10 kept, 0 lost");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_second_instance_cannot_share_a_promises_file(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let scratch = Scratch::new();
    let file = scratch.0.join("promises").display().to_string();
    let on_file = [("PROMISES_FILE", file.clone())];
    let (_first, _) = app.spawn_server("api", &on_file).await;

    let second = tokio::process::Command::new(crate::common::faults::BIN)
        .arg("api")
        .env(
            "DATABASE_URL",
            crate::common::faults::database_url(&app.db, None),
        )
        .env("REDIS_URL", &app.redis_url)
        .env("REDIS_KEY_PREFIX", app.keys.prefix())
        .env("PROMISES_FILE", &file)
        .env("BIND", "127.0.0.1:0")
        .env("JWT_SECRET", crate::common::SECRET)
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(60), second)
        .await
        .expect("the second instance refuses to start")
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("another instance keeps its promises there"),
        "{stderr}"
    );
}

/// Shoppers press again and again while a sale is held: not rate limited here.
fn press_on() -> [(&'static str, String); 2] {
    [
        ("RATE_LIMIT_PER_USER", "1000".into()),
        ("RATE_LIMIT_PER_USER_BURST", "1000".into()),
    ]
}

/// Every shopper who pressed again is told they hold the order of their first 202.
fn hold_their_first_orders(
    again: &HashMap<i64, (StatusCode, Value)>,
    promised: &HashMap<i64, i64>,
) {
    for (user, (status, body)) in again {
        assert_eq!(*status, StatusCode::CONFLICT, "user {user}: {body}");
        assert_eq!(body["error"]["code"], "already_ordered", "{body}");
        assert_eq!(
            body["error"]["order_id"],
            promised[user].to_string(),
            "user {user} holds the order of the first 202"
        );
    }
}

/// The instance that gave the lost 202s is frozen while its shoppers press again through
/// another instance: the server's new term holds every grab until it has admitted them
/// again (a fresh 202 there would take the unit and the place of the first).
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_shopper_whose_202_redis_lost_cannot_win_again_through_another_instance_first(
    db: PgPool,
) {
    let mut redis = PrivateRedis::start();
    let app = TestApp::spawn_with(db, redis.url.clone(), true).await;
    let (giver, at_giver) = app.spawn_server("api", &press_on()).await;
    let (_other, at_other) = app.spawn_server("api", &press_on()).await;
    let stock = 20;
    let sale = open_sale_at(&app.client, &at_giver, stock).await;
    redis.save();
    let promised = won(&press_through_503s(&app, &at_giver, sale, 1..=10).await);
    assert_eq!(promised.len(), 10);

    // Its instance frozen, then Redis back from its snapshot: the 10 orders live only in
    // that instance's memory.
    giver.freeze(true);
    redis.crash_and_restart();
    let lost: i64 = redis.command(redis::cmd("XLEN").arg(app.keys.stream(seckill::keys::Shard(0))));
    assert_eq!(lost, 0, "the snapshot holds no admission");
    // (Well within the frozen instance's lease: it still holds the new term back.)
    let until = Instant::now() + Duration::from_secs(3);
    let mut held = 0;
    while Instant::now() < until {
        for (user, answer) in press_all(&app, &at_other, sale, 1..=10, 10).await {
            let (status, body) = answer.expect("an answer");
            assert_eq!(
                status,
                StatusCode::SERVICE_UNAVAILABLE,
                "user {user} pressed again elsewhere before the first 202 was back: {body}"
            );
            assert_eq!(body["error"]["code"], "unavailable", "{body}");
            held += 1;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    giver.freeze(false);
    let again = press_through_503s(&app, &at_other, sale, 1..=10).await;
    hold_their_first_orders(&again, &promised);
    let metrics = metrics_at(&app.client, &at_other).await;
    let refused = metric_value(&metrics, "seckill_admissions_total{outcome=\"held\"}");
    assert!(refused.unwrap_or(0.0) >= held as f64, "{refused:?}");

    let _worker = crate::common::faults::Process::spawn(
        "worker",
        &app.redis_url,
        app.keys.prefix(),
        &crate::common::faults::database_url(&app.db, None),
        &[],
    );
    assert_eq!(
        app.wait_for_orders(sale, 10, Duration::from_secs(30)).await,
        10
    );
    let stored = app.assert_consistent(sale, stock).await;
    assert_eq!(stored, promised.values().copied().collect());
    println!(
        "10 202s redis lost while their instance was frozen: {held} grabs of their shoppers \
         elsewhere held, then 10 already_ordered with the first ids, 10 orders"
    );
}

/// A killed instance no longer holds a new term back once its lease has run out.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_killed_instance_holds_a_new_term_back_only_until_its_lease_runs_out(db: PgPool) {
    let mut redis = PrivateRedis::start();
    let app = TestApp::spawn_with(db, redis.url.clone(), true).await;
    let (mut gone, _) = app.spawn_server("api", &press_on()).await;
    let (_other, at_other) = app.spawn_server("api", &press_on()).await;
    let sale = open_sale_at(&app.client, &at_other, 5).await;

    gone.kill9();
    redis.crash_and_restart();
    let began = Instant::now();
    let (status, body) = press_all(&app, &at_other, sale, [1], 1).await[0]
        .1
        .clone()
        .expect("an answer");
    assert_eq!(
        status,
        StatusCode::SERVICE_UNAVAILABLE,
        "held first: {body}"
    );
    let answers = won(&press_through_503s(&app, &at_other, sale, 1..=5).await);
    assert_eq!(answers.len(), 5, "sold once the lease ran out");
    println!(
        "a new term held {:.1} s by a killed instance's lease",
        began.elapsed().as_secs_f64()
    );
}
