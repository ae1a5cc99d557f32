//! A paid coupon's life at its shop and after: redeemed once (`used`), or a refund asked
//! (`refunding`) and confirmed by the provider (`refunded`), its unit back while the
//! sale is open.

use sqlx::{PgPool, Postgres, Transaction};

use super::*;

/// Who redeems a coupon.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Redeemer {
    /// Staff of this shop: only its vouchers' coupons.
    Staff(ShopId),
    Admin,
}

/// What a redemption found or did.
#[derive(Debug, Clone)]
pub enum Redemption {
    /// Used now.
    Used(OrderRow),
    /// Its status does not allow it (used already, not paid, refunding...): as it is.
    Refused(OrderRow),
    /// No such order in Postgres.
    Missing,
    /// The voucher is another shop's.
    OtherShop,
    /// The code is not this order's.
    WrongCode,
}

/// Redeems a paid coupon at its shop: `used`, once. The order's lock decides against a
/// refund asked at the same moment: whichever commits first wins, the other finds the
/// order moved.
#[tracing::instrument(skip(db, code))]
pub(crate) async fn redeem(
    db: &PgPool,
    order_id: OrderId,
    code: &str,
    by: Redeemer,
    staff: UserId,
) -> Result<Redemption, sqlx::Error> {
    let mut tx = db.begin().await?;
    let found: Option<(OrderStatus, VoucherId, ShopId, Option<String>)> = sqlx::query_as(
        "SELECT o.status, o.voucher_id, v.shop_id, o.redeem_code \
         FROM voucher_orders o JOIN vouchers v ON v.id = o.voucher_id \
         WHERE o.id = $1 FOR UPDATE OF o",
    )
    .bind(order_id)
    .fetch_optional(&mut *tx)
    .await?;
    let Some((status, voucher_id, shop_id, stored)) = found else {
        return Ok(Redemption::Missing);
    };
    if matches!(by, Redeemer::Staff(shop) if shop != shop_id) {
        return Ok(Redemption::OtherShop);
    }
    let code_holds = stored.is_some_and(|c| RedeemCode::from(c).matches(code));
    if status != OrderStatus::Paid {
        let row = crate::store::orders::get(&mut *tx, order_id).await?;
        return Ok(match (status, code_holds) {
            // Used already: the same code again is the same answer, not a new use.
            (OrderStatus::Used, false) => Redemption::WrongCode,
            _ => row.map_or(Redemption::Missing, Redemption::Refused),
        });
    }
    if !code_holds {
        return Ok(Redemption::WrongCode);
    }
    let set = "used_at = now(), used_by = $2";
    let order = (order_id, voucher_id);
    let row = leave_paid(&mut tx, order, OrderStatus::Used, set, staff).await?;
    tx.commit().await?;
    Ok(Redemption::Used(row))
}

/// Asks for the refund of a paid, unused coupon: `refunding` with `reason`, until the
/// provider confirms the refund ([`refunded`]). A second ask finds it `refunding`
/// (unchanged).
#[tracing::instrument(skip(db))]
pub(crate) async fn ask_refund(
    db: &PgPool,
    order_id: OrderId,
    reason: RefundReason,
) -> Result<Transition, sqlx::Error> {
    let mut tx = db.begin().await?;
    let found: Option<(OrderStatus, VoucherId)> =
        sqlx::query_as("SELECT status, voucher_id FROM voucher_orders WHERE id = $1 FOR UPDATE")
            .bind(order_id)
            .fetch_optional(&mut *tx)
            .await?;
    let Some((status, voucher_id)) = found else {
        return Ok(Transition::Missing);
    };
    if status != OrderStatus::Paid {
        let row = crate::store::orders::get(&mut *tx, order_id).await?;
        return Ok(row.map_or(Transition::Missing, Transition::Unchanged));
    }
    let set = "refund_reason = $2, refund_asked_at = now()";
    let order = (order_id, voucher_id);
    let row = leave_paid(&mut tx, order, OrderStatus::Refunding, set, reason).await?;
    tx.commit().await?;
    Ok(Transition::Moved(row))
}

/// Moves a paid order this transaction holds locked to `to`, setting `set` as well
/// (`$2` is `value`), and moves it in its sale's counts: under the sale's lock, as
/// every change of those counts.
async fn leave_paid<T>(
    tx: &mut Transaction<'_, Postgres>,
    (order_id, voucher_id): (OrderId, VoucherId),
    to: OrderStatus,
    set: &str,
    value: T,
) -> Result<OrderRow, sqlx::Error>
where
    T: Send + for<'q> sqlx::Encode<'q, Postgres> + sqlx::Type<Postgres>,
{
    lock_sales(tx, &[voucher_id]).await?;
    let row: OrderRow = sqlx::query_as(&format!(
        "UPDATE voucher_orders SET status = '{}', {set} WHERE id = $1 RETURNING {ORDER_COLUMNS}",
        to.as_str()
    ))
    .bind(order_id)
    .bind(value)
    .fetch_one(&mut **tx)
    .await?;
    recount(tx, voucher_id, OrderStatus::Paid, to, 0, 0).await?;
    Ok(row)
}

/// The provider confirmed the refund of an order this transaction holds locked as
/// `refunding`: `refunded`. If it still held its unit and its sale is still open, the
/// unit goes back on sale (its release owed to Redis), once: never after the sale ended.
pub(crate) async fn refunded(
    tx: &mut Transaction<'_, Postgres>,
    order_id: OrderId,
    voucher_id: VoucherId,
) -> Result<(OrderRow, Option<Release>), sqlx::Error> {
    lock_sales(tx, &[voucher_id]).await?;
    let gives_back: bool = sqlx::query_scalar(
        "SELECT o.closed_at IS NULL AND s.end_time > now() \
         FROM voucher_orders o JOIN seckill_vouchers s ON s.voucher_id = o.voucher_id \
         WHERE o.id = $1",
    )
    .bind(order_id)
    .fetch_optional(&mut **tx)
    .await?
    .unwrap_or(false);
    let row: OrderRow = sqlx::query_as(&format!(
        "UPDATE voucher_orders SET status = 'refunded', refunded_at = now(), \
           closed_at = CASE WHEN $2 THEN now() ELSE closed_at END \
         WHERE id = $1 RETURNING {ORDER_COLUMNS}"
    ))
    .bind(order_id)
    .bind(gives_back)
    .fetch_one(&mut **tx)
    .await?;
    recount(
        tx,
        voucher_id,
        OrderStatus::Refunding,
        OrderStatus::Refunded,
        gives_back as i32,
        0,
    )
    .await?;
    let release = if gives_back {
        sqlx::query("UPDATE seckill_vouchers SET stock = stock + 1, updated_at = now() WHERE voucher_id = $1")
            .bind(voucher_id)
            .execute(&mut **tx)
            .await?;
        let release: Release = sqlx::query_as(
            "INSERT INTO stock_releases (order_id, voucher_id, user_id) VALUES ($1, $2, $3) \
             RETURNING order_id, voucher_id, user_id, \
               (SELECT segments FROM seckill_vouchers s WHERE s.voucher_id = $2) AS segments",
        )
        .bind(order_id)
        .bind(voucher_id)
        .bind(row.user_id)
        .fetch_one(&mut **tx)
        .await?;
        Some(release)
    } else {
        None
    };
    Ok((row, release))
}
