//! `sale_epochs` and `sale_carried`: which build of each sale segment's Redis state may
//! make its orders. Every build draws an epoch and records it here under the sale's row
//! lock, with the orders it counted in flight (carried into the new epoch); the worker
//! writes an order only when its entry's epoch is the segment's current one or the order
//! was carried, checked under the same lock. An entry admitted by any other Redis state
//! (an old primary still reachable after a failover, a copy that was rebuilt away from)
//! is never an order.

use std::collections::HashSet;

use sqlx::{PgExecutor, Postgres, Transaction};

use super::admitted::NewOrder;
use crate::domain::{Epoch, OrderId, UserId, VoucherId};
use crate::keys::SaleSegment;

/// The channel every build announces its epoch on (`<voucher_id> <segment> <epoch>`, sent
/// at its commit): API instances listen, and refuse to admit from an older build
/// (`admission::fence`).
pub(crate) const CHANNEL: &str = "seckill_sale_epochs";

/// A segment's current build: its epoch, and the term of the Redis server life it was built
/// into.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub(crate) struct Built {
    pub epoch: Epoch,
    pub term: String,
}

/// A new epoch, larger than every one drawn before.
pub(crate) async fn draw(tx: &mut Transaction<'_, Postgres>) -> Result<Epoch, sqlx::Error> {
    sqlx::query_scalar("SELECT nextval('sale_epoch_seq')")
        .fetch_one(&mut **tx)
        .await
}

/// The segment's current build (`None`: never built by a release that knows epochs).
pub(crate) async fn built<'e>(
    db: impl PgExecutor<'e>,
    segment: SaleSegment,
) -> Result<Option<Built>, sqlx::Error> {
    sqlx::query_as("SELECT epoch, term FROM sale_epochs WHERE voucher_id = $1 AND segment = $2")
        .bind(segment.voucher_id)
        .bind(segment.segment as i16)
        .fetch_optional(db)
        .await
}

/// The segment's current epoch (`None`: never built by a release that knows epochs).
pub(crate) async fn of<'e>(
    db: impl PgExecutor<'e>,
    segment: SaleSegment,
) -> Result<Option<Epoch>, sqlx::Error> {
    Ok(built(db, segment).await?.map(|b| b.epoch))
}

/// Each segment's current epoch of the sale (segments never built by a release that
/// knows epochs absent).
pub(crate) async fn of_sale(
    tx: &mut Transaction<'_, Postgres>,
    voucher_id: VoucherId,
) -> Result<Vec<(i16, Epoch)>, sqlx::Error> {
    sqlx::query_as("SELECT segment, epoch FROM sale_epochs WHERE voucher_id = $1")
        .bind(voucher_id)
        .fetch_all(&mut **tx)
        .await
}

/// Records that the segment's state was built with `epoch` into the server life `term`,
/// carrying `in_flight` (the orders the build counted, admitted under an earlier epoch)
/// into it. The carried orders of earlier builds go: whatever of them is still in
/// flight, this build counted again.
pub(crate) async fn record(
    tx: &mut Transaction<'_, Postgres>,
    segment: SaleSegment,
    epoch: Epoch,
    term: &str,
    in_flight: &[(OrderId, UserId)],
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO sale_epochs (voucher_id, segment, epoch, term) VALUES ($1, $2, $3, $4) \
         ON CONFLICT (voucher_id, segment) DO UPDATE SET epoch = $3, term = $4, built_at = now(), \
           term_before = CASE WHEN sale_epochs.term <> $4 THEN sale_epochs.term \
                              ELSE sale_epochs.term_before END",
    )
    .bind(segment.voucher_id)
    .bind(segment.segment as i16)
    .bind(epoch)
    .bind(term)
    .execute(&mut **tx)
    .await?;
    sqlx::query("SELECT pg_notify($1, $2)")
        .bind(CHANNEL)
        .bind(format!(
            "{} {} {epoch}",
            segment.voucher_id, segment.segment
        ))
        .execute(&mut **tx)
        .await?;
    sqlx::query("DELETE FROM sale_carried WHERE voucher_id = $1 AND segment = $2")
        .bind(segment.voucher_id)
        .bind(segment.segment as i16)
        .execute(&mut **tx)
        .await?;
    if !in_flight.is_empty() {
        let (orders, users): (Vec<OrderId>, Vec<UserId>) = in_flight.iter().copied().unzip();
        sqlx::query(
            "INSERT INTO sale_carried (voucher_id, segment, order_id, user_id) \
             SELECT $1, $2, o, u FROM unnest($3::int8[], $4::int8[]) AS t (o, u) \
             ON CONFLICT DO NOTHING",
        )
        .bind(segment.voucher_id)
        .bind(segment.segment as i16)
        .bind(&orders)
        .bind(&users)
        .execute(&mut **tx)
        .await?;
    }
    Ok(())
}

/// The current epoch of every segment of the sales that end after `since`.
pub(crate) async fn of_sales_ending_after<'e>(
    db: impl PgExecutor<'e>,
    since: chrono::DateTime<chrono::Utc>,
) -> Result<Vec<(VoucherId, i16, Epoch)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT e.voucher_id, e.segment, e.epoch FROM sale_epochs e \
         JOIN seckill_vouchers s ON s.voucher_id = e.voucher_id WHERE s.end_time > $1",
    )
    .bind(since)
    .fetch_all(db)
    .await
}

/// Records order `order_id` of `user_id` as carried into the segment's current epoch: it
/// was admitted again into the current state (its first entry, of a stale epoch or lost,
/// would otherwise never be written). Until the segment's next build, which counts it
/// again if it is still in flight.
pub(crate) async fn carry(
    tx: &mut Transaction<'_, Postgres>,
    segment: SaleSegment,
    order_id: OrderId,
    user_id: UserId,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO sale_carried (voucher_id, segment, order_id, user_id) VALUES ($1, $2, $3, $4) \
         ON CONFLICT DO NOTHING",
    )
    .bind(segment.voucher_id)
    .bind(segment.segment as i16)
    .bind(order_id)
    .bind(user_id)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Which of `orders` the fence lets become rows: those whose entry carries their
/// segment's current epoch, those the segment's last build carried (the order of that user:
/// an id minted twice across a split is not carried by another's), and every order of a
/// segment never built with an epoch. To be asked under the sales' row locks, which every
/// build takes.
pub(crate) async fn admissible(
    tx: &mut Transaction<'_, Postgres>,
    orders: &[NewOrder],
) -> Result<HashSet<OrderId>, sqlx::Error> {
    if orders.is_empty() {
        return Ok(HashSet::new());
    }
    let ids: Vec<OrderId> = orders.iter().map(|o| o.id).collect();
    let users: Vec<UserId> = orders.iter().map(|o| o.user_id).collect();
    let vouchers: Vec<i64> = orders.iter().map(|o| o.voucher_id.get()).collect();
    let segments: Vec<i16> = orders.iter().map(|o| o.segment as i16).collect();
    let epochs: Vec<Option<Epoch>> = orders.iter().map(|o| o.epoch).collect();
    let admitted: Vec<OrderId> = sqlx::query_scalar(
        "SELECT t.id FROM unnest($1::int8[], $2::int8[], $3::int2[], $4::int8[], $5::int8[]) \
             AS t (id, voucher_id, segment, epoch, user_id) \
         LEFT JOIN sale_epochs e ON e.voucher_id = t.voucher_id AND e.segment = t.segment \
         WHERE e.epoch IS NULL OR e.epoch = t.epoch \
            OR EXISTS (SELECT 1 FROM sale_carried c \
                       WHERE c.voucher_id = t.voucher_id AND c.segment = t.segment \
                         AND c.order_id = t.id AND c.user_id = t.user_id)",
    )
    .bind(&ids)
    .bind(&vouchers)
    .bind(&segments)
    .bind(&epochs)
    .bind(&users)
    .fetch_all(&mut **tx)
    .await?;
    Ok(admitted.into_iter().collect())
}
