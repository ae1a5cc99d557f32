//! Two primaries at once: the old one, still reachable by an API instance and a
//! worker after a failover, and the new one. Whichever worker writes first, no 202 is
//! lost and the sale sells exactly its stock.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::Value;
use sqlx::PgPool;

use super::*;
use crate::common::{open_sale_at, press_all, vid, TestApp};

/// Which order of the writes: the old primary's worker before the new primary's
/// rebuild and sales, or after them (the harmful order, forced by holding that worker
/// back with SIGSTOP).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Order {
    OldPrimaryFirst,
    NewPrimaryFirst,
}

/// A sale of 20; 5 orders written; then the replica promoted while API 1 and worker 1
/// stay on the old primary, whose other replica follows the new one. The old primary
/// takes grabs it cannot get acknowledged: with `REDIS_WAIT_REPLICAS=1`, the first call
/// after the replicas went (`503 unknown`: units taken, entries appended), then none
/// (refused unsent, nothing reserved); with 0, ten 202s. API 2 and worker 2 on the new
/// primary rebuild the sale from Postgres and sell what is left. Whichever worker
/// writes first, the sale sells exactly 20, every unknown is an order or none, and no
/// 202 of the new primary is lost; with acknowledgements, no 202 at all.
async fn two_primaries(db: PgPool, order: Order, old_waits: bool) {
    let trio = Trio::start().await;
    let app = TestApp::spawn_with(db, trio.url(0).to_string(), true).await;
    let old_env = match old_waits {
        true => waiting_for_one(),
        false => vec![("REDIS_WAIT_REPLICAS", "0".to_string())],
    };
    let (_api1, base1) = app.spawn_server("api", &on(trio.url(0), old_env)).await;
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

    trio.fail_over_leaving_node_0().await;
    let old = press_all(&app, &base1, sale, 6..=15, 10).await;
    let (old_promised, unknown) = promised_and_unknown(&old);
    let stream = app.keys.stream(app.keys.shard_of(vid(sale))).to_string();
    let entries: usize = trio.cmd(0, redis::cmd("XLEN").arg(&stream));
    let taken = old_promised.len() + unknown.len();
    match old_waits {
        true => {
            assert!(old_promised.is_empty(), "no replica acknowledges: {old:?}");
            assert!(
                !unknown.is_empty(),
                "the first call took its units: {old:?}"
            );
        }
        false => assert_eq!(old_promised.len(), 10, "{old:?}"),
    }
    assert!(entries >= 1, "the old primary appended its orders' entries");
    if order == Order::OldPrimaryFirst {
        assert_eq!(
            app.wait_for_orders(sale, 5 + taken, Duration::from_secs(30))
                .await,
            5 + taken,
            "worker 1 writes the old primary's orders before the new primary is built"
        );
    }

    // API 2 and worker 2 on the new primary: its first look rebuilds the sale.
    let (_api2, base2) = app
        .spawn_server("api", &on(trio.url(1), waiting_for_one()))
        .await;
    let _worker2 = worker_on(&app, trio.url(1));
    let new = crate::recovery::rollback::press_through_503s(&app, &base2, sale, 16..=60).await;
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
            while (stale_epoch_burials(&app, sale).await as usize) < taken {
                assert!(began.elapsed() < Duration::from_secs(60), "not buried");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }

    let orders = stored(&app, sale).await;
    let lost = |promised: &HashMap<i64, i64>| -> Vec<i64> {
        promised
            .values()
            .filter(|o| !orders.contains_key(o))
            .copied()
            .collect()
    };
    let old_taken: HashMap<i64, i64> = old_promised
        .clone()
        .into_iter()
        .chain(unknown.clone())
        .collect();
    let became: HashSet<i64> = old_taken
        .values()
        .filter(|o| orders.contains_key(o))
        .copied()
        .collect();
    println!(
        "{order:?}, old primary waiting: {old_waits}: 202s {} (early {}, old primary {}, new \
         primary {}), lost: new primary's {}, old primary's {}; unknowns {}; of the old \
         primary's {} orders {} written, {} refused by the fence; orders in postgres {}",
        early.len() + old_promised.len() + new_promised.len(),
        early.len(),
        old_promised.len(),
        new_promised.len(),
        lost(&new_promised).len(),
        lost(&old_promised).len(),
        unknown.len(),
        taken,
        became.len(),
        taken - became.len(),
        orders.len()
    );
    assert!(lost(&early).is_empty() && lost(&new_promised).is_empty());
    assert_eq!(orders.len(), 20, "the sale sells exactly its stock");
    app.assert_consistent(sale, 20).await;
    let stale = stale_epoch_burials(&app, sale).await as usize;
    match order {
        // Written before the rebuild, which counted them.
        Order::OldPrimaryFirst => {
            assert_eq!(became.len(), taken);
            assert_eq!(new_promised.len(), 15 - taken);
            assert_eq!(stale, 0);
        }
        // Refused by the fence: never orders, no unit taken, dead-lettered.
        Order::NewPrimaryFirst => {
            assert!(
                became.is_empty(),
                "an old primary's order was written: {became:?}"
            );
            assert_eq!(stale, taken);
            // Their shoppers hold nothing, and a retry is judged afresh.
            let user = *old_taken.keys().next().unwrap();
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
    worker1.kill9();
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn two_primaries_lose_no_202_when_the_old_primarys_worker_writes_first(db: PgPool) {
    two_primaries(db, Order::OldPrimaryFirst, true).await;
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn two_primaries_lose_no_202_when_the_old_primarys_worker_writes_after_the_new_one_sold(
    db: PgPool,
) {
    two_primaries(db, Order::NewPrimaryFirst, true).await;
}

/// Without acknowledgements the old primary's 202s can only be refused (as a failover
/// to a lagging replica loses them: what `REDIS_WAIT_REPLICAS=0` accepts); the new
/// primary's are all kept, and the sale still sells exactly its stock.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn without_acknowledgements_the_old_primarys_orders_are_refused_and_the_new_ones_kept(
    db: PgPool,
) {
    two_primaries(db, Order::NewPrimaryFirst, false).await;
}

/// A sale created on the new primary while an API instance still reaches the old one:
/// a grab there finds it missing, and the heal it starts must not build it into the old
/// primary (the sale's epoch would move there, and every order of the new primary be
/// refused). The old primary's term is older: the build is refused, its grabs get 503
/// with nothing reserved, and the new primary sells the sale whole.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn an_old_primary_cannot_take_a_sale_from_the_new_one(db: PgPool) {
    let trio = Trio::start().await;
    let app = TestApp::spawn_with(db, trio.url(0).to_string(), true).await;
    let (_api1, base1) = app
        .spawn_server("api", &on(trio.url(0), waiting_for_one()))
        .await;
    trio.promote(1);
    trio.follow(2, 1).await;
    let (_api2, base2) = app
        .spawn_server("api", &on(trio.url(1), waiting_for_one()))
        .await;
    let _worker2 = worker_on(&app, trio.url(1));
    let sale = open_sale_at(&app.client, &base2, 10).await;
    let segment = seckill::keys::SaleSegment::new(vid(sale), 0, 1);
    let built_into = |app: &TestApp| {
        let db = app.db.clone();
        async move {
            sqlx::query_as::<_, (i64, String)>(
                "SELECT epoch, term FROM sale_epochs WHERE voucher_id = $1 AND segment = 0",
            )
            .bind(sale)
            .fetch_one(&db)
            .await
            .unwrap()
        }
    };
    let before = built_into(&app).await;

    // The old primary is asked for a sale it never had, again and again.
    let (status, body) = {
        let mut last = (StatusCode::OK, Value::Null);
        for user in 1..=20 {
            let answers = press_all(&app, &base1, sale, [user], 1).await;
            last = answers[0].1.clone().unwrap();
            assert_eq!(last.0, StatusCode::SERVICE_UNAVAILABLE, "{:?}", last.1);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        last
    };
    assert_eq!(
        body["error"]["outcome"],
        Value::Null,
        "nothing reserved: {body}"
    );
    let exists: bool = trio.cmd(0, redis::cmd("EXISTS").arg(app.keys.segment(segment)));
    let armed: Option<String> = trio.cmd(
        0,
        redis::cmd("HGET")
            .arg(app.keys.segment(segment))
            .arg("epoch"),
    );
    assert!(
        armed.is_none(),
        "no state armed on the old primary (exists: {exists})"
    );
    assert_eq!(
        built_into(&app).await,
        before,
        "the sale still lives on the new primary"
    );
    println!("{status}: {body}");

    // The new primary sells it whole, and every 202 is written.
    let answers = crate::recovery::rollback::press_through_503s(&app, &base2, sale, 21..=40).await;
    let won = crate::recovery::rollback::won(&answers);
    assert_eq!(won.len(), 10);
    wait_drained(trio.url(1), &app, sale).await;
    let orders = stored(&app, sale).await;
    assert!(
        won.values().all(|o| orders.contains_key(o)),
        "every 202 written"
    );
    assert_eq!(stale_epoch_burials(&app, sale).await, 0);
}

/// The hole the 30-minute nemesis run met (seed 2026 at 1377 s, load/results/2026-11-27-
/// nemesis.md): a second primary that keeps a replica of its own. Node 1 is promoted and
/// the sale rebuilt there (Postgres's epoch names node 1's state), while node 0 keeps
/// its replica (node 2 still follows it), so `REDIS_WAIT_REPLICAS=1` is met on node 0
/// too. Its sale state, built before the rebuild, still admits: every 202 it answers is
/// of an epoch Postgres no longer accepts, a promise no worker can keep (and the
/// shoppers who bought through node 1 in between hold an order already). The admission
/// must not answer 202 from a state whose epoch is not the sale's current one: it hears
/// of the rebuild from Postgres and refuses that state before it takes anything.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn an_old_primary_that_keeps_a_replica_answers_no_202_for_a_sale_rebuilt_elsewhere(
    db: PgPool,
) {
    let trio = Trio::start().await;
    let app = TestApp::spawn_with(db, trio.url(0).to_string(), true).await;
    let (_api1, base1) = app
        .spawn_server("api", &on(trio.url(0), waiting_for_one()))
        .await;
    let _worker1 = worker_on(&app, trio.url(0));
    let sale = open_sale_at(&app.client, &base1, 20).await;
    let early = press_all(&app, &base1, sale, 1..=5, 5).await;
    assert_eq!(promised_and_unknown(&early).0.len(), 5);
    assert_eq!(
        app.wait_for_orders(sale, 5, Duration::from_secs(30)).await,
        5
    );

    // Node 1 promoted, node 2 still node 0's replica: two primaries, node 0 with a
    // replica acknowledging. API 2 on node 1 (no replica: its guard off) rebuilds the
    // sale there and sells to 6..=10.
    trio.promote(1);
    trio.guard_off(1);
    let (_api2, base2) = app
        .spawn_server(
            "api",
            &on(trio.url(1), vec![("REDIS_WAIT_REPLICAS", "0".to_string())]),
        )
        .await;
    let _worker2 = crate::common::faults::Process::spawn(
        "worker",
        trio.url(1),
        app.keys.prefix(),
        &crate::common::faults::database_url(&app.db, None),
        &[("REDIS_WAIT_REPLICAS", "0".to_string())],
    );
    let new = crate::recovery::rollback::press_through_503s(&app, &base2, sale, 6..=10).await;
    assert!(
        new.iter().all(|(_, (s, _))| *s == StatusCode::ACCEPTED),
        "{new:?}"
    );
    assert_eq!(
        app.wait_for_orders(sale, 10, Duration::from_secs(30)).await,
        10
    );

    // Node 0 still holds its own state, armed and of its term: none of it may be a
    // 202, and it takes nothing.
    let state_key = app
        .keys
        .segment(seckill::keys::SaleSegment::new(vid(sale), 0, 1));
    let stock =
        |trio: &Trio| -> i64 { trio.cmd(0, redis::cmd("HGET").arg(&state_key).arg("stock")) };
    let stock_before = stock(&trio);
    let stale = press_all(&app, &base1, sale, 6..=15, 10).await;
    let (promised, unknown) = promised_and_unknown(&stale);
    assert!(
        promised.is_empty() && unknown.is_empty(),
        "202s or unknowns from a sale state Postgres no longer names: {stale:?}"
    );
    for (user, answer) in &stale {
        let (status, body) = answer.as_ref().unwrap();
        assert_eq!(
            *status,
            StatusCode::SERVICE_UNAVAILABLE,
            "user {user}: {body}"
        );
        let message = body["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("nothing was reserved"),
            "user {user}: {body}"
        );
    }
    assert_eq!(stock(&trio), stock_before, "node 0 took no unit");
    println!(
        "an old primary with a replica, after the sale was rebuilt elsewhere: {} presses, \
         0 × 202, {} × 503 with nothing reserved; its stock stays {stock_before}",
        stale.len(),
        stale.len()
    );
    // An instance started on node 0 now reads the epochs before it serves: refused
    // from its first grab.
    let (_api3, base3) = app
        .spawn_server("api", &on(trio.url(0), waiting_for_one()))
        .await;
    let fresh = press_all(&app, &base3, sale, 16..=20, 5).await;
    let (promised, unknown) = promised_and_unknown(&fresh);
    assert!(
        promised.is_empty() && unknown.is_empty(),
        "a fresh instance on the old primary: {fresh:?}"
    );
    assert_eq!(stock(&trio), stock_before, "node 0 took no unit");
    // Node 1 goes on: its shoppers' orders all written, none buried.
    assert_eq!(
        app.wait_for_orders(sale, 10, Duration::from_secs(30)).await,
        10
    );
    assert_eq!(stale_epoch_burials(&app, sale).await, 0);
}
