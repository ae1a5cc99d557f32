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
        .key(keys.buyers(voucher_id))
        .key(keys.stream(shard))
        .key(keys.pending(shard))
        .key(keys.user_pending(shard, user_id))
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

/// Looks an order up among those the worker has not written yet.
pub async fn pending_order<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    order_id: i64,
) -> RedisResult<Option<PendingOrder>> {
    for shard in keys.shards() {
        let raw: Option<String> = redis::cmd("HGET")
            .arg(keys.pending(shard))
            .arg(order_id)
            .query_async(conn)
            .await?;
        if let Some(raw) = raw {
            let mut parts = raw.split(':').map(str::parse::<i64>);
            if let (Some(Ok(voucher_id)), Some(Ok(user_id)), Some(Ok(admitted_ms))) =
                (parts.next(), parts.next(), parts.next())
            {
                return Ok(Some(PendingOrder {
                    order_id,
                    voucher_id,
                    user_id,
                    admitted_ms,
                }));
            }
        }
    }
    Ok(None)
}

/// A user's orders that the worker has not written yet.
pub async fn pending_orders_of<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    user_id: i64,
) -> RedisResult<Vec<PendingOrder>> {
    let mut out = Vec::new();
    for shard in keys.shards() {
        let raw: Vec<(i64, String)> = redis::cmd("HGETALL")
            .arg(keys.user_pending(shard, user_id))
            .query_async(conn)
            .await?;
        for (order_id, value) in raw {
            if let Some((v, t)) = value.split_once(':') {
                if let (Ok(voucher_id), Ok(admitted_ms)) = (v.parse(), t.parse()) {
                    out.push(PendingOrder {
                        order_id,
                        voucher_id,
                        user_id,
                        admitted_ms,
                    });
                }
            }
        }
    }
    Ok(out)
}
