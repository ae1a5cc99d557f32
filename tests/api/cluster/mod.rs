//! Scale-out on a real 3-master Redis Cluster: two `seckill api` and two `seckill worker`
//! processes, six stream shards, a dozen sales at once. And a cluster with a replica per
//! master losing a master mid-storm: replica acknowledgements per node, and the same
//! healing as after any failover once its replica is promoted.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use crate::common::cluster::PrivateCluster;
use crate::common::faults::{self, Process};
use crate::common::{metric_value, metrics_at, vid};
use futures::StreamExt;
use reqwest::StatusCode;
use seckill::auth::JwtKeys;
use serde_json::Value;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

mod failover;
pub(crate) mod sales;

/// One shopper's press during a storm.
struct Press {
    voucher: i64,
    sent: Instant,
    answered: Instant,
    /// `None`: no answer came (the request failed or timed out).
    answer: Option<(StatusCode, Value)>,
}

async fn press(
    http: &reqwest::Client,
    jwt: &JwtKeys,
    base: &str,
    voucher: i64,
    user: i64,
) -> Press {
    let sent = Instant::now();
    let resp = http
        .post(format!("{base}/vouchers/{voucher}/seckill"))
        .bearer_auth(jwt.mint(user, false, 600).unwrap())
        .timeout(Duration::from_secs(30))
        .send()
        .await;
    let answer = match resp {
        Ok(resp) => {
            let status = resp.status();
            resp.json::<Value>().await.ok().map(|body| (status, body))
        }
        Err(_) => None,
    };
    Press {
        voucher,
        sent,
        answered: Instant::now(),
        answer,
    }
}

/// `seckill reconcile` (compare only) against the cluster, without blocking the test's
/// runtime; its exit code and output.
pub(crate) async fn reconcile(env: &[(&'static str, String)]) -> (i32, String) {
    let mut cmd = tokio::process::Command::new(faults::BIN);
    cmd.arg("reconcile")
        .env("REDIS_URL", "redis://127.0.0.1:1")
        .env("REDIS_KEY_PREFIX", "")
        .env("RUST_LOG", "warn");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().await.unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}
