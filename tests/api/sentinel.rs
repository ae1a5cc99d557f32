//! Redis Sentinel: a real `seckill serve` finds the master through three real sentinels
//! and follows a failover without a restart (the primary killed with SIGKILL mid-sale, or
//! handed over with `SENTINEL FAILOVER`), in plain TCP and in TLS.
//!
//! Durability is not asserted here: grabs admitted on the old primary and not yet
//! replicated may be lost, and grabs may be refused (503) for a while after a failover.
//! What is asserted: the same process goes on admitting from the new master, reads its
//! stock from it, and its worker goes on writing orders to Postgres.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::Value;
use sqlx::PgPool;
use tokio::time::Instant;

use crate::common::faults::{self, Process};
use crate::common::sentinel::{PrivateSentinel, MASTER};
use crate::common::tls::Certs;
use crate::common::vid;
use seckill::auth::JwtKeys;

/// Far more than the test's grabs: a refusal is never "sold out".
const STOCK: i64 = 1_000_000;
/// Grabs answered 202 in a row that show the new master serves steadily.
const STEADY: usize = 20;
/// How long after the promotion the server may take to serve steadily again.
const RECOVERY: Duration = Duration::from_secs(60);

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_server_on_sentinel_goes_on_selling_from_the_promoted_replica_after_the_primary_is_killed(
    db: PgPool,
) {
    let mut redis = PrivateSentinel::start().await;
    let (server, base) = serve(&db, &redis, &[]).await;
    let timings = failover_mid_sale(&db, &mut redis, &base, Failover::Kill).await;
    println!("plain TCP, primary killed -9: {timings}");
    assert_still_running(server);
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_server_on_tls_sentinels_follows_a_killed_primary_to_the_tls_replica(db: PgPool) {
    let certs = Certs::make();
    let mut redis = PrivateSentinel::start_tls(&certs).await;
    let ca = ("REDIS_TLS_CA_FILE", certs.ca.display().to_string());
    // Sentinels whose certificate the CA file does not vouch for: the start stops at
    // once, naming the settings.
    let other = ("REDIS_TLS_CA_FILE", certs.other_ca.display().to_string());
    let (code, err) = crate::tls::cli(&["dead-letters"], &sentinel_env(&redis, other)).await;
    assert_eq!(code, Some(2), "{err}");
    for needle in [
        "TLS with Redis failed",
        "REDIS_SENTINEL_URLS",
        "REDIS_TLS_CA_FILE",
    ] {
        assert!(err.contains(needle), "{needle:?} not in {err}");
    }
    let (server, base) = serve(&db, &redis, &[ca]).await;
    let timings = failover_mid_sale(&db, &mut redis, &base, Failover::Kill).await;
    println!("TLS, primary killed -9: {timings}");
    assert_still_running(server);
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn after_a_handover_the_old_primary_now_a_replica_is_left_for_the_new_master(db: PgPool) {
    let mut redis = PrivateSentinel::start().await;
    let (server, base) = serve(&db, &redis, &[]).await;
    let timings = failover_mid_sale(&db, &mut redis, &base, Failover::Handover).await;
    println!("plain TCP, SENTINEL FAILOVER: {timings}");
    // The old primary lives on as a replica: every 202 since it was demoted came from the
    // new master (a replica refuses writes).
    assert_eq!(
        redis.role(redis.primary_port).await.as_deref(),
        Some("slave")
    );
    assert_still_running(server);
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn the_replicas_link_can_be_cut_to_make_it_lag_and_healed(db: PgPool) {
    let redis = PrivateSentinel::start().await;
    let (_server, base) = serve(&db, &redis, &[]).await;
    let http = reqwest::Client::new();
    let voucher = crate::common::open_sale_at(&http, &base, 10).await;
    let key = seckill::keys::Keys::new("").unwrap().voucher(vid(voucher));
    let stock = |port| {
        let redis = &redis;
        let cmd = redis::cmd("HGET").arg(&key).arg("stock").clone();
        async move { redis.query::<Option<i64>>(port, &cmd).await.unwrap() }
    };
    redis.wait_replica_in_sync().await;
    assert_eq!(stock(redis.replica_port).await, Some(10));

    redis.cut_replica_link();
    let shoppers = Shoppers::start(&base, voucher, 1);
    shoppers.wait_for_admissions(3, |_| true).await;
    shoppers.stop().await;
    let sold = 10 - stock(redis.primary_port).await.unwrap();
    assert!(sold >= 3);
    assert_eq!(
        stock(redis.replica_port).await,
        Some(10),
        "the replica lags"
    );

    redis.heal_replica_link().await;
    assert_eq!(stock(redis.replica_port).await, Some(10 - sold));
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn sentinel_settings_that_cannot_work_stop_every_redis_command_naming_them(db: PgPool) {
    let (urls, master) = ("REDIS_SENTINEL_URLS", "REDIS_SENTINEL_MASTER");
    let cases: [(&[(&str, &str)], &str); 4] = [
        (
            &[(urls, "redis://127.0.0.1:1")],
            "REDIS_SENTINEL_URLS is set but REDIS_SENTINEL_MASTER is not",
        ),
        (
            &[(master, "seckill")],
            "REDIS_SENTINEL_MASTER is set but REDIS_SENTINEL_URLS is not",
        ),
        (
            &[
                (urls, "redis://127.0.0.1:1"),
                (master, "seckill"),
                ("REDIS_CLUSTER_URLS", "redis://127.0.0.1:2"),
            ],
            "REDIS_SENTINEL_URLS and REDIS_CLUSTER_URLS are both set",
        ),
        (
            &[
                (urls, "redis://127.0.0.1:1,rediss://127.0.0.1:2"),
                (master, "seckill"),
            ],
            "REDIS_SENTINEL_URLS: either every URL is rediss:// (TLS) or none is",
        ),
    ];
    for (settings, expected) in cases {
        for command in [&["dead-letters"][..], &["worker"], &["serve"]] {
            let mut env = vec![
                ("DATABASE_URL", faults::database_url(&db, None)),
                ("BIND", format!("127.0.0.1:{}", faults::free_port())),
            ];
            env.extend(settings.iter().map(|(k, v)| (*k, v.to_string())));
            let (code, err) = crate::tls::cli(command, &env).await;
            assert_eq!(code, Some(2), "{command:?} {settings:?}: {err}");
            assert!(
                err.contains(expected),
                "{command:?}: {expected:?} not in {err}"
            );
        }
    }
}

/// The environment that points a command at the sentinels, plus `extra`.
fn sentinel_env(
    redis: &PrivateSentinel,
    extra: (&'static str, String),
) -> Vec<(&'static str, String)> {
    vec![
        ("REDIS_SENTINEL_URLS", redis.sentinel_urls()),
        ("REDIS_SENTINEL_MASTER", MASTER.to_string()),
        extra,
    ]
}

/// Starts `seckill serve` (API and worker) on a spare port, finding Redis through the
/// sentinels only, and waits until it is ready.
async fn serve(
    db: &PgPool,
    redis: &PrivateSentinel,
    extra: &[(&str, String)],
) -> (Process, String) {
    let port = faults::free_port();
    let mut env = sentinel_env(redis, ("BIND", format!("127.0.0.1:{port}")));
    env.push(("WORKER_BLOCK_MS", "300".to_string()));
    env.extend(extra.iter().cloned());
    let url = faults::database_url(db, None);
    // REDIS_URL left at its default: it is not used with Sentinel.
    let server = Process::spawn("serve", seckill::config::DEFAULT_REDIS_URL, "", &url, &env);
    let base = format!("http://127.0.0.1:{port}");
    faults::wait_ready(&base).await;
    (server, base)
}

fn assert_still_running(mut server: Process) {
    assert!(
        server.child.try_wait().unwrap().is_none(),
        "the server was not restarted, nor did it exit"
    );
}

enum Failover {
    /// `kill -9` of the primary; the sentinels find it down and promote the replica.
    Kill,
    /// `SENTINEL FAILOVER`: the primary lives on and is turned into a replica.
    Handover,
}

/// Sells through the server at `base` while the primary fails over, until the server
/// admits steadily again; checks that it reads the stock from the new master and that
/// its worker writes the new master's orders to Postgres. Returns the timings.
async fn failover_mid_sale(
    db: &PgPool,
    redis: &mut PrivateSentinel,
    base: &str,
    how: Failover,
) -> String {
    let http = reqwest::Client::new();
    let voucher = crate::common::open_sale_at(&http, base, STOCK).await;
    let shoppers = Shoppers::start(base, voucher, 4);
    shoppers.wait_for_admissions(STEADY, |_| true).await;

    let failed_at = Instant::now();
    match how {
        Failover::Kill => redis.kill_primary(),
        Failover::Handover => {
            let cmd = redis::cmd("SENTINEL").arg("FAILOVER").arg(MASTER).clone();
            let ok: String = redis.query(redis.sentinel_ports[0], &cmd).await.unwrap();
            assert_eq!(ok, "OK");
        }
    }
    let promoted = redis.wait_replica_promoted().await;
    assert_eq!(redis.master_url().await, redis.url(redis.replica_port));
    // From when only the new master can admit: the old one is dead, or demoted (a
    // replica refuses writes). Until Sentinel demotes a live old master, a client may
    // still write to it, and those writes are lost in its resync.
    let (settled_at, left) = match how {
        Failover::Kill => (failed_at + promoted, String::new()),
        Failover::Handover => {
            let left = assert_left_before_demotion(redis).await - failed_at;
            redis.wait_role(redis.primary_port, "slave").await;
            let left = format!(
                "; the server left the old primary at {:.1} s",
                left.as_secs_f64()
            );
            (Instant::now(), left)
        }
    };
    let steady = shoppers
        .wait_for_admissions(STEADY, |p| p.sent > settled_at)
        .await;
    let presses = shoppers.stop().await;

    // (After a handover the old primary admits until the server leaves it.)
    let first = presses
        .iter()
        .filter(|p| p.sent > failed_at && p.status == Some(StatusCode::ACCEPTED))
        .map(|p| p.answered - failed_at)
        .min()
        .expect("a 202 after the failover");
    assert_only_admitted_or_refused(&presses);
    assert_stock_read_from(redis, base, voucher).await;
    let after: Vec<i64> = presses
        .iter()
        .filter(|p| p.sent > settled_at)
        .filter_map(|p| p.order)
        .collect();
    assert_persisted(db, voucher, &after).await;
    let refused = presses
        .iter()
        .filter(|p| p.status == Some(StatusCode::SERVICE_UNAVAILABLE))
        .count();
    format!(
        "sentinels agreed on the replica {:.1} s after the failover began; first 202 after \
         it {:.1} s{left}; only the new master could admit from {:.1} s; {STEADY} in a row \
         by {:.1} s; {} grabs, {refused} refused (503)",
        promoted.as_secs_f64(),
        first.as_secs_f64(),
        (settled_at - failed_at).as_secs_f64(),
        (steady - failed_at).as_secs_f64(),
        presses.len()
    )
}

/// The server closes its connections to the old primary while that still says it is
/// the master: it follows what the sentinels say, not only errors (the demotion, seconds
/// later, would otherwise be the first error it sees).
async fn assert_left_before_demotion(redis: &PrivateSentinel) -> Instant {
    let port = redis.primary_port;
    let deadline = Instant::now() + RECOVERY;
    loop {
        let left = redis.unnamed_clients(port).await == Some(0);
        // Read after the count: a demotion (which closes every client) came after it.
        let master = redis.role(port).await.as_deref() == Some("master");
        assert!(
            master,
            "Sentinel demoted the old primary before the server left it"
        );
        if left {
            return Instant::now();
        }
        assert!(
            Instant::now() < deadline,
            "the server stayed on the old primary"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every grab was answered, 202 or 503: a failover never shows as a 5xx of another kind
/// or a dropped connection.
fn assert_only_admitted_or_refused(presses: &[Press]) {
    for p in presses {
        assert!(
            matches!(
                p.status,
                Some(StatusCode::ACCEPTED | StatusCode::SERVICE_UNAVAILABLE)
            ),
            "user {}: {:?} {}",
            p.user,
            p.status,
            p.body
        );
    }
}

/// The server's stock (not Postgres's fallback) is the new master's.
async fn assert_stock_read_from(redis: &PrivateSentinel, base: &str, voucher: i64) {
    let resp = reqwest::get(format!("{base}/vouchers/{voucher}"))
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert!(
        resp.headers().get("x-seckill-fallback").is_none(),
        "stock read from Redis"
    );
    let shown = resp.json::<Value>().await.unwrap()["seckill"]["stock"]
        .as_i64()
        .unwrap();
    let key = seckill::keys::Keys::new("").unwrap().voucher(vid(voucher));
    let cmd = redis::cmd("HGET").arg(key).arg("stock").clone();
    let master: i64 = redis.query(redis.replica_port, &cmd).await.unwrap();
    assert_eq!(shown, master, "the stock shown is the new master's");
    assert!(shown < STOCK);
}

/// Waits (bounded) until Postgres holds every one of `orders`.
async fn assert_persisted(db: &PgPool, voucher: i64, orders: &[i64]) {
    assert!(!orders.is_empty());
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let stored: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM voucher_orders WHERE voucher_id = $1 AND id = ANY($2)",
        )
        .bind(voucher)
        .bind(orders)
        .fetch_one(db)
        .await
        .unwrap();
        if stored == orders.len() as i64 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{stored} of the {} orders admitted after the failover reached Postgres",
            orders.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One grab: when it was sent and answered, and what came back.
#[derive(Debug, Clone)]
struct Press {
    user: i64,
    sent: Instant,
    answered: Instant,
    status: Option<StatusCode>,
    body: Value,
    order: Option<i64>,
}

/// Shoppers pressing "grab" one after another on `lanes` lanes, each press a new user,
/// until stopped (or for three minutes at most).
struct Shoppers {
    presses: Arc<Mutex<Vec<Press>>>,
    stop: Arc<AtomicBool>,
    lanes: Vec<tokio::task::JoinHandle<()>>,
}

impl Shoppers {
    fn start(base: &str, voucher: i64, lanes: i64) -> Self {
        let presses = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let lanes = (0..lanes)
            .map(|lane| {
                let (presses, stop) = (presses.clone(), stop.clone());
                let url = format!("{base}/vouchers/{voucher}/seckill");
                tokio::spawn(press_until_stopped(url, lane, presses, stop))
            })
            .collect();
        Self {
            presses,
            stop,
            lanes,
        }
    }

    /// Waits until `n` grabs in a row (by sending time, among those `counted`) were
    /// admitted; when the last of them was answered.
    async fn wait_for_admissions(&self, n: usize, counted: impl Fn(&Press) -> bool) -> Instant {
        let deadline = Instant::now() + RECOVERY;
        loop {
            let mut presses: Vec<Press> = self.presses.lock().unwrap().clone();
            presses.retain(&counted);
            presses.sort_by_key(|p| p.sent);
            let mut run = 0;
            for p in &presses {
                run = if p.status == Some(StatusCode::ACCEPTED) {
                    run + 1
                } else {
                    0
                };
                if run == n {
                    return p.answered;
                }
            }
            assert!(
                Instant::now() < deadline,
                "no {n} grabs in a row admitted within {RECOVERY:?}: {:?}",
                presses.iter().rev().take(5).collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn stop(self) -> Vec<Press> {
        self.stop.store(true, Ordering::SeqCst);
        for lane in self.lanes {
            lane.await.unwrap();
        }
        Arc::try_unwrap(self.presses).unwrap().into_inner().unwrap()
    }
}

async fn press_until_stopped(
    url: String,
    lane: i64,
    presses: Arc<Mutex<Vec<Press>>>,
    stop: Arc<AtomicBool>,
) {
    let jwt = JwtKeys::new(crate::common::SECRET).unwrap();
    let http = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut user = 1_000_000 * (lane + 1);
    while !stop.load(Ordering::SeqCst) && Instant::now() < deadline {
        user += 1;
        let sent = Instant::now();
        let resp = http
            .post(&url)
            .bearer_auth(jwt.mint(user, false, 600).unwrap())
            .timeout(Duration::from_secs(30))
            .send()
            .await;
        let (status, body) = match resp {
            Ok(r) => (
                Some(r.status()),
                r.json::<Value>().await.unwrap_or(Value::Null),
            ),
            Err(e) => (None, Value::String(e.to_string())),
        };
        let order = body["order_id"].as_str().and_then(|id| id.parse().ok());
        if status != Some(StatusCode::ACCEPTED) {
            // Refused: a pause, as a shopper's retry would have.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        presses.lock().unwrap().push(Press {
            user,
            sent,
            answered: Instant::now(),
            status,
            body,
            order,
        });
    }
}
