//! Order transitions after admission: `created → paid | cancelled | expired`.
//!
//! Postgres judges every transition with a conditional update on the order's current
//! status. Closing an order (cancel, expiry) returns its unit to the sale's stock and
//! records the release owed to Redis (`stock_releases`) in the same transaction, so a
//! unit comes back to Postgres exactly once, and the Redis side can never be forgotten.
//!
//! Locks: a transaction that writes an order row and a sale row (pay, cancel, expiry)
//! locks the order rows first (`FOR UPDATE`; the sweeper skips locked ones), then the
//! sale rows in voucher order ([`lock_sales`]), and writes only then. The worker is why:
//! it holds sale locks while its inserts may wait for an order row another transaction
//! is writing (the one-active-order index waits for an update in progress, not for a
//! row that is only locked). So nobody may write an order row and then wait for a sale
//! lock; these transactions, once they write, wait for nothing (a paid row's entry in
//! that index meets no insert in progress: inserts skip while the user holds an active
//! order), so no cycle passes through them. Burials and sale loads take sale locks but
//! write no order row; making releases touches only `stock_releases`. Worker batches
//! holding orders of the same users can still deadlock each other on that index (only
//! with orders Redis admitted twice after losing data): Postgres aborts one, and it is
//! retried.

use sqlx::{FromRow, PgPool, Postgres, Transaction};

use super::orders::{OrderRow, ORDER_COLUMNS};
use super::vouchers::lock_sales;
use crate::domain::{OrderId, OrderStatus, UserId, VoucherId};

/// A unit owed back to a sale's live stock in Redis, for a closed order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, FromRow)]
pub struct Release {
    pub order_id: OrderId,
    pub voucher_id: VoucherId,
    pub user_id: UserId,
    /// Parts of the sale (the user's home part holds the buyer record and takes the unit).
    pub segments: i16,
}

impl Release {
    /// The part whose state holds the order's buyer record.
    pub fn sale_part(&self) -> crate::keys::SalePart {
        crate::keys::SalePart::home_of(self.voucher_id, self.user_id, self.segments as u8)
    }
}

/// How a request wants an order closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Close {
    /// By its owner or an admin: `cancelled`, or `expired` if the deadline has passed.
    Cancel,
    /// Only if its deadline has passed: `expired`.
    ExpireIfDue,
}

/// What a transition found or did.
#[derive(Debug, Clone)]
pub enum Transition {
    /// This call moved the order; here it is now.
    Moved(OrderRow),
    /// The order's status did not allow the change; here it is as it is.
    Unchanged(OrderRow),
    /// No such order in Postgres (it may still be pending in Redis).
    Missing,
}

/// Pays a `created` order whose deadline has not passed (by Postgres's clock), and
/// counts it on its sale's row: the order's lock, then the sale's, then the writes (the
/// module's lock order).
#[tracing::instrument(skip(db))]
pub(crate) async fn pay(
    db: &PgPool,
    order_id: OrderId,
    payment_ref: Option<&str>,
) -> Result<Transition, sqlx::Error> {
    let mut tx = db.begin().await?;
    let payable: Option<VoucherId> = sqlx::query_scalar(
        "SELECT voucher_id FROM voucher_orders \
         WHERE id = $1 AND status = 'created' AND pay_before > now() FOR UPDATE",
    )
    .bind(order_id)
    .fetch_optional(&mut *tx)
    .await?;
    let paid: Option<OrderRow> = match payable {
        None => None,
        Some(voucher_id) => {
            lock_sales(&mut tx, &[voucher_id]).await?;
            // Still payable: locked since the check, and now() is the transaction's.
            let row: OrderRow = sqlx::query_as(&format!(
                "UPDATE voucher_orders SET status = 'paid', paid_at = now(), payment_ref = $2 \
                 WHERE id = $1 RETURNING {ORDER_COLUMNS}"
            ))
            .bind(order_id)
            .bind(payment_ref)
            .fetch_one(&mut *tx)
            .await?;
            sqlx::query("UPDATE seckill_vouchers SET paid = paid + 1 WHERE voucher_id = $1")
                .bind(voucher_id)
                .execute(&mut *tx)
                .await?;
            Some(row)
        }
    };
    tx.commit().await?;
    Ok(match paid {
        Some(row) => Transition::Moved(row),
        None => match super::orders::get(db, order_id).await? {
            Some(row) => Transition::Unchanged(row),
            None => Transition::Missing,
        },
    })
}

/// Closes one `created` order: cancelled or expired as `how` and its deadline say, its
/// unit returned to Postgres's stock and its Redis release recorded as owed.
#[tracing::instrument(skip(db))]
pub(crate) async fn close(
    db: &PgPool,
    order_id: OrderId,
    how: Close,
) -> Result<Transition, sqlx::Error> {
    let mut tx = db.begin().await?;
    let found: Option<(OrderStatus, bool)> = sqlx::query_as(
        "SELECT status, pay_before <= now() FROM voucher_orders WHERE id = $1 FOR UPDATE",
    )
    .bind(order_id)
    .fetch_optional(&mut *tx)
    .await?;
    let Some((status, due)) = found else {
        return Ok(Transition::Missing);
    };
    let to = match (status, how, due) {
        (OrderStatus::Created, _, true) => OrderStatus::Expired,
        (OrderStatus::Created, Close::Cancel, false) => OrderStatus::Cancelled,
        _ => {
            let row = super::orders::get(&mut *tx, order_id).await?;
            tx.rollback().await?;
            return Ok(row.map_or(Transition::Missing, Transition::Unchanged));
        }
    };
    let closed = close_rows(&mut tx, &[order_id], to).await?;
    let row = super::orders::get(&mut *tx, order_id).await?;
    tx.commit().await?;
    debug_assert_eq!(closed.len(), 1);
    Ok(row.map_or(Transition::Missing, Transition::Moved))
}

/// Expires up to `limit` orders whose deadline has passed, in one transaction; returns
/// the releases now owed to Redis. Rows another sweeper (or a payment) holds are
/// skipped, so several sweepers share the work.
#[tracing::instrument(skip(db))]
pub(crate) async fn expire_due(db: &PgPool, limit: i64) -> Result<Vec<Release>, sqlx::Error> {
    let mut tx = db.begin().await?;
    let due: Vec<OrderId> = sqlx::query_scalar(
        "SELECT id FROM voucher_orders WHERE status = 'created' AND pay_before <= now() \
         ORDER BY pay_before LIMIT $1 FOR UPDATE SKIP LOCKED",
    )
    .bind(limit)
    .fetch_all(&mut *tx)
    .await?;
    if due.is_empty() {
        tx.rollback().await?;
        return Ok(Vec::new());
    }
    let released = close_rows(&mut tx, &due, OrderStatus::Expired).await?;
    tx.commit().await?;
    Ok(released)
}

/// Closes orders this transaction holds locked as `created`: the sales' rows locked (in
/// voucher order), each sale's stock raised by its closed orders, the orders moved to
/// `to`, and their releases recorded as owed.
async fn close_rows(
    tx: &mut Transaction<'_, Postgres>,
    order_ids: &[OrderId],
    to: OrderStatus,
) -> Result<Vec<Release>, sqlx::Error> {
    let owners: Vec<(VoucherId, UserId)> =
        sqlx::query_as("SELECT voucher_id, user_id FROM voucher_orders WHERE id = ANY($1)")
            .bind(order_ids)
            .fetch_all(&mut **tx)
            .await?;
    let vouchers: Vec<VoucherId> = owners.iter().map(|&(v, _)| v).collect();
    lock_sales(tx, &vouchers).await?;
    let released: Vec<Release> = sqlx::query_as(
        "UPDATE voucher_orders SET status = $2, closed_at = now() \
         WHERE id = ANY($1) AND status = 'created' \
         RETURNING id AS order_id, voucher_id, user_id, \
           (SELECT segments FROM seckill_vouchers s \
            WHERE s.voucher_id = voucher_orders.voucher_id) AS segments",
    )
    .bind(order_ids)
    .bind(to)
    .fetch_all(&mut **tx)
    .await?;
    let mut per_voucher: std::collections::BTreeMap<VoucherId, i32> = Default::default();
    for r in &released {
        *per_voucher.entry(r.voucher_id).or_default() += 1;
    }
    let (ids, counts): (Vec<VoucherId>, Vec<i32>) = per_voucher.into_iter().unzip();
    // The unit back, and the order counted as `to` (the live view's figures).
    sqlx::query(
        "UPDATE seckill_vouchers s SET stock = s.stock + d.n, updated_at = now(), \
             cancelled = s.cancelled + CASE WHEN $3 = 'cancelled' THEN d.n ELSE 0 END, \
             expired = s.expired + CASE WHEN $3 = 'expired' THEN d.n ELSE 0 END \
         FROM unnest($1::int8[], $2::int4[]) AS d (voucher_id, n) \
         WHERE s.voucher_id = d.voucher_id",
    )
    .bind(&ids)
    .bind(&counts)
    .bind(to)
    .execute(&mut **tx)
    .await?;
    let (orders, (vouchers, users)): (Vec<OrderId>, (Vec<VoucherId>, Vec<UserId>)) = released
        .iter()
        .map(|r| (r.order_id, (r.voucher_id, r.user_id)))
        .unzip();
    sqlx::query(
        "INSERT INTO stock_releases (order_id, voucher_id, user_id) \
         SELECT * FROM unnest($1::int8[], $2::int8[], $3::int8[])",
    )
    .bind(&orders)
    .bind(&vouchers)
    .bind(&users)
    .execute(&mut **tx)
    .await?;
    Ok(released)
}

/// Takes up to `limit` owed releases, locked for this transaction (others skip them).
#[tracing::instrument(skip(tx))]
pub(crate) async fn take_owed(
    tx: &mut Transaction<'_, Postgres>,
    limit: i64,
) -> Result<Vec<Release>, sqlx::Error> {
    sqlx::query_as(
        "SELECT order_id, voucher_id, user_id, \
           (SELECT segments FROM seckill_vouchers s \
            WHERE s.voucher_id = r.voucher_id) AS segments \
         FROM stock_releases r ORDER BY owed_since LIMIT $1 FOR UPDATE SKIP LOCKED",
    )
    .bind(limit)
    .fetch_all(&mut **tx)
    .await
}

/// Forgets releases that have been made in Redis.
#[tracing::instrument(skip_all, fields(n = order_ids.len()))]
pub(crate) async fn released<'e>(
    db: impl sqlx::PgExecutor<'e>,
    order_ids: &[OrderId],
) -> Result<(), sqlx::Error> {
    sqlx::query("DELETE FROM stock_releases WHERE order_id = ANY($1)")
        .bind(order_ids)
        .execute(db)
        .await?;
    Ok(())
}

/// `(user_id, order_id)` of a sale's releases still owed (for reconcile's books).
pub(crate) async fn owed_for(
    tx: &mut Transaction<'_, Postgres>,
    voucher_id: VoucherId,
) -> Result<Vec<(UserId, OrderId)>, sqlx::Error> {
    sqlx::query_as("SELECT user_id, order_id FROM stock_releases WHERE voucher_id = $1")
        .bind(voucher_id)
        .fetch_all(&mut **tx)
        .await
}

/// How many releases are owed.
#[tracing::instrument(skip(db))]
pub(crate) async fn owed_count(db: &PgPool) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT count(*) FROM stock_releases")
        .fetch_one(db)
        .await
}

/// Orders per status of a sale (for reconcile's books).
#[tracing::instrument(skip(db))]
pub(crate) async fn status_counts(
    db: &PgPool,
    voucher_id: VoucherId,
) -> Result<Vec<(OrderStatus, i64)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT status, count(*) FROM voucher_orders WHERE voucher_id = $1 GROUP BY status",
    )
    .bind(voucher_id)
    .fetch_all(db)
    .await
}
