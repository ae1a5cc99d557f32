//! Entries that will never be orders: the dead-letter stream, and settling a buried
//! order's buyer record and unit in the sale's state.

use redis::aio::ConnectionLike;
use redis::RedisResult;

use crate::domain::{OrderId, UserId};
use crate::keys::{Keys, SaleSegment, Shard};
use crate::scripts::{Call, Replicas};

use super::entry::Delivery;

/// Most dead letters kept; older ones are trimmed away.
pub(crate) const DEAD_LETTERS_KEPT: usize = 1_000_000;

/// Appends an entry to the dead-letter stream with its reason. The caller acks it after.
pub(crate) async fn dead_letter<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    shard: Shard,
    entry: &Delivery,
) -> RedisResult<()> {
    let Delivery::DeadLetter { fields, reason, .. } = entry else {
        return Err(redis::RedisError::from((
            redis::ErrorKind::Client,
            "only dead letters go to the dead-letter stream",
        )));
    };
    let mut cmd = redis::cmd("XADD");
    cmd.arg(keys.dead_letters(shard))
        .arg("MAXLEN")
        .arg("~")
        .arg(DEAD_LETTERS_KEPT)
        .arg("*")
        .arg("entry_id")
        .arg(entry.entry_id())
        .arg("reason")
        .arg(reason.to_string());
    for (k, v) in fields {
        // Prefixed so a stray field cannot pose as one of ours.
        cmd.arg(format!("orig.{k}")).arg(v);
    }
    cmd.query_async(conn).await
}

/// Settles a dead order in Redis (`seckill_settle_dead`, `lua/lifecycle.lua`): if the user's buyer
/// record still names it, points the record at `holder` (the order Postgres holds for
/// the user) or drops it, and returns the unit when `return_unit`. `true` when the
/// buyer record was settled now. Its entry is acknowledged with its batch.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn settle_dead<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    segment: SaleSegment,
    user_id: UserId,
    order_id: OrderId,
    holder: Option<OrderId>,
    return_unit: bool,
    replicas: Replicas,
) -> RedisResult<bool> {
    // `true`: settled now; `false`: settled before (nothing left to do).
    let settled: RedisResult<bool> = Call::function("seckill_settle_dead")
        .key(keys.segment(segment))
        .key(keys.segment_marker(segment))
        .arg(crate::keys::buyer_field(user_id))
        .arg(order_id)
        .arg(holder.map(|h| h.to_string()).unwrap_or_default())
        .arg(if return_unit { "1" } else { "0" })
        .invoke_waiting(conn, replicas)
        .await;
    // Announced whenever the unit may be back (an error may come after the script ran).
    if return_unit && !matches!(settled, Ok(false)) {
        crate::sale_changes::announce(conn, keys, segment.voucher_id).await;
    }
    settled
}
