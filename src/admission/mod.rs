//! Admission: the one atomic Redis step that decides who gets an order.

pub mod keys;
pub mod loader;
pub mod order_id;
pub mod upkeep;

use std::sync::LazyLock;

use redis::aio::ConnectionLike;
use redis::{RedisResult, Script};

use keys::Keys;

static SECKILL: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../lua/seckill.lua")));

/// The verdict of the admission script.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Admitted {
        order_id: i64,
    },
    /// The voucher's state is not in Redis: fail closed.
    NotLoaded,
    NotStarted,
    Ended,
    AlreadyOrdered {
        order_id: i64,
    },
    SoldOut,
}

impl Outcome {
    /// A stable name for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            Outcome::Admitted { .. } => "admitted",
            Outcome::NotLoaded => "not_loaded",
            Outcome::NotStarted => "not_started",
            Outcome::Ended => "ended",
            Outcome::AlreadyOrdered { .. } => "already_ordered",
            Outcome::SoldOut => "sold_out",
        }
    }
}

/// Runs the admission script: one EVALSHA (the script is loaded again on NOSCRIPT).
#[tracing::instrument(level = "debug", skip(conn, keys))]
pub async fn admit<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    voucher_id: i64,
    user_id: i64,
    order_id: i64,
) -> RedisResult<Outcome> {
    let shard = keys.shard_of(voucher_id);
    let reply: Vec<redis::Value> = SECKILL
        .key(keys.voucher(voucher_id))
        .key(keys.stream(shard))
        .key(keys.pending(shard))
        .arg(voucher_id)
        .arg(user_id)
        .arg(order_id)
        .invoke_async(conn)
        .await?;
    let code = reply
        .first()
        .and_then(|v| redis::from_redis_value_ref::<i64>(v).ok());
    let id = reply
        .get(1)
        .and_then(|v| redis::from_redis_value_ref::<i64>(v).ok());
    Ok(match (code.unwrap_or(-1), id) {
        (0, Some(order_id)) => Outcome::Admitted { order_id },
        (1, _) => Outcome::NotLoaded,
        (2, _) => Outcome::NotStarted,
        (3, _) => Outcome::Ended,
        (4, Some(order_id)) => Outcome::AlreadyOrdered { order_id },
        (5, _) => Outcome::SoldOut,
        _ => {
            return Err(redis::RedisError::from((
                redis::ErrorKind::UnexpectedReturnType,
                "unexpected reply from the admission script",
            )))
        }
    })
}

/// Remaining stock as Redis sees it (`None`: the sale is not loaded).
pub async fn live_stock<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    voucher_id: i64,
) -> RedisResult<Option<i64>> {
    redis::cmd("HGET")
        .arg(keys.voucher(voucher_id))
        .arg("stock")
        .query_async(conn)
        .await
}

/// An order admitted in Redis and not yet acknowledged by the worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PendingOrder {
    pub order_id: i64,
    pub voucher_id: i64,
    pub user_id: i64,
    pub admitted_ms: i64,
}

/// Looks orders up among those the worker has not written yet.
pub async fn pending_orders<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    order_ids: &[i64],
) -> RedisResult<Vec<PendingOrder>> {
    let mut found = Vec::new();
    if order_ids.is_empty() {
        return Ok(found);
    }
    for shard in keys.shards() {
        let raw: Vec<Option<String>> = redis::cmd("HMGET")
            .arg(keys.pending(shard))
            .arg(order_ids)
            .query_async(conn)
            .await?;
        for (&order_id, raw) in order_ids.iter().zip(raw) {
            let Some(raw) = raw else { continue };
            let mut parts = raw.split(':').map(str::parse::<i64>);
            if let (Some(Ok(voucher_id)), Some(Ok(user_id)), Some(Ok(admitted_ms))) =
                (parts.next(), parts.next(), parts.next())
            {
                found.push(PendingOrder {
                    order_id,
                    voucher_id,
                    user_id,
                    admitted_ms,
                });
            }
        }
    }
    Ok(found)
}

/// Looks an order up among those the worker has not written yet.
pub async fn pending_order<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    order_id: i64,
) -> RedisResult<Option<PendingOrder>> {
    Ok(pending_orders(conn, keys, &[order_id]).await?.pop())
}

/// The user's orders in the given sales that the worker has not written yet: the
/// buyer records of those sales, confirmed by the pending records.
pub async fn pending_orders_of<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    user_id: i64,
    voucher_ids: &[i64],
) -> RedisResult<Vec<PendingOrder>> {
    if voucher_ids.is_empty() {
        return Ok(Vec::new());
    }
    let field = keys::buyer_field(user_id);
    let mut pipe = redis::pipe();
    for &voucher_id in voucher_ids {
        pipe.cmd("HGET").arg(keys.voucher(voucher_id)).arg(&field);
    }
    let held: Vec<Option<i64>> = pipe.query_async(conn).await?;
    let order_ids: Vec<i64> = held.into_iter().flatten().collect();
    let mut found = pending_orders(conn, keys, &order_ids).await?;
    found.retain(|p| p.user_id == user_id);
    Ok(found)
}
