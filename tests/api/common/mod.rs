//! Test harness: the real app on a loopback port, against the real Postgres (a fresh
//! database per test, from `#[sqlx::test]`) and the real Redis under a key prefix of
//! the test's own, deleted when the test ends.

pub mod browser;
pub mod cluster;
pub mod faults;
pub mod sentinel;
pub mod tls;

mod processes;
mod requests;
mod spawn;
mod stores;
pub use requests::notification;

use std::time::Duration;

use chrono::{DateTime, Utc};
use reqwest::StatusCode;
use serde_json::{json, Value};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use seckill::auth::JwtKeys;
use seckill::config::{ApiArgs, DatabaseArgs, JwtArgs, RedisArgs, ServerArgs, Settings};
use seckill::domain::{OrderId, UserId, VoucherId};
use seckill::keys::Keys;
use seckill::redis_conn::{self, RedisConn};
use seckill::startup::Application;
use seckill::worker::{BatchReport, Worker, WorkerConfig};
use seckill::AppState;

pub const SECRET: &str = "integration-test-secret";
/// What the stand-in payment provider signs its notifications with.
pub const PAYMENT_SECRET: &str = "integration-test-payment-secret";

/// Opens a sale of `stock` (now, for an hour) through the API at `base` (another
/// process's, say) as an administrator signed with [`SECRET`]; its id.
pub async fn open_sale_at(http: &reqwest::Client, base: &str, stock: i64) -> i64 {
    let now = Utc::now();
    let admin = JwtKeys::new(SECRET).unwrap().mint(1, true, 600).unwrap();
    let resp = http
        .post(format!("{base}/vouchers"))
        .bearer_auth(admin)
        .json(&sale_body(
            stock,
            now - chrono::Duration::minutes(1),
            now + chrono::Duration::hours(1),
        ))
        .send()
        .await
        .unwrap();
    let status = resp.status();
    let voucher: Value = resp.json().await.unwrap();
    assert_eq!(status, StatusCode::CREATED, "{voucher}");
    voucher["id"].as_i64().unwrap()
}

/// A flash-sale voucher's body.
fn sale_body(stock: i64, begin: DateTime<Utc>, end: DateTime<Utc>) -> Value {
    json!({
        "shop_id": 1, "title": "50 off 100", "sub_title": "weekdays", "rules": "one per person",
        "pay_value": 5000, "actual_value": 10000,
        "seckill": {"stock": stock, "begin_time": begin, "end_time": end},
    })
}

/// A voucher id the tests hold as a JSON number.
pub fn vid(id: i64) -> VoucherId {
    VoucherId::new(id).expect("a positive voucher id")
}

/// A user id the tests hold as a number.
pub fn uid(id: i64) -> UserId {
    UserId::new(id).expect("a positive user id")
}

/// An order id the tests hold as a number.
pub fn oid(id: i64) -> OrderId {
    OrderId::new(id).expect("a positive order id")
}

/// A grab of `voucher` (a sale in one segment) by `user`, minted `order`, as the
/// admission call takes it.
pub fn grab_of(voucher: i64, user: i64, order: i64) -> seckill::admission::Grab {
    seckill::admission::Grab {
        voucher_id: vid(voucher),
        user_id: uid(user),
        order_id: oid(order),
        segment: 0,
        segments: 1,
    }
}

/// A live check for `persist_batch` that calls every entry still pending.
pub fn all_live(
    ids: Vec<OrderId>,
) -> futures::future::BoxFuture<'static, anyhow::Result<std::collections::HashSet<OrderId>>> {
    Box::pin(async move { Ok(ids.into_iter().collect()) })
}

/// Tokens signed with [`SECRET`] only, as every test but the JWKS ones runs.
pub fn hs256_only() -> JwtArgs {
    JwtArgs {
        jwt_secret: Some(SECRET.into()),
        ..JwtArgs::default()
    }
}

pub fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

pub struct TestApp {
    pub redis_url: String,
    pub base: String,
    /// The internal listener (`ADMIN_BIND`): metrics and the live view, no token.
    pub admin_base: String,
    pub db: PgPool,
    pub redis: RedisConn,
    pub keys: Keys,
    pub state: AppState,
    pub client: reqwest::Client,
    jwt: JwtKeys,
    cancel: CancellationToken,
}

impl Drop for TestApp {
    /// Leaves nothing behind in Redis: every key under the test's prefix goes.
    fn drop(&mut self) {
        self.cancel.cancel();
        let pattern = format!("{}*", self.keys.prefix());
        let Ok(client) = redis::Client::open(self.redis_url.as_str()) else {
            return;
        };
        // Bounded: the Redis may sit behind a proxy of this test's runtime, which a
        // blocking drop keeps from running.
        let Ok(mut conn) = client.get_connection_with_timeout(Duration::from_secs(2)) else {
            return;
        };
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(&pattern)
            .query(&mut conn)
            .unwrap_or_default();
        if !keys.is_empty() {
            let _: redis::RedisResult<()> = redis::cmd("DEL").arg(keys).query(&mut conn);
        }
    }
}

/// An administrator's token: what `/metrics` and the live view need on the API port.
pub fn admin_bearer() -> String {
    JwtKeys::new(SECRET).unwrap().mint(1, true, 3600).unwrap()
}

/// The `/metrics` page of the server at `base` (its API port: with an admin's token).
pub async fn metrics_at(http: &reqwest::Client, base: &str) -> String {
    let resp = http
        .get(format!("{base}/metrics"))
        .bearer_auth(admin_bearer())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    resp.text().await.unwrap()
}

/// The value of one series (`name{labels}` exactly as rendered) in a Prometheus text
/// exposition; `None` if absent. Counters with known labels exist at 0 from start-up, so
/// a test that an event was counted compares the value, not the presence.
pub fn metric_value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// Presses "grab" for each user against `base`, `concurrency` at a time. Returns each
/// user's status and body, or `None` where no answer came.
pub async fn press_all(
    app: &TestApp,
    base: &str,
    voucher: i64,
    users: impl IntoIterator<Item = i64>,
    concurrency: usize,
) -> Vec<(i64, Option<(StatusCode, Value)>)> {
    use futures::StreamExt;
    futures::stream::iter(users)
        .map(|user| {
            let req = app
                .client
                .post(format!("{base}/vouchers/{voucher}/seckill"))
                .bearer_auth(app.token(user))
                .timeout(Duration::from_secs(30));
            async move {
                let answer = match req.send().await {
                    Ok(resp) => {
                        let status = resp.status();
                        resp.json::<Value>().await.ok().map(|body| (status, body))
                    }
                    Err(_) => None,
                };
                (user, answer)
            }
        })
        .buffer_unordered(concurrency)
        .collect()
        .await
}
