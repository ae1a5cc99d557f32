//! Recovery paths against the service's promise, with real processes and real races:
//! a shopper who got `202` with an order id holds that order (it ends in Postgres), no
//! more 202s than the stock, nobody holds two orders, Postgres stock = initial - orders,
//! and after the drain Redis's live stock equals Postgres's.
//!
//! The system is driven only from outside: HTTP, the `seckill` binary (`serve`, `api`,
//! `worker`, `reconcile`), SQL on the test's database and raw Redis commands.

use std::collections::HashMap;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::faults::{self, Process, BIN};
use crate::common::{press_all, vid, TestApp};
use reqwest::StatusCode;
use seckill::keys::{Keys, Shard};
use serde_json::Value;
use sqlx::{Connection, PgPool};

/// `reconcile --repair` rebuilds the sale while the worker commits
/// and acknowledges batches; an order committed between repair's Postgres read and its
/// Redis write must neither vanish from the buyers nor come back as stock.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn repair_racing_the_worker_during_a_storm_hands_out_exactly_the_stock_and_loses_no_order(
    db: PgPool,
) {
    let _run_time = RunTime::start();
    let app = TestApp::spawn(db).await;
    let stock = 2000;
    let voucher = app.open_sale(stock).await;
    let (_serve, base) = app
        .spawn_server(
            "serve",
            &[
                ("WORKER_BATCH_SIZE", "32".into()),
                ("WORKER_BLOCK_MS", "100".into()),
            ],
        )
        .await;

    let voucher_arg = voucher.to_string();
    let repair = ["reconcile", "--voucher", &voucher_arg, "--repair"];
    let storm_done = AtomicBool::new(false);
    let storm = async {
        let results = press_all(&app, &base, voucher, 1..=2500, 64).await;
        storm_done.store(true, Ordering::SeqCst);
        results
    };
    // Two repairers, a dozen runs each at most, for as long as the storm lasts.
    let repairs = || async {
        let mut runs = Vec::new();
        for _ in 0..12 {
            if storm_done.load(Ordering::SeqCst) {
                break;
            }
            runs.push(seckill_async(&app, &repair, &[]).await);
        }
        runs
    };
    let (mut results, mut runs, more) = tokio::join!(storm, repairs(), repairs());
    runs.extend(more);
    let during = runs.len();
    // Sold out: again while the worker is still writing the backlog (bounded); late
    // shoppers get whatever stock Redis wrongly regained; once more after the drain.
    for _ in 0..5 {
        if !unacknowledged(&app, app.keys.stream(Shard(0))).await {
            break;
        }
        runs.push(seckill_async(&app, &repair, &[]).await);
    }
    results.extend(press_all(&app, &base, voucher, 2501..=3000, 64).await);
    wait_drained(&app, &app.keys, Duration::from_secs(60)).await;
    runs.push(seckill_async(&app, &repair, &[]).await);
    let winners = admitted(&results);
    let drained = wait_drained(&app, &app.keys, Duration::from_secs(60)).await;

    let stored = app.assert_consistent(voucher, stock).await;
    let lost: Vec<i64> = winners
        .values()
        .filter(|id| !stored.contains(id))
        .copied()
        .collect();
    let dead = dead_letters(&app, &app.keys).await;
    let pg_stock = app.pg_stock(voucher).await;
    let live = app.redis_stock(voucher).await;
    println!(
        "repair runs: {during} during the storm, {} after (exit codes {:?}); 202s: {} for \
         stock {stock}; in postgres: {}; 202'd ids not in postgres: {}; dead letters: \
         {dead}; pg stock {pg_stock}, redis stock {live:?}; drained: {drained}",
        runs.len() - during,
        runs.iter().map(|r| r.0).collect::<Vec<_>>(),
        winners.len(),
        stored.len(),
        lost.len(),
    );
    assert!(
        during >= 2,
        "repair ran during the storm only {during} times"
    );
    assert!(drained, "the streams were not drained within 60 s");
    assert_eq!(winners.len(), stock as usize, "202s handed out vs stock");
    assert!(
        lost.is_empty(),
        "{} 202'd orders never reached postgres",
        lost.len()
    );
    assert_eq!(dead, 0, "dead letters");
    assert_eq!(pg_stock, 0);
    assert_eq!(live, Some(0), "redis stock after the drain");
}

/// The repair race above, through the API's on-line reload instead. While the worker
/// drains a backlog, the sale's Redis state is deleted again and again; each press that
/// finds it missing answers 503 and reloads it from Postgres in the background.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn online_reloads_racing_the_worker_lose_no_buyer_and_oversell_nothing(db: PgPool) {
    let _run_time = RunTime::start();
    let app = TestApp::spawn(db).await;
    let stock = 3000;
    let voucher = app.open_sale(stock).await;
    let (_api, base) = app.spawn_server("api", &[]).await;

    // A backlog: 2,400 orders admitted while no worker runs; then three workers write it
    // in small batches.
    let first = admitted(&press_all(&app, &base, voucher, 1..=2400, 64).await);
    assert_eq!(first.len(), 2400);
    let url = faults::database_url(&app.db, None);
    let env = [
        ("WORKER_BATCH_SIZE", "8".to_string()),
        ("WORKER_BLOCK_MS", "100".to_string()),
    ];
    let _workers: Vec<Process> = (0..3)
        .map(|_| Process::spawn("worker", &app.redis_url, app.keys.prefix(), &url, &env))
        .collect();

    // During the drain, 40 times: the sale's row is briefly locked (say, an admin's
    // transaction), so the workers' commits bunch up behind it; the sale's state is
    // lost; a press answers 503 and starts the reload; the lock is released meanwhile —
    // the workers commit and acknowledge while the reload runs — and the reload ends.
    let mut lock = sqlx::PgConnection::connect(&url).await.unwrap();
    let mut statuses: HashMap<u16, usize> = HashMap::new();
    let mut reload_winners: HashMap<i64, i64> = HashMap::new();
    let mut persisted_at_reload = Vec::new();
    let mut forgotten_after_reload = Vec::new();
    let mut second_orders: Vec<i64> = Vec::new();
    let mut doubles = 0;
    for i in 0..40i64 {
        sqlx::query("BEGIN").execute(&mut lock).await.unwrap();
        sqlx::query("SELECT 1 FROM seckill_vouchers WHERE voucher_id = $1 FOR UPDATE")
            .bind(voucher)
            .execute(&mut lock)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(40)).await;
        let _: i64 = app
            .redis_cmd(redis::cmd("DEL").arg(app.keys.voucher(vid(voucher))))
            .await;
        persisted_at_reload.push(pg_order_count(&app, voucher).await);
        let user = 100_000 + i;
        // The release goes out while the press is on its way, a little later each time
        // (0 to 5 ms), so that some releases land inside the reload.
        let release = async {
            tokio::time::sleep(Duration::from_micros(1000 * (i as u64 % 6))).await;
            sqlx::query("COMMIT").execute(&mut lock).await.unwrap();
        };
        let ((status, body), ()) = tokio::join!(press(&app, &base, voucher, user), release);
        *statuses.entry(status.as_u16()).or_default() += 1;
        if status == StatusCode::ACCEPTED {
            reload_winners.insert(user, order_id(&body));
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while app.redis_stock(voucher).await.is_none() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // Earlier winners the reloaded sale does not know as buyers (at most 100) press
        // again before the next reload: each must hear of their own order.
        let fields: Vec<String> = (1..=2400).map(|u| format!("u:{u}")).collect();
        let held: Vec<Option<i64>> = app
            .redis_cmd(
                redis::cmd("HMGET")
                    .arg(app.keys.voucher(vid(voucher)))
                    .arg(&fields),
            )
            .await;
        let unknown: Vec<i64> = (1..=2400)
            .zip(held)
            .filter(|(u, held)| *held != Some(first[u]))
            .map(|(u, _)| u)
            .take(100)
            .collect();
        forgotten_after_reload.push(unknown.len());
        for (user, answer) in press_all(&app, &base, voucher, unknown, 16).await {
            let (status, body) = answer.expect("an answer");
            if status == StatusCode::ACCEPTED {
                second_orders.push(order_id(&body));
            }
            if status == StatusCode::ACCEPTED || !names_order(&body, first[&user]) {
                doubles += 1;
            }
        }
    }
    println!(
        "answers to presses that found the state missing: {statuses:?}; \
         orders in postgres at each reload: {persisted_at_reload:?}; earlier winners \
         missing from the buyers after each reload: {forgotten_after_reload:?}"
    );

    // The rest of the sale, then every earlier winner presses again.
    let rest = admitted(&press_all(&app, &base, voucher, 2401..=3600, 64).await);
    let again = press_all(&app, &base, voucher, 1..=2400, 64).await;
    for (user, answer) in &again {
        let (status, body) = answer.as_ref().expect("an answer");
        if *status == StatusCode::ACCEPTED {
            second_orders.push(order_id(body));
        }
        if *status == StatusCode::ACCEPTED || !names_order(body, first[user]) {
            doubles += 1;
        }
    }
    // Every order id a 202 handed out.
    let handed_out: Vec<i64> = first
        .values()
        .chain(reload_winners.values())
        .chain(rest.values())
        .chain(second_orders.iter())
        .copied()
        .collect();

    let drained = wait_drained(&app, &app.keys, Duration::from_secs(60)).await;
    let stored = app.assert_consistent(voucher, stock).await;
    let lost = handed_out.iter().filter(|id| !stored.contains(id)).count();
    let dead = dead_letters(&app, &app.keys).await;
    let pg_stock = app.pg_stock(voucher).await;
    let live = app.redis_stock(voucher).await;
    println!(
        "202s: {} ({} of them second orders of earlier winners) for stock {stock}; \
         earlier winners not told their own order: {doubles}; in postgres: {}; \
         202'd ids not in postgres: {lost}; dead letters: {dead}; pg stock {pg_stock}, \
         redis stock {live:?}; drained: {drained}",
        handed_out.len(),
        second_orders.len(),
        stored.len(),
    );
    assert!(
        persisted_at_reload.iter().any(|&n| n > 0 && n < 2400),
        "no reload happened while the worker was draining: {persisted_at_reload:?}"
    );
    assert!(drained, "the streams were not drained within 60 s");
    assert_eq!(handed_out.len(), stock as usize, "202s handed out vs stock");
    assert_eq!(
        doubles, 0,
        "earlier winners got a second order or were not told theirs"
    );
    assert_eq!(lost, 0, "202'd orders never reached postgres");
    assert_eq!(dead, 0, "dead letters");
    assert_eq!(live, Some(pg_stock as i64), "redis stock vs postgres stock");
    assert_eq!(pg_stock, 0);
}

/// A worker whose transaction waits on a row lock is slow, not dead.
/// Other workers take its entries over (short claim idle) and their delivery count grows
/// past the bound, but an order that its first worker then commits must not be
/// dead-lettered as poison (which also forgets its buyer, who could then buy again).
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn orders_committed_behind_a_long_row_lock_are_never_dead_lettered_as_poison(db: PgPool) {
    let _run_time = RunTime::start();
    let app = TestApp::spawn(db.clone()).await;
    let stock = 500;
    let voucher = app.open_sale(stock).await;
    let (_api, base) = app.spawn_server("api", &[]).await;
    let url = faults::database_url(&db, None);
    // Someone holds the sale's row (a long admin transaction) for ten claim periods.
    let mut lock = sqlx::PgConnection::connect(&url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut lock).await.unwrap();
    sqlx::query("SELECT 1 FROM seckill_vouchers WHERE voucher_id = $1 FOR UPDATE")
        .bind(voucher)
        .execute(&mut lock)
        .await
        .unwrap();
    let winners = admitted(&press_all(&app, &base, voucher, 1..=100, 32).await);
    assert_eq!(winners.len(), 100);

    // Six workers: the first to read takes the whole backlog in one batch and waits
    // for the lock; the others are free, see its entries idle past the claim time and
    // take them over, again and again.
    let env = [
        ("WORKER_CLAIM_IDLE_MS", "300".to_string()),
        ("WORKER_MAX_DELIVERIES", "2".to_string()),
        ("WORKER_BLOCK_MS", "100".to_string()),
        ("WORKER_BATCH_SIZE", "500".to_string()),
    ];
    let _workers: Vec<Process> = (0..6)
        .map(|_| Process::spawn("worker", &app.redis_url, app.keys.prefix(), &url, &env))
        .collect();
    let consumers = wait_for_consumers(&app, 6, Duration::from_secs(20)).await;
    assert!(consumers >= 6, "only {consumers} workers came up");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let dead_during_lock = dead_letters(&app, &app.keys).await;
    sqlx::query("COMMIT").execute(&mut lock).await.unwrap();

    let drained = wait_drained(&app, &app.keys, Duration::from_secs(30)).await;
    let stored = app.assert_consistent(voucher, stock).await;
    let lost = winners.values().filter(|id| !stored.contains(id)).count();
    let dead = dead_letters(&app, &app.keys).await;

    // Every winner presses again: already ordered, the same order.
    let again = press_all(&app, &base, voucher, 1..=100, 32).await;
    let second_202s = admitted(&again).len();
    let mut not_their_order = 0;
    for (user, answer) in &again {
        let (status, body) = answer.as_ref().expect("an answer");
        if *status != StatusCode::CONFLICT
            || body["error"]["code"] != "already_ordered"
            || !names_order(body, winners[user])
        {
            not_their_order += 1;
        }
    }
    let drained_again = wait_drained(&app, &app.keys, Duration::from_secs(30)).await;
    let dead_after = dead_letters(&app, &app.keys).await;
    let pg_stock = app.pg_stock(voucher).await;
    let live = app.redis_stock(voucher).await;
    println!(
        "202s: {}; in postgres: {}; 202'd ids not in postgres: {lost}; dead letters while \
         locked: {dead_during_lock}, after the drain: {dead}, after the presses again: \
         {dead_after}; second 202s: {second_202s}; presses again not answered with their \
         order: {not_their_order}; pg stock {pg_stock}, redis stock {live:?}; drained: \
         {drained}/{drained_again}",
        winners.len(),
        stored.len(),
    );
    assert!(drained && drained_again, "the streams were not drained");
    assert_eq!(lost, 0, "202'd orders never reached postgres");
    assert_eq!(dead, 0, "committed orders were dead-lettered");
    assert_eq!(second_202s, 0, "winners got a second 202");
    assert_eq!(not_their_order, 0);
    assert_eq!(dead_after, 0);
    assert_eq!(stored.len(), 100);
    assert_eq!(live, Some(pg_stock as i64), "redis stock vs postgres stock");
}

/// Redis forgot a buyer whose order Postgres holds (a hand edit, a
/// lossy restore). Their presses must not keep producing phantom 202s that each take a
/// unit: at most the first one, which the worker then resolves to the Postgres order,
/// giving the unit back.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_buyer_redis_forgot_is_restored_from_postgres_and_gets_no_more_phantom_orders(
    db: PgPool,
) {
    let _run_time = RunTime::start();
    let app = TestApp::spawn(db).await;
    let stock = 100;
    let voucher = app.open_sale(stock).await;
    let (_serve, base) = app
        .spawn_server("serve", &[("WORKER_BLOCK_MS", "100".into())])
        .await;
    let winners = admitted(&press_all(&app, &base, voucher, 1..=20, 8).await);
    assert_eq!(winners.len(), 20);
    assert_eq!(
        app.wait_for_orders(voucher, 20, Duration::from_secs(20))
            .await,
        20
    );
    assert!(wait_drained(&app, &app.keys, Duration::from_secs(20)).await);

    let user = 7;
    let pg_order = winners[&user];
    let sale = app.keys.voucher(vid(voucher));
    let _: i64 = app
        .redis_cmd(redis::cmd("HDEL").arg(&sale).arg(format!("u:{user}")))
        .await;
    let stock_before = app.redis_stock(voucher).await;

    let mut answers = Vec::new();
    for _ in 0..6 {
        answers.push(press(&app, &base, voucher, user).await);
        // Let the worker deal with whatever the press admitted.
        assert!(wait_drained(&app, &app.keys, Duration::from_secs(10)).await);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let phantoms = answers
        .iter()
        .filter(|(s, _)| *s == StatusCode::ACCEPTED)
        .count();
    let buyer: Option<String> = app
        .redis_cmd(redis::cmd("HGET").arg(&sale).arg(format!("u:{user}")))
        .await;
    let live = app.redis_stock(voucher).await;
    let pg_stock = app.pg_stock(voucher).await;
    let dead = dead_letters(&app, &app.keys).await;
    println!(
        "answers to the forgotten buyer's six presses: {:?}; redis stock {stock_before:?} \
         before, {live:?} after; pg stock {pg_stock}; buyer record {buyer:?} (postgres \
         order {pg_order}); dead letters {dead}",
        answers
            .iter()
            .map(|(s, b)| format!("{} {}", s.as_u16(), b))
            .collect::<Vec<_>>(),
    );
    let stored = app.assert_consistent(voucher, stock).await;
    assert_eq!(stored.len(), 20, "the phantom orders were written");
    assert!(
        phantoms <= 1,
        "{phantoms} phantom 202s for a buyer who holds an order"
    );
    for (i, (status, body)) in answers.iter().enumerate().skip(1) {
        assert_eq!(*status, StatusCode::CONFLICT, "press {}: {body}", i + 1);
        assert_eq!(body["error"]["code"], "already_ordered", "press {}", i + 1);
        assert_eq!(
            body["error"]["order_id"],
            pg_order.to_string(),
            "press {}",
            i + 1
        );
    }
    assert_eq!(buyer, Some(pg_order.to_string()), "buyer record restored");
    assert_eq!(live, Some(pg_stock as i64), "redis stock vs postgres stock");
}

/// A healthy live sale under load is not drift. Reconcile without
/// `--repair` during a storm must exit 0 every time.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn reconcile_during_a_storm_on_a_healthy_sale_exits_zero(db: PgPool) {
    let _run_time = RunTime::start();
    let app = TestApp::spawn(db).await;
    let stock = 3000;
    let voucher = app.open_sale(stock).await;
    let (_serve, base) = app
        .spawn_server(
            "serve",
            &[
                ("WORKER_BATCH_SIZE", "32".into()),
                ("WORKER_BLOCK_MS", "100".into()),
            ],
        )
        .await;

    let storm_done = AtomicBool::new(false);
    // A storm of some seconds: 3,600 shoppers in twelve waves, a quarter second apart.
    let storm = async {
        let mut results = Vec::new();
        for wave in 0..12 {
            let users = wave * 300 + 1..=wave * 300 + 300;
            results.extend(press_all(&app, &base, voucher, users, 64).await);
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        storm_done.store(true, Ordering::SeqCst);
        results
    };
    // Two operators, six runs each at most, for as long as the storm lasts.
    let voucher_arg = voucher.to_string();
    let reconcile = ["reconcile", "--voucher", &voucher_arg];
    let checks = || async {
        let mut runs = Vec::new();
        for _ in 0..6 {
            if storm_done.load(Ordering::SeqCst) {
                break;
            }
            runs.push(seckill_async(&app, &reconcile, &[]).await);
        }
        runs
    };
    let (results, mut runs, more) = tokio::join!(storm, checks(), checks());
    runs.extend(more);
    let winners = admitted(&results);
    let codes: Vec<Option<i32>> = runs.iter().map(|r| r.0).collect();
    println!(
        "reconcile runs during the storm: {} with exit codes {codes:?}; 202s: {}",
        runs.len(),
        winners.len()
    );
    for (code, out, took) in &runs {
        if *code != Some(0) {
            println!("--- exit {code:?} after {took:?}:\n{out}");
        }
    }
    let failed = codes.iter().filter(|c| **c != Some(0)).count();
    assert_eq!(
        failed, 0,
        "reconcile runs that failed during the storm: {codes:?}"
    );
    assert!(
        runs.len() >= 2,
        "reconcile ran only {} times during the storm",
        runs.len()
    );
    assert_eq!(winners.len(), stock as usize);
    assert!(wait_drained(&app, &app.keys, Duration::from_secs(60)).await);
    let (after, out, _) = seckill_async(&app, &reconcile, &[]).await;
    assert_eq!(after, Some(0), "after the drain:\n{out}");
}

/// Loading a sale must not stall Redis for everybody else. With a
/// long backlog of other vouchers' orders in the stream, `reconcile --repair` runs while
/// a probe PINGs Redis: no PING may wait long.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn repairing_a_sale_behind_a_long_backlog_does_not_stall_redis(db: PgPool) {
    let run_time = RunTime::start();
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(100).await;
    let stream = app.keys.stream(app.keys.shard_of(vid(voucher))).to_string();
    let _: () = app
        .redis_cmd(
            redis::cmd("XGROUP")
                .arg("CREATE")
                .arg(&stream)
                .arg(seckill::stream::GROUP)
                .arg("0")
                .arg("MKSTREAM"),
        )
        .await;
    let backlog = 200_000;
    // Another sale's orders, with nobody working on them yet.
    let other = app.open_sale(backlog).await;
    assert_eq!(
        app.keys.shard_of(vid(other)),
        app.keys.shard_of(vid(voucher))
    );
    xadd_orders(&app, &stream, other, 1, backlog, 50_000_000).await;
    let len: i64 = app.redis_cmd(redis::cmd("XLEN").arg(&stream)).await;
    assert_eq!(len, backlog);
    println!(
        "backlog of {backlog} entries built in {:.1} s",
        run_time.elapsed().as_secs_f64()
    );

    let probe = PingProbe::start(&app.redis_url);
    let (code, out, took) = seckill_async(
        &app,
        &["reconcile", "--voucher", &voucher.to_string(), "--repair"],
        &[],
    )
    .await;
    let (worst, pings) = probe.stop();
    println!(
        "reconcile --repair took {took:?}, exit {code:?}; worst PING {worst:?} over {pings} \
         pings\n{out}"
    );
    assert_eq!(code, Some(0), "{out}");
    assert_eq!(app.redis_stock(voucher).await, Some(100));
    assert!(
        worst < Duration::from_millis(250),
        "Redis stalled for {worst:?} while a sale was loaded"
    );
}

/// The same through the API: the on-line reload of a sale whose state was
/// lost must not stall Redis either, behind the same backlog.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn reloading_a_lost_sale_on_line_behind_a_long_backlog_does_not_stall_redis(db: PgPool) {
    let _run_time = RunTime::start();
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(100).await;
    let stream = app.keys.stream(app.keys.shard_of(vid(voucher))).to_string();
    let (_api, base) = app.spawn_server("api", &[]).await;
    let backlog = 200_000;
    let other = app.open_sale(backlog).await;
    xadd_orders(&app, &stream, other, 1, backlog, 50_000_000).await;

    let probe = PingProbe::start(&app.redis_url);
    let _: i64 = app
        .redis_cmd(redis::cmd("DEL").arg(app.keys.voucher(vid(voucher))))
        .await;
    let (status, body) = press(&app, &base, voucher, 1).await;
    let reload_started = Instant::now();
    let deadline = reload_started + Duration::from_secs(60);
    while app.redis_stock(voucher).await.is_none() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let reloaded_after = reload_started.elapsed();
    let (worst, pings) = probe.stop();
    let live = app.redis_stock(voucher).await;
    println!(
        "press while the state was lost: {status} {body}; reloaded after {reloaded_after:?} \
         (redis stock {live:?}); worst PING {worst:?} over {pings} pings"
    );
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(live, Some(100), "the sale was reloaded");
    assert!(
        worst < Duration::from_millis(250),
        "Redis stalled for {worst:?} while a sale was reloaded"
    );
    assert_eq!(press(&app, &base, voucher, 2).await.0, StatusCode::ACCEPTED);
}

/// Shards are served fairly. A backlog on shard 0 must not hold up
/// an order on shard 1 until the whole backlog is written.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn an_order_on_a_quiet_shard_is_written_before_a_busy_shards_backlog_drains(db: PgPool) {
    let _run_time = RunTime::start();
    let app = TestApp::spawn(db.clone()).await;
    let keys = Keys::with_shards(app.keys.prefix(), 2).unwrap();
    let shards = [("STREAM_SHARDS", "2".to_string())];
    let (_api, base) = app.spawn_server("api", &shards).await;

    let backlog = 15_000i64;
    let mut busy = None;
    let mut quiet = None;
    for _ in 0..4 {
        let id = crate::common::open_sale_at(&app.client, &base, backlog).await;
        match keys.shard_of(vid(id)) {
            Shard(0) => busy = busy.or(Some(id)),
            _ => quiet = quiet.or(Some(id)),
        }
    }
    let (busy, quiet) = (busy.unwrap(), quiet.unwrap());
    assert_eq!(keys.shard_of(vid(busy)), Shard(0));
    assert_eq!(keys.shard_of(vid(quiet)), Shard(1));

    // Real orders of the busy sale, queued on shard 0 before any worker runs.
    xadd_orders(&app, keys.stream(Shard(0)), busy, 1, backlog, 70_000_000).await;
    let (status, body) = press(&app, &base, quiet, 1).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let quiet_order = order_id(&body);

    let t0 = Instant::now();
    let _worker = Process::spawn(
        "worker",
        &app.redis_url,
        app.keys.prefix(),
        &faults::database_url(&db, None),
        &shards,
    );
    let deadline = t0 + Duration::from_secs(90);
    let mut landed = None;
    while Instant::now() < deadline {
        let (quiet_done, busy_done): (i64, i64) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE id = $1), count(*) FILTER (WHERE voucher_id = $2) \
             FROM voucher_orders",
        )
        .bind(quiet_order)
        .bind(busy)
        .fetch_one(&db)
        .await
        .unwrap();
        if quiet_done == 1 {
            landed = Some((t0.elapsed(), busy_done));
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (after, busy_done) = landed.expect("the quiet shard's order was never written");
    let busy_total = app
        .wait_for_orders(busy, backlog as usize, Duration::from_secs(90))
        .await;
    let drained_in = t0.elapsed();
    println!(
        "shard 1's order written after {after:?}, when {busy_done} of shard 0's {backlog} \
         were written (all {busy_total} written after {drained_in:?})"
    );
    assert_eq!(busy_total, backlog as usize);
    assert!(
        busy_done < backlog / 2,
        "shard 1's order waited for {busy_done} of shard 0's {backlog} orders"
    );
}

// ---------------------------------------------------------------------------------------
// Helpers of this file.

/// Prints how long the test ran when it ends, passed or failed.
struct RunTime(Instant);

impl RunTime {
    fn start() -> Self {
        Self(Instant::now())
    }

    fn elapsed(&self) -> Duration {
        self.0.elapsed()
    }
}

impl Drop for RunTime {
    fn drop(&mut self) {
        println!("run time: {:.1} s", self.0.elapsed().as_secs_f64());
    }
}

/// One press by `user` against `base`.
async fn press(app: &TestApp, base: &str, voucher: i64, user: i64) -> (StatusCode, Value) {
    app.send(
        app.client
            .post(format!("{base}/vouchers/{voucher}/seckill"))
            .bearer_auth(app.token(user)),
    )
    .await
}

/// Whether an error answer names `order_id` as the caller's order.
fn names_order(body: &Value, order_id: i64) -> bool {
    body["error"]["order_id"].as_str() == Some(order_id.to_string().as_str())
}

fn order_id(body: &Value) -> i64 {
    body["order_id"]
        .as_str()
        .unwrap_or_else(|| panic!("no order id in {body}"))
        .parse()
        .unwrap()
}

/// The order ids of the 202 answers, by user; panics on any 5xx but 503 (a sale
/// being reloaded).
fn admitted(results: &[(i64, Option<(StatusCode, Value)>)]) -> HashMap<i64, i64> {
    let mut ids = HashMap::new();
    for (user, answer) in results {
        if let Some((status, body)) = answer {
            assert!(
                !status.is_server_error() || *status == StatusCode::SERVICE_UNAVAILABLE,
                "user {user}: {status} {body}"
            );
            if *status == StatusCode::ACCEPTED {
                ids.insert(*user, order_id(body));
            }
        }
    }
    ids
}

/// Runs `seckill <args>` in the test's database and key space, off the async runtime
/// (the test's other futures keep running): exit code (`None`: killed after two
/// minutes), stdout, and how long it took.
async fn seckill_async(
    app: &TestApp,
    args: &[&str],
    env: &[(&str, String)],
) -> (Option<i32>, String, Duration) {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    let (db, redis_url, prefix) = (
        faults::database_url(&app.db, None),
        app.redis_url.clone(),
        app.keys.prefix().to_string(),
    );
    tokio::task::spawn_blocking(move || {
        let mut cmd = Command::new(BIN);
        cmd.args(&args)
            .env("DATABASE_URL", db)
            .env("REDIS_URL", redis_url)
            .env("REDIS_KEY_PREFIX", prefix);
        run_captured(cmd, &env)
    })
    .await
    .unwrap()
}

fn run_captured(mut cmd: Command, env: &[(String, String)]) -> (Option<i32>, String, Duration) {
    cmd.env("JWT_SECRET", crate::common::SECRET)
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let started = Instant::now();
    let mut child = cmd.spawn().unwrap();
    let stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let mut stdout = stdout;
        std::io::Read::read_to_string(&mut stdout, &mut s).ok();
        s
    });
    let deadline = started + Duration::from_secs(120);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let out = reader.join().unwrap();
    (status.and_then(|s| s.code()), out, started.elapsed())
}

/// Waits (bounded) until every shard's stream has nothing unacknowledged: nothing
/// pending in the group and nothing after its last delivered entry.
async fn wait_drained(app: &TestApp, keys: &Keys, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        let mut busy = false;
        for shard in keys.shards() {
            busy |= unacknowledged(app, keys.stream(shard)).await;
        }
        if !busy {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether the stream holds entries its consumer group has not acknowledged.
async fn unacknowledged(app: &TestApp, stream: &str) -> bool {
    let exists: i64 = app.redis_cmd(redis::cmd("EXISTS").arg(stream)).await;
    if exists == 0 {
        return false;
    }
    let groups: Vec<HashMap<String, redis::Value>> = app
        .redis_cmd(redis::cmd("XINFO").arg("GROUPS").arg(stream))
        .await;
    let group = groups.iter().find(|g| {
        g.get("name")
            .and_then(|v| redis::from_redis_value_ref::<String>(v).ok())
            .as_deref()
            == Some(seckill::stream::GROUP)
    });
    let Some(group) = group else {
        let len: i64 = app.redis_cmd(redis::cmd("XLEN").arg(stream)).await;
        return len > 0;
    };
    let pending: i64 = group
        .get("pending")
        .and_then(|v| redis::from_redis_value_ref(v).ok())
        .unwrap_or(0);
    if pending > 0 {
        return true;
    }
    let last: String = group
        .get("last-delivered-id")
        .and_then(|v| redis::from_redis_value_ref(v).ok())
        .unwrap_or_else(|| "0-0".into());
    let after: redis::Value = app
        .redis_cmd(
            redis::cmd("XRANGE")
                .arg(stream)
                .arg(format!("({last}"))
                .arg("+")
                .arg("COUNT")
                .arg(1),
        )
        .await;
    matches!(after, redis::Value::Array(a) if !a.is_empty())
}

/// How many orders of the voucher Postgres holds.
async fn pg_order_count(app: &TestApp, voucher: i64) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM voucher_orders WHERE voucher_id = $1")
        .bind(voucher)
        .fetch_one(&app.db)
        .await
        .unwrap()
}

/// Dead letters in every shard.
async fn dead_letters(app: &TestApp, keys: &Keys) -> i64 {
    let mut n = 0;
    for shard in keys.shards() {
        let len: i64 = app
            .redis_cmd(redis::cmd("XLEN").arg(keys.dead_letters(shard)))
            .await;
        n += len;
    }
    n
}

/// Waits (bounded) until the group of the first shard has `n` consumers.
async fn wait_for_consumers(app: &TestApp, n: usize, limit: Duration) -> usize {
    let stream = app.keys.stream(Shard(0)).to_string();
    let deadline = Instant::now() + limit;
    loop {
        let consumers: redis::RedisResult<Vec<redis::Value>> = redis::cmd("XINFO")
            .arg("CONSUMERS")
            .arg(&stream)
            .arg(seckill::stream::GROUP)
            .query_async(&mut app.redis.clone())
            .await;
        let have = consumers.map(|c| c.len()).unwrap_or(0);
        if have >= n || Instant::now() > deadline {
            return have;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// XADDs `count` well-formed orders of `voucher` to `stream`, users `first_user..`,
/// order ids `first_order..`, in pipelines of a thousand.
async fn xadd_orders(
    app: &TestApp,
    stream: &str,
    voucher: i64,
    first_user: i64,
    count: i64,
    first_order: i64,
) {
    let now_ms = chrono::Utc::now().timestamp_millis();
    let mut conn = app.redis.clone();
    let mut i = 0;
    while i < count {
        let mut pipe = redis::pipe();
        for j in i..(i + 1000).min(count) {
            pipe.cmd("XADD")
                .arg(stream)
                .arg("*")
                .arg("order_id")
                .arg(first_order + j)
                .arg("voucher_id")
                .arg(voucher)
                .arg("user_id")
                .arg(first_user + j)
                .arg("admitted_ms")
                .arg(now_ms)
                .ignore();
        }
        let _: () = pipe.query_async(&mut conn).await.unwrap();
        i += 1000;
    }
}

/// PINGs Redis in a loop on a thread and connection of its own, and keeps the worst
/// round trip.
struct PingProbe {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<(Duration, u64)>,
}

impl PingProbe {
    fn start(url: &str) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let mut conn = redis::Client::open(url).unwrap().get_connection().unwrap();
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut worst = Duration::ZERO;
            let mut pings = 0u64;
            let deadline = Instant::now() + Duration::from_secs(180);
            while !flag.load(Ordering::SeqCst) && Instant::now() < deadline {
                let t = Instant::now();
                let _: String = redis::cmd("PING").query(&mut conn).unwrap();
                worst = worst.max(t.elapsed());
                pings += 1;
                std::thread::sleep(Duration::from_millis(2));
            }
            (worst, pings)
        });
        Self { stop, thread }
    }

    fn stop(self) -> (Duration, u64) {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.join().unwrap()
    }
}

/// One worker process writes with `WORKER_CONCURRENCY` consumers of its own, several
/// batches in flight. Killed with -9 in the middle of a backlog, whatever its lanes held
/// is taken over by another worker and written exactly once.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_worker_writes_through_one_consumer_per_lane_and_a_kill_loses_nothing_any_lane_held(
    db: PgPool,
) {
    let _run_time = RunTime::start();
    let app = TestApp::spawn(db.clone()).await;
    let n = 20_000;
    let voucher = app.open_sale(n).await;
    let stream = app.keys.stream(app.keys.shard_of(vid(voucher))).to_string();
    xadd_orders(&app, &stream, voucher, 1, n, 60_000_000).await;
    let url = faults::database_url(&db, None);
    let count = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM voucher_orders")
            .fetch_one(&app.db)
            .await
            .unwrap()
    };
    let lanes = [
        ("WORKER_CONSUMER", "lanes".to_string()),
        ("WORKER_CONCURRENCY", "3".to_string()),
        ("WORKER_BATCH_SIZE", "200".to_string()),
    ];
    let mut first = Process::spawn("worker", &app.redis_url, app.keys.prefix(), &url, &lanes);
    let deadline = Instant::now() + Duration::from_secs(60);
    while count().await < n / 4 {
        assert!(Instant::now() < deadline, "the worker wrote nothing");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    first.kill9();
    let written_by_first = count().await;
    let consumers: Vec<HashMap<String, redis::Value>> = app
        .redis_cmd(
            redis::cmd("XINFO")
                .arg("CONSUMERS")
                .arg(&stream)
                .arg(seckill::stream::GROUP),
        )
        .await;
    let mut held = Vec::new();
    for c in &consumers {
        let name: String = redis::from_redis_value(c["name"].clone()).unwrap();
        let pending: i64 = redis::from_redis_value(c["pending"].clone()).unwrap();
        held.push((name, pending));
    }
    held.sort();
    println!("killed after {written_by_first} of {n} orders; held by its lanes: {held:?}");
    let names: Vec<&str> = held.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(names, ["lanes", "lanes/1", "lanes/2"]);
    assert!(
        written_by_first < n,
        "the whole backlog was written before the kill"
    );

    let _second = Process::spawn(
        "worker",
        &app.redis_url,
        app.keys.prefix(),
        &url,
        &[("WORKER_CLAIM_IDLE_MS", "300".to_string())],
    );
    assert!(wait_drained(&app, &app.keys, Duration::from_secs(90)).await);
    let distinct: i64 = sqlx::query_scalar("SELECT count(DISTINCT user_id) FROM voucher_orders")
        .fetch_one(&app.db)
        .await
        .unwrap();
    assert_eq!((count().await, distinct), (n, n));
    assert_eq!(app.pg_stock(voucher).await, 0);
    assert_eq!(dead_letters(&app, &app.keys).await, 0);
}
