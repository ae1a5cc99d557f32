//! Test harness: the real app on a loopback port, against the real Postgres (a fresh
//! database per test, from `#[sqlx::test]`) and the real Redis under a key prefix of
//! the test's own, deleted when the test ends.

pub mod browser;
pub mod cluster;
pub mod faults;
pub mod sentinel;
pub mod tls;

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
    pub db: PgPool,
    pub redis: RedisConn,
    pub keys: Keys,
    pub state: AppState,
    pub client: reqwest::Client,
    jwt: JwtKeys,
    cancel: CancellationToken,
}

impl TestApp {
    pub async fn spawn(db: PgPool) -> Self {
        Self::spawn_with(db, redis_url(), false).await
    }

    /// The app against the Redis at `redis_url`; with `upkeep`, the background duties
    /// of an API process run too (lease renewal, reloading sales after data loss).
    pub async fn spawn_with(db: PgPool, redis_url: String, upkeep: bool) -> Self {
        Self::spawn_full(db, redis_url, upkeep, Settings::default(), hs256_only()).await
    }

    /// The app with its own settings (limits, retention).
    pub async fn spawn_with_settings(db: PgPool, settings: Settings) -> Self {
        Self::spawn_full(db, redis_url(), false, settings, hs256_only()).await
    }

    /// The app against the Redis at `redis_url`, with its own settings (replicas to
    /// wait for, limits, retention).
    pub async fn spawn_on(db: PgPool, redis_url: String, settings: Settings) -> Self {
        Self::spawn_full(db, redis_url, true, settings, hs256_only()).await
    }

    /// The app verifying tokens as `jwt` says (JWKS, issuer, audience; [`SECRET`] or
    /// no secret at all). [`TestApp::token`] mints with [`SECRET`], without `iss`/`aud`.
    pub async fn spawn_with_jwt(db: PgPool, jwt: JwtArgs) -> Self {
        Self::spawn_full(db, redis_url(), false, Settings::default(), jwt).await
    }

    /// The app started the way `seckill api` starts it ([`Application::build`]), on a
    /// spare loopback port, in the test's database and a key prefix of its own.
    /// (`_upkeep`: the background duties always run, as in production.)
    async fn spawn_full(
        db: PgPool,
        redis_url: String,
        _upkeep: bool,
        settings: Settings,
        jwt: JwtArgs,
    ) -> Self {
        let prefix = format!("test{:016x}:", rand::random::<u64>());
        let keys = Keys::new(prefix.clone()).unwrap();
        let api = ApiArgs {
            database: DatabaseArgs {
                database_url: faults::database_url(&db, None).into(),
                database_max_connections: 16,
            },
            redis: RedisArgs {
                redis_url: redis_url.clone().into(),
                redis_cluster_urls: Vec::new(),
                redis_tls_ca_file: None,
                redis_key_prefix: prefix,
                stream_shards: 1,
                redis_sentinel_urls: Vec::new(),
                redis_sentinel_master: None,
                durability: seckill::config::DurabilityArgs {
                    redis_wait_replicas: settings.replicas.n,
                    redis_wait_timeout_ms: settings.replicas.timeout.as_millis() as u64,
                },
            },
            jwt,
            bind: "127.0.0.1:0".parse().unwrap(),
            skip_migrations: true,
            sale_state_retention_secs: settings.sale_state_retention.as_secs(),
            cors_allowed_origins: settings.cors_allowed_origins,
            live_max_viewers: seckill::config::defaults::LIVE_MAX_VIEWERS,
            live_max_sales: seckill::config::defaults::LIVE_MAX_SALES,
            limits: settings.limits,
            server: ServerArgs::default(),
            edge: settings.edge,
        };
        let cancel = CancellationToken::new();
        let app = Application::build(api, None, cancel.clone()).await.unwrap();
        let addr = app.local_addr().unwrap();
        let state = app.state().clone();
        tokio::spawn(app.run());
        let redis = redis_conn::connect(&redis_url, redis_conn::COMMAND_TIMEOUT).unwrap();
        Self {
            redis_url,
            base: format!("http://{addr}"),
            db,
            redis,
            keys,
            state,
            client: reqwest::Client::builder()
                .pool_max_idle_per_host(2000)
                .build()
                .unwrap(),
            jwt: JwtKeys::new(SECRET).unwrap(),
            cancel,
        }
    }

    pub fn token(&self, user_id: i64) -> String {
        self.jwt.mint(user_id, false, 3600).unwrap()
    }

    pub fn admin_token(&self) -> String {
        self.jwt.mint(1, true, 3600).unwrap()
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    /// Sends a request and returns the status and the JSON body (`Null` if none).
    pub async fn send(&self, req: reqwest::RequestBuilder) -> (StatusCode, Value) {
        let resp = req.send().await.expect("request failed");
        let status = resp.status();
        let text = resp.text().await.unwrap();
        let body = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}"))
        };
        (status, body)
    }

    pub async fn get(&self, path: &str, token: Option<&str>) -> (StatusCode, Value) {
        let mut req = self.client.get(self.url(path));
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        self.send(req).await
    }

    pub async fn post_json(
        &self,
        path: &str,
        token: Option<&str>,
        body: &Value,
    ) -> (StatusCode, Value) {
        let mut req = self.client.post(self.url(path)).json(body);
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        self.send(req).await
    }

    /// Creates a flash-sale voucher through the API and returns its id.
    pub async fn create_sale(&self, stock: i64, begin: DateTime<Utc>, end: DateTime<Utc>) -> i64 {
        let body = sale_body(stock, begin, end);
        let (status, voucher) = self
            .post_json("/vouchers", Some(&self.admin_token()), &body)
            .await;
        assert_eq!(status, StatusCode::CREATED, "{voucher}");
        voucher["id"].as_i64().unwrap()
    }

    /// A sale open now and for the next hour, whose orders must be paid within
    /// `pay_within_secs` of admission.
    pub async fn open_sale_paying(&self, stock: i64, pay_within_secs: i64) -> i64 {
        let now = Utc::now();
        let body = json!({
            "shop_id": 1, "title": "50 off 100", "pay_value": 5000, "actual_value": 10000,
            "seckill": {"stock": stock, "begin_time": now - chrono::Duration::minutes(1),
                        "end_time": now + chrono::Duration::hours(1),
                        "pay_within_secs": pay_within_secs},
        });
        let (status, voucher) = self
            .post_json("/vouchers", Some(&self.admin_token()), &body)
            .await;
        assert_eq!(status, StatusCode::CREATED, "{voucher}");
        assert_eq!(voucher["seckill"]["pay_within_secs"], pay_within_secs);
        voucher["id"].as_i64().unwrap()
    }

    /// `POST /orders/{id}/{action}` (`pay` or `cancel`) as `token`, with an optional
    /// JSON body; returns the status, the `Retry-After` header and the JSON body.
    pub async fn order_action(
        &self,
        order_id: &str,
        action: &str,
        token: &str,
        body: Option<&Value>,
    ) -> (StatusCode, Option<String>, Value) {
        let mut req = self
            .client
            .post(self.url(&format!("/orders/{order_id}/{action}")))
            .bearer_auth(token);
        if let Some(body) = body {
            req = req.json(body);
        }
        let resp = req.send().await.expect("request failed");
        let status = resp.status();
        let retry_after = resp
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap().to_string());
        let text = resp.text().await.unwrap();
        let body = serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}"));
        (status, retry_after, body)
    }

    /// Pays the order as user `user_id`.
    pub async fn pay(&self, order_id: &str, user_id: i64) -> (StatusCode, Value) {
        let (status, _, body) = self
            .order_action(order_id, "pay", &self.token(user_id), None)
            .await;
        (status, body)
    }

    /// Cancels the order as user `user_id`.
    pub async fn cancel(&self, order_id: &str, user_id: i64) -> (StatusCode, Value) {
        let (status, _, body) = self
            .order_action(order_id, "cancel", &self.token(user_id), None)
            .await;
        (status, body)
    }

    /// An order's status in Postgres (`None`: not written).
    pub async fn pg_status(&self, order_id: &str) -> Option<String> {
        sqlx::query_scalar("SELECT status FROM voucher_orders WHERE id = $1")
            .bind(order_id.parse::<i64>().unwrap())
            .fetch_optional(&self.db)
            .await
            .unwrap()
    }

    /// Orders of the voucher per status in Postgres.
    /// The sale's orders by status, counted; and checked against the counts its row
    /// keeps for the live view (paid, cancelled, expired, and created as initial stock
    /// less stock less paid), which every transition must keep equal.
    pub async fn pg_statuses(&self, voucher_id: i64) -> std::collections::BTreeMap<String, i64> {
        // One statement, so one snapshot even while orders move.
        let (counted, kept): (sqlx::types::Json<std::collections::BTreeMap<String, i64>>, Vec<i64>) =
            sqlx::query_as(
                "SELECT coalesce((SELECT jsonb_object_agg(status, n) FROM (SELECT status, count(*) AS n \
                     FROM voucher_orders WHERE voucher_id = $1 GROUP BY status) c), '{}'), \
                 ARRAY[(initial_stock - stock - paid)::int8, paid, cancelled, expired] \
                 FROM seckill_vouchers WHERE voucher_id = $1",
            )
            .bind(voucher_id)
            .fetch_one(&self.db)
            .await
            .unwrap();
        let counted = counted.0;
        let of = |status: &str| counted.get(status).copied().unwrap_or(0);
        assert_eq!(
            kept,
            [of("created"), of("paid"), of("cancelled"), of("expired")],
            "the sale row's counts (created, paid, cancelled, expired) against its orders"
        );
        counted
    }

    /// Releases still owed to Redis.
    pub async fn owed_releases(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM stock_releases")
            .fetch_one(&self.db)
            .await
            .unwrap()
    }

    /// The `/metrics` page.
    pub async fn metrics_text(&self) -> String {
        metrics_at(&self.client, &self.base).await
    }

    /// A worker named `consumer` reads a batch of `shard`, commits it, and dies before
    /// XACK: its entries stay pending. Returns the orders committed.
    pub async fn commit_without_ack(
        &self,
        consumer: &str,
        shard: seckill::keys::Shard,
    ) -> Vec<seckill::store::orders::NewOrder> {
        use seckill::stream::{Entry, ReadFrom};
        let dying = self.worker_named(consumer);
        dying.ensure_groups().await.unwrap();
        let batch = dying
            .read_batch(shard, ReadFrom::New { block_ms: 1 })
            .await
            .unwrap();
        let orders: Vec<_> = batch
            .iter()
            .map(|e| match e {
                Entry::Order { order, .. } => *order,
                other => panic!("unexpected {other:?}"),
            })
            .collect();
        seckill::store::orders::persist_batch(&self.db, &orders, &all_live)
            .await
            .unwrap();
        orders
    }

    /// One pass of the expiry sweeper, in this process.
    pub async fn sweep(&self) -> seckill::lifecycle::sweeper::SweepReport {
        let mut conn = self.redis.clone();
        seckill::lifecycle::sweeper::sweep_once(
            &self.db,
            &mut conn,
            &self.keys,
            100,
            seckill::scripts::Replicas::NONE,
        )
        .await
        .unwrap()
    }

    /// Runs `seckill <args>` against the test's database and key space; returns the
    /// exit code and standard output.
    pub fn cli(&self, args: &[&str]) -> (i32, String) {
        let out = self.cli_command(args).output().unwrap();
        Self::cli_output(args, out)
    }

    /// [`TestApp::cli`] with more environment (Sentinel, say), without blocking the
    /// test's runtime (whose tasks, a proxy say, the command may need).
    pub async fn cli_async(&self, args: &[&str], env: &[(&str, String)]) -> (i32, String) {
        let mut cmd = self.cli_command(args);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let out = tokio::process::Command::from(cmd).output().await.unwrap();
        Self::cli_output(args, out)
    }

    fn cli_command(&self, args: &[&str]) -> std::process::Command {
        let mut cmd = std::process::Command::new(faults::BIN);
        cmd.args(args)
            .env("DATABASE_URL", faults::database_url(&self.db, None))
            .env("REDIS_URL", &self.redis_url)
            .env("REDIS_KEY_PREFIX", self.keys.prefix())
            .env("RUST_LOG", "warn");
        cmd
    }

    fn cli_output(args: &[&str], out: std::process::Output) -> (i32, String) {
        let stdout = String::from_utf8(out.stdout).unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        println!("$ seckill {}\n{stdout}{stderr}", args.join(" "));
        (out.status.code().unwrap(), stdout)
    }

    /// A sale that is open now and for the next hour.
    pub async fn open_sale(&self, stock: i64) -> i64 {
        let now = Utc::now();
        self.create_sale(
            stock,
            now - chrono::Duration::minutes(1),
            now + chrono::Duration::hours(1),
        )
        .await
    }

    pub async fn grab(&self, voucher_id: i64, user_id: i64) -> (StatusCode, Value) {
        let req = self
            .client
            .post(self.url(&format!("/vouchers/{voucher_id}/seckill")))
            .bearer_auth(self.token(user_id));
        self.send(req).await
    }

    pub fn worker_named(&self, consumer: &str) -> Worker {
        self.worker_on(self.db.clone(), consumer)
    }

    /// A worker writing through `db` (say, a pool behind a proxy).
    pub fn worker_on(&self, db: PgPool, consumer: &str) -> Worker {
        let conn = redis_conn::connect(&self.redis_url, Duration::from_secs(5)).unwrap();
        Worker::new(
            db,
            conn,
            self.keys.clone(),
            WorkerConfig {
                consumer: consumer.into(),
                batch_size: 64,
                block: Duration::from_millis(50),
                claim_idle: Duration::from_millis(200),
                max_deliveries: 3,
                trim_every: Duration::from_millis(100),
                replicas: seckill::scripts::Replicas::NONE,
            },
        )
    }

    pub fn worker(&self) -> Worker {
        self.worker_named(&WorkerConfig::unique_consumer_name())
    }

    /// Runs a worker until the stream is empty.
    pub async fn drain(&self) -> BatchReport {
        self.worker().drain().await.unwrap()
    }

    pub async fn pg_stock(&self, voucher_id: i64) -> i32 {
        sqlx::query_scalar("SELECT stock FROM seckill_vouchers WHERE voucher_id = $1")
            .bind(voucher_id)
            .fetch_one(&self.db)
            .await
            .unwrap()
    }

    /// `(order id, user id)` of the voucher's active (created or paid) orders.
    pub async fn pg_orders(&self, voucher_id: i64) -> Vec<(i64, i64)> {
        sqlx::query_as(
            "SELECT id, user_id FROM voucher_orders \
             WHERE voucher_id = $1 AND status IN ('created', 'paid') ORDER BY id",
        )
        .bind(voucher_id)
        .fetch_all(&self.db)
        .await
        .unwrap()
    }

    /// Redis's live stock of a sale (`None`: not loaded), read as the API reads it.
    pub async fn redis_stock(&self, voucher_id: i64) -> Option<i64> {
        seckill::admission::redis_stock(&mut self.redis.clone(), &self.keys, vid(voucher_id))
            .await
            .unwrap()
    }

    /// Starts `seckill <subcommand>` on a spare port, in this app's database and key
    /// space, and waits until it is ready. Returns the process and its base URL.
    pub async fn spawn_server(
        &self,
        subcommand: &str,
        env: &[(&str, String)],
    ) -> (faults::Process, String) {
        let port = faults::free_port();
        let mut env = env.to_vec();
        env.push(("BIND", format!("127.0.0.1:{port}")));
        let process = faults::Process::spawn(
            subcommand,
            &self.redis_url,
            self.keys.prefix(),
            &faults::database_url(&self.db, None),
            &env,
        );
        let base = format!("http://127.0.0.1:{port}");
        faults::wait_ready(&base).await;
        (process, base)
    }

    pub async fn redis_cmd<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> T {
        cmd.query_async(&mut self.redis.clone()).await.unwrap()
    }

    /// Every order of the voucher in Postgres, asserting the invariants that must hold
    /// after any fault: no user twice, and stock = initial - orders.
    pub async fn assert_consistent(
        &self,
        voucher_id: i64,
        initial: i64,
    ) -> std::collections::HashSet<i64> {
        let orders = self.pg_orders(voucher_id).await;
        let users: std::collections::HashSet<i64> = orders.iter().map(|(_, u)| *u).collect();
        assert_eq!(users.len(), orders.len(), "a user holds two orders");
        assert!(
            orders.len() as i64 <= initial,
            "oversold: {} orders for {initial}",
            orders.len()
        );
        assert_eq!(
            self.pg_stock(voucher_id).await as i64,
            initial - orders.len() as i64,
            "postgres stock = initial - orders"
        );
        orders.into_iter().map(|(id, _)| id).collect()
    }

    /// Waits (bounded) until Postgres holds `n` orders of the voucher.
    pub async fn wait_for_orders(&self, voucher_id: i64, n: usize, limit: Duration) -> usize {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let have = self.pg_orders(voucher_id).await.len();
            if have >= n || tokio::time::Instant::now() > deadline {
                return have;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Entries of the group not yet acknowledged.
    pub async fn pending_count(&self) -> i64 {
        let stream = self.keys.stream(seckill::keys::Shard(0));
        let reply: redis::Value = self
            .redis_cmd(
                redis::cmd("XPENDING")
                    .arg(stream)
                    .arg(seckill::stream::GROUP),
            )
            .await;
        match reply {
            redis::Value::Array(parts) => redis::from_redis_value_ref(&parts[0]).unwrap(),
            other => panic!("unexpected XPENDING reply {other:?}"),
        }
    }
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

/// The `/metrics` page of the server at `base`.
pub async fn metrics_at(http: &reqwest::Client, base: &str) -> String {
    let resp = http.get(format!("{base}/metrics")).send().await.unwrap();
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
