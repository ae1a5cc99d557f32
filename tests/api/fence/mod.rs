//! Only the Redis a sale was last built into can make its orders: two primaries at once
//! (an old one still reachable after a failover, and the new one), a demoted primary
//! that comes back with its Lua state, a replica that stalls, WAIT that fails. Real
//! `seckill` processes against real Redis servers, a primary and two replicas of the
//! test's own, failed over by hand as Sentinel would.

mod failback;
mod replicas;
mod two_primaries;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::Value;

use crate::common::faults::{PrivateRedis, Process};
use crate::common::{vid, TestApp};

/// A primary and two replicas, each a `redis-server` of the test's own.
pub(crate) struct Trio {
    nodes: [PrivateRedis; 3],
}

impl Trio {
    /// Node 0 the primary, nodes 1 and 2 its replicas, in sync.
    pub(crate) async fn start() -> Self {
        let trio = Self {
            nodes: [
                PrivateRedis::start(),
                PrivateRedis::start(),
                PrivateRedis::start(),
            ],
        };
        for replica in [1, 2] {
            trio.follow(replica, 0).await;
        }
        trio
    }

    pub(crate) fn url(&self, node: usize) -> &str {
        &self.nodes[node].url
    }

    pub(crate) fn cmd<T: redis::FromRedisValue>(&self, node: usize, cmd: &redis::Cmd) -> T {
        self.nodes[node].run_command(cmd)
    }

    /// Makes `node` a replica of `master` and waits until it has all of its data.
    pub(crate) async fn follow(&self, node: usize, master: usize) {
        let addr = self.nodes[master].addr();
        let () = self.cmd(
            node,
            redis::cmd("REPLICAOF")
                .arg(addr.ip().to_string())
                .arg(addr.port()),
        );
        self.wait_in_sync(node, master).await;
    }

    /// Promotes `node` (as Sentinel does): it stops following and takes writes.
    pub(crate) fn promote(&self, node: usize) {
        let () = self.cmd(node, redis::cmd("REPLICAOF").arg("NO").arg("ONE"));
    }

    /// Turns `node`'s min-replicas write guard off, as on a server whose CONFIG the
    /// service cannot set, or in the seconds before Redis's own guard counts its
    /// replicas gone.
    pub(crate) fn guard_off(&self, node: usize) {
        let () = self.cmd(
            node,
            redis::cmd("CONFIG")
                .arg("SET")
                .arg("min-replicas-to-write")
                .arg(0),
        );
    }

    /// The failover, as Sentinel makes it: node 1 promoted, node 2 follows it. Node 0 is
    /// not told (partitioned, say), and still takes writes: its guard is off.
    pub(crate) async fn fail_over_leaving_node_0(&self) {
        self.promote(1);
        self.follow(2, 1).await;
        self.guard_off(0);
    }

    pub(crate) fn info(&self, node: usize, field: &str) -> Option<String> {
        let text: String = self.cmd(node, redis::cmd("INFO").arg("replication"));
        text.lines()
            .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
            .map(|v| v.trim().to_string())
    }

    pub(crate) async fn wait_in_sync(&self, node: usize, master: usize) {
        let began = Instant::now();
        loop {
            let up = self.info(node, "master_link_status").as_deref() == Some("up");
            let offset = self.info(node, "master_repl_offset");
            if up && offset.is_some() && offset == self.info(master, "master_repl_offset") {
                return;
            }
            assert!(
                began.elapsed() < Duration::from_secs(30),
                "redis {node} did not catch up with {master}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Waiting for one replica's acknowledgement, as in production with Sentinel.
pub(crate) fn waiting_for_one() -> Vec<(&'static str, String)> {
    vec![
        ("REDIS_WAIT_REPLICAS", "1".into()),
        ("REDIS_WAIT_TIMEOUT_MS", "300".into()),
    ]
}

/// `env` with `REDIS_URL` pointing at `url`.
pub(crate) fn on(url: &str, mut env: Vec<(&'static str, String)>) -> Vec<(&'static str, String)> {
    env.push(("REDIS_URL", url.to_string()));
    env
}

/// A `seckill worker` of the test's database and key space on the Redis at `url`.
pub(crate) fn worker_on(app: &TestApp, url: &str) -> Process {
    Process::spawn(
        "worker",
        url,
        app.keys.prefix(),
        &crate::common::faults::database_url(&app.db, None),
        &waiting_for_one(),
    )
}

/// The order ids the answers name as the caller's (202, or `already_ordered` with an
/// id), and the ids of the grabs whose outcome was unknown, per user.
pub(crate) fn promised_and_unknown(
    answers: &[(i64, Option<(StatusCode, Value)>)],
) -> (HashMap<i64, i64>, HashMap<i64, i64>) {
    let id = |body: &Value, at: &str| -> Option<i64> { body.pointer(at)?.as_str()?.parse().ok() };
    let mut promised = HashMap::new();
    let mut unknown = HashMap::new();
    for (user, answer) in answers {
        let Some((status, body)) = answer else {
            panic!("user {user}: no answer");
        };
        match (
            *status,
            body.pointer("/error/outcome").and_then(Value::as_str),
        ) {
            (StatusCode::ACCEPTED, _) => {
                promised.insert(*user, id(body, "/order_id").unwrap());
            }
            (StatusCode::SERVICE_UNAVAILABLE, Some("unknown")) => {
                let order = id(body, "/error/order_id").expect("an unknown names its order id");
                unknown.insert(*user, order);
            }
            _ => {}
        }
    }
    (promised, unknown)
}

/// Every active order of the sale in Postgres: order id -> user.
pub(crate) async fn stored(app: &TestApp, voucher: i64) -> HashMap<i64, i64> {
    app.pg_orders(voucher).await.into_iter().collect()
}

/// Waits (bounded) until the orders a worker of `url` must write are settled: its
/// stream has nothing unacknowledged nor undelivered.
pub(crate) async fn wait_drained(url: &str, app: &TestApp, voucher: i64) {
    let shard = app.keys.shard_of(vid(voucher));
    let client = redis::Client::open(url).unwrap();
    let began = Instant::now();
    loop {
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let stats = seckill::stream::stats(&mut conn, &app.keys, shard).await;
        if let Ok(s) = &stats {
            if s.pending == 0 && s.lag == Some(0) {
                return;
            }
        }
        assert!(
            began.elapsed() < Duration::from_secs(60),
            "the stream on {url} was not drained: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Orders of the sale buried because the fence refused their epoch.
pub(crate) async fn stale_epoch_burials(app: &TestApp, voucher: i64) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM dead_orders WHERE voucher_id = $1 AND reason LIKE 'stale_epoch%'",
    )
    .bind(voucher)
    .fetch_one(&app.db)
    .await
    .unwrap()
}

pub(crate) fn signal(process: &Process, signal: &str) {
    let status = std::process::Command::new("kill")
        .args([signal, &process.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

pub(crate) fn stop(process: &Process) {
    signal(process, "-STOP");
}

pub(crate) fn resume(process: &Process) {
    signal(process, "-CONT");
}
