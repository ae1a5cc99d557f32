//! A primary demoted under its replica with a partial resynchronization keeps its Lua
//! state (its term), and may be promoted again lacking nothing, or lagging. Either
//! way, what the other side wrote meanwhile makes it draw a new term when it is master
//! again: its sales are rebuilt from Postgres, and a node number claimed on it waits
//! out the lease grace.

use std::time::Duration;

use reqwest::StatusCode;
use sqlx::PgPool;

use super::*;
use crate::common::{metric_value, metrics_at, open_sale_at, press_all, vid, TestApp};

/// `FAILOVER TO` node `to` from its master `from` (Redis's own coordinated failover:
/// writes paused, the replica caught up, roles swapped, the old master resynchronized
/// partially); waits until `to` is master and `from` follows it, in sync.
async fn fail_over(trio: &Trio, from: usize, to: usize) {
    let addr = trio.nodes[to].addr();
    let () = trio.cmd(
        from,
        redis::cmd("FAILOVER")
            .arg("TO")
            .arg(addr.ip().to_string())
            .arg(addr.port()),
    );
    let began = std::time::Instant::now();
    while trio.info(to, "role").as_deref() != Some("master") {
        assert!(
            began.elapsed() < Duration::from_secs(30),
            "no failover to {to}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    trio.wait_in_sync(from, to).await;
}

/// The term of node `node` (its first-shard marker) and its age.
fn term(trio: &Trio, node: usize, app: &TestApp) -> (String, i64) {
    let marker = app.keys.term_marker(seckill::keys::Shard(0));
    // (Then the term whose data it took over, and whether it is opened.)
    let (term, age, _came_after, _opened): (String, i64, String, i64) = trio.cmd(
        node,
        redis::cmd("FCALL").arg("seckill_term").arg(1).arg(marker),
    );
    (term, age)
}

/// Claims order-id node `number` on node `node` with a token of the test's: (1 claimed,
/// the term's age in ms).
fn claim(trio: &Trio, node: usize, app: &TestApp, number: u16) -> (i64, i64) {
    let lease = format!("{}seckill:node:{number}", app.keys.prefix());
    trio.cmd(
        node,
        redis::cmd("FCALL")
            .arg("seckill_claim_lease")
            .arg(2)
            .arg(&lease)
            .arg(format!("{}seckill:{{{lease}}}:term", app.keys.prefix()))
            .arg("test-token")
            .arg(60_000),
    )
}

fn partial_resyncs(trio: &Trio, node: usize) -> i64 {
    let text: String = trio.cmd(node, redis::cmd("INFO").arg("stats"));
    text.lines()
        .find_map(|l| l.strip_prefix("sync_partial_ok:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap()
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_primary_failed_back_after_a_partial_resync_gets_a_new_term_and_its_sales_are_rebuilt(
    db: PgPool,
) {
    let trio = Trio::start().await;
    let app = TestApp::spawn_with(db, trio.url(0).to_string(), true).await;
    let (api, base) = app
        .spawn_server("api", &on(trio.url(0), waiting_for_one()))
        .await;
    let sale = open_sale_at(&app.client, &base, 50).await;
    let first = press_all(&app, &base, sale, 1..=10, 10).await;
    assert_eq!(promised_and_unknown(&first).0.len(), 10);
    let (before, _) = term(&trio, 0, &app);

    // The API instance is held still, so what the server says right after the failback
    // is seen before anybody rebuilds anything.
    stop(&api);
    let partial = partial_resyncs(&trio, 1);
    fail_over(&trio, 0, 1).await;
    assert!(
        partial_resyncs(&trio, 1) > partial,
        "node 0 resynchronized partially under node 1"
    );
    // Node 1, master meanwhile, is written to by the processes that follow it: here a
    // release of a unit of the sale (of nobody's order: nothing changes but the slot's
    // marker), as an instance's would be, and a lease claim.
    let segment = seckill::keys::SaleSegment::new(vid(sale), 0, 1);
    let released: i64 = trio.cmd(
        1,
        redis::cmd("FCALL")
            .arg("seckill_release")
            .arg(2)
            .arg(app.keys.segment(segment))
            .arg(app.keys.segment_marker(segment))
            .arg("u:999999")
            .arg(1)
            .arg(""),
    );
    assert_eq!(released, 0);
    let (_, _) = claim(&trio, 1, &app, 1001);
    let (meanwhile, _) = term(&trio, 1, &app);
    assert_ne!(meanwhile, before);
    let partial = partial_resyncs(&trio, 0);
    fail_over(&trio, 1, 0).await;
    assert!(
        partial_resyncs(&trio, 0) > partial,
        "node 1 resynchronized partially under node 0"
    );

    let (after, age_ms) = term(&trio, 0, &app);
    println!("term before {before}, on the other side {meanwhile}, after the failback {after} ({age_ms} ms old)");
    assert_ne!(after, before, "a failback keeps no term");
    assert!(age_ms < 2_000, "the new term is young: {age_ms} ms");
    // Every sale built before is stale there until rebuilt from Postgres.
    let peeked: Vec<String> = trio.cmd(
        0,
        redis::cmd("FCALL")
            .arg("seckill_peek")
            .arg(2)
            .arg(app.keys.segment(segment))
            .arg(app.keys.segment_marker(segment)),
    );
    assert_eq!(peeked, ["6"], "stale: built in an earlier term");
    // A number claimed now waits out the lease grace.
    let (claimed, lease_age_ms) = claim(&trio, 0, &app, 1000);
    assert_eq!(claimed, 1);
    assert!(lease_age_ms < 4_000, "the grace applies: {lease_age_ms} ms");

    // Nobody runs anything: the instance heals the sale and sells again.
    resume(&api);
    let again = crate::recovery::rollback::press_through_503s(&app, &base, sale, 1..=20).await;
    let winners = crate::recovery::rollback::won(&again);
    assert_eq!(winners.len(), 10, "the ten new shoppers win");
    for user in 1..=10 {
        let (status, body) = &again[&user];
        assert_eq!(
            (*status, body["error"]["code"].as_str()),
            (StatusCode::CONFLICT, Some("already_ordered")),
            "user {user} holds an order already"
        );
    }
    // (Counted by the instance's term watcher, woken by the first stale grab.)
    let began = std::time::Instant::now();
    loop {
        let healed = metric_value(
            &metrics_at(&app.client, &base).await,
            "seckill_redis_rollbacks_healed_total",
        )
        .unwrap_or(0.0);
        if healed >= 1.0 {
            break;
        }
        assert!(
            began.elapsed() < Duration::from_secs(10),
            "the instance did not count the new term it healed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
