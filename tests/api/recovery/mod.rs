//! Recovery paths against the service's promise, with real processes and real races:
//! a shopper who got `202` with an order id holds that order (it ends in Postgres), no
//! more 202s than the stock, nobody holds two orders, Postgres stock = initial - orders,
//! and after the drain Redis's live stock equals Postgres's.
//!
//! The system is driven only from outside: HTTP, the `seckill` binary (`serve`, `api`,
//! `worker`, `reconcile`), SQL on the test's database and raw Redis commands.

use std::collections::HashMap;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::faults::{self, Process, BIN};
use crate::common::{press_all, vid, TestApp};
use reqwest::StatusCode;
use seckill::keys::{Keys, Shard};
use serde_json::Value;
use sqlx::{Connection, PgPool};

mod backlog;
mod durability;
mod eviction;
mod restore;
pub(crate) mod rollback;
mod sale_faults;
mod storms;
mod worker_faults;

// ---------------------------------------------------------------------------------------
// Helpers of this file.

/// Prints how long the test ran when it ends, passed or failed.
struct RunTime(Instant);

impl RunTime {
    fn start() -> Self {
        Self(Instant::now())
    }

    fn elapsed(&self) -> Duration {
        self.0.elapsed()
    }
}

impl Drop for RunTime {
    fn drop(&mut self) {
        println!("run time: {:.1} s", self.0.elapsed().as_secs_f64());
    }
}

/// One press by `user` against `base`.
async fn press(app: &TestApp, base: &str, voucher: i64, user: i64) -> (StatusCode, Value) {
    app.send(
        app.client
            .post(format!("{base}/vouchers/{voucher}/seckill"))
            .bearer_auth(app.token(user)),
    )
    .await
}

/// Whether an error answer names `order_id` as the caller's order.
fn names_order(body: &Value, order_id: i64) -> bool {
    body["error"]["order_id"].as_str() == Some(order_id.to_string().as_str())
}

fn order_id(body: &Value) -> i64 {
    body["order_id"]
        .as_str()
        .unwrap_or_else(|| panic!("no order id in {body}"))
        .parse()
        .unwrap()
}

/// The order ids of the 202 answers, by user; panics on any 5xx but 503 (a sale
/// being reloaded).
fn admitted(results: &[(i64, Option<(StatusCode, Value)>)]) -> HashMap<i64, i64> {
    let mut ids = HashMap::new();
    for (user, answer) in results {
        if let Some((status, body)) = answer {
            assert!(
                !status.is_server_error() || *status == StatusCode::SERVICE_UNAVAILABLE,
                "user {user}: {status} {body}"
            );
            if *status == StatusCode::ACCEPTED {
                ids.insert(*user, order_id(body));
            }
        }
    }
    ids
}

/// Runs `seckill <args>` in the test's database and key space, off the async runtime
/// (the test's other futures keep running): exit code (`None`: killed after two
/// minutes), stdout, and how long it took.
async fn seckill_async(
    app: &TestApp,
    args: &[&str],
    env: &[(&str, String)],
) -> (Option<i32>, String, Duration) {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    let (db, redis_url, prefix) = (
        faults::database_url(&app.db, None),
        app.redis_url.clone(),
        app.keys.prefix().to_string(),
    );
    tokio::task::spawn_blocking(move || {
        let mut cmd = Command::new(BIN);
        cmd.args(&args)
            .env("DATABASE_URL", db)
            .env("REDIS_URL", redis_url)
            .env("REDIS_KEY_PREFIX", prefix);
        run_captured(cmd, &env)
    })
    .await
    .unwrap()
}

fn run_captured(mut cmd: Command, env: &[(String, String)]) -> (Option<i32>, String, Duration) {
    cmd.env("JWT_SECRET", crate::common::SECRET)
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let started = Instant::now();
    let mut child = cmd.spawn().unwrap();
    let stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let mut stdout = stdout;
        std::io::Read::read_to_string(&mut stdout, &mut s).ok();
        s
    });
    let deadline = started + Duration::from_secs(120);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let out = reader.join().unwrap();
    (status.and_then(|s| s.code()), out, started.elapsed())
}

/// Waits (bounded) until every shard's stream has nothing unacknowledged: nothing
/// pending in the group and nothing after its last delivered entry.
async fn wait_drained(app: &TestApp, keys: &Keys, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        let mut busy = false;
        for shard in keys.shards() {
            busy |= unacknowledged(app, keys.stream(shard)).await;
        }
        if !busy {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether the stream holds entries its consumer group has not acknowledged.
async fn unacknowledged(app: &TestApp, stream: &str) -> bool {
    let exists: i64 = app.redis_cmd(redis::cmd("EXISTS").arg(stream)).await;
    if exists == 0 {
        return false;
    }
    let groups: Vec<HashMap<String, redis::Value>> = app
        .redis_cmd(redis::cmd("XINFO").arg("GROUPS").arg(stream))
        .await;
    let group = groups.iter().find(|g| {
        g.get("name")
            .and_then(|v| redis::from_redis_value_ref::<String>(v).ok())
            .as_deref()
            == Some(seckill::stream::GROUP)
    });
    let Some(group) = group else {
        let len: i64 = app.redis_cmd(redis::cmd("XLEN").arg(stream)).await;
        return len > 0;
    };
    let pending: i64 = group
        .get("pending")
        .and_then(|v| redis::from_redis_value_ref(v).ok())
        .unwrap_or(0);
    if pending > 0 {
        return true;
    }
    let last: String = group
        .get("last-delivered-id")
        .and_then(|v| redis::from_redis_value_ref(v).ok())
        .unwrap_or_else(|| "0-0".into());
    let after: redis::Value = app
        .redis_cmd(
            redis::cmd("XRANGE")
                .arg(stream)
                .arg(format!("({last}"))
                .arg("+")
                .arg("COUNT")
                .arg(1),
        )
        .await;
    matches!(after, redis::Value::Array(a) if !a.is_empty())
}

/// How many orders of the voucher Postgres holds.
async fn pg_order_count(app: &TestApp, voucher: i64) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM voucher_orders WHERE voucher_id = $1")
        .bind(voucher)
        .fetch_one(&app.db)
        .await
        .unwrap()
}

/// Dead letters in every shard.
async fn dead_letters(app: &TestApp, keys: &Keys) -> i64 {
    let mut n = 0;
    for shard in keys.shards() {
        let len: i64 = app
            .redis_cmd(redis::cmd("XLEN").arg(keys.dead_letters(shard)))
            .await;
        n += len;
    }
    n
}

/// Waits (bounded) until the group of the first shard has `n` consumers.
async fn wait_for_consumers(app: &TestApp, n: usize, limit: Duration) -> usize {
    let stream = app.keys.stream(Shard(0)).to_string();
    let deadline = Instant::now() + limit;
    loop {
        let consumers: redis::RedisResult<Vec<redis::Value>> = redis::cmd("XINFO")
            .arg("CONSUMERS")
            .arg(&stream)
            .arg(seckill::stream::GROUP)
            .query_async(&mut app.redis.clone())
            .await;
        let have = consumers.map(|c| c.len()).unwrap_or(0);
        if have >= n || Instant::now() > deadline {
            return have;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// XADDs `count` well-formed orders of `voucher` to `stream`, users `first_user..`,
/// order ids `first_order..`, in pipelines of a thousand.
async fn xadd_orders(
    app: &TestApp,
    stream: &str,
    voucher: i64,
    first_user: i64,
    count: i64,
    first_order: i64,
) {
    let now_ms = chrono::Utc::now().timestamp_millis();
    let epoch = app.epoch(voucher).await;
    let mut conn = app.redis.clone();
    let mut i = 0;
    while i < count {
        let mut pipe = redis::pipe();
        for j in i..(i + 1000).min(count) {
            let xadd = pipe
                .cmd("XADD")
                .arg(stream)
                .arg("*")
                .arg("order_id")
                .arg(first_order + j)
                .arg("voucher_id")
                .arg(voucher)
                .arg("user_id")
                .arg(first_user + j)
                .arg("admitted_ms")
                .arg(now_ms);
            if let Some(epoch) = epoch {
                xadd.arg("epoch").arg(epoch.get());
            }
            xadd.ignore();
        }
        let _: () = pipe.query_async(&mut conn).await.unwrap();
        i += 1000;
    }
}

/// PINGs Redis in a loop on a thread and connection of its own, and keeps the worst
/// round trip.
struct PingProbe {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<(Duration, u64)>,
}

impl PingProbe {
    fn start(url: &str) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let mut conn = redis::Client::open(url).unwrap().get_connection().unwrap();
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut worst = Duration::ZERO;
            let mut pings = 0u64;
            let deadline = Instant::now() + Duration::from_secs(180);
            while !flag.load(Ordering::SeqCst) && Instant::now() < deadline {
                let t = Instant::now();
                let _: String = redis::cmd("PING").query(&mut conn).unwrap();
                worst = worst.max(t.elapsed());
                pings += 1;
                std::thread::sleep(Duration::from_millis(2));
            }
            (worst, pings)
        });
        Self { stop, thread }
    }

    fn stop(self) -> (Duration, u64) {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.join().unwrap()
    }
}
