//! A Redis that may evict keys never answers 202, and what it evicted is lost writes
//! every instance notices: its promises are kept as after a restart from an older copy.
//!
//! Two `seckill api` instances and a `seckill worker` paused with SIGSTOP (so every
//! order lives only in Redis), a private Redis switched to an evicting policy and
//! filled until it evicted the sale, the order stream and the term marker.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::Value;
use sqlx::PgPool;

use crate::common::faults::{self, PrivateRedis, Process};
use crate::common::{metric_value, metrics_at, open_sale_at, vid, TestApp};
use crate::recovery::rollback::{press_through_503s, won};
use seckill::keys::Shard;

/// The filler's keys (not the service's), 10 KB each.
const FILLER: &str = "filler:";

/// Sets `policy` (and, when `room` is given, a `maxmemory` that much above what the
/// server uses now).
fn set_policy(redis: &PrivateRedis, policy: &str, room: Option<u64>) {
    let maxmemory = match room {
        Some(room) => used_memory(redis) + room,
        None => 0,
    };
    redis.run_command::<()>(
        redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory-policy")
            .arg(policy)
            .arg("maxmemory")
            .arg(maxmemory),
    );
}

fn info_field(redis: &PrivateRedis, section: &str, field: &str) -> u64 {
    let text: String = redis.run_command(redis::cmd("INFO").arg(section));
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("INFO {section} has no {field}"))
}

fn used_memory(redis: &PrivateRedis) -> u64 {
    info_field(redis, "memory", "used_memory")
}

fn exists(redis: &PrivateRedis, key: &str) -> bool {
    redis.run_command(redis::cmd("EXISTS").arg(key))
}

/// Writes filler until Redis has evicted every key in `ours` (at most 200 MB); returns
/// how many keys it evicted.
fn fill_until_evicted(redis: &PrivateRedis, ours: &[String]) -> u64 {
    let value = "x".repeat(10_000);
    for batch in 0..200 {
        let mut pipe = redis::pipe();
        for i in 0..1_000 {
            pipe.cmd("SET")
                .arg(format!("{FILLER}{batch}:{i}"))
                .arg(&value)
                .ignore();
        }
        let mut conn = redis::Client::open(redis.url.as_str())
            .unwrap()
            .get_connection()
            .unwrap();
        pipe.query::<()>(&mut conn).unwrap();
        if ours.iter().all(|k| !exists(redis, k)) {
            return info_field(redis, "stats", "evicted_keys");
        }
    }
    panic!("200 MB of filler did not evict {ours:?}");
}

/// Deletes the filler.
fn remove_filler(redis: &PrivateRedis) {
    let keys: Vec<String> = redis.run_command(redis::cmd("KEYS").arg(format!("{FILLER}*")));
    for chunk in keys.chunks(1_000) {
        redis.run_command::<()>(redis::cmd("DEL").arg(chunk));
    }
}

/// One press each, once: the answers.
async fn press_once(
    app: &TestApp,
    bases: &[String; 2],
    voucher: i64,
    users: impl IntoIterator<Item = i64>,
) -> Vec<(i64, StatusCode, Value)> {
    let mut out = Vec::new();
    for user in users {
        let (status, body) = app
            .send(
                app.client
                    .post(format!(
                        "{}/vouchers/{voucher}/seckill",
                        bases[user as usize % 2]
                    ))
                    .bearer_auth(app.token(user)),
            )
            .await;
        out.push((user, status, body));
    }
    out
}

/// Presses through 503s, each user at the instance of its parity.
async fn press_both(
    app: &TestApp,
    bases: &[String; 2],
    voucher: i64,
    users: std::ops::RangeInclusive<i64>,
) -> HashMap<i64, (StatusCode, Value)> {
    let evens = press_through_503s(
        app,
        &bases[0],
        voucher,
        users.clone().filter(|u| u % 2 == 0),
    );
    let odds = press_through_503s(app, &bases[1], voucher, users.filter(|u| u % 2 == 1));
    let (mut answers, odds) = tokio::join!(evens, odds);
    answers.extend(odds);
    answers
}

/// Both instances answer `/readyz` 503 naming the eviction.
async fn not_ready_naming_eviction(app: &TestApp, bases: &[String; 2]) {
    for base in bases {
        let resp = app
            .client
            .get(format!("{base}/readyz"))
            .send()
            .await
            .unwrap();
        let status = resp.status();
        let body: Value = resp.json().await.unwrap();
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        assert_eq!(body["checks"]["redis_memory"], "may_evict", "{body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains("may evict keys"), "{message}");
    }
}

/// Every answer naming an order names one order per shopper; returns them.
fn one_order_each(answers: &[&HashMap<i64, (StatusCode, Value)>]) -> HashMap<i64, i64> {
    let mut told: HashMap<i64, i64> = HashMap::new();
    for (user, (status, body)) in answers.iter().flat_map(|a| a.iter()) {
        let id = match *status {
            StatusCode::ACCEPTED => body["order_id"].as_str(),
            StatusCode::CONFLICT if body["error"]["code"] == "already_ordered" => {
                body["error"]["order_id"].as_str()
            }
            _ => None,
        };
        if let Some(id) = id {
            let id: i64 = id.parse().unwrap();
            let before = told.insert(*user, id);
            assert!(
                before.is_none() || before == Some(id),
                "user {user} told of two orders: {before:?} and {id}"
            );
        }
    }
    told
}

/// The worker resumes; every order anyone was told of is written under its shopper, and
/// nothing else.
async fn every_order_told_is_written(
    app: &TestApp,
    worker: &Process,
    voucher: i64,
    stock: i64,
    told: &HashMap<i64, i64>,
) {
    worker.freeze(false);
    assert_eq!(
        app.wait_for_orders(voucher, told.len(), Duration::from_secs(60))
            .await,
        told.len()
    );
    let rows: Vec<(i64, i64)> =
        sqlx::query_as("SELECT user_id, id FROM voucher_orders WHERE voucher_id = $1")
            .bind(voucher)
            .fetch_all(&app.db)
            .await
            .unwrap();
    let written: HashMap<i64, i64> = rows.into_iter().collect();
    assert_eq!(
        &written, told,
        "every order told is written, and nothing else"
    );
    assert!(written.len() as i64 <= stock);
}

/// A worker process that has made its consumer group, then paused.
async fn paused_worker(app: &TestApp, redis: &PrivateRedis) -> Process {
    let worker = Process::spawn(
        "worker",
        &app.redis_url,
        app.keys.prefix(),
        &faults::database_url(&app.db, None),
        &[],
    );
    let stream = app.keys.stream(Shard(0)).to_string();
    let deadline = Instant::now() + Duration::from_secs(30);
    while redis
        .try_command::<Vec<redis::Value>>(redis::cmd("XINFO").arg("GROUPS").arg(&stream))
        .is_err()
    {
        assert!(Instant::now() < deadline, "the worker made no group");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    worker.freeze(true);
    worker
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_redis_switched_to_an_evicting_policy_mid_sale_loses_no_202_and_tells_no_shopper_two_orders(
    db: PgPool,
) {
    let redis = PrivateRedis::start();
    let app = TestApp::spawn_with(db, redis.url.clone(), true).await;
    let (_one, one) = app.spawn_server("api", &[]).await;
    let (_two, two) = app.spawn_server("api", &[]).await;
    let bases = [one, two];
    let stock = 300;
    let voucher = open_sale_at(&app.client, &bases[0], stock).await;
    let worker = paused_worker(&app, &redis).await;

    let first = press_both(&app, &bases, voucher, 1..=200).await;
    assert_eq!(won(&first).len(), 200);

    set_policy(&redis, "allkeys-lru", Some(2_000_000));
    let switched = Instant::now();
    let sale = app
        .keys
        .segment(seckill::keys::SaleSegment::new(vid(voucher), 0, 1));
    let ours = [
        sale,
        app.keys.stream(Shard(0)).to_string(),
        app.keys.term_marker(Shard(0)),
    ];
    let evicted = fill_until_evicted(&redis, &ours);
    // No 202 once the instances' admission step has looked at the policy (it does
    // every 100 ms): the crowd after the eviction is refused, nothing reserved.
    tokio::time::sleep(Duration::from_millis(300).saturating_sub(switched.elapsed())).await;
    let during = press_once(&app, &bases, voucher, 150..=260).await;
    for (user, status, body) in &during {
        assert_eq!(
            *status,
            StatusCode::SERVICE_UNAVAILABLE,
            "user {user}: {body}"
        );
        assert_eq!(body["error"]["code"], "unavailable", "{body}");
    }
    not_ready_naming_eviction(&app, &bases).await;
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let metrics = metrics_at(&app.client, &bases[0]).await;
    assert_eq!(metric_value(&metrics, "seckill_redis_may_evict"), Some(1.0));

    set_policy(&redis, "noeviction", None);
    remove_filler(&redis);
    let after = press_both(&app, &bases, voucher, 1..=400).await;
    let told = one_order_each(&[&first, &after]);
    for (user, order) in won(&first) {
        assert_eq!(
            told[&user], order,
            "user {user} keeps the order of their 202"
        );
    }
    assert_eq!(
        told.len() as i64,
        stock,
        "the units the 202s left, sold, no more"
    );
    every_order_told_is_written(&app, &worker, voucher, stock, &told).await;
    let mut readmitted = 0.0;
    for base in &bases {
        let metrics = metrics_at(&app.client, base).await;
        readmitted += metric_value(&metrics, "seckill_promises_readmitted_total").unwrap_or(0.0);
    }
    println!(
        "evicting policy mid-sale: {evicted} keys evicted, {} 503s while it could evict, \
         200 202s before ({readmitted} admitted again by the api processes), {} after, 0 \
         lost, no shopper told two orders",
        during.len(),
        told.len() - 200
    );
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn instances_started_while_redis_is_down_never_admit_on_an_evicting_redis(db: PgPool) {
    let port = faults::free_port();
    let url = format!("redis://127.0.0.1:{port}");
    let app = TestApp::spawn_with(db, url.clone(), true).await;
    let (_one, one) = app.spawn_server_unready("api", &[]).await;
    let (_two, two) = app.spawn_server_unready("api", &[]).await;
    let bases = [one, two];

    let redis = PrivateRedis::start_on(port, &["--maxmemory-policy", "allkeys-lru"]);
    let stock = 300;
    let voucher = open_sale_at(&app.client, &bases[0], stock).await;
    not_ready_naming_eviction(&app, &bases).await;
    // Two waves a second apart (shoppers the later waves do not reuse): every press
    // refused, nothing reserved.
    let mut refused = 0;
    for wave in [1_001..=1_100, 1_101..=1_200] {
        for (user, status, body) in press_once(&app, &bases, voucher, wave).await {
            assert_eq!(
                status,
                StatusCode::SERVICE_UNAVAILABLE,
                "user {user}: {body}"
            );
            refused += 1;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let entries: u64 = redis.run_command(redis::cmd("XLEN").arg(app.keys.stream(Shard(0))));
    assert_eq!(entries, 0, "no order admitted while the policy may evict");

    set_policy(&redis, "noeviction", None);
    // A worker, too, refuses to start on a Redis that may evict.
    let worker = paused_worker(&app, &redis).await;
    let first = press_both(&app, &bases, voucher, 1..=200).await;
    assert_eq!(won(&first).len(), 200);
    set_policy(&redis, "allkeys-lru", Some(2_000_000));
    let ours = [app.keys.stream(Shard(0)).to_string()];
    let evicted = fill_until_evicted(&redis, &ours);
    set_policy(&redis, "noeviction", None);
    remove_filler(&redis);
    let after = press_both(&app, &bases, voucher, 1..=400).await;
    let told = one_order_each(&[&first, &after]);
    assert_eq!(told.len() as i64, stock);
    every_order_told_is_written(&app, &worker, voucher, stock, &told).await;
    println!(
        "started with redis down, then allkeys-lru: {refused} presses refused, 0 admitted; \
         {evicted} keys evicted later, 0 of 200 202s lost"
    );
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn keys_an_operator_deletes_mid_sale_are_lost_writes_every_instance_sees(db: PgPool) {
    let redis = PrivateRedis::start();
    let app = TestApp::spawn_with(db, redis.url.clone(), true).await;
    let (_one, one) = app.spawn_server("api", &[]).await;
    let (_two, two) = app.spawn_server("api", &[]).await;
    let bases = [one, two];
    let stock = 150;
    let voucher = open_sale_at(&app.client, &bases[0], stock).await;
    let worker = paused_worker(&app, &redis).await;
    let first = press_both(&app, &bases, voucher, 1..=100).await;
    assert_eq!(won(&first).len(), 100);
    let healed_before: Vec<f64> = futures::future::join_all(bases.iter().map(|b| async {
        let metrics = metrics_at(&app.client, b).await;
        metric_value(&metrics, "seckill_redis_rollbacks_healed_total").unwrap_or(0.0)
    }))
    .await;

    // An operator "cleans up": the sale's state and the order stream, every 202's
    // only record until the worker writes it.
    let sale = app
        .keys
        .segment(seckill::keys::SaleSegment::new(vid(voucher), 0, 1));
    let stream = app.keys.stream(Shard(0)).to_string();
    let deleted: u64 = redis.run_command(redis::cmd("DEL").arg(&sale).arg(&stream));
    assert_eq!(deleted, 2);

    // Every instance sees a new term (not only one that happens to rebuild).
    let deadline = Instant::now() + Duration::from_secs(20);
    for (base, before) in bases.iter().zip(&healed_before) {
        loop {
            let metrics = metrics_at(&app.client, base).await;
            let healed = metric_value(&metrics, "seckill_redis_rollbacks_healed_total");
            if healed.unwrap_or(0.0) > *before {
                break;
            }
            assert!(Instant::now() < deadline, "{base} never saw a new term");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let after = press_both(&app, &bases, voucher, 1..=250).await;
    let told = one_order_each(&[&first, &after]);
    for (user, order) in won(&first) {
        assert_eq!(
            told[&user], order,
            "user {user} keeps the order of their 202"
        );
    }
    assert_eq!(told.len() as i64, stock, "the units left, sold, no more");
    every_order_told_is_written(&app, &worker, voucher, stock, &told).await;
    println!(
        "operator DEL of the sale and the stream mid-sale: both instances saw a new term; \
         100 202s before, all kept; {} after; 0 lost, no shopper told two orders",
        told.len() - 100
    );
}
