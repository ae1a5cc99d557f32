//! Long backlogs and row locks: orders behind a long row lock, repair and reload
//! behind a backlog, and a quiet shard's order written before a busy shard's backlog.

use super::*;

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

/// Loading a sale must not stall Redis for everybody else. With a
/// long backlog of other vouchers' orders in the stream, `reconcile --repair` runs while
/// a probe PINGs Redis: no PING may wait long.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn repairing_a_sale_behind_a_long_backlog_does_not_stall_redis(db: PgPool) {
    let run_time = RunTime::start();
    // A Redis of its own: the worst PING measures this load alone, not another
    // test's big deletes on a shared server.
    let redis = faults::PrivateRedis::start();
    let app = TestApp::spawn_with(db, redis.url.clone(), false).await;
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
    // A Redis of its own: the worst PING measures this load alone, not another
    // test's big deletes on a shared server.
    let redis = faults::PrivateRedis::start();
    let app = TestApp::spawn_with(db, redis.url.clone(), false).await;
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
    // Reloaded once armed: the load writes the state, Postgres commits its epoch, and
    // only then does the state admit (a press in between is still "being loaded").
    let armed = || async {
        let epoch: Option<i64> = app
            .redis_cmd(
                redis::cmd("HGET")
                    .arg(app.keys.voucher(vid(voucher)))
                    .arg("epoch"),
            )
            .await;
        epoch.is_some()
    };
    while !armed().await && Instant::now() < deadline {
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
