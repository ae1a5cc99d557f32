//! What a live snapshot says: a sale's stock, outcomes, orders, lag, clock and errors,
//! the same from every instance.

use super::*;

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn the_live_stream_shows_a_sales_stock_outcomes_and_orders_as_they_change(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(3).await;
    let mut events = Events::open(&app.client, &app.base).await;

    let first = events.next(WAIT).await;
    let view = sale_in(&first, voucher).expect("an open sale is shown");
    assert_eq!(view["state"], "open");
    assert_eq!(view["initial_stock"], 3);
    assert_eq!(view["title"], "50 off 100");
    for field in ["length", "pending", "lag", "dead_letters"] {
        assert!(first["worker"][field].is_u64(), "worker.{field}: {first}");
    }

    // Five shoppers for three units, and one of the winners again.
    let mut orders = Vec::new();
    for user in 1..=5 {
        let (status, body) = app.grab(voucher, user).await;
        if status == StatusCode::ACCEPTED {
            orders.push((user, body["order_id"].as_str().unwrap().to_string()));
        }
    }
    assert_eq!(orders.len(), 3);
    let (status, _) = app.grab(voucher, orders[0].0).await;
    assert_eq!(status, StatusCode::CONFLICT);

    // Admitted, not yet written (no worker runs in this app).
    let view = events
        .until(voucher, WAIT, |v| v["outcomes"]["admitted"] == 3)
        .await;
    assert_eq!(view["outcomes"]["sold_out"], 2, "{view}");
    assert_eq!(view["outcomes"]["already_ordered"], 1, "{view}");
    assert_eq!(view["remaining"], 0, "{view}");
    assert_eq!(view["orders"]["in_flight"], 3, "{view}");
    assert_eq!(view["orders"]["persisted"], 0, "{view}");

    // Written by the worker.
    app.drain().await;
    let view = events
        .until(voucher, WAIT, |v| v["orders"]["persisted"] == 3)
        .await;
    assert_eq!(view["orders"]["in_flight"], 0, "{view}");
    assert_eq!(view["orders"]["created"], 3, "{view}");

    // Paid and cancelled: the cancelled unit is back on sale.
    let (status, _) = app.pay(&orders[1].1, orders[1].0).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = app.cancel(&orders[2].1, orders[2].0).await;
    assert_eq!(status, StatusCode::OK);
    let view = events
        .until(voucher, WAIT, |v| v["orders"]["cancelled"] == 1)
        .await;
    assert_eq!(view["orders"]["paid"], 1, "{view}");
    assert_eq!(view["orders"]["created"], 1, "{view}");
    assert_eq!(view["remaining"], 1, "{view}");
    assert_eq!(view["orders"]["persisted"], 3, "{view}");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn the_live_stream_counts_the_grabs_answered_at_the_edge(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(1).await;
    let (status, _) = app.grab(voucher, 1).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    // Fresh shoppers press the sold-out sale for a second: after the first answers
    // from Redis, the instance answers most of them itself. (The metrics are this test
    // process's, shared with other tests: the live view's count is this sale's own.)
    let presses = 40;
    for user in 100..100 + presses {
        let (status, body) = app.grab(voucher, user).await;
        assert_eq!(status, StatusCode::CONFLICT, "{body}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let mut events = Events::open(&app.client, &app.base).await;
    let view = events
        .until(voucher, WAIT, |v| v["outcomes"]["sold_out"] == presses)
        .await;
    // Most of them answered at the edge: a subset of the sold-out answers, never more.
    let at_edge = view["outcomes"]["answered_at_edge"].as_i64().unwrap();
    assert!((3..=presses).contains(&at_edge), "{view}");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn every_api_instance_shows_the_same_numbers(db: PgPool) {
    let app = TestApp::spawn(db).await;
    // A second instance (the binary) in the same stores, limiting each shopper to one
    // grab a second.
    let limits = [
        ("RATE_LIMIT_PER_USER", "1".to_string()),
        ("RATE_LIMIT_PER_USER_BURST", "1".to_string()),
    ];
    let (_other, other) = app.spawn_server("api", &limits).await;
    let voucher = app.open_sale(4).await;

    // Grabs through both: three here, three there, and one shopper twice at once there.
    for user in 1..=3 {
        app.grab(voucher, user).await;
    }
    let grab_there = |user: i64| {
        app.client
            .post(format!("{other}/vouchers/{voucher}/seckill"))
            .bearer_auth(app.token(user))
            .send()
    };
    let mut statuses = Vec::new();
    for user in 4..=6 {
        statuses.push(grab_there(user).await.unwrap().status());
    }
    statuses.push(grab_there(6).await.unwrap().status());
    assert_eq!(
        statuses.last(),
        Some(&StatusCode::TOO_MANY_REQUESTS),
        "{statuses:?}"
    );
    app.drain().await;

    let settled = |v: &Value| {
        v["outcomes"]["admitted"] == 4
            && v["outcomes"]["sold_out"] == 2
            && v["outcomes"]["rate_limited"] == 1
            && v["orders"]["persisted"] == 4
    };
    let mut here = Events::open(&app.client, &app.base).await;
    let mut there = Events::open(&app.client, &other).await;
    let a = here.until(voucher, WAIT, settled).await;
    let b = there.until(voucher, WAIT, settled).await;
    for field in [
        "outcomes",
        "orders",
        "remaining",
        "initial_stock",
        "dead_letters",
    ] {
        assert_eq!(a[field], b[field], "{field}: here {a}, there {b}");
    }
    println!(
        "both instances: {} admitted, {} sold out, {} rate limited, {} persisted",
        a["outcomes"]["admitted"],
        a["outcomes"]["sold_out"],
        a["outcomes"]["rate_limited"],
        a["orders"]["persisted"]
    );
}

/// The grab counts a process has not flushed yet reach Redis when it stops (its last
/// flush follows its last answer), and grabs refused by rate limiting at voucher ids no
/// sale has make no keys.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_stopping_instance_writes_its_last_counts_and_made_up_vouchers_cost_no_keys(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let limits = [
        ("RATE_LIMIT_PER_USER", "1".to_string()),
        ("RATE_LIMIT_PER_USER_BURST", "1".to_string()),
    ];
    let (mut other, base) = app.spawn_server("api", &limits).await;
    let voucher = crate::common::open_sale_at(&app.client, &base, 5).await;
    let grab = |voucher: i64, user: i64| {
        app.client
            .post(format!("{base}/vouchers/{voucher}/seckill"))
            .bearer_auth(app.token(user))
            .send()
    };
    let mut statuses = Vec::new();
    for user in 1..=8 {
        statuses.push(grab(voucher, user).await.unwrap().status().as_u16());
    }
    // Shopper 8 again at once: refused by the limiter, counted (the sale is known).
    statuses.push(grab(voucher, 8).await.unwrap().status().as_u16());
    // Shopper 9 at 50 vouchers that do not exist: one 404, then refused by the limiter.
    for made_up in 900_001..=900_050 {
        statuses.push(grab(made_up, 9).await.unwrap().status().as_u16());
    }
    let count = |code: u16| statuses.iter().filter(|&&s| s == code).count();
    assert_eq!(
        (count(202), count(409), count(429), count(404)),
        (5, 3, 50, 1)
    );

    // Straight away, well within the second between flushes.
    other.sigterm();
    let status = other
        .wait_exit(Duration::from_secs(20))
        .await
        .expect("stopped");
    assert!(status.success(), "{status}");
    let key = format!("{}seckill:live:{voucher}", app.keys.prefix());
    let counts: std::collections::HashMap<String, u64> =
        app.redis_cmd(redis::cmd("HGETALL").arg(&key)).await;
    assert_eq!(counts.get("admitted"), Some(&5), "{counts:?}");
    assert_eq!(counts.get("sold_out"), Some(&3), "{counts:?}");
    assert_eq!(counts.get("rate_limited"), Some(&1), "{counts:?}");
    let keys: Vec<String> = app
        .redis_cmd(redis::cmd("KEYS").arg(format!("{}seckill:live:*", app.keys.prefix())))
        .await;
    assert_eq!(keys, vec![key], "only the real sale has counts");
}

/// Whether a sale is upcoming, open or ended is Postgres's answer (`now()`), one clock
/// for every instance: an instance whose clock is an hour behind still shows a sale
/// that began half an hour ago as open. (Postgres's clock is moved here by a `now()` of
/// the test database's own, found first on its search path.)
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_sales_state_follows_the_database_clock_not_the_instances(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let now = chrono::Utc::now();
    let sale = app
        .create_sale(
            5,
            now + chrono::Duration::minutes(30),
            now + chrono::Duration::hours(2),
        )
        .await;
    let name: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&app.db)
        .await
        .unwrap();
    for statement in [
        "CREATE SCHEMA skew".to_string(),
        "CREATE FUNCTION skew.now() RETURNS timestamptz LANGUAGE sql STABLE \
         AS $$ SELECT pg_catalog.now() + interval '1 hour' $$"
            .to_string(),
        format!("ALTER DATABASE \"{name}\" SET search_path = public, skew, pg_catalog"),
    ] {
        sqlx::query(&statement).execute(&app.db).await.unwrap();
    }
    // A new process, so new connections: they see the database an hour ahead. (`public`
    // stays first on the path: tables, and the migrations' own, are created there.)
    let (_api, base) = app.spawn_server("api", &[]).await;
    let mut events = Events::open(&app.client, &base).await;
    let snapshot = events.next(WAIT).await;
    let view = sale_in(&snapshot, sale).expect("shown");
    assert_eq!(view["state"], "open", "{view}");
    // And the snapshot's time is the database's, so countdowns agree too.
    let at: chrono::DateTime<chrono::Utc> = snapshot["at"].as_str().unwrap().parse().unwrap();
    let ahead = (at - chrono::Utc::now()).num_seconds();
    assert!((3590..=3610).contains(&ahead), "at {at}: {ahead} s ahead");
}

/// A lag Redis cannot tell (its group's `lag` is NULL once an entry past the group's
/// last delivery is deleted) is sent as null, shown as unknown, never as 0 (which reads
/// as "every order delivered").
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_lag_redis_cannot_tell_is_null_not_zero(db: PgPool) {
    let app = TestApp::spawn(db).await;
    app.worker().ensure_groups().await.unwrap();
    let voucher = app.open_sale(3).await;
    for user in 1..=3 {
        let (status, body) = app.grab(voucher, user).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    }
    let mut events = Events::open(&app.client, &app.base).await;
    let known = |s: &Value| s["worker"]["lag"] == 3;
    let deadline = Instant::now() + WAIT;
    loop {
        let snapshot = events.next(WAIT).await;
        if known(&snapshot) {
            break;
        }
        assert!(Instant::now() < deadline, "lag never 3: {snapshot}");
    }

    let stream = app.keys.stream(seckill::keys::Shard(0));
    let entries: Vec<(String, Vec<(String, String)>)> = app
        .redis_cmd(redis::cmd("XRANGE").arg(stream).arg("-").arg("+"))
        .await;
    assert_eq!(entries.len(), 3);
    let _: i64 = app
        .redis_cmd(redis::cmd("XDEL").arg(stream).arg(&entries[1].0))
        .await;
    let deadline = Instant::now() + WAIT;
    loop {
        let snapshot = events.next(WAIT).await;
        if snapshot["worker"]["lag"].is_null() {
            assert_eq!(snapshot["worker"]["length"], 2, "{snapshot}");
            break;
        }
        assert!(Instant::now() < deadline, "lag never null: {snapshot}");
    }
}

/// With no worker ever started there is no consumer group: every entry is still to be
/// delivered, so the lag is the stream's length, on the page and on `/metrics` (0 would
/// read as "all delivered" exactly when no worker runs).
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn with_no_worker_ever_started_the_lag_is_the_whole_stream(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(3).await;
    for user in 1..=3 {
        let (status, body) = app.grab(voucher, user).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    }
    let groups: Vec<redis::Value> = app
        .redis_cmd(
            redis::cmd("XINFO")
                .arg("GROUPS")
                .arg(app.keys.stream(app.keys.shard_of(vid(voucher)))),
        )
        .await;
    assert!(groups.is_empty(), "no group yet: {groups:?}");
    let mut events = Events::open(&app.client, &app.base).await;
    let deadline = Instant::now() + WAIT;
    loop {
        let snapshot = events.next(WAIT).await;
        if snapshot["worker"]["length"] == 3 {
            assert_eq!(snapshot["worker"]["lag"], 3, "{snapshot}");
            break;
        }
        assert!(Instant::now() < deadline, "never 3 entries: {snapshot}");
    }
    // A process of its own: this test binary's recorder is shared by parallel tests.
    let (_api, base) = app.spawn_server("api", &[]).await;
    let text = crate::common::metrics_at(&app.client, &base).await;
    assert_eq!(
        crate::common::metric_value(&text, "seckill_stream_lag{shard=\"0\"}"),
        Some(3.0),
        "{text}"
    );
}

/// A corrupt stock in Redis (the most negative integer) is shown as it is, with no
/// overflow in the in-flight arithmetic (it panicked the producer in debug builds and
/// wrapped in release), and the stream carries on; once the stock is right again, so
/// is the page. (Were the producer to panic anyway, it is restarted: see
/// `startup::tests`.)
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_corrupt_stock_in_redis_neither_stops_the_stream_nor_overflows(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(5).await;
    let (status, body) = app.grab(voucher, 1).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let mut events = Events::open(&app.client, &app.base).await;
    events.until(voucher, WAIT, |v| v["remaining"] == 4).await;

    let key = app.keys.voucher(vid(voucher));
    let _: i64 = app
        .redis_cmd(redis::cmd("HSET").arg(&key).arg("stock").arg(i64::MIN))
        .await;
    let corrupt = events
        .until(voucher, WAIT, |v| v["remaining"] == i64::MIN)
        .await;
    let in_flight = corrupt["orders"]["in_flight"].as_i64();
    assert!(in_flight.is_none_or(|n| n >= 0), "{corrupt}");
    // Snapshots keep coming while it is corrupt.
    for _ in 0..2 {
        let snapshot = events.next(WAIT).await;
        assert_eq!(sale_in(&snapshot, voucher).unwrap()["remaining"], i64::MIN);
    }
    let _: i64 = app
        .redis_cmd(redis::cmd("HSET").arg(&key).arg("stock").arg(4))
        .await;
    events.until(voucher, WAIT, |v| v["remaining"] == 4).await;
}

/// A page opening while grabs flow gets the real grab rate and admission time in its
/// very first snapshot (never a 0 while the producer builds up a history): they are
/// the last seconds' figures Redis keeps, the same on every instance.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_new_pages_first_snapshot_carries_the_real_grab_rate_and_admission_time(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(100_000).await;
    let stop = std::sync::atomic::AtomicBool::new(false);
    let grabbing = async {
        let mut user = 1;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let (status, body) = app.grab(voucher, user).await;
            assert_eq!(status, StatusCode::ACCEPTED, "{body}");
            user += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        user - 1
    };
    let watching = async {
        // No page has watched yet: the process has no history of this sale's counts.
        tokio::time::sleep(Duration::from_secs(4)).await;
        let mut first = Events::open(&app.client, &app.base).await;
        let snapshot = first.next(WAIT).await;
        let (_api, other) = app.spawn_server("api", &[]).await;
        let there = Events::open(&app.client, &other).await.next(WAIT).await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        (snapshot, there)
    };
    let (grabs, (snapshot, there)) = tokio::join!(grabbing, watching);
    let view = sale_in(&snapshot, voucher).unwrap();
    let rate = view["grabs_per_sec"].as_f64().unwrap_or(0.0);
    // About 40 a second on an idle machine; a busy one grabs fewer.
    assert!(rate >= 5.0, "grabs/s {rate} in the first snapshot: {view}");
    let p99 = view["admission_p99_ms"].as_f64();
    assert!(p99.is_some_and(|ms| ms > 0.0), "{view}");
    assert_eq!(view["errors_per_sec"], 0.0, "{view}");
    // A new instance's first snapshot too: no history there at all.
    let view = sale_in(&there, voucher).unwrap();
    let rate = view["grabs_per_sec"].as_f64().unwrap_or(0.0);
    assert!(rate >= 5.0, "grabs/s {rate} on another instance: {view}");
    println!("{grabs} grabs; first snapshots: {view}");
}

/// The figures of a sale's orders add up, in every snapshot: admitted = persisted + in
/// flight + dead letters, and persisted = awaiting payment + paid + cancelled +
/// expired; once the grab counts are in, admitted is the count of 202s.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_sales_orders_add_up_admitted_is_persisted_plus_in_flight_plus_dead_letters(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(10).await;
    let mut orders = Vec::new();
    for user in 1..=5 {
        let (status, body) = app.grab(voucher, user).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{body}");
        orders.push((user, body["order_id"].as_str().unwrap().to_string()));
        if user == 3 {
            // Three written; two left in flight.
            app.drain().await;
        }
    }
    let adds_up = |v: &Value| {
        let o = &v["orders"];
        let n = |f: &str| o[f].as_i64().unwrap_or_else(|| panic!("orders.{f}: {v}"));
        assert_eq!(
            n("persisted"),
            n("created") + n("paid") + n("cancelled") + n("expired"),
            "{v}"
        );
        if let Some(in_flight) = o["in_flight"].as_i64() {
            assert_eq!(
                n("admitted"),
                n("persisted") + in_flight + v["dead_letters"].as_i64().unwrap(),
                "{v}"
            );
        } else {
            assert!(o["admitted"].is_null(), "{v}");
        }
    };
    let mut events = Events::open(&app.client, &app.base).await;
    let view = events
        .until(voucher, WAIT, |v| {
            adds_up(v);
            v["outcomes"]["admitted"] == 5
        })
        .await;
    assert_eq!(view["orders"]["admitted"], 5, "{view}");
    assert_eq!(view["orders"]["persisted"], 3, "{view}");
    assert_eq!(view["orders"]["in_flight"], 2, "{view}");

    // Paid, cancelled (its unit back on sale and sold again), all written.
    let (status, _) = app.pay(&orders[0].1, orders[0].0).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = app.cancel(&orders[1].1, orders[1].0).await;
    assert_eq!(status, StatusCode::OK);
    let (status, body) = app.grab(voucher, 6).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    app.drain().await;
    let view = events
        .until(voucher, WAIT, |v| {
            adds_up(v);
            v["outcomes"]["admitted"] == 6 && v["orders"]["in_flight"] == 0
        })
        .await;
    assert_eq!(view["orders"]["admitted"], 6, "{view}");
    assert_eq!(view["orders"]["persisted"], 6, "{view}");
    assert_eq!(view["orders"]["created"], 4, "{view}");
    assert_eq!(view["orders"]["paid"], 1, "{view}");
    assert_eq!(view["orders"]["cancelled"], 1, "{view}");
    // 10 units, 6 taken, 1 given back.
    assert_eq!(view["remaining"], 5, "{view}");
}

/// Grabs answered 503 are counted as their sale's errors, by kind (nothing reserved: a
/// sale whose Redis state is being repaired; outcome unknown: a call Redis answered
/// too late), with their rate over the last seconds.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn grabs_answered_503_are_counted_as_their_sales_errors_with_their_rate(db: PgPool) {
    // A Redis of its own: it is blocked below.
    let redis = crate::common::faults::PrivateRedis::start();
    let app = TestApp::spawn_with(db, redis.url.clone(), false).await;
    let voucher = app.open_sale(5).await;
    let (status, body) = app.grab(voucher, 1).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");

    // A corrupt stock: refused, nothing reserved, while the sale is repaired.
    let _: i64 = app
        .redis_cmd(
            redis::cmd("HSET")
                .arg(app.keys.voucher(vid(voucher)))
                .arg("stock")
                .arg("x"),
        )
        .await;
    let (status, body) = app.grab(voucher, 2).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(body["error"]["outcome"].is_null(), "{body}");
    let deadline = Instant::now() + WAIT;
    while app.grab(voucher, 3).await.0 != StatusCode::ACCEPTED {
        assert!(Instant::now() < deadline, "never repaired");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Redis answers after the API gave up: the outcome is unknown.
    let blocked = crate::http_limits::block_redis(&redis.url, 3_500).await;
    let (status, body) = app.grab(voucher, 4).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(body["error"]["outcome"], "unknown", "{body}");
    blocked.await.unwrap();

    let mut events = Events::open(&app.client, &app.base).await;
    let view = events
        .until(voucher, WAIT, |v| {
            v["outcomes"]["unknown"] == 1 && v["errors_per_sec"].as_f64() > Some(0.0)
        })
        .await;
    assert!(
        view["outcomes"]["unavailable"].as_u64() >= Some(1),
        "{view}"
    );
    assert_eq!(view["outcomes"]["admitted"], 2, "{view}");
    // The grab whose answer was lost did go through: an order in flight, not a 202.
    assert_eq!(view["orders"]["admitted"], 3, "{view}");
}
