//! Entries the worker buries or dead-letters: malformed entries, stock Postgres lacks,
//! late replays, entries Redis lost, phantom buyers and row-lock races.

use super::*;

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn malformed_entries_are_dead_lettered_and_do_not_hold_up_real_orders(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(10).await;
    let stream = app.keys.stream(app.keys.shard_of(vid(voucher)));
    let _: String = app
        .redis_cmd(
            redis::cmd("XADD")
                .arg(stream)
                .arg("*")
                .arg("order_id")
                .arg("oops"),
        )
        .await;
    let _: String = app
        .redis_cmd(
            redis::cmd("XADD")
                .arg(stream)
                .arg("*")
                .arg("hello")
                .arg("world"),
        )
        .await;
    let admitted = admit(&app, voucher, 1..=5).await;

    let report = app.drain().await;
    assert_eq!((report.inserted, report.dead_lettered), (5, 2));
    assert_eq!(stored_ids(&app, voucher).await, admitted);
    assert_eq!(app.pending_count().await, 0);
    let dlq = app.keys.dead_letters(app.keys.shard_of(vid(voucher)));
    let dead: usize = app.redis_cmd(redis::cmd("XLEN").arg(dlq)).await;
    assert_eq!(dead, 2);
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn postgres_never_sells_more_than_its_stock_even_if_redis_admitted_more(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(2).await;
    let admitted = admit(&app, voucher, 1..=2).await;
    // Orders that Redis should never have let through (say, after state was rebuilt
    // from a stale copy): one more buyer, and a second order for a user.
    for (order_id, user) in [(900_001i64, 3i64), (900_002, 1)] {
        let xadd = app.entry_of_one_order(voucher, user, order_id).await;
        let _: String = app.redis_cmd(&xadd).await;
    }
    let report = app.drain().await;
    assert_eq!((report.inserted, report.dead_lettered), (2, 2));
    assert_eq!(stored_ids(&app, voucher).await, admitted);
    assert_eq!(app.pg_stock(voucher).await, 0);
    assert_eq!(app.pending_count().await, 0);
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn buyer_records_expire_with_the_sale_state(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(5).await;
    admit(&app, voucher, 1..=1).await;
    // Buyers are fields of the sale's hash, so they expire with it.
    let buyer: Option<String> = app
        .redis_cmd(
            redis::cmd("HGET")
                .arg(app.keys.voucher(vid(voucher)))
                .arg("u:1"),
        )
        .await;
    assert!(buyer.is_some());
    let ttl: i64 = app
        .redis_cmd(redis::cmd("PTTL").arg(app.keys.voucher(vid(voucher))))
        .await;
    // open_sale ends in an hour; the default retention is a day after that.
    let expected = 25 * 3600 * 1000;
    assert!((expected - ttl).abs() < 60_000, "{ttl}");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_dead_lettered_order_releases_its_buyer_who_may_try_again(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(5).await;
    let (_, admitted) = app.grab(voucher, 7).await;
    let order_id = admitted["order_id"].as_str().unwrap().to_string();
    // Postgres has nothing left to sell (say, it was sold through another channel).
    sqlx::query("UPDATE seckill_vouchers SET stock = 0 WHERE voucher_id = $1")
        .bind(voucher)
        .execute(&app.db)
        .await
        .unwrap();
    let report = app.drain().await;
    assert_eq!((report.inserted, report.dead_lettered), (0, 1));

    let (status, _) = app
        .get(&format!("/orders/{order_id}"), Some(&app.token(7)))
        .await;
    assert_eq!(
        status,
        StatusCode::NOT_FOUND,
        "a dead-lettered order is no order"
    );
    let (_, mine) = app.get("/orders", Some(&app.token(7))).await;
    assert_eq!(mine, serde_json::json!([]));
    // Redis still has units, so the user can grab again (and that order is refused by
    // Postgres's guard in turn: nothing is ever oversold).
    let (status, again) = app.grab(voucher, 7).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{again}");
    assert_ne!(again["order_id"].as_str().unwrap(), order_id);
    app.drain().await;
    assert!(stored_ids(&app, voucher).await.is_empty());
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_buried_order_is_never_written_by_a_late_replay_and_its_unit_returns_once(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(10).await;
    let admitted = admit(&app, voucher, 1..=1).await;
    let order_id = *admitted.iter().next().unwrap();
    assert_eq!(redis_sale(&app, voucher, 1).await.0, Some(9));
    // A slow worker holds the entry; a peer gave up on it as poison and buried it in
    // Postgres, then died before settling it in Redis.
    let (slow, shard, held) = read_new(&app, voucher, "worker-slow").await;
    let order = *held[0].order().unwrap();
    seckill::store::dead_orders::bury(&app.db, &order, "poison: test", true)
        .await
        .unwrap();

    // The slow worker writes its batch at last: the tombstone refuses it, and it
    // finishes the burial instead.
    let report = slow.process_batch(shard, &held).await.unwrap();
    assert_eq!(
        (report.inserted, report.dead_lettered),
        (0, 1),
        "{report:?}"
    );
    assert!(stored_ids(&app, voucher).await.is_empty());
    assert_eq!(app.pg_stock(voucher).await, 10);
    let (stock, buyer) = redis_sale(&app, voucher, 1).await;
    assert_eq!(stock, Some(10), "the unit is back on sale");
    assert_eq!(buyer, None, "the user holds no order");
    let dead: Vec<i64> = sqlx::query_scalar("SELECT id FROM dead_orders")
        .fetch_all(&app.db)
        .await
        .unwrap();
    assert_eq!(dead, vec![order_id]);
    assert_eq!(app.pending_count().await, 0);

    // Replayed once more (its entry is acknowledged now): nothing changes.
    let report = slow.process_batch(shard, &held).await.unwrap();
    assert_eq!((report.inserted, report.vanished), (0, 1), "{report:?}");
    assert_eq!(
        redis_sale(&app, voucher, 1).await.0,
        Some(10),
        "returned once"
    );
    assert!(stored_ids(&app, voucher).await.is_empty());
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_batch_whose_entries_redis_lost_is_not_written(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(10).await;
    admit(&app, voucher, 1..=3).await;
    let (worker, shard, held) = read_new(&app, voucher, "worker-held").await;
    assert_eq!(held.len(), 3);
    // Redis loses its data while the batch is held (say, Postgres was down): a new
    // term, noticed here by the worker's next call, and the sale is reloaded from
    // Postgres, which does not know these orders.
    let _: () = app
        .redis_cmd(
            redis::cmd("DEL")
                .arg(app.keys.stream(shard))
                .arg(app.keys.voucher(vid(voucher))),
        )
        .await;
    worker.ensure_groups().await.unwrap();
    seckill::admission::loader::load_sale(
        &app.db,
        &mut app.redis.clone(),
        &app.keys,
        vid(voucher),
        std::time::Duration::from_secs(60),
        seckill::admission::loader::Mode::Heal,
        seckill::scripts::Replicas::NONE,
    )
    .await
    .unwrap();
    assert_eq!(redis_sale(&app, voucher, 1).await.0, Some(10));
    // Writing the batch now would leave Redis selling 10 units Postgres has 7 of.
    let report = worker.process_batch(shard, &held).await.unwrap();
    assert_eq!((report.inserted, report.vanished), (0, 3), "{report:?}");
    assert!(stored_ids(&app, voucher).await.is_empty());
    assert_eq!(app.pg_stock(voucher).await, 10);
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_buyer_redis_forgot_gets_their_real_order_back_and_the_phantom_unit_returns(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(10).await;
    let real = *admit(&app, voucher, 5..=5).await.iter().next().unwrap();
    app.drain().await;
    // Redis forgets the buyer (an AOF-second loss, a failover).
    let _: () = app
        .redis_cmd(
            redis::cmd("HDEL")
                .arg(app.keys.voucher(vid(voucher)))
                .arg("u:5"),
        )
        .await;
    let (status, phantom) = app.grab(voucher, 5).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{phantom}");
    assert_eq!(redis_sale(&app, voucher, 5).await.0, Some(8));
    let report = app.drain().await;
    assert_eq!(report.dead_lettered, 1);

    let (stock, buyer) = redis_sale(&app, voucher, 5).await;
    assert_eq!(
        stock,
        Some(9),
        "the phantom's unit is back: redis = postgres"
    );
    assert_eq!(app.pg_stock(voucher).await, 9);
    assert_eq!(
        buyer,
        Some(real.to_string()),
        "the record names the real order"
    );
    for _ in 0..5 {
        let (status, body) = app.grab(voucher, 5).await;
        assert_eq!(status, StatusCode::CONFLICT, "{body}");
        assert_eq!(body["error"]["order_id"], real.to_string());
    }
    assert_eq!(redis_sale(&app, voucher, 5).await.0, Some(9));
}

/// A batch inserts its rows before it takes the sale's row lock (so batches of one sale
/// build their rows side by side); what moved while it waited for the lock is decided
/// again under it. Here a peer buries one of its orders and another entry is finished
/// elsewhere (acknowledged) while the batch waits: neither row may be committed.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn rows_inserted_before_the_row_lock_are_dropped_if_buried_or_gone_while_waiting_for_it(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(10).await;
    admit(&app, voucher, 1..=4).await;
    let (worker, shard, held) = read_new(&app, voucher, "worker-waiting").await;
    assert_eq!(held.len(), 4);
    let order_of = |user: i64| {
        *held
            .iter()
            .filter_map(|e| e.order())
            .find(|o| o.user_id == uid(user))
            .unwrap()
    };
    let (buried, gone) = (order_of(1), order_of(2));
    let kept = HashSet::from([order_of(3).id.get(), order_of(4).id.get()]);
    let gone_entry = held
        .iter()
        .find_map(|e| match e {
            Delivery::Order { entry_id, order } if order.id == gone.id => Some(entry_id.clone()),
            _ => None,
        })
        .unwrap();

    // Someone holds the sale's row; the batch inserts its rows and waits for it.
    let (lock, batch) = batch_waiting_for_the_row_lock(&app, voucher, worker, shard, held).await;

    // Meanwhile a peer buries user 1's order (its tombstone is committed) and user 2's
    // entry is finished elsewhere.
    sqlx::query(
        "INSERT INTO dead_orders (id, user_id, voucher_id, reason) VALUES ($1, $2, $3, 'test')",
    )
    .bind(buried.id)
    .bind(buried.user_id)
    .bind(voucher)
    .execute(&app.db)
    .await
    .unwrap();
    let acked: i64 = app
        .redis_cmd(
            redis::cmd("XACK")
                .arg(app.keys.stream(shard))
                .arg(seckill::stream::GROUP)
                .arg(&gone_entry),
        )
        .await;
    assert_eq!(acked, 1);
    lock.commit().await.unwrap();

    let report = batch.await.unwrap().unwrap();
    assert_eq!(
        (report.inserted, report.vanished, report.dead_lettered),
        (2, 1, 1),
        "{report:?}"
    );
    let stored = stored_ids(&app, voucher).await;
    assert_eq!(stored, kept, "only the orders nothing happened to");
    assert_eq!(
        app.pg_stock(voucher).await,
        8,
        "stock taken for the two rows only"
    );
    // The buried order was settled in Redis as its burial would: buyer record gone,
    // unit back (6 left after four admissions, plus one).
    assert_eq!(redis_sale(&app, voucher, 1).await, (Some(7), None));
}

/// A peer buried an order because Postgres had no unit for it (Redis sold one too many)
/// and died before settling it in Redis. A worker that meets the order later finds it
/// dead already and settles it as the burial decided: the buyer record goes, and no unit
/// comes back to Redis (one would be sold again, and that 202 could never be written).
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn an_order_buried_for_want_of_stock_returns_no_unit_whoever_settles_it(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(10).await;
    admit(&app, voucher, 1..=1).await;
    assert_eq!(redis_sale(&app, voucher, 1).await.0, Some(9));
    let (late, shard, held) = read_new(&app, voucher, "worker-late").await;
    let order = *held[0].order().unwrap();
    let burial =
        seckill::store::dead_orders::bury(&app.db, &order, "no stock left in postgres", false)
            .await
            .unwrap();
    assert!(matches!(
        burial,
        seckill::store::dead_orders::Burial::Dead {
            newly: true,
            returns_unit: false,
            ..
        }
    ));

    let report = late.process_batch(shard, &held).await.unwrap();
    assert_eq!(
        (report.inserted, report.dead_lettered),
        (0, 1),
        "{report:?}"
    );
    assert!(stored_ids(&app, voucher).await.is_empty());
    assert_eq!(
        redis_sale(&app, voucher, 1).await,
        (Some(9), None),
        "buyer record settled, no unit back"
    );
}

/// An order skipped before the lock because its user held another order is asked again
/// under the lock: here the other order was cancelled while the batch waited, so this
/// one (a phantom Redis admitted after forgetting the buyer) is written, not buried.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn an_order_whose_users_other_order_closed_while_the_batch_waited_is_written(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(10).await;
    let first = *admit(&app, voucher, 7..=7).await.iter().next().unwrap();
    app.drain().await;
    // Redis forgets the buyer; the user's next grab is admitted again.
    let _: () = app
        .redis_cmd(
            redis::cmd("HDEL")
                .arg(app.keys.voucher(vid(voucher)))
                .arg("u:7"),
        )
        .await;
    let second = *admit(&app, voucher, 7..=7).await.iter().next().unwrap();
    let (worker, shard, held) = read_new(&app, voucher, "worker-waiting").await;
    assert_eq!(held.len(), 1);

    let (lock, batch) = batch_waiting_for_the_row_lock(&app, voucher, worker, shard, held).await;
    // The first order's cancel commits meanwhile (as its transaction would have, before
    // this batch's lock; done by hand here, since a real cancel waits for the same lock).
    sqlx::query("UPDATE voucher_orders SET status = 'cancelled', closed_at = now() WHERE id = $1")
        .bind(first)
        .execute(&app.db)
        .await
        .unwrap();
    lock.commit().await.unwrap();

    let report = batch.await.unwrap().unwrap();
    assert_eq!(
        (report.inserted, report.dead_lettered),
        (1, 0),
        "{report:?}"
    );
    assert_eq!(
        app.pg_status(&second.to_string()).await.as_deref(),
        Some("created"),
        "the second order is the user's live order now"
    );
}
