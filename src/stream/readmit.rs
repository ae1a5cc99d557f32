//! An order admitted again, under its own id, into its sale's current state
//! (`seckill_adopt`, `lua/seckill.lua`): one whose entry the fence refused as stale, or
//! that Redis lost with every copy of its entry. A unit is taken there, its buyer
//! recorded and a new entry appended, stamped with the current epoch, exactly as an
//! admission would have; a worker then writes it like any other.

use chrono::{DateTime, Utc};
use redis::aio::ConnectionLike;

use crate::domain::{Epoch, OrderId, UserId};
use crate::keys::{Keys, SalePart};
use crate::scripts::{Call, Replicas};

/// What admitting an order again did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Readmitted {
    /// Admitted again now, or found admitted already (its buyer record names it).
    Kept,
    /// No unit left for it, or its user holds another order there.
    Refused,
    /// This Redis does not hold the sale's current state (or did not answer, or could
    /// not get the write acknowledged): to be tried again, where the sale lives.
    Elsewhere,
}

/// Admits order `order_id` of `user_id` again into `part`'s state of Postgres's `epoch`,
/// as admitted at `admitted_at`, waiting for `replicas`.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn readmit<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    part: SalePart,
    epoch: Epoch,
    user_id: UserId,
    order_id: OrderId,
    admitted_at: DateTime<Utc>,
    replicas: Replicas,
) -> Readmitted {
    let code: redis::RedisResult<i64> = Call::function("seckill_adopt")
        .key(keys.stream(keys.shard_of_part(part)))
        .key(keys.part_marker(part))
        .key(keys.part(part))
        .arg(epoch)
        .arg(part.voucher_id)
        .arg(user_id)
        .arg(order_id)
        .arg(admitted_at.timestamp_millis())
        .invoke_waiting(conn, replicas)
        .await;
    match code {
        Ok(0 | 1) => Readmitted::Kept,
        Ok(4 | 5) => Readmitted::Refused,
        Ok(_) => Readmitted::Elsewhere,
        Err(e) => {
            tracing::debug!(order_id = order_id.get(), error = %e, "admitted again? not confirmed");
            Readmitted::Elsewhere
        }
    }
}
