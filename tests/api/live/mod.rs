//! The live view: `/live/events` snapshots while a sale sells, the same numbers from
//! every instance, one producer however many pages watch, and the page itself in a real
//! (headless) Chromium.

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::Value;
use sqlx::PgPool;

use crate::common::browser::Browser;
use crate::common::{vid, TestApp};
use seckill::admission::Outcome;

mod browser;
mod flush;
mod limits;
mod stream;

/// An open `/live/events` stream, read event by event.
pub(crate) struct Events {
    response: reqwest::Response,
    buffer: String,
}

impl Events {
    pub(crate) async fn open(client: &reqwest::Client, base: &str) -> Self {
        let response = client
            .get(format!("{base}/live/events"))
            .bearer_auth(crate::common::admin_bearer())
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(
            response.headers()["content-type"],
            "text/event-stream",
            "an event stream"
        );
        Self {
            response,
            buffer: String::new(),
        }
    }

    /// The next snapshot (at most `limit` away).
    async fn next(&mut self, limit: Duration) -> Value {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            if let Some(end) = self.buffer.find("\n\n") {
                let event: String = self.buffer.drain(..end + 2).collect();
                let data: Vec<&str> = event
                    .lines()
                    .filter_map(|l| l.strip_prefix("data: "))
                    .collect();
                if event.lines().any(|l| l == "event: snapshot") {
                    return serde_json::from_str(&data.join("\n")).unwrap();
                }
                continue;
            }
            let chunk = tokio::time::timeout_at(deadline, self.response.chunk())
                .await
                .unwrap_or_else(|_| panic!("no snapshot within {limit:?}"))
                .unwrap()
                .expect("the stream stays open");
            self.buffer.push_str(std::str::from_utf8(&chunk).unwrap());
        }
    }

    /// Snapshots until `sale`'s view satisfies `done` (at most `limit`); that view.
    pub(crate) async fn until(
        &mut self,
        sale: i64,
        limit: Duration,
        done: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = Instant::now() + limit;
        let mut last = Value::Null;
        while Instant::now() < deadline {
            let snapshot = self.next(limit).await;
            if let Some(view) = sale_in(&snapshot, sale) {
                if done(view) {
                    return view.clone();
                }
                last = view.clone();
            }
        }
        panic!("sale {sale} never reached the expected figures within {limit:?}; last {last}");
    }
}

fn sale_in(snapshot: &Value, id: i64) -> Option<&Value> {
    snapshot["sales"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["id"] == id)
}

const WAIT: Duration = Duration::from_secs(20);

/// `name`'s value in a Prometheus text exposition (no labels); 0 when absent.
fn metric(text: &str, name: &str) -> f64 {
    crate::common::metric_value(text, name).unwrap_or(0.0)
}

/// An admission, as the tally counts it (whatever its order id).
fn admitted() -> Outcome {
    Outcome::Admitted {
        order_id: seckill::domain::OrderId::new(1).unwrap(),
    }
}

/// One process's grab counts and their flushes, under a key prefix of the test's own.
struct Counter {
    tally: seckill::admission::tally::Tally,
    conn: seckill::redis_conn::RedisConn,
    keys: seckill::keys::Keys,
    /// A connection of its own, for what the test does to Redis and reads back.
    admin: redis::aio::MultiplexedConnection,
    url: String,
}

impl Counter {
    async fn new(url: &str) -> Self {
        let conn = seckill::redis_conn::connect(url, seckill::redis_conn::COMMAND_TIMEOUT).unwrap();
        let prefix = format!("test{:016x}:", rand::random::<u64>());
        let admin = redis::Client::open(url)
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        Self {
            tally: Default::default(),
            conn,
            keys: seckill::keys::Keys::new(prefix).unwrap(),
            admin,
            url: url.to_string(),
        }
    }

    fn add(&self, voucher: i64, outcome: Outcome, n: usize) {
        for _ in 0..n {
            self.tally.add(vid(voucher), &outcome);
        }
    }

    async fn flush(&self) -> redis::RedisResult<()> {
        self.tally.flush(&self.conn, &self.keys).await
    }

    async fn cmd<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> T {
        cmd.query_async(&mut self.admin.clone()).await.unwrap()
    }

    /// `voucher`'s count of `outcome` in Redis.
    async fn count(&self, voucher: i64, outcome: &str) -> Option<u64> {
        self.cmd(
            redis::cmd("HGET")
                .arg(self.keys.live_counts(vid(voucher)))
                .arg(outcome),
        )
        .await
    }
}

impl Drop for Counter {
    /// Leaves nothing behind in Redis: every key under the test's prefix goes.
    fn drop(&mut self) {
        let Ok(mut conn) = redis::Client::open(self.url.as_str()).and_then(|c| c.get_connection())
        else {
            return;
        };
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{}*", self.keys.prefix()))
            .query(&mut conn)
            .unwrap_or_default();
        if !keys.is_empty() {
            let _: redis::RedisResult<()> = redis::cmd("DEL").arg(keys).query(&mut conn);
        }
    }
}

/// `seckill api` on a spare port with `env`, its standard error captured (read on a
/// thread, so that a chatty log never blocks it): the process, its base URL, and the
/// log, complete once the process has exited.
async fn spawn_logged(
    app: &TestApp,
    env: &[(&str, String)],
) -> (
    crate::common::faults::Process,
    String,
    std::thread::JoinHandle<String>,
) {
    use crate::common::faults;
    use std::io::Read;
    let port = faults::free_port();
    let mut child = std::process::Command::new(faults::BIN)
        .arg("api")
        .env("DATABASE_URL", faults::database_url(&app.db, None))
        .env("REDIS_URL", &app.redis_url)
        .env("REDIS_KEY_PREFIX", app.keys.prefix())
        .env("JWT_SECRET", crate::common::SECRET)
        .env("BIND", format!("127.0.0.1:{port}"))
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let log = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let base = format!("http://127.0.0.1:{port}");
    faults::wait_ready(&base).await;
    (faults::Process { child }, base, log)
}

/// `sale`'s id, whether it is sold out, and its state, of each sale in `snapshot`.
fn order_of(snapshot: &Value) -> Vec<(i64, bool, String)> {
    snapshot["sales"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["id"].as_i64().unwrap(),
                s["sold_out"]
                    .as_bool()
                    .unwrap_or_else(|| panic!("no sold_out: {s}")),
                s["state"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// Sales of one unit sold (the orders written, or one still in flight), a sale still
/// selling that ends last, an upcoming one and one just ended: `(sold and written, sold
/// in flight, selling, upcoming, ended)`.
async fn sales_mid_sale(app: &TestApp) -> (Vec<i64>, i64, i64, i64, i64) {
    use chrono::Duration as Minutes;
    let now = chrono::Utc::now();
    let mut sold = Vec::new();
    for i in 0..3 {
        let voucher = app
            .create_sale(1, now - Minutes::minutes(1), now + Minutes::minutes(10 + i))
            .await;
        let (status, body) = app.grab(voucher, 100 + i).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{body}");
        sold.push(voucher);
    }
    let ended = app
        .create_sale(5, now - Minutes::minutes(1), now + Minutes::minutes(30))
        .await;
    app.drain().await;
    sqlx::query(
        "UPDATE seckill_vouchers SET begin_time = now() - interval '10 minutes', \
         end_time = now() - interval '1 minute' WHERE voucher_id = $1",
    )
    .bind(ended)
    .execute(&app.db)
    .await
    .unwrap();
    // Sold out in Redis, its order not yet in Postgres (whose stock still counts it).
    let in_flight = app
        .create_sale(1, now - Minutes::minutes(1), now + Minutes::minutes(20))
        .await;
    let (status, body) = app.grab(in_flight, 200).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let selling = app
        .create_sale(50, now - Minutes::minutes(1), now + Minutes::hours(2))
        .await;
    let (status, body) = app.grab(selling, 300).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let upcoming = app
        .create_sale(5, now + Minutes::hours(1), now + Minutes::hours(3))
        .await;
    (sold, in_flight, selling, upcoming, ended)
}
