//! Reconcile's comparison: one segment of a sale read through the same fence as a load
//! (see [`super`]), Redis's side in one read-only function call (`seckill_check`), so
//! a sale in full swing balances exactly. Nothing is written: no epoch is drawn, and the
//! staged data is deleted afterwards.

use redis::aio::ConnectionLike;
use serde::Serialize;
use sqlx::PgPool;

use super::fenced::{Counting, Fence};
use super::Loaded;
use crate::domain::Epoch;
use crate::keys::{Keys, SaleSegment};
use crate::scripts::Replicas;
use crate::store;

/// One sale (one segment of it) seen from both stores at one moment: Postgres under the
/// sale's row lock, Redis (the segment's state and stream position) in one script.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Checked {
    pub initial_stock: i64,
    /// Postgres's stock (of a segment: its allotment less its buyers' active orders).
    pub pg_stock: i64,
    pub pg_orders: i64,
    /// The whole sale's stock and active orders in Postgres, read under the same lock
    /// (the sums of a segmented sale's segments, each read under a lock of its own, may
    /// straddle a move).
    pub sale_stock: i64,
    pub sale_orders: i64,
    pub end_time: chrono::DateTime<chrono::Utc>,
    /// What Redis must hold: stock, buyer records, and how many of those are orders in
    /// flight (admitted, not yet written).
    pub expected: Loaded,
    /// Redis's stock (`None`: the sale's state is missing).
    pub actual_stock: Option<i64>,
    pub actual_buyers: i64,
    /// Expected buyer records Redis lacks or names another order in.
    pub mismatched_buyers: i64,
    /// Closed orders whose release to Redis is owed and whose buyer record still holds
    /// their unit: counted in `expected`.
    pub owed_held: i64,
    /// The segment's epoch in Postgres, and the one Redis's state is armed with (`None`:
    /// none; a state being armed with Postgres's counts as armed).
    pub pg_epoch: Option<Epoch>,
    pub actual_epoch: Option<Epoch>,
}

/// `seckill_check`'s own fields of its argument, beside the fence's (see
/// `lua/load_voucher.lua`).
#[derive(Serialize)]
struct CheckArgs {
    /// Closed orders of the segment whose release to Redis is still owed.
    owed: Vec<Owed>,
    /// The moves taken out of the segment that Postgres recorded (the others are units on
    /// their way, in neither segment's stock).
    recorded_out: Vec<String>,
}

#[derive(Serialize)]
struct Owed {
    user: String,
    order: String,
}

/// Compares one segment's Redis state with what a load would write now. `None`: the
/// voucher has no flash sale.
#[tracing::instrument(skip(db, conn, keys))]
pub(crate) async fn check_segment<C: ConnectionLike + Send>(
    db: &PgPool,
    conn: &mut C,
    keys: &Keys,
    segment: SaleSegment,
) -> anyhow::Result<Option<Checked>> {
    let counting = Counting {
        scan: true,
        unsettled_burials: true,
    };
    let Some(mut fence) = Fence::lock(db, conn, keys, segment, counting).await? else {
        return Ok(None);
    };
    let args = CheckArgs {
        owed: store::lifecycle::owed_for(&mut fence.tx, segment.voucher_id)
            .await?
            .into_iter()
            .filter(|(u, _)| segment.is_home_of(*u))
            .map(|(u, o)| Owed {
                user: u.to_string(),
                order: o.to_string(),
            })
            .collect(),
        recorded_out: recorded_out(&mut fence.tx, conn, keys, segment).await?,
    };
    let reply = fence
        .step(conn, "seckill_check", &args, Replicas::NONE)
        .await;
    let removed = fence.stage.remove(conn).await;
    let reply = reply?
        .ok_or_else(|| anyhow::anyhow!("the check step of {segment:?} answered 'left alone'"))?;
    removed?;
    let c = Compared::parse(&reply)?;
    fence.tx.commit().await?;
    Ok(Some(Checked {
        initial_stock: fence.sale.initial_stock as i64,
        pg_stock: fence.pg_stock,
        pg_orders: fence.pg_orders,
        sale_stock: fence.sale.stock as i64,
        sale_orders: fence.sale_orders,
        end_time: fence.sale.end_time,
        expected: c.expected,
        actual_stock: c.actual_stock,
        actual_buyers: c.actual_buyers,
        mismatched_buyers: c.mismatched_buyers,
        owed_held: c.owed_held,
        pg_epoch: fence.pg_built.map(|b| b.epoch),
        actual_epoch: c.actual_epoch,
    }))
}

/// Which of the moves Redis took out of the segment Postgres recorded (a segmented
/// sale's only).
async fn recorded_out<C: ConnectionLike + Send>(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    conn: &mut C,
    keys: &Keys,
    segment: SaleSegment,
) -> anyhow::Result<Vec<String>> {
    if segment.label().is_none() {
        return Ok(Vec::new());
    }
    let taken: Vec<i64> = redis::cmd("HKEYS")
        .arg(keys.moves_out(segment))
        .query_async(conn)
        .await?;
    let recorded = store::segments::recorded_among(tx, &taken).await?;
    Ok(recorded.iter().map(i64::to_string).collect())
}

/// What `seckill_check` answered: what Redis must hold, and what it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Compared {
    pub(super) expected: Loaded,
    pub(super) actual_stock: Option<i64>,
    pub(super) actual_buyers: i64,
    pub(super) mismatched_buyers: i64,
    pub(super) owed_held: i64,
    pub(super) actual_epoch: Option<Epoch>,
}

impl Compared {
    pub(super) fn parse(reply: &[redis::Value]) -> anyhow::Result<Self> {
        let unexpected = || anyhow::anyhow!("unexpected reply from the check step: {reply:?}");
        let figures: Vec<i64> = reply
            .iter()
            .map(|v| redis::from_redis_value_ref::<i64>(v).ok())
            .collect::<Option<_>>()
            .ok_or_else(unexpected)?;
        let &[stock, buyers, in_flight, actual_stock, actual_buyers, mismatched_buyers, owed_held, actual_epoch] =
            figures.as_slice()
        else {
            return Err(unexpected());
        };
        Ok(Compared {
            expected: Loaded {
                stock,
                buyers,
                in_flight,
            },
            actual_stock: (actual_stock >= 0).then_some(actual_stock),
            actual_buyers,
            mismatched_buyers,
            owed_held,
            actual_epoch: Epoch::new(actual_epoch),
        })
    }
}
