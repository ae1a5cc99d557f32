//! Delivering the stream to the worker: pending entries taken over, batches not written
//! twice, acks, trimming, expiry of buyer records and redelivery bounds.

use super::*;

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn entries_a_dead_worker_never_acked_are_persisted_once_when_it_starts_again(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(50).await;
    let admitted = admit(&app, voucher, 1..=40).await;
    assert_eq!(deliver_and_die(&app, "worker-a").await, 40);
    assert_eq!(app.pending_count().await, 40);
    assert!(stored_ids(&app, voucher).await.is_empty());

    // The same consumer starts again: it replays its own pending list first.
    let report = app.worker_named("worker-a").drain().await.unwrap();
    assert_eq!(report.inserted, 40);
    assert_eq!(stored_ids(&app, voucher).await, admitted);
    assert_eq!(app.pg_stock(voucher).await, 10);
    assert_eq!(app.pending_count().await, 0);
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn another_worker_takes_over_what_a_dead_consumer_left_pending(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(50).await;
    let admitted = admit(&app, voucher, 1..=25).await;
    deliver_and_die(&app, "worker-dead").await;

    // Not yet idle long enough: a live worker leaves them alone.
    let survivor = app.worker_named("worker-live");
    assert_eq!(survivor.reclaim().await.unwrap().entries, 0);
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let report = survivor.reclaim().await.unwrap();
    assert_eq!((report.entries, report.inserted), (25, 25));
    assert_eq!(stored_ids(&app, voucher).await, admitted);
    assert_eq!(app.pg_stock(voucher).await, 25);
    assert_eq!(app.pending_count().await, 0);
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_batch_committed_but_never_acked_is_not_written_twice(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(30).await;
    let admitted = admit(&app, voucher, 1..=20).await;

    // A worker reads, commits, and dies before XACK.
    app.commit_without_ack("worker-b", seckill::keys::Shard(0))
        .await;
    assert_eq!(app.pg_stock(voucher).await, 10);

    let report = app.worker_named("worker-b").drain().await.unwrap();
    assert_eq!((report.inserted, report.already_there), (0, 20));
    assert_eq!(stored_ids(&app, voucher).await, admitted);
    assert_eq!(
        app.pg_stock(voucher).await,
        10,
        "stock taken once, not twice"
    );
    assert_eq!(app.pending_count().await, 0);
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn the_service_loop_drains_the_stream_and_stops_when_cancelled(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(20).await;
    let cancel = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn(app.worker().run(cancel.clone()));
    let admitted = admit(&app, voucher, 1..=20).await;
    let mut stored = HashSet::new();
    for _ in 0..100 {
        stored = stored_ids(&app, voucher).await;
        if stored.len() == admitted.len() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(stored, admitted);
    cancel.cancel();
    tokio::time::timeout(std::time::Duration::from_secs(5), running)
        .await
        .expect("worker stops promptly")
        .unwrap();
    assert_eq!(app.pg_stock(voucher).await, 0);
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn an_entry_delivered_too_often_is_dead_lettered_instead_of_retried_forever(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(10).await;
    admit(&app, voucher, 1..=2).await;
    // Delivered once, then re-read six more times by a consumer that keeps dying.
    deliver_and_die(&app, "worker-crashloop").await;
    let crashing = app.worker_named("worker-crashloop");
    for _ in 0..6 {
        let again = crashing
            .read_batch(seckill::keys::Shard(0), ReadFrom::OwnPending)
            .await
            .unwrap();
        assert_eq!(again.len(), 2);
    }
    // The harness allows 3 deliveries (then entries are written alone) and gives up
    // past twice that: the next replay, the 8th delivery, buries them.
    let report = crashing.drain().await.unwrap();
    assert_eq!((report.inserted, report.dead_lettered), (0, 2));
    assert_eq!(app.pending_count().await, 0);
    let dlq = app.keys.dead_letters(app.keys.shard_of(vid(voucher)));
    let dead: Vec<(String, Vec<(String, String)>)> = app
        .redis_cmd(redis::cmd("XRANGE").arg(dlq).arg("-").arg("+"))
        .await;
    assert_eq!(dead.len(), 2);
    let reason = &dead[0].1.iter().find(|(k, _)| k == "reason").unwrap().1;
    assert!(reason.starts_with("poison: delivered 8 times"), "{reason}");
    assert!(dead[0]
        .1
        .iter()
        .any(|(k, v)| k == "orig.voucher_id" && *v == voucher.to_string()));
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn acknowledged_entries_are_trimmed_but_pending_ones_are_kept(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(20).await;
    let stream = app.keys.stream(app.keys.shard_of(vid(voucher)));
    admit(&app, voucher, 1..=10).await;
    deliver_and_die(&app, "worker-gone").await;
    admit(&app, voucher, 11..=15).await;

    let live = app.worker_named("worker-live");
    let shard = app.keys.shard_of(vid(voucher));
    let fresh = live
        .read_batch(shard, ReadFrom::New { block_ms: 1 })
        .await
        .unwrap();
    assert_eq!(fresh.len(), 5);
    live.process_batch(shard, &fresh).await.unwrap();
    live.trim().await.unwrap();
    let len: usize = app.redis_cmd(redis::cmd("XLEN").arg(stream)).await;
    assert_eq!(len, 15, "nothing older than a pending entry goes");

    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    live.drain().await.unwrap();
    let len: usize = app.redis_cmd(redis::cmd("XLEN").arg(stream)).await;
    assert_eq!(len, 0);
    assert_eq!(stored_ids(&app, voucher).await.len(), 15);
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn consumers_of_dead_workers_are_forgotten_once_they_hold_nothing(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(5).await;
    admit(&app, voucher, 1..=3).await;
    deliver_and_die(&app, "worker-ghost").await;
    let stream = app.keys.stream(app.keys.shard_of(vid(voucher)));
    let names = || async {
        let consumers: Vec<std::collections::HashMap<String, redis::Value>> = app
            .redis_cmd(
                redis::cmd("XINFO")
                    .arg("CONSUMERS")
                    .arg(stream)
                    .arg(seckill::stream::GROUP),
            )
            .await;
        consumers
            .iter()
            .map(|c| redis::from_redis_value_ref::<String>(&c["name"]).unwrap())
            .collect::<Vec<_>>()
    };
    let live = app.worker_named("worker-live");
    // Idle long enough, but still holding entries: kept.
    tokio::time::sleep(std::time::Duration::from_millis(900)).await;
    live.trim().await.unwrap();
    assert!(names().await.contains(&"worker-ghost".to_string()));
    // Its entries taken over, and idle on: forgotten.
    live.reclaim().await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(900)).await;
    live.trim().await.unwrap();
    assert!(!names().await.contains(&"worker-ghost".to_string()));
    assert_eq!(stored_ids(&app, voucher).await.len(), 3);
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_committed_order_delivered_too_often_is_acknowledged_not_dead_lettered(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(10).await;
    admit(&app, voucher, 1..=2).await;
    // A slow worker committed the batch but never acknowledged it ...
    let (slow, shard, batch) = read_new(&app, voucher, "worker-slow").await;
    let orders: Vec<NewOrder> = batch.iter().filter_map(|e| e.order().copied()).collect();
    orders::persist_batch(&app.db, &orders, &all_live)
        .await
        .unwrap();
    // ... and its entries were re-read until they counted as poison.
    for _ in 0..6 {
        slow.read_batch(shard, ReadFrom::OwnPending).await.unwrap();
    }
    let report = slow.drain().await.unwrap();
    assert_eq!(
        (report.dead_lettered, report.already_there),
        (0, 2),
        "{report:?}"
    );
    let dlq: usize = app
        .redis_cmd(redis::cmd("XLEN").arg(app.keys.dead_letters(shard)))
        .await;
    assert_eq!(dlq, 0, "a committed order is never a dead letter");
    assert_eq!(stored_ids(&app, voucher).await.len(), 2);
    assert_eq!(app.pending_count().await, 0);
    let (stock, buyer) = redis_sale(&app, voucher, 1).await;
    assert_eq!(stock, Some(8));
    assert!(buyer.is_some(), "the buyer record stays");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn orders_redelivered_past_the_bound_are_written_one_by_one_not_buried(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(10).await;
    let admitted = admit(&app, voucher, 1..=4).await;
    // Workers kept dying while holding the batch (killed, not poisoned by it).
    deliver_and_die(&app, "worker-killed").await;
    let killed = app.worker_named("worker-killed");
    for _ in 0..3 {
        killed
            .read_batch(seckill::keys::Shard(0), ReadFrom::OwnPending)
            .await
            .unwrap();
    }
    // Fifth delivery: past the bound of 3, within twice it: written, entry by entry.
    let report = killed.drain().await.unwrap();
    assert_eq!(
        (report.inserted, report.dead_lettered),
        (4, 0),
        "{report:?}"
    );
    assert_eq!(stored_ids(&app, voucher).await, admitted);
    assert_eq!(app.pending_count().await, 0);
}
