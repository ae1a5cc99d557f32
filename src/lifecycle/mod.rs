//! The order's life after admission: payment (confirmed by the payment provider's
//! signed notification, [`payments`]), redemption at the shop, refunds, cancellation,
//! and expiry of unpaid orders.
//!
//! Postgres judges every transition ([`store::lifecycle`]): a conditional update, and for
//! a closed order its unit back in Postgres's stock plus a release owed to Redis, in one
//! transaction. Redis follows, idempotently: `seckill_release` (`lua/lifecycle.lua`) returns the unit to the
//! live stock and frees the buyer record only while that record still names the order,
//! so a retry, the outbox drain ([`sweeper`]) or a second path changes nothing. A crash
//! between the commit and the release leaves the release owed in `stock_releases`, and
//! the sweeper makes it.

pub mod payments;
pub mod signature;
pub mod sweeper;

use std::time::Duration;

use redis::aio::ConnectionLike;
use sqlx::PgPool;

use crate::domain::RefundReason;
use crate::domain::{OrderId, OrderStatus};
use crate::keys::{self, Keys};
use crate::metrics::{TRANSITIONS, UNITS_RETURNED};
use crate::scripts::{Call, Replicas};
use crate::store::lifecycle::{
    self as transitions, Close, Payment, Redeemer, Redemption, Release, Transition,
};
use crate::store::orders::OrderRow;

/// How long a request waits for Redis to take a release back before leaving it owed
/// (the sweeper makes it later).
const RELEASE_DEADLINE: Duration = Duration::from_millis(1000);

/// Makes one release in Redis, in the state of Postgres's `epoch` of the sale segment:
/// `true` when the unit went back now, `false` when there was nothing to release (made
/// before, or the sale's state was rebuilt since). With `replicas`, `Ok` only once they
/// hold it: the release's outbox row may go then (a failover that lost it would
/// otherwise lose the unit in Redis for good). A state of another epoch (an old
/// primary's) refuses it: an error, and the release stays owed.
pub async fn release<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    r: &Release,
    epoch: Option<crate::domain::Epoch>,
    replicas: Replicas,
) -> redis::RedisResult<bool> {
    // 1: the unit went back; 0: nothing was left to release; -1: not the sale's state.
    let returned: redis::RedisResult<i64> = Call::function("seckill_release")
        .key(keys.segment(r.sale_segment()))
        .key(keys.segment_marker(r.sale_segment()))
        .arg(keys::buyer_field(r.user_id))
        .arg(r.order_id)
        .arg(epoch.map(|e| e.to_string()).unwrap_or_default())
        .invoke_waiting(conn, replicas)
        .await;
    // Announced whenever the unit may be back (an error may come after the script ran,
    // as when too few replicas acknowledged).
    if !matches!(returned, Ok(0) | Ok(-1)) {
        crate::sale_changes::announce(conn, keys, r.voucher_id).await;
    }
    let returned = match returned? {
        -1 => {
            return Err(std::io::Error::other(
                "the sale's state in this redis is of another epoch than postgres's (an old \
                 primary?): release left owed",
            )
            .into())
        }
        n => n == 1,
    };
    if returned {
        metrics::counter!(UNITS_RETURNED, "store" => "redis").increment(1);
    }
    Ok(returned)
}

/// Counts a transition made now (and, for an order that gave its unit back now, the
/// unit Postgres got back).
fn count(row: &OrderRow, unit_back: bool) {
    metrics::counter!(TRANSITIONS, "to" => row.status.as_str()).increment(1);
    if unit_back {
        metrics::counter!(UNITS_RETURNED, "store" => "postgres").increment(1);
    }
}

/// Settles the release of an order this request just closed, under a deadline: if Redis
/// is slow or down the release stays owed (the order is closed either way).
async fn release_now<C: ConnectionLike + Send>(
    db: &PgPool,
    conn: &mut C,
    keys: &Keys,
    replicas: Replicas,
    row: &OrderRow,
) {
    let settle = async {
        let segments = crate::store::segments::segments_of(db, row.voucher_id)
            .await?
            .unwrap_or(1);
        let r = Release {
            order_id: row.id,
            voucher_id: row.voucher_id,
            user_id: row.user_id,
            segments: segments as i16,
        };
        let epoch = crate::store::epochs::of(db, r.sale_segment()).await?;
        release(conn, keys, &r, epoch, replicas).await?;
        transitions::released(db, &[r.order_id]).await?;
        anyhow::Ok(())
    };
    match tokio::time::timeout(RELEASE_DEADLINE, settle).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => tracing::warn!(
            order_id = row.id.get(),
            error = format!("{e:#}"),
            "release left owed; the sweeper will make it"
        ),
        Err(_) => tracing::warn!(
            order_id = row.id.get(),
            "redis did not take the release in time; the sweeper will make it"
        ),
    }
}

/// Pays an order by hand (an administrator's, with a reason; shoppers' payments come
/// from the provider, [`payments::receive`]): `Moved` when paid now, `Unchanged` with
/// the order as it is otherwise (already paid, or closed: an unpaid order past its
/// deadline is expired here and then, never paid).
pub async fn pay<C: ConnectionLike + Send>(
    db: &PgPool,
    conn: &mut C,
    keys: &Keys,
    replicas: Replicas,
    order_id: OrderId,
    payment: Payment<'_>,
) -> anyhow::Result<Transition> {
    match transitions::pay(db, order_id, payment).await? {
        Transition::Moved(row) => {
            count(&row, false);
            Ok(Transition::Moved(row))
        }
        Transition::Unchanged(row) if row.status == OrderStatus::Created => {
            // Past its deadline, not yet swept.
            match expire_if_due(db, conn, keys, replicas, order_id).await? {
                Transition::Moved(row) => Ok(Transition::Unchanged(row)),
                other => Ok(other),
            }
        }
        other => Ok(other),
    }
}

/// Expires an unpaid order past its deadline now (`Moved`), rather than leave its
/// shopper a window the sweeper is about to close; `Unchanged` if it is not due.
pub async fn expire_if_due<C: ConnectionLike + Send>(
    db: &PgPool,
    conn: &mut C,
    keys: &Keys,
    replicas: Replicas,
    order_id: OrderId,
) -> anyhow::Result<Transition> {
    let done = transitions::close(db, order_id, Close::ExpireIfDue).await?;
    if let Transition::Moved(row) = &done {
        count(row, true);
        release_now(db, conn, keys, replicas, row).await;
    }
    Ok(done)
}

/// Cancels an order: `Moved` when closed now (`cancelled`, or `expired` when its
/// deadline had passed), `Unchanged` with the order as it is otherwise.
pub async fn cancel<C: ConnectionLike + Send>(
    db: &PgPool,
    conn: &mut C,
    keys: &Keys,
    replicas: Replicas,
    order_id: OrderId,
) -> anyhow::Result<Transition> {
    let done = transitions::close(db, order_id, Close::Cancel).await?;
    if let Transition::Moved(row) = &done {
        count(row, true);
        release_now(db, conn, keys, replicas, row).await;
    }
    Ok(done)
}

/// Redeems a paid coupon at its shop (see [`transitions::redeem`]).
pub async fn redeem(
    db: &PgPool,
    order_id: OrderId,
    code: &str,
    by: Redeemer,
    staff: crate::domain::UserId,
) -> anyhow::Result<Redemption> {
    let done = transitions::redeem(db, order_id, code, by, staff).await?;
    if let Redemption::Used(row) = &done {
        count(row, false);
    }
    Ok(done)
}

/// Asks for the refund of a paid, unused coupon: `refunding` until the provider
/// confirms it.
pub async fn ask_refund(
    db: &PgPool,
    order_id: OrderId,
    reason: RefundReason,
) -> anyhow::Result<Transition> {
    let done = transitions::ask_refund(db, order_id, reason).await?;
    if let Transition::Moved(row) = &done {
        count(row, false);
    }
    Ok(done)
}
