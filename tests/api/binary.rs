//! The real binary: `seckill serve` migrates, serves, persists orders through its own
//! worker and shuts down cleanly on SIGTERM; `seckill token` mints usable tokens.

use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::faults::BIN;
use crate::common::TestApp;
use reqwest::StatusCode;
use serde_json::Value;
use sqlx::PgPool;

/// A token from `seckill token`.
fn token(user: i64, admin: bool) -> String {
    let mut cmd = Command::new(BIN);
    cmd.args(["token", "--user", &user.to_string()])
        .env("JWT_SECRET", crate::common::SECRET);
    if admin {
        cmd.arg("--admin");
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

#[sqlx::test(migrations = false)]
async fn the_serve_binary_runs_a_sale_end_to_end_and_stops_on_sigterm(db: PgPool) {
    // The binary applies the migrations itself; the app here only lends its key space
    // and helpers (spawning it touches no table).
    let app = TestApp::spawn(db.clone()).await;
    let (mut server, base) = app
        .spawn_server("serve", &[("WORKER_BLOCK_MS", "200".to_string())])
        .await;
    let http = reqwest::Client::new();

    let voucher = crate::common::open_sale_at(&http, &base, 2).await;

    let mut winners = Vec::new();
    for user in [10, 11, 12] {
        let resp = http
            .post(format!("{base}/vouchers/{voucher}/seckill"))
            .bearer_auth(token(user, false))
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
                .get(format!("{base}/orders/{id}"))
                .bearer_auth(token(*user, false))
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
    assert_eq!(app.pg_stock(voucher).await, 0);

    server.sigterm();
    let status = server.wait_exit(Duration::from_secs(10)).await;
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(0),
        "exit 0 within 10 s of SIGTERM"
    );
}

#[test]
fn serve_refuses_to_start_without_a_jwt_secret_or_a_jwks() {
    let out = Command::new(BIN)
        .arg("serve")
        .env_remove("JWT_SECRET")
        .env_remove("JWT_JWKS_URL")
        .env("DATABASE_URL", "postgres://127.0.0.1:1/none")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("JWT_SECRET") && stderr.contains("JWT_JWKS_URL"),
        "{stderr}"
    );
}
