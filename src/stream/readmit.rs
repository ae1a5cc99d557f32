//! An order admitted again, under its own id, into its sale's current state
//! (`seckill_adopt`, `lua/seckill.lua`): one whose entry the fence refused as stale, or
//! that Redis lost with every copy of its entry. A unit is taken there, its buyer
//! recorded and a new entry appended, stamped with the current epoch, exactly as an
//! admission would have; a worker then writes it like any other.
//!
//! It is done under the sale's row lock, as every move of state between the stores: an
//! order Postgres holds (written, perhaps closed since, or buried) is never admitted
//! again, and the adoption is recorded as carried into the current epoch in the same
//! transaction, so that whichever of the order's entries a worker meets it is written,
//! never buried as stale behind an adoption.

use chrono::{DateTime, Utc};
use redis::aio::ConnectionLike;
use sqlx::PgPool;

use crate::domain::{OrderId, UserId};
use crate::keys::{Keys, SaleSegment};
use crate::scripts::{Call, Replicas};
use crate::store;

/// What admitting an order again did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Readmitted {
    /// Admitted again now (`anew`, its new entry's id), or found admitted already (the
    /// stream's last entry id then: its entry is no later).
    Kept {
        entry: Option<(u64, u64)>,
        anew: bool,
    },
    /// Postgres holds it already (written or buried): nothing to do.
    Settled,
    /// No unit left for it, or its user holds another order there.
    Refused,
    /// This Redis does not hold the sale's current state (or did not answer, or could
    /// not get the write acknowledged, or the segment ran dry: units may still come to it):
    /// to be tried again.
    Elsewhere,
}

/// One order to admit again: `order_id` of `user_id` in `segment`, admitted at `admitted_at`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Readmission {
    pub segment: SaleSegment,
    pub user_id: UserId,
    pub order_id: OrderId,
    pub admitted_at: DateTime<Utc>,
}

/// Admits `r` again into its segment's state of Postgres's current epoch, under the sale's
/// row lock, waiting for `replicas`.
pub(crate) async fn readmit<C: ConnectionLike + Send>(
    db: &PgPool,
    conn: &mut C,
    keys: &Keys,
    r: Readmission,
    replicas: Replicas,
) -> anyhow::Result<Readmitted> {
    let mut tx = db.begin().await?;
    store::vouchers::lock_sales(&mut tx, &[r.segment.voucher_id]).await?;
    if !store::orders::settled_among(&mut *tx, &[r.order_id])
        .await?
        .is_empty()
    {
        return Ok(Readmitted::Settled);
    }
    let Some(epoch) = store::epochs::of(&mut *tx, r.segment).await? else {
        return Ok(Readmitted::Refused);
    };
    let reply: redis::RedisResult<Vec<redis::Value>> = Call::function("seckill_adopt")
        .key(keys.stream(keys.shard_of_segment(r.segment)))
        .key(keys.segment_marker(r.segment))
        .key(keys.segment(r.segment))
        .arg(epoch)
        .arg(r.segment.voucher_id)
        .arg(r.user_id)
        .arg(r.order_id)
        .arg(r.admitted_at.timestamp_millis())
        .invoke_waiting(conn, replicas)
        .await;
    let reply = match reply {
        Ok(reply) => reply,
        Err(e) => {
            tracing::debug!(order_id = r.order_id.get(), error = %e, "admitted again? not confirmed");
            return Ok(Readmitted::Elsewhere);
        }
    };
    let code = reply
        .first()
        .and_then(|v| redis::from_redis_value_ref::<i64>(v).ok());
    let entry = reply
        .get(1)
        .and_then(|v| redis::from_redis_value_ref::<String>(v).ok())
        .and_then(|id| super::parse_entry_id(&id));
    Ok(match code {
        Some(0 | 1) => {
            store::epochs::carry(&mut tx, r.segment, r.order_id, r.user_id).await?;
            tx.commit().await?;
            Readmitted::Kept {
                entry,
                anew: code == Some(1),
            }
        }
        Some(4 | 5) => Readmitted::Refused,
        _ => Readmitted::Elsewhere,
    })
}
