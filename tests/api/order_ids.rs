//! Order-id node leases: a process mints only while Redis confirms its lease, and a
//! number Redis forgot (it lost writes) is not used by two processes at once.

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use sqlx::PgPool;

use crate::common::faults::{PrivateRedis, Proxy};
use crate::common::{open_sale_at, redis_url, TestApp};
use seckill::config::Settings;

/// The node number an order id carries.
fn node_of(order_id: i64) -> i64 {
    (order_id >> 12) & 0x3ff
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn an_instance_whose_lease_renewals_fail_stops_minting_and_starts_again_once_renewed(
    db: PgPool,
) {
    let redis: std::net::SocketAddr = redis_url().trim_start_matches("redis://").parse().unwrap();
    let proxy = Proxy::start(redis).await;
    let app = TestApp::spawn_on(db, format!("redis://{}", proxy.addr), Settings::default()).await;
    assert!(
        app.state.admission.ids.next().is_some(),
        "minting once leased"
    );

    proxy.cut();
    let cut = Instant::now();
    while app.state.admission.ids.next().is_some() {
        assert!(
            cut.elapsed() < Duration::from_secs(5),
            "still minting 5 s after the renewals stopped"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!(
        "minting stopped {} ms after the cut",
        cut.elapsed().as_millis()
    );

    proxy.heal();
    let healed = Instant::now();
    while app.state.admission.ids.next().is_none() {
        assert!(healed.elapsed() < Duration::from_secs(10), "never renewed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_lease_redis_forgot_is_not_minted_with_by_a_new_holder_until_the_old_one_stopped(
    db: PgPool,
) {
    let mut redis = PrivateRedis::start();
    // The copy Redis will come back from: taken before any lease existed.
    redis.save();
    // The old holder reaches Redis through a proxy, cut when Redis comes back: its
    // renewals fail, so nothing tells it the number was forgotten.
    let path = Proxy::start(redis.addr()).await;
    let old = TestApp::spawn_on(db, format!("redis://{}", path.addr), Settings::default()).await;
    let node = node_of(old.state.admission.ids.next().unwrap().get());

    path.cut();
    // The last id the old holder can mint, asked until it stops.
    let ids = old.state.admission.ids.clone();
    let old_last = tokio::spawn(async move {
        let mut last = None;
        while let Some(id) = ids.next() {
            last = Some(id);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        last
    });
    redis.crash_and_restart();
    // Every number but the old holder's is taken: a new process can only claim that one.
    let mut fill = redis::pipe();
    for n in (0..1024).filter(|&n| n != node) {
        fill.cmd("SET")
            .arg(format!("{}seckill:node:{n}", old.keys.prefix()))
            .arg("someone-else")
            .arg("PX")
            .arg(120_000)
            .ignore();
    }
    let mut conn = redis::Client::open(redis.url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let _: () = fill.query_async(&mut conn).await.unwrap();

    let direct = [("REDIS_URL", redis.url.clone())];
    let (_new, base) = old.spawn_server("api", &direct).await;
    let sale = open_sale_at(&old.client, &base, 1000).await;
    let started = Instant::now();
    let mut user = 1;
    let new_first = loop {
        let resp = old
            .client
            .post(format!("{base}/vouchers/{sale}/seckill"))
            .bearer_auth(old.token(user))
            .send()
            .await
            .unwrap();
        user += 1;
        if resp.status() == StatusCode::ACCEPTED {
            let body: serde_json::Value = resp.json().await.unwrap();
            break body["order_id"].as_str().unwrap().parse::<i64>().unwrap();
        }
        assert!(started.elapsed() < Duration::from_secs(30), "never minted");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(node_of(new_first), node, "the only number left");
    let old_last = old_last.await.unwrap().unwrap().get();
    // Ids carry their millisecond: the new holder's first comes after the old one's last.
    let ms = |id: i64| id >> 22;
    println!(
        "node {node}: the new holder's first id {} ms after the old holder's last",
        ms(new_first) - ms(old_last)
    );
    assert!(
        ms(new_first) > ms(old_last),
        "both minted with node {node} at once"
    );
}
