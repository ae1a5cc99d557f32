//! Only the Redis a sale was last built into can make its orders: two primaries at once
//! (an old one still reachable after a failover, and the new one), a demoted primary
//! that comes back with its Lua state, a replica that stalls, WAIT that fails. Real
//! `seckill` processes against real Redis servers, a primary and two replicas of the
//! test's own, promoted by hand as Sentinel would.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::Value;
use sqlx::PgPool;

use crate::common::faults::{PrivateRedis, Process};
use crate::common::{open_sale_at, press_all, vid, TestApp};

/// A primary and two replicas, each a `redis-server` of the test's own.
struct Trio {
    nodes: [PrivateRedis; 3],
}

impl Trio {
    /// Node 0 the primary, nodes 1 and 2 its replicas, in sync.
    async fn start() -> Self {
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

    fn url(&self, node: usize) -> &str {
        &self.nodes[node].url
    }

    fn cmd<T: redis::FromRedisValue>(&self, node: usize, cmd: &redis::Cmd) -> T {
        self.nodes[node].run_command(cmd)
    }

    /// Makes `node` a replica of `master` and waits until it has all of its data.
    async fn follow(&self, node: usize, master: usize) {
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
    fn promote(&self, node: usize) {
        let () = self.cmd(node, redis::cmd("REPLICAOF").arg("NO").arg("ONE"));
    }

    fn info(&self, node: usize, field: &str) -> Option<String> {
        let text: String = self.cmd(node, redis::cmd("INFO").arg("replication"));
        text.lines()
            .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
            .map(|v| v.trim().to_string())
    }

    async fn wait_in_sync(&self, node: usize, master: usize) {
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
fn waiting_for_one() -> Vec<(&'static str, String)> {
    vec![
        ("REDIS_WAIT_REPLICAS", "1".into()),
        ("REDIS_WAIT_TIMEOUT_MS", "300".into()),
    ]
}

/// `env` with `REDIS_URL` pointing at `url`.
fn on(url: &str, mut env: Vec<(&'static str, String)>) -> Vec<(&'static str, String)> {
    env.push(("REDIS_URL", url.to_string()));
    env
}

/// A `seckill worker` of the test's database and key space on the Redis at `url`.
fn worker_on(app: &TestApp, url: &str) -> Process {
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
fn promised_and_unknown(
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
async fn stored(app: &TestApp, voucher: i64) -> HashMap<i64, i64> {
    app.pg_orders(voucher).await.into_iter().collect()
}

/// Waits (bounded) until the orders a worker of `url` must write are settled: its
/// stream has nothing unacknowledged nor undelivered.
async fn wait_drained(url: &str, app: &TestApp, voucher: i64) {
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

/// Which order of the writes: the old primary's worker before the new primary's
/// rebuild and sales, or after them (the harmful order, forced by holding that worker
/// back with SIGSTOP).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Order {
    OldPrimaryFirst,
    NewPrimaryFirst,
}

/// A sale of 20; 5 orders written; then the replica promoted while API 1 and worker 1
/// stay on the old primary, whose other replica follows the new one: the old primary
/// takes 10 grabs it cannot get acknowledged (`503 unknown`: the units taken, the
/// entries appended). API 2 and worker 2 on the new primary rebuild the sale from
/// Postgres and sell what is left. Whichever worker writes first, no 202 is lost, the
/// sale sells exactly 20, and each unknown is an order or none.
async fn two_primaries(db: PgPool, order: Order) {
    let trio = Trio::start().await;
    let app = TestApp::spawn_with(db, trio.url(0).to_string(), true).await;
    let (_api1, base1) = app
        .spawn_server("api", &on(trio.url(0), waiting_for_one()))
        .await;
    let mut worker1 = worker_on(&app, trio.url(0));
    let sale = open_sale_at(&app.client, &base1, 20).await;
    let early = press_all(&app, &base1, sale, 1..=5, 5).await;
    let (early, _) = promised_and_unknown(&early);
    assert_eq!(early.len(), 5, "five 202s while the replicas acknowledge");
    assert_eq!(
        app.wait_for_orders(sale, 5, Duration::from_secs(30)).await,
        5
    );
    if order == Order::NewPrimaryFirst {
        stop(&worker1);
    }

    // The failover, as Sentinel makes it: node 1 promoted, node 2 follows it. Node 0
    // is not told (partitioned, say). Its min-replicas guard is off, as on a server
    // whose CONFIG the service cannot set, or in the second before it notices the
    // replicas gone: it takes units it cannot get acknowledged.
    trio.promote(1);
    trio.follow(2, 1).await;
    let () = trio.cmd(
        0,
        redis::cmd("CONFIG")
            .arg("SET")
            .arg("min-replicas-to-write")
            .arg(0),
    );
    let old = press_all(&app, &base1, sale, 6..=15, 10).await;
    let (old_promised, unknown) = promised_and_unknown(&old);
    assert!(
        old_promised.is_empty(),
        "no replica acknowledges the old primary: {old:?}"
    );
    assert_eq!(unknown.len(), 10, "{old:?}");
    let stream = app.keys.stream(app.keys.shard_of(vid(sale))).to_string();
    let entries: usize = trio.cmd(0, redis::cmd("XLEN").arg(&stream));
    assert!(
        entries >= 1,
        "the old primary appended the unknowns' entries"
    );
    if order == Order::OldPrimaryFirst {
        assert_eq!(
            app.wait_for_orders(sale, 15, Duration::from_secs(30)).await,
            15,
            "worker 1 writes the old primary's orders before the new primary is built"
        );
    }

    // API 2 and worker 2 on the new primary: its first look rebuilds the sale.
    let (_api2, base2) = app
        .spawn_server("api", &on(trio.url(1), waiting_for_one()))
        .await;
    let _worker2 = worker_on(&app, trio.url(1));
    let new = crate::rollback::press_through_503s(&app, &base2, sale, 16..=60).await;
    let new: Vec<(i64, Option<(StatusCode, Value)>)> =
        new.into_iter().map(|(u, a)| (u, Some(a))).collect();
    let (new_promised, new_unknown) = promised_and_unknown(&new);
    assert!(
        new_unknown.is_empty(),
        "the new primary has a replica: {new_unknown:?}"
    );
    wait_drained(trio.url(1), &app, sale).await;
    match order {
        Order::OldPrimaryFirst => wait_drained(trio.url(0), &app, sale).await,
        Order::NewPrimaryFirst => {
            assert_eq!(
                new_promised.len(),
                15,
                "the new primary sells what Postgres has left"
            );
            resume(&worker1);
            // Worker 1 buries them in Postgres; settling them on the old primary then
            // waits for a replica it no longer has (retried until it is demoted).
            let began = Instant::now();
            while stale_epoch_burials(&app, sale).await < 10 {
                assert!(began.elapsed() < Duration::from_secs(60), "not buried");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }

    let orders = stored(&app, sale).await;
    let promised: Vec<i64> = early
        .values()
        .chain(new_promised.values())
        .copied()
        .collect();
    let lost: Vec<&i64> = promised
        .iter()
        .filter(|o| !orders.contains_key(o))
        .collect();
    let became: HashSet<i64> = unknown
        .values()
        .filter(|o| orders.contains_key(o))
        .copied()
        .collect();
    println!(
        "{order:?}: 202s {} (early {}, new primary {}), lost {}; unknowns {}: {} became orders, {} none; \
         orders in postgres {}",
        promised.len(),
        early.len(),
        new_promised.len(),
        lost.len(),
        unknown.len(),
        became.len(),
        unknown.len() - became.len(),
        orders.len()
    );
    assert!(lost.is_empty(), "202s lost: {lost:?}");
    assert_eq!(orders.len(), 20, "the sale sells exactly its stock");
    app.assert_consistent(sale, 20).await;
    let stale = stale_epoch_burials(&app, sale).await;
    match order {
        // Written before the rebuild, which counted them.
        Order::OldPrimaryFirst => {
            assert_eq!(became.len(), 10);
            assert_eq!(new_promised.len(), 5);
            assert_eq!(stale, 0);
        }
        // Refused by the fence: never orders, no unit taken, dead-lettered.
        Order::NewPrimaryFirst => {
            assert!(
                became.is_empty(),
                "an old primary's order was written: {became:?}"
            );
            assert_eq!(stale, 10);
            // Their shoppers hold nothing, and a retry is judged afresh.
            let user = *unknown.keys().next().unwrap();
            let (status, mine) = app
                .send(
                    app.client
                        .get(format!("{base2}/orders"))
                        .bearer_auth(app.token(user)),
                )
                .await;
            assert_eq!(status, StatusCode::OK);
            assert_eq!(mine, Value::Array(Vec::new()), "user {user} holds no order");
            let again = press_all(&app, &base2, sale, [user], 1).await;
            assert_eq!(
                again[0].1.as_ref().unwrap().1["error"]["code"],
                "sold_out",
                "{again:?}"
            );
        }
    }
    // The books balance on the new primary, nobody having repaired anything.
    let (code, out) = app
        .cli_async(&["reconcile"], &[("REDIS_URL", trio.url(1).to_string())])
        .await;
    assert_eq!(code, 0, "{out}");
    drop(worker1.child.kill());
}

/// Orders of the sale buried because the fence refused their epoch.
async fn stale_epoch_burials(app: &TestApp, voucher: i64) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM dead_orders WHERE voucher_id = $1 AND reason LIKE 'stale_epoch%'",
    )
    .bind(voucher)
    .fetch_one(&app.db)
    .await
    .unwrap()
}

fn signal(process: &Process, signal: &str) {
    let status = std::process::Command::new("kill")
        .args([signal, &process.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

fn stop(process: &Process) {
    signal(process, "-STOP");
}

fn resume(process: &Process) {
    signal(process, "-CONT");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn two_primaries_lose_no_202_when_the_old_primarys_worker_writes_first(db: PgPool) {
    two_primaries(db, Order::OldPrimaryFirst).await;
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn two_primaries_lose_no_202_when_the_old_primarys_worker_writes_after_the_new_one_sold(
    db: PgPool,
) {
    two_primaries(db, Order::NewPrimaryFirst).await;
}
