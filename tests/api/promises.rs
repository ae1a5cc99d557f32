//! A 202 Redis lost with every copy (a primary back from an older snapshot before
//! anything wrote its orders) is still kept by the instance that gave it: admitted again
//! into the rebuilt sale under its own id, even when that instance was killed meanwhile
//! and started again on its promises file.

use std::collections::HashMap;
use std::time::Duration;

use reqwest::StatusCode;
use sqlx::PgPool;

use crate::common::faults::PrivateRedis;
use crate::common::{metric_value, metrics_at, open_sale_at, TestApp};
use crate::rollback::{press_through_503s, won};

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
    for (user, (status, body)) in &again {
        assert_eq!(*status, StatusCode::CONFLICT, "user {user}: {body}");
        assert_eq!(body["error"]["code"], "already_ordered", "{body}");
        assert_eq!(
            body["error"]["order_id"],
            promised[user].to_string(),
            "user {user}"
        );
    }
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
