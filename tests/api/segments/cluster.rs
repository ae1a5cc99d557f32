//! A segmented sale on a real 3-master Redis Cluster: two `seckill api` and two
//! `seckill worker` processes, six stream shards; a mover killed with SIGKILL between
//! taking units and recording the move, a repair racing what it left.

use std::time::Duration;

use super::*;
use crate::cluster::reconcile;
use crate::cluster::sales::start_apis_and_workers;
use crate::common::cluster::PrivateCluster;
use crate::common::faults::{self, Process, Proxy};
use crate::common::{uid, vid, SECRET};
use futures::StreamExt;
use seckill::auth::JwtKeys;
use seckill::keys::{home_segment, Keys, SaleSegment};

const SEGMENTS: u8 = 3;

/// The keys as the processes lay them out (no prefix, six shards).
fn cluster_keys() -> Keys {
    Keys::with_shards("", 6).unwrap()
}

/// Each master's Redis CPU seconds so far (`INFO cpu`, user + sys).
async fn cpu_seconds(cluster: &PrivateCluster) -> Vec<f64> {
    let mut out = Vec::new();
    for &port in &cluster.ports {
        let info: String = cluster
            .query(port, redis::cmd("INFO").arg("cpu"))
            .await
            .unwrap();
        let field = |name: &str| -> f64 {
            info.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':')?.trim().parse().ok())
                .unwrap()
        };
        out.push(field("used_cpu_sys") + field("used_cpu_user"));
    }
    out
}

/// Presses once for each user, through `bases[i % n]` for the i-th, `64` at a time.
async fn storm(
    http: &reqwest::Client,
    jwt: &JwtKeys,
    bases: &[String],
    voucher: i64,
    users: Vec<i64>,
) -> Vec<(i64, Option<(StatusCode, Value)>)> {
    futures::stream::iter(users.into_iter().enumerate())
        .map(|(i, user)| {
            let req = http
                .post(format!(
                    "{}/vouchers/{voucher}/seckill",
                    bases[i % bases.len()]
                ))
                .bearer_auth(jwt.mint(user, false, 600).unwrap())
                .timeout(Duration::from_secs(30));
            async move {
                let answer = match req.send().await {
                    Ok(resp) => {
                        let status = resp.status();
                        resp.json::<Value>().await.ok().map(|b| (status, b))
                    }
                    Err(_) => None,
                };
                (user, answer)
            }
        })
        .buffer_unordered(64)
        .collect()
        .await
}

/// The orders Postgres holds for a sale (user -> order id), once it holds `n` or a
/// minute passed.
async fn stored_orders(db: &PgPool, voucher: i64, n: usize) -> HashMap<i64, String> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let rows: Vec<(i64, i64)> =
            sqlx::query_as("SELECT user_id, id FROM voucher_orders WHERE voucher_id = $1")
                .bind(voucher)
                .fetch_all(db)
                .await
                .unwrap();
        if rows.len() >= n || tokio::time::Instant::now() > deadline {
            return rows
                .into_iter()
                .map(|(u, id)| (u, id.to_string()))
                .collect();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn cluster_env(cluster: &PrivateCluster, db: &PgPool) -> Vec<(&'static str, String)> {
    vec![
        ("DATABASE_URL", faults::database_url(db, None)),
        ("REDIS_CLUSTER_URLS", cluster.urls()),
        ("STREAM_SHARDS", "6".to_string()),
    ]
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_sale_in_three_segments_on_three_masters_sells_exactly_its_stock_spread_over_them(
    db: PgPool,
) {
    let cluster = PrivateCluster::start(3);
    let (_apis, _workers, bases) = start_apis_and_workers(&cluster, &db).await;
    let http = reqwest::Client::new();
    let jwt = JwtKeys::new(SECRET).unwrap();
    let admin = jwt.mint(1, true, 600).unwrap();
    let voucher = segmented_sale_at(&http, &bases[0], &admin, 3000, SEGMENTS as i64).await;

    let before = cpu_seconds(&cluster).await;
    let answers = storm(&http, &jwt, &bases, voucher, (10_001..=13_150).collect()).await;
    let after = cpu_seconds(&cluster).await;
    let won = winners(&answers);
    assert_eq!(
        won.len(),
        3000,
        "exactly the stock, none stranded in a drained segment"
    );

    let used: Vec<f64> = before.iter().zip(&after).map(|(b, a)| a - b).collect();
    let total: f64 = used.iter().sum();
    let busiest = used.iter().cloned().fold(0.0, f64::max) / total;
    println!(
        "Redis CPU per master during the storm: {used:.3?} s, busiest {:.0}%",
        busiest * 100.0
    );
    assert!(
        busiest <= 0.5,
        "the busiest master carried {:.0}% of {used:?}",
        busiest * 100.0
    );

    // Winners pressing again through the other instance hear their own order.
    for (i, (user, order)) in won.iter().take(200).enumerate() {
        let other = &bases[(i + 1) % 2];
        let (_, answer) = storm(
            &http,
            &jwt,
            std::slice::from_ref(other),
            voucher,
            vec![*user],
        )
        .await
        .remove(0);
        let (status, body) = answer.unwrap();
        assert_eq!(status, StatusCode::CONFLICT, "{body}");
        assert_eq!(
            body["error"]["order_id"].as_str(),
            Some(order.as_str()),
            "{body}"
        );
    }
    assert_eq!(
        stored_orders(&db, voucher, 3000).await,
        won,
        "every 202 in Postgres"
    );
    let (code, books) = reconcile(&cluster_env(&cluster, &db)).await;
    assert_eq!(code, 0, "{books}");

    // After the sell-out: a cancelled unit goes to a fresh shopper of another segment, through
    // the other instance.
    let mut fresh = 20_000;
    for (user, order) in won.iter().take(2) {
        let resp = http
            .post(format!("{}/orders/{order}/cancel", bases[0]))
            .bearer_auth(jwt.mint(*user, false, 600).unwrap())
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        while home_segment(uid(fresh), SEGMENTS) == home_segment(uid(*user), SEGMENTS) {
            fresh += 1;
        }
        let (_, answer) = storm(&http, &jwt, &bases[1..], voucher, vec![fresh])
            .await
            .remove(0);
        let (status, body) = answer.unwrap();
        assert_eq!(status, StatusCode::ACCEPTED, "user {fresh}: {body}");
        fresh += 1;
    }
    stored_orders(&db, voucher, 3002).await;
    let (code, books) = reconcile(&cluster_env(&cluster, &db)).await;
    assert_eq!(code, 0, "{books}");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_mover_killed_between_take_and_record_loses_and_doubles_no_unit(db: PgPool) {
    let cluster = PrivateCluster::start(3);
    let http = reqwest::Client::new();
    let jwt = JwtKeys::new(SECRET).unwrap();
    let proxy = Proxy::start(faults::postgres_addr(&db)).await;
    let (mut mover, a) = spawn_on_cluster("api", &cluster, &db, Some(proxy.addr)).await;
    let (other, b) = spawn_on_cluster("api", &cluster, &db, None).await;
    let (_worker, _) = spawn_on_cluster("worker", &cluster, &db, None).await;
    let admin = jwt.mint(1, true, 600).unwrap();
    let voucher = segmented_sale_at(&http, &b, &admin, 300, SEGMENTS as i64).await;
    let home = |u: i64| home_segment(uid(u), SEGMENTS);

    // Shoppers of segment 0 only, through the mover: segment 0 drains, and its next grab makes
    // the mover take units from another segment. Postgres is frozen for the mover after its
    // first grab, so it takes the units and then hangs before recording the move.
    let segment0: Vec<i64> = (1..).filter(|&u| home(u) == 0).take(150).collect();
    let first = storm(
        &http,
        &jwt,
        std::slice::from_ref(&a),
        voucher,
        segment0[..1].to_vec(),
    )
    .await;
    assert_eq!(first[0].1.as_ref().unwrap().0, StatusCode::ACCEPTED);
    proxy.freeze();
    let pressing = tokio::spawn({
        let (http, jwt, a) = (http.clone(), JwtKeys::new(SECRET).unwrap(), a.clone());
        let users = segment0[1..].to_vec();
        async move { storm(&http, &jwt, &[a], voucher, users).await }
    });
    wait_for_a_take(&cluster, voucher).await;
    mover.kill9();
    let early = pressing.await.unwrap();
    let early_won = winners_or_lost(&early);

    // A repair races the other instance's finisher and a storm through it.
    let repair = tokio::spawn(repair(cluster_env(&cluster, &db)));
    let late = storm(
        &http,
        &jwt,
        std::slice::from_ref(&b),
        voucher,
        (5_000..5_400).collect(),
    )
    .await;
    let out = repair.await.unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let late_won = winners(&late);
    // Whatever the repair left unsold goes now.
    let last = storm(
        &http,
        &jwt,
        std::slice::from_ref(&b),
        voucher,
        (6_000..6_400).collect(),
    )
    .await;
    let last_won = winners(&last);
    drop(other);

    let answered = early_won.len() + late_won.len() + last_won.len();
    let stored = stored_orders(&db, voucher, 300).await;
    println!(
        "202s: {} before the kill, {} after, {} at the end; {} orders stored",
        early_won.len(),
        late_won.len(),
        last_won.len(),
        stored.len()
    );
    assert_eq!(
        stored.len(),
        300,
        "every unit sold once: none lost in the move, none doubled"
    );
    for (user, order) in early_won.iter().chain(&late_won).chain(&last_won) {
        assert_eq!(
            stored.get(user),
            Some(order),
            "user {user}'s 202 is in Postgres"
        );
    }
    assert!(answered <= 300);
    let dead: i64 = sqlx::query_scalar("SELECT count(*) FROM dead_orders")
        .fetch_one(&db)
        .await
        .unwrap();
    assert_eq!(dead, 0, "no admitted order refused by Postgres");
    let (code, books) = reconcile(&cluster_env(&cluster, &db)).await;
    assert_eq!(code, 0, "{books}");
}

/// `seckill <subcommand>` on the cluster (an API on a port of its own), its Postgres
/// through `via` if given; the process and its base URL, once ready (an API's).
async fn spawn_on_cluster(
    subcommand: &str,
    cluster: &PrivateCluster,
    db: &PgPool,
    via: Option<std::net::SocketAddr>,
) -> (Process, String) {
    let port = faults::free_port();
    let env = vec![
        ("REDIS_CLUSTER_URLS", cluster.urls()),
        ("STREAM_SHARDS", "6".to_string()),
        ("BIND", format!("127.0.0.1:{port}")),
    ];
    let url = faults::database_url(db, via);
    let process = Process::spawn(subcommand, "redis://127.0.0.1:1", "", &url, &env);
    let base = format!("http://127.0.0.1:{port}");
    if subcommand == "api" {
        faults::wait_ready(&base).await;
    }
    (process, base)
}

/// Waits until some segment of the sale holds a move's record: units taken, not settled.
async fn wait_for_a_take(cluster: &PrivateCluster, voucher: i64) {
    let keys = cluster_keys();
    let moves_out: Vec<String> = SaleSegment::all(vid(voucher), SEGMENTS)
        .map(|p| keys.moves_out(p))
        .collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        for key in &moves_out {
            let master = cluster.master_of(key).await;
            let n: i64 = cluster
                .query(master, redis::cmd("HLEN").arg(key))
                .await
                .unwrap();
            if n > 0 {
                return;
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the mover never took units"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// `seckill reconcile --repair` against the cluster; its output.
async fn repair(env: Vec<(&'static str, String)>) -> std::process::Output {
    let mut cmd = tokio::process::Command::new(faults::BIN);
    cmd.args(["reconcile", "--repair"])
        .env("REDIS_URL", "redis://127.0.0.1:1")
        .env("REDIS_KEY_PREFIX", "")
        .env("RUST_LOG", "warn");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().await.unwrap()
}

/// The winners among answers of a storm cut by a kill: unanswered presses are allowed
/// (they may or may not have won; Postgres tells), any other answer must be a 202.
fn winners_or_lost(answers: &[(i64, Option<(StatusCode, Value)>)]) -> HashMap<i64, String> {
    let answered: Vec<(i64, Option<(StatusCode, Value)>)> = answers
        .iter()
        .filter(|(_, a)| a.as_ref().is_some_and(|(s, _)| *s == StatusCode::ACCEPTED))
        .cloned()
        .collect();
    winners(&answered)
}
