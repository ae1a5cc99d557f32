//! The worker when the world is not what it expects: an order id minted twice, a
//! pending list shared with other workers, an entry id Redis gave to another order, a
//! database schema of another release.

use std::collections::HashSet;

use sqlx::PgPool;

use crate::common::{metric_value, oid, uid, vid, TestApp};
use crate::worker::{admit, read_new, redis_sale};

/// Appends an order entry to the sale's shard, as admission writes it (and nothing else:
/// no unit taken, no buyer record), as a replay of an entry would look.
async fn add_entry(app: &TestApp, voucher: i64, user: i64, order_id: i64) -> String {
    app.redis_cmd(&app.entry_of_one_order(voucher, user, order_id).await)
        .await
}

/// What another API process minting `order_id` again does: admits it for `user`, taking
/// a unit of the sale and setting the user's buyer record to it.
async fn admit_minted_again(app: &TestApp, voucher: i64, user: i64, order_id: i64) {
    add_entry(app, voucher, user, order_id).await;
    let sale = app.keys.voucher(vid(voucher));
    let _: i64 = app
        .redis_cmd(redis::cmd("HINCRBY").arg(&sale).arg("stock").arg(-1))
        .await;
    let _: i64 = app
        .redis_cmd(
            redis::cmd("HSET")
                .arg(&sale)
                .arg(format!("u:{user}"))
                .arg(order_id),
        )
        .await;
}

/// The reasons of the dead letters of the voucher's shard, oldest first.
async fn dead_letter_reasons(app: &TestApp, voucher: i64) -> Vec<String> {
    let letters: Vec<(String, Vec<(String, String)>)> = app
        .redis_cmd(
            redis::cmd("XRANGE")
                .arg(app.keys.dead_letters(app.keys.shard_of(vid(voucher))))
                .arg("-")
                .arg("+"),
        )
        .await;
    letters
        .into_iter()
        .map(|(_, fields)| {
            fields
                .into_iter()
                .find_map(|(k, v)| (k == "reason").then_some(v))
                .unwrap_or_default()
        })
        .collect()
}

/// `(id, user_id, voucher_id)` of every buried order.
async fn buried(app: &TestApp) -> HashSet<(i64, i64, i64)> {
    sqlx::query_as("SELECT id, user_id, voucher_id FROM dead_orders")
        .fetch_all(&app.db)
        .await
        .unwrap()
        .into_iter()
        .collect()
}

/// Duplicate order ids dead-lettered so far, by this process's recorder (shared by the
/// tests of this binary, so compare before and after).
async fn duplicates_counted(app: &TestApp) -> f64 {
    let text = app.metrics_text().await;
    metric_value(&text, "seckill_dead_lettered_total{kind=\"duplicate_id\"}").unwrap_or(0.0)
}

const DUPLICATE: &str = "order id already used by another order";

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn an_order_whose_id_another_order_holds_is_dead_lettered_and_gives_back_its_unit_and_buyer(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let (sale, other_sale) = (app.open_sale(10).await, app.open_sale(5).await);
    let id = *admit(&app, sale, 1..=1).await.iter().next().unwrap();
    app.drain().await;
    // Another API process minted the same id: for another buyer of the sale, and for a
    // buyer of another sale.
    admit_minted_again(&app, sale, 2, id).await;
    admit_minted_again(&app, other_sale, 3, id).await;
    assert_eq!(
        redis_sale(&app, sale, 2).await,
        (Some(8), Some(id.to_string()))
    );
    let counted = duplicates_counted(&app).await;

    let report = app.drain().await;
    println!("duplicates: {report:?}");
    assert_eq!(
        (report.inserted, report.already_there, report.dead_lettered),
        (0, 0, 2),
        "{report:?}"
    );
    assert_eq!(
        app.pg_orders(sale).await,
        vec![(id, 1)],
        "the id stays user 1's"
    );
    assert!(app.pg_orders(other_sale).await.is_empty());
    assert_eq!(
        (app.pg_stock(sale).await, app.pg_stock(other_sale).await),
        (9, 5)
    );
    assert_eq!(
        redis_sale(&app, sale, 2).await,
        (Some(9), None),
        "unit back, buyer record gone"
    );
    assert_eq!(redis_sale(&app, other_sale, 3).await, (Some(5), None));
    assert_eq!(redis_sale(&app, sale, 1).await.1, Some(id.to_string()));
    assert_eq!(
        dead_letter_reasons(&app, sale).await,
        [DUPLICATE, DUPLICATE]
    );
    assert!(duplicates_counted(&app).await >= counted + 2.0);
    let tombstones = HashSet::from([(id, 2, sale), (id, 3, other_sale)]);
    assert_eq!(buried(&app).await, tombstones);

    // Replayed: the order that owns the id is already there; the duplicate is settled
    // again without a second dead letter or a second unit back.
    add_entry(&app, sale, 1, id).await;
    add_entry(&app, sale, 2, id).await;
    let report = app.drain().await;
    println!("replays: {report:?}");
    assert_eq!(
        (report.inserted, report.already_there),
        (0, 1),
        "{report:?}"
    );
    assert_eq!(redis_sale(&app, sale, 2).await, (Some(9), None));
    assert_eq!(dead_letter_reasons(&app, sale).await.len(), 2);
    assert_eq!(buried(&app).await, tombstones);
    assert_eq!(app.pg_stock(sale).await, 9);
    assert_eq!(app.pending_count().await, 0);
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn one_order_id_twice_in_one_batch_takes_one_unit_and_the_other_buyers_order_is_dead_lettered(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let sale = app.open_sale(10).await;
    let id = *admit(&app, sale, 1..=1).await.iter().next().unwrap();
    // The same id minted again for user 2, and user 1's entry once more (a replay).
    admit_minted_again(&app, sale, 2, id).await;
    add_entry(&app, sale, 1, id).await;
    let (worker, shard, held) = read_new(&app, sale, "worker-one-batch").await;
    assert_eq!(held.len(), 3);

    let report = worker.process_batch(shard, &held).await.unwrap();
    println!("one batch: {report:?}");
    assert_eq!(
        (report.inserted, report.already_there, report.dead_lettered),
        (1, 1, 1),
        "{report:?}"
    );
    assert_eq!(app.pg_orders(sale).await, vec![(id, 1)]);
    assert_eq!(app.pg_stock(sale).await, 9, "one unit for one row");
    assert_eq!(redis_sale(&app, sale, 2).await, (Some(9), None));
    assert_eq!(redis_sale(&app, sale, 1).await.1, Some(id.to_string()));
    assert_eq!(dead_letter_reasons(&app, sale).await, [DUPLICATE]);
    assert_eq!(buried(&app).await, HashSet::from([(id, 2, sale)]));
    assert_eq!(app.pending_count().await, 0);
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn persisting_one_order_id_twice_writes_one_row_and_takes_one_unit(db: PgPool) {
    use seckill::store::orders::{self, NewOrder, Persisted, Rejection};
    let app = TestApp::spawn(db).await;
    let sale = app.open_sale(10).await;
    let first = NewOrder {
        id: oid(4242),
        user_id: uid(1),
        voucher_id: vid(sale),
        admitted_at: chrono::Utc::now(),
        segment: 0,
        segments: 1,
        epoch: app.epoch(sale).await,
    };
    let other_buyer = NewOrder {
        user_id: uid(2),
        ..first
    };
    let outcomes = orders::persist_batch(
        &app.db,
        &[first, other_buyer, first],
        &crate::common::all_live,
    )
    .await
    .unwrap();
    assert_eq!(
        outcomes,
        [
            Persisted::Inserted,
            Persisted::Rejected(Rejection::IdTaken),
            Persisted::AlreadyThere
        ]
    );
    assert_eq!(app.pg_orders(sale).await, vec![(4242, 1)]);
    assert_eq!(app.pg_stock(sale).await, 9);
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn an_order_whose_id_a_buried_order_holds_is_dead_lettered_as_a_duplicate(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let sale = app.open_sale(10).await;
    // Order 4242 of user 1 was buried (say, as poison) and settled.
    let first = seckill::store::orders::NewOrder {
        id: oid(4242),
        user_id: uid(1),
        voucher_id: vid(sale),
        admitted_at: chrono::Utc::now(),
        segment: 0,
        segments: 1,
        epoch: app.epoch(sale).await,
    };
    seckill::store::dead_orders::bury(&app.db, &first, "poison: test", true)
        .await
        .unwrap();
    admit_minted_again(&app, sale, 2, 4242).await;
    let counted = duplicates_counted(&app).await;

    let report = app.drain().await;
    assert_eq!(
        (report.inserted, report.dead_lettered),
        (0, 1),
        "{report:?}"
    );
    assert_eq!(dead_letter_reasons(&app, sale).await, [DUPLICATE]);
    assert!(duplicates_counted(&app).await > counted);
    assert_eq!(redis_sale(&app, sale, 2).await, (Some(10), None));
    assert_eq!(
        buried(&app).await,
        HashSet::from([(4242, 1, sale), (4242, 2, sale)])
    );
    assert!(app.pg_orders(sale).await.is_empty());
}

/// Appends `n` entries to the voucher's shard and delivers them to `consumer`, which
/// keeps them pending: another worker's batches, or what a dead one left behind.
async fn pending_elsewhere(app: &TestApp, voucher: i64, consumer: &str, n: usize) {
    let stream = app.keys.stream(app.keys.shard_of(vid(voucher)));
    let mut pipe = redis::pipe();
    for i in 0..n {
        pipe.cmd("XADD")
            .arg(stream)
            .arg("*")
            .arg("filler")
            .arg(i)
            .ignore();
    }
    let () = pipe.query_async(&mut app.redis.clone()).await.unwrap();
    let delivered: redis::Value = app
        .redis_cmd(
            redis::cmd("XREADGROUP")
                .arg("GROUP")
                .arg(seckill::stream::GROUP)
                .arg(consumer)
                .arg("COUNT")
                .arg(n)
                .arg("STREAMS")
                .arg(stream)
                .arg(">"),
        )
        .await;
    assert!(matches!(
        delivered,
        redis::Value::Array(_) | redis::Value::Map(_)
    ));
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_batch_whose_entries_lie_far_apart_in_a_long_pending_list_is_written_whole(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let sale = app.open_sale(10).await;
    admit(&app, sale, 1..=1).await;
    let (worker, shard, mut held) = read_new(&app, sale, "worker-spread").await;
    // Between the batch's two entries, 12,000 entries another worker holds: more than
    // a page of pending entries for a batch of two.
    pending_elsewhere(&app, sale, "worker-other", 12_000).await;
    admit(&app, sale, 2..=2).await;
    held.extend(read_new(&app, sale, "worker-spread").await.2);
    assert_eq!(held.len(), 2);

    let report = worker.process_batch(shard, &held).await.unwrap();
    println!("far apart: {report:?}");
    assert_eq!((report.inserted, report.vanished), (2, 0), "{report:?}");
    assert_eq!(app.pg_orders(sale).await.len(), 2);
    assert_eq!(app.pg_stock(sale).await, 8);
    assert_eq!(
        app.pending_count().await,
        12_000,
        "only the batch acknowledged"
    );
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn an_entry_id_redis_gave_to_another_order_is_not_written_for_the_lost_one_nor_acknowledged(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let sale = app.open_sale(10).await;
    let first = *admit(&app, sale, 1..=1).await.iter().next().unwrap();
    admit(&app, sale, 2..=2).await;
    let (worker, shard, held) = read_new(&app, sale, "worker-held").await;
    assert_eq!(held.len(), 2);
    // Redis loses the second entry and, its clock behind, gives that entry id to a new
    // order (a restart from an older copy, a failover): the id is pending, its order
    // is another.
    let entry_id = |e: &seckill::stream::Delivery| match e {
        seckill::stream::Delivery::Order { entry_id, .. } => entry_id.clone(),
        other => panic!("not an order: {other:?}"),
    };
    let reused = entry_id(&held[1]);
    let stream = app.keys.stream(shard);
    let _: i64 = app
        .redis_cmd(redis::cmd("XDEL").arg(stream).arg(&reused))
        .await;
    let _: () = app
        .redis_cmd(redis::cmd("XSETID").arg(stream).arg(entry_id(&held[0])))
        .await;
    let newcomer = 900_003_i64;
    let mut xadd = redis::cmd("XADD");
    xadd.arg(stream)
        .arg(&reused)
        .arg("order_id")
        .arg(newcomer)
        .arg("voucher_id")
        .arg(sale)
        .arg("user_id")
        .arg(3)
        .arg("admitted_ms")
        .arg(chrono::Utc::now().timestamp_millis())
        .arg("epoch")
        .arg(app.epoch(sale).await.unwrap().get());
    let _: String = app.redis_cmd(&xadd).await;

    let report = worker.process_batch(shard, &held).await.unwrap();
    println!("reused id: {report:?}");
    assert_eq!((report.inserted, report.vanished), (1, 1), "{report:?}");
    let ids =
        |orders: Vec<(i64, i64)>| orders.into_iter().map(|(id, _)| id).collect::<HashSet<_>>();
    assert_eq!(ids(app.pg_orders(sale).await), HashSet::from([first]));
    assert_eq!(
        app.pending_count().await,
        1,
        "the newcomer's entry stays pending"
    );

    // A worker takes it over once idle, and writes the order it holds now.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let report = app.worker_named("worker-next").reclaim().await.unwrap();
    assert_eq!(report.inserted, 1, "{report:?}");
    assert_eq!(
        ids(app.pg_orders(sale).await),
        HashSet::from([first, newcomer])
    );
    assert_eq!(app.pending_count().await, 0);
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn entries_delivered_too_often_are_found_however_far_apart_they_lie_in_the_pending_list(
    db: PgPool,
) {
    use seckill::stream::ReadFrom;
    let app = TestApp::spawn(db).await;
    let sale = app.open_sale(10).await;
    admit(&app, sale, 1..=1).await;
    let (crashing, shard, _) = read_new(&app, sale, "worker-crashloop").await;
    pending_elsewhere(&app, sale, "worker-other", 12_000).await;
    admit(&app, sale, 2..=2).await;
    read_new(&app, sale, "worker-crashloop").await;
    // Re-read six more times by a consumer that keeps dying: 7 deliveries each, past
    // twice the harness's bound of 3.
    for _ in 0..6 {
        let again = crashing
            .read_batch(shard, ReadFrom::OwnPending)
            .await
            .unwrap();
        assert_eq!(again.len(), 2);
    }
    // (The drain takes over the other worker's idle entries too: malformed ones.)
    let report = crashing.drain().await.unwrap();
    println!("poison far apart: {report:?}");
    assert_eq!(report.inserted, 0, "{report:?}");
    let reasons = dead_letter_reasons(&app, sale).await;
    let poison = reasons
        .iter()
        .filter(|r| r.starts_with("poison: delivered 8 times"));
    assert_eq!(poison.count(), 2);
    assert!(app.pg_orders(sale).await.is_empty());
}

/// Worker turns refused by the schema so far, by this process's recorder.
async fn schema_errors_counted(app: &TestApp) -> f64 {
    let text = app.metrics_text().await;
    metric_value(&text, "seckill_worker_schema_errors_total").unwrap_or(0.0)
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_schema_this_worker_does_not_expect_holds_its_batch_instead_of_burying_it(db: PgPool) {
    use std::time::{Duration, Instant};
    let app = TestApp::spawn(db).await;
    let sale = app.open_sale(10).await;
    let admitted = admit(&app, sale, 1..=3).await;
    // A later release's migration: a column every writer must fill, without a default.
    sqlx::raw_sql(
        "ALTER TABLE voucher_orders ADD COLUMN channel text NOT NULL DEFAULT 'web'; \
         ALTER TABLE voucher_orders ALTER COLUMN channel DROP DEFAULT",
    )
    .execute(&app.db)
    .await
    .unwrap();
    let counted = schema_errors_counted(&app).await;
    let cancel = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn(app.worker_named("worker-previous").run(cancel.clone()));

    // The worker retries with backoff: wait for a few refused turns.
    let deadline = Instant::now() + Duration::from_secs(10);
    while schema_errors_counted(&app).await < counted + 3.0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let dlq: usize = app
        .redis_cmd(redis::cmd("XLEN").arg(app.keys.dead_letters(app.keys.shard_of(vid(sale)))))
        .await;
    assert_eq!(dlq, 0, "nothing dead-lettered");
    assert!(buried(&app).await.is_empty(), "nothing tombstoned");
    assert_eq!(app.pending_count().await, 3, "the batch stays pending");
    assert_eq!(
        redis_sale(&app, sale, 1).await.0,
        Some(7),
        "no unit given back"
    );
    let refused = schema_errors_counted(&app).await - counted;
    println!("turns refused by the schema: {refused}");
    assert!(refused >= 3.0, "{refused}");

    // The schema is this worker's again: the batch it held is written.
    sqlx::raw_sql("ALTER TABLE voucher_orders DROP COLUMN channel")
        .execute(&app.db)
        .await
        .unwrap();
    assert_eq!(
        app.wait_for_orders(sale, 3, Duration::from_secs(20)).await,
        3
    );
    let stored: HashSet<i64> = app
        .pg_orders(sale)
        .await
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    assert_eq!(stored, admitted);
    assert_eq!(app.pg_stock(sale).await, 7);
    cancel.cancel();
    tokio::time::timeout(Duration::from_secs(5), running)
        .await
        .expect("the worker stops")
        .unwrap();
    assert_eq!(app.pending_count().await, 0);
}
