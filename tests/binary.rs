//! The real binary: `seckill serve` migrates, serves, persists orders through its own
//! worker and shuts down cleanly on SIGTERM; `seckill token` mints usable tokens.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{json, Value};
use sqlx::PgPool;

const BIN: &str = env!("CARGO_BIN_EXE_seckill");

/// The URL of the test's own database (`DATABASE_URL` names the server).
fn database_url(db: &PgPool) -> String {
    let base = std::env::var("DATABASE_URL").expect("DATABASE_URL");
    let name = db.connect_options().get_database().unwrap().to_string();
    let (without_query, query) = base
        .split_once('?')
        .map_or((base.as_str(), None), |(a, b)| (a, Some(b)));
    let scheme_end = without_query.find("://").unwrap() + 3;
    let server = match without_query[scheme_end..].find('/') {
        Some(slash) => &without_query[..scheme_end + slash],
        None => without_query,
    };
    match query {
        Some(q) => format!("{server}/{name}?{q}"),
        None => format!("{server}/{name}"),
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Server {
    child: std::process::Child,
    base: String,
    prefix: String,
}

impl Server {
    fn start(db: &PgPool) -> Self {
        let port = free_port();
        let prefix = format!("bin{:016x}:", rand::random::<u64>());
        let child = Command::new(BIN)
            .arg("serve")
            .env("DATABASE_URL", database_url(db))
            .env("REDIS_URL", common::redis_url())
            .env("REDIS_KEY_PREFIX", &prefix)
            .env("JWT_SECRET", common::SECRET)
            .env("BIND", format!("127.0.0.1:{port}"))
            .env("WORKER_BLOCK_MS", "200")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        Self {
            child,
            base: format!("http://127.0.0.1:{port}"),
            prefix,
        }
    }

    fn token(&self, user: i64, admin: bool) -> String {
        let mut cmd = Command::new(BIN);
        cmd.args(["token", "--user", &user.to_string()])
            .env("JWT_SECRET", common::SECRET);
        if admin {
            cmd.arg("--admin");
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success());
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    }

    fn sigterm(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Ok(mut conn) =
            redis::Client::open(common::redis_url()).and_then(|c| c.get_connection())
        {
            let keys: Vec<String> = redis::cmd("KEYS")
                .arg(format!("{}*", self.prefix))
                .query(&mut conn)
                .unwrap_or_default();
            if !keys.is_empty() {
                let _: redis::RedisResult<()> = redis::cmd("DEL").arg(keys).query(&mut conn);
            }
        }
    }
}

async fn wait_ready(http: &reqwest::Client, base: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if let Ok(r) = http.get(format!("{base}/readyz")).send().await {
            if r.status() == StatusCode::OK {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("server never became ready");
}

#[sqlx::test(migrations = false)]
async fn the_serve_binary_runs_a_sale_end_to_end_and_stops_on_sigterm(db: PgPool) {
    let server = Server::start(&db);
    let http = reqwest::Client::new();
    wait_ready(&http, &server.base).await;

    let now = chrono::Utc::now();
    let created: Value = http
        .post(format!("{}/vouchers", server.base))
        .bearer_auth(server.token(1, true))
        .json(&json!({"shop_id": 1, "title": "50 off 100", "pay_value": 5000, "actual_value": 10000,
            "seckill": {"stock": 2, "begin_time": now - chrono::Duration::minutes(1), "end_time": now + chrono::Duration::hours(1)}}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let voucher = created["id"].as_i64().expect("voucher created");

    let mut winners = Vec::new();
    for user in [10, 11, 12] {
        let resp = http
            .post(format!("{}/vouchers/{voucher}/seckill", server.base))
            .bearer_auth(server.token(user, false))
            .send()
            .await
            .unwrap();
        let status = resp.status();
        let body: Value = resp.json().await.unwrap();
        if user == 12 {
            assert_eq!(
                (status, body["error"]["code"].as_str()),
                (StatusCode::CONFLICT, Some("sold_out"))
            );
        } else {
            assert_eq!(status, StatusCode::ACCEPTED, "{body}");
            winners.push((user, body["order_id"].as_str().unwrap().to_string()));
        }
    }

    // The in-process worker writes both orders.
    for (user, id) in &winners {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let order: Value = http
                .get(format!("{}/orders/{id}", server.base))
                .bearer_auth(server.token(*user, false))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            if order["status"] == "created" {
                break;
            }
            assert_eq!(order["status"], "pending");
            assert!(Instant::now() < deadline, "order {id} never persisted");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let stock: i32 = sqlx::query_scalar("SELECT stock FROM seckill_vouchers WHERE voucher_id = $1")
        .bind(voucher)
        .fetch_one(&db)
        .await
        .unwrap();
    assert_eq!(stock, 0);

    let mut server = server;
    let started = Instant::now();
    server.sigterm();
    let status = loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            break status;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no exit within 10 s of SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(status.code(), Some(0));
}

#[test]
fn serve_refuses_to_start_without_a_jwt_secret() {
    let out = Command::new(BIN)
        .arg("serve")
        .env_remove("JWT_SECRET")
        .env("DATABASE_URL", "postgres://127.0.0.1:1/none")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("JWT_SECRET"));
}
