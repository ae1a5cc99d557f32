//! The worker: replays, take-overs, idempotent writes and entries that can never be orders.

use std::collections::HashSet;

use crate::common::{all_live, uid, vid, TestApp};
use reqwest::StatusCode;
use seckill::store::orders::{self, NewOrder};
use seckill::stream::{Delivery, ReadFrom};
use sqlx::PgPool;

mod burial;
mod delivery;
mod entries;

/// Admits `n` users and returns their order ids.
pub(crate) async fn admit(
    app: &TestApp,
    voucher: i64,
    users: std::ops::RangeInclusive<i64>,
) -> HashSet<i64> {
    let mut ids = HashSet::new();
    for user in users {
        let (status, body) = app.grab(voucher, user).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{body}");
        ids.insert(body["order_id"].as_str().unwrap().parse().unwrap());
    }
    ids
}

async fn stored_ids(app: &TestApp, voucher: i64) -> HashSet<i64> {
    app.pg_orders(voucher)
        .await
        .into_iter()
        .map(|(id, _)| id)
        .collect()
}

/// Delivers every new entry to `consumer` and never acknowledges them: a worker that
/// died between read and commit.
async fn deliver_and_die(app: &TestApp, consumer: &str) -> usize {
    let dead = app.worker_named(consumer);
    dead.ensure_groups().await.unwrap();
    let shard = seckill::keys::Shard(0);
    let mut delivered = 0;
    loop {
        let batch = dead
            .read_batch(shard, ReadFrom::New { block_ms: 1 })
            .await
            .unwrap();
        if batch.is_empty() {
            return delivered;
        }
        delivered += batch.len();
    }
}

/// A worker named `consumer` that has read (and holds, unacknowledged) the new entries
/// of the voucher's shard.
pub(crate) async fn read_new(
    app: &TestApp,
    voucher: i64,
    consumer: &str,
) -> (seckill::worker::Worker, seckill::keys::Shard, Vec<Delivery>) {
    let worker = app.worker_named(consumer);
    worker.ensure_groups().await.unwrap();
    let shard = app.keys.shard_of(vid(voucher));
    let entries = worker
        .read_batch(shard, ReadFrom::New { block_ms: 1 })
        .await
        .unwrap();
    (worker, shard, entries)
}

/// Reads the sale's live stock and a user's buyer record straight from Redis.
pub(crate) async fn redis_sale(
    app: &TestApp,
    voucher: i64,
    user: i64,
) -> (Option<i64>, Option<String>) {
    let key = app.keys.voucher(vid(voucher));
    let stock: Option<i64> = app
        .redis_cmd(redis::cmd("HGET").arg(&key).arg("stock"))
        .await;
    let buyer: Option<String> = app
        .redis_cmd(redis::cmd("HGET").arg(&key).arg(format!("u:{user}")))
        .await;
    (stock, buyer)
}

/// Takes the sale's row lock, then starts `worker` on the batch `held`, and returns once
/// the batch (its rows inserted) waits for that lock: the lock's transaction, to commit
/// when the test has done what happens meanwhile, and the batch's task.
async fn batch_waiting_for_the_row_lock(
    app: &TestApp,
    voucher: i64,
    worker: seckill::worker::Worker,
    shard: seckill::keys::Shard,
    held: Vec<Delivery>,
) -> (
    sqlx::Transaction<'static, sqlx::Postgres>,
    tokio::task::JoinHandle<anyhow::Result<seckill::worker::BatchReport>>,
) {
    let mut lock = app.db.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM seckill_vouchers WHERE voucher_id = $1 FOR UPDATE")
        .bind(voucher)
        .execute(&mut *lock)
        .await
        .unwrap();
    let batch = tokio::spawn(async move { worker.process_batch(shard, &held).await });
    let waiting = async {
        loop {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                 AND wait_event_type = 'Lock' AND query LIKE '%seckill_vouchers%'",
            )
            .fetch_one(&app.db)
            .await
            .unwrap();
            if n > 0 {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(10), waiting)
        .await
        .expect("the batch never waited for the row lock");
    (lock, batch)
}
