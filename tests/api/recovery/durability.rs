//! Replica acknowledgements (`REDIS_WAIT_REPLICAS`) and failovers to a replica that
//! lagged behind: what a 202 survives, measured.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use futures::StreamExt;
use reqwest::StatusCode;
use serde_json::Value;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::common::faults::{self, PrivateRedis, Proxy};
use crate::common::sentinel::{PrivateSentinel, MASTER};
use crate::common::{metric_value, metrics_at, open_sale_at, vid, TestApp};
use seckill::config::Settings;
use seckill::scripts::Replicas;

fn waiting_for(n: u32) -> Settings {
    Settings {
        replicas: Replicas {
            n,
            timeout: Duration::from_millis(500),
            max_lag: Duration::from_secs(1),
        },
        ..Settings::default()
    }
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_grab_is_answered_202_only_once_a_replica_holds_it_and_refused_unsent_while_none_is_there(
    db: PgPool,
) {
    let primary = PrivateRedis::start();
    let mut replica = Some(PrivateRedis::start());
    replica
        .as_ref()
        .unwrap()
        .replicate_from(primary.addr())
        .await;
    let app = TestApp::spawn_on(db, primary.url.clone(), waiting_for(1)).await;
    let voucher = app.open_sale(10).await;

    let (status, body) = app.grab(voucher, 1).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let order = body["order_id"].as_str().unwrap().to_string();
    // The answer came after the replica held the order: read it there.
    let on_replica: Option<String> = replica.as_ref().unwrap().run_command(
        redis::cmd("HGET")
            .arg(app.keys.voucher(vid(voucher)))
            .arg("u:1"),
    );
    assert_eq!(on_replica.as_deref(), Some(order.as_str()));

    // No replica: the master refuses writes (min-replicas, which the instance set), and
    // the instance's probe finds none: the grab is refused before its unit is taken.
    drop(replica.take());
    let started = Instant::now();
    let (status, body) = app.grab(voucher, 2).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(
        body["error"]["outcome"],
        Value::Null,
        "nothing reserved: {body}"
    );
    println!(
        "no replica: 503 nothing reserved after {} ms",
        started.elapsed().as_millis()
    );
    assert_eq!(app.redis_stock(voucher).await, Some(9), "no unit taken");
    // A replica again: the grab is admitted (until the order-id lease is confirmed on a
    // replica again, and the probe sees it acknowledge, grabs are refused).
    let replica = PrivateRedis::start();
    replica.replicate_from(primary.addr()).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    let (status, body) = loop {
        let (status, body) = app.grab(voucher, 2).await;
        if status != StatusCode::SERVICE_UNAVAILABLE || Instant::now() > deadline {
            break (status, body);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let second = body["order_id"].as_str().unwrap().to_string();
    app.drain().await;
    assert_eq!(app.pg_status(&second).await.as_deref(), Some("created"));
    assert_eq!(app.pg_status(&order).await.as_deref(), Some("created"));
}

/// What a fault mid-storm cost.
#[derive(Debug)]
struct Loss {
    admitted: usize,
    units: i64,
    lost: usize,
    oversold: i64,
    healed_in: Duration,
    /// 202s Redis lost that the instance admitted again (its kept promises).
    readmitted: f64,
}

impl std::fmt::Display for Loss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "202s {}, units {}, 202s lost {} ({} lost by Redis, admitted again by the \
             instance), oversold {}, first admission {:.1} s after Redis was back",
            self.admitted,
            self.units,
            self.lost,
            self.readmitted,
            self.oversold,
            self.healed_in.as_secs_f64()
        )
    }
}

/// A Sentinel deployment (three sentinels, a primary, a replica replicating through a
/// cuttable proxy) and a real `seckill serve` finding Redis through the sentinels.
/// Mid-storm Postgres becomes unreachable for the worker (its backlog waits in the
/// stream), the replica's link is cut (it lags), the primary is killed -9 and the
/// sentinels promote the lagging replica; a spare replica joins it (as the old primary
/// would on rejoining), Postgres comes back. Counts what the 202s became.
async fn failover_mid_storm(db: PgPool, wait_replicas: u32) -> Loss {
    let mut redis = PrivateSentinel::start().await;
    let spare = PrivateRedis::start();
    // The harness's own app (database, tokens, reconcile) on a Redis of its own.
    let scratch = PrivateRedis::start();
    let postgres = Proxy::start(faults::postgres_addr(&db)).await;
    let app = TestApp::spawn_on(db.clone(), scratch.url.clone(), Settings::default()).await;
    let sentinels = vec![
        ("REDIS_SENTINEL_URLS", redis.sentinel_urls()),
        ("REDIS_SENTINEL_MASTER", MASTER.to_string()),
        ("REDIS_WAIT_REPLICAS", wait_replicas.to_string()),
    ];
    let sale = Sale::open(&app, &postgres, sentinels).await;
    let fault = async {
        tokio::time::sleep(Duration::from_millis(1000)).await;
        postgres.cut();
        tokio::time::sleep(Duration::from_millis(500)).await;
        redis.cut_replica_link();
        tokio::time::sleep(Duration::from_millis(700)).await;
        redis.kill_primary();
        redis.wait_replica_promoted().await;
        let promoted = Instant::now();
        // The promoted replica gets a replica of its own: without one, no grab can be
        // acknowledged any more.
        redis.give_promoted_a_replica(&spare).await;
        postgres.heal();
        promoted
    };
    sale.through(fault).await
}

/// A real `seckill serve` whose worker reaches Postgres through `postgres` (cut, its
/// backlog waits in Redis), and a sale on it with more units than the storm takes.
struct Sale<'a> {
    app: &'a TestApp,
    redis_env: Vec<(&'static str, String)>,
    _server: faults::Process,
    base: String,
    voucher: i64,
    units: i64,
}

impl<'a> Sale<'a> {
    async fn open(
        app: &'a TestApp,
        postgres: &Proxy,
        redis_env: Vec<(&'static str, String)>,
    ) -> Sale<'a> {
        let mut env = redis_env.clone();
        env.push((
            "DATABASE_URL",
            faults::database_url(&app.db, Some(postgres.addr)),
        ));
        let (server, base) = app.spawn_server("serve", &env).await;
        let units = 5000;
        let voucher = open_sale_at(&app.client, &base, units).await;
        Sale {
            app,
            redis_env,
            _server: server,
            base,
            voucher,
            units,
        }
    }

    /// Storms the sale while `fault` runs (it answers when Redis is back), until a grab
    /// is admitted again and a moment longer; then counts what the 202s became, checks
    /// no unit was sold twice, and that the books balance without anyone's repair.
    async fn through(self, fault: impl std::future::Future<Output = Instant>) -> Loss {
        let stop = CancellationToken::new();
        let fault = async {
            let back = fault.await;
            loop {
                let (status, body) = self.grab(1_000_000).await;
                let code = &body["error"]["code"];
                if status == StatusCode::ACCEPTED || code == "already_ordered" {
                    break;
                }
                assert!(back.elapsed() < Duration::from_secs(60), "{body}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let healed_in = back.elapsed();
            tokio::time::sleep(Duration::from_millis(1500)).await;
            stop.cancel();
            healed_in
        };
        let (mut answers, healed_in) = tokio::join!(self.storm(&stop), fault);
        answers.insert(1_000_000, self.grab(1_000_000).await);
        self.tally(answers, healed_in).await
    }

    /// One grab by `user` through the server under test (not the harness's own app,
    /// whose Redis is another).
    async fn grab(&self, user: i64) -> (StatusCode, Value) {
        let req = self
            .app
            .client
            .post(format!("{}/vouchers/{}/seckill", self.base, self.voucher))
            .bearer_auth(self.app.token(user));
        self.app.send(req).await
    }

    /// Distinct shoppers, 16 at a time, until `stop`.
    async fn storm(&self, stop: &CancellationToken) -> HashMap<i64, (StatusCode, Value)> {
        let mut answers = HashMap::new();
        let mut next = 1;
        while !stop.is_cancelled() {
            let got: Vec<_> = futures::stream::iter(next..next + 16)
                .map(|user| {
                    let req = self
                        .app
                        .client
                        .post(format!("{}/vouchers/{}/seckill", self.base, self.voucher))
                        .bearer_auth(self.app.token(user))
                        .timeout(Duration::from_secs(10));
                    async move {
                        let resp = req.send().await.ok()?;
                        let status = resp.status();
                        Some((user, (status, resp.json::<Value>().await.ok()?)))
                    }
                })
                .buffer_unordered(16)
                .filter_map(|a| async move { a })
                .collect()
                .await;
            next += 16;
            answers.extend(got);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        answers
    }

    async fn tally(&self, answers: HashMap<i64, (StatusCode, Value)>, healed_in: Duration) -> Loss {
        let (app, voucher, units) = (self.app, self.voucher, self.units);
        let given: HashSet<i64> = answers
            .values()
            .filter(|(status, _)| *status == StatusCode::ACCEPTED)
            .map(|(_, body)| body["order_id"].as_str().unwrap().parse().unwrap())
            .collect();
        for (status, body) in answers.values() {
            assert!(
                !status.is_server_error() || body["error"]["code"] == "unavailable",
                "{status} {body}"
            );
        }
        // Whatever the workers can write, written.
        let settle = Instant::now() + Duration::from_secs(30);
        let stored: HashSet<i64> = loop {
            let stored: HashSet<i64> = app
                .pg_orders(voucher)
                .await
                .into_iter()
                .map(|(id, _)| id)
                .collect();
            if given.is_subset(&stored) || Instant::now() > settle {
                break stored;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        app.assert_consistent(voucher, units).await;
        assert!(given.len() as i64 <= units, "more 202s than units");
        let metrics = metrics_at(&app.client, &self.base).await;
        assert_eq!(
            metric_value(&metrics, "seckill_dead_lettered_total{kind=\"no_stock\"}"),
            Some(0.0),
            "a 202 beyond the stock"
        );
        let readmitted = metric_value(&metrics, "seckill_promises_readmitted_total").unwrap();
        // Healed by itself: nobody runs --repair.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let (code, out) = app.cli_async(&["reconcile"], &self.redis_env).await;
            if code == 0 {
                break;
            }
            assert!(Instant::now() < deadline, "never balanced:\n{out}");
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        Loss {
            admitted: given.len(),
            units,
            lost: given.difference(&stored).count(),
            oversold: (stored.len() as i64 - units).max(0),
            healed_in,
            readmitted,
        }
    }
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_failover_to_a_lagging_replica_loses_no_202_when_a_replica_must_acknowledge(db: PgPool) {
    let f = failover_mid_storm(db, 1).await;
    println!("failover, REDIS_WAIT_REPLICAS=1: {f}");
    assert!(f.admitted > 0);
    assert_eq!(f.lost, 0, "every 202 in Postgres");
    assert_eq!(f.oversold, 0);
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_failover_to_a_lagging_replica_without_acknowledgements_loses_no_202_while_units_are_left(
    db: PgPool,
) {
    let f = failover_mid_storm(db, 0).await;
    println!("failover, REDIS_WAIT_REPLICAS=0: {f}");
    assert!(f.admitted > 0);
    // The worker's backlog the replica never got: answered 202, gone with the primary,
    // and admitted again by the instance that gave them (units are left for them).
    assert!(f.readmitted > 0.0, "redis lost nothing: {f:?}");
    assert_eq!(f.lost, 0, "a 202 redis lost was not kept: {f:?}");
    assert_eq!(f.oversold, 0);
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_redis_that_may_evict_keys_is_refused_at_start_naming_the_setting(db: PgPool) {
    let redis = PrivateRedis::start();
    redis.run_command::<()>(
        redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory-policy")
            .arg("volatile-lru"),
    );
    let env = [
        ("DATABASE_URL", faults::database_url(&db, None)),
        ("REDIS_URL", redis.url.clone()),
        ("BIND", format!("127.0.0.1:{}", faults::free_port())),
    ];
    for command in ["api", "worker"] {
        let (code, stderr) = crate::tls::cli(&[command], &env).await;
        assert_eq!(code, Some(2), "{command}: {stderr}");
        assert!(
            stderr.contains("maxmemory-policy is volatile-lru")
                && stderr.contains("set maxmemory-policy noeviction"),
            "{command}: {stderr}"
        );
    }
}

/// Redis killed -9 mid-storm and started again from its append-only file, the worker cut
/// from Postgres (its backlog only in Redis): a process crash, with the file synced as
/// `appendfsync` says.
async fn crash_mid_storm(db: PgPool, appendfsync: &str) -> Loss {
    let mut redis = PrivateRedis::with_aof(appendfsync);
    let postgres = Proxy::start(faults::postgres_addr(&db)).await;
    let app = TestApp::spawn_on(db, redis.url.clone(), Settings::default()).await;
    let sale = Sale::open(&app, &postgres, vec![]).await;
    let fault = async {
        tokio::time::sleep(Duration::from_millis(1000)).await;
        postgres.cut();
        tokio::time::sleep(Duration::from_millis(700)).await;
        redis.crash_and_restart();
        let back = Instant::now();
        postgres.heal();
        back
    };
    sale.through(fault).await
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_redis_process_crash_with_appendfsync_everysec_loses_no_202(db: PgPool) {
    let loss = crash_mid_storm(db, "everysec").await;
    println!("process crash, appendfsync everysec, REDIS_WAIT_REPLICAS=0: {loss}");
    assert!(loss.admitted > 0);
    assert_eq!(
        loss.lost, 0,
        "what Redis wrote is in the kernel's page cache"
    );
    assert_eq!(loss.oversold, 0);
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_redis_process_crash_with_appendfsync_always_loses_no_202(db: PgPool) {
    let loss = crash_mid_storm(db, "always").await;
    println!("process crash, appendfsync always, REDIS_WAIT_REPLICAS=0: {loss}");
    assert!(loss.admitted > 0);
    assert_eq!(loss.lost, 0);
    assert_eq!(loss.oversold, 0);
}
