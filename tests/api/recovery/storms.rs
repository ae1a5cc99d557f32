//! Repair, online reload and reconcile run during a storm: exact stock, no buyer
//! lost, nothing oversold, exit zero on a healthy sale.

use super::*;

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
    let (_serve, base) = serve_in_small_batches(&app).await;

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

    let (reload_winners, persisted_at_reload, mut second_orders, mut doubles) =
        forty_reloads_during_the_drain(&app, &base, voucher, &url, &first).await;

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

/// Forty reloads of the sale during the drain, each racing the workers' commits; returns
/// the orders the reloading presses won, the orders in Postgres at each reload, second
/// orders of earlier winners, and how many earlier winners were not told their own order.
async fn forty_reloads_during_the_drain(
    app: &TestApp,
    base: &str,
    voucher: i64,
    url: &str,
    first: &HashMap<i64, i64>,
) -> (HashMap<i64, i64>, Vec<i64>, Vec<i64>, i32) {
    // During the drain, 40 times: the sale's row is briefly locked (say, an admin's
    // transaction), so the workers' commits bunch up behind it; the sale's state is
    // lost; a press answers 503 and starts the reload; the lock is released meanwhile —
    // the workers commit and acknowledge while the reload runs — and the reload ends.
    let mut lock = sqlx::PgConnection::connect(url).await.unwrap();
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
        persisted_at_reload.push(pg_order_count(app, voucher).await);
        let user = 100_000 + i;
        // The release goes out while the press is on its way, a little later each time
        // (0 to 5 ms), so that some releases land inside the reload.
        let release = async {
            tokio::time::sleep(Duration::from_micros(1000 * (i as u64 % 6))).await;
            sqlx::query("COMMIT").execute(&mut lock).await.unwrap();
        };
        let ((status, body), ()) = tokio::join!(press(app, base, voucher, user), release);
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
        for (user, answer) in press_all(app, base, voucher, unknown, 16).await {
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
    (reload_winners, persisted_at_reload, second_orders, doubles)
}

/// A healthy live sale under load is not drift. Reconcile without
/// `--repair` during a storm must exit 0 every time.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn reconcile_during_a_storm_on_a_healthy_sale_exits_zero(db: PgPool) {
    let _run_time = RunTime::start();
    let app = TestApp::spawn(db).await;
    let stock = 3000;
    let voucher = app.open_sale(stock).await;
    let (_serve, base) = serve_in_small_batches(&app).await;

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

/// `seckill serve` whose worker commits small batches often: many commits and
/// acknowledgements for a storm to race.
async fn serve_in_small_batches(app: &TestApp) -> (Process, String) {
    app.spawn_server(
        "serve",
        &[
            ("WORKER_BATCH_SIZE", "32".into()),
            ("WORKER_BLOCK_MS", "100".into()),
        ],
    )
    .await
}
