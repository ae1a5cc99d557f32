//! `GET /orders/{order_id}`, `GET /orders`, and the shopper's moves: `POST
//! /orders/{order_id}/pay` and `/cancel`. An order is `pending` while only Redis knows
//! it, `created` once the worker has written it to Postgres, then `paid`, `cancelled`
//! or `expired` as Postgres decides (see [`crate::lifecycle`]).

use axum::extract::State;
use axum::http::HeaderMap;
use axum::Json;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::admission::{self, PendingOrder};
use crate::auth::AuthUser;
use crate::domain::{OrderId, OrderStatus, PayType, RefundReason, UserId, VoucherId, CURRENCY};
use crate::http::error::{AdminOnly, AppError, AppResult, Authed, ErrorBody};
use crate::http::extract::{MaybeJson, PathId};
use crate::http::state::AppState;
use crate::http::text::{text, Needed};
use crate::http::{fallback_headers, redis_read};
use crate::lifecycle;
use crate::store::lifecycle::{Payment, Redeemer, Redemption, Transition};
use crate::store::orders::{self, OrderRow};
use crate::store::vouchers;

mod shapes;
use shapes::MAX_PAY_REASON;
pub(crate) use shapes::{Checkout, ManualPayment, OrderResponse, PaymentView, RedeemOrder};

/// Sales whose Redis state may still hold buyer records (not ended longer ago than the
/// retention).
async fn recent_sales(state: &AppState) -> AppResult<Vec<(VoucherId, u8)>> {
    let since = crate::clock::now()
        - chrono::Duration::from_std(state.settings.sale_state_retention).unwrap_or_default();
    Ok(crate::store::vouchers::sales_ending_after(&state.db, since)
        .await?
        .into_iter()
        .map(|s| (s.voucher_id, s.segments()))
        .collect())
}

/// Most stream entries an administrator's lookup of a pending order scans.
const ADMIN_STREAM_SCAN: usize = 200_000;

#[utoipa::path(get, path = "/orders/{order_id}", operation_id = "getOrder", tag = "orders", security(("bearer" = [])),
    params(("order_id" = String, Path, description = "order id: 64-bit, as a string of digits (as in bodies)", pattern = "^[1-9][0-9]{0,18}$")),
    responses(
        (status = 200, description = "the order", body = OrderResponse),
        (status = 400, description = "not a valid id (`validation`)", body = ErrorBody),
        (status = 401, description = "no or bad token (`unauthorized`)", body = ErrorBody),
        (status = 404, description = "no such order, or somebody else's (`not_found`)", body = ErrorBody),
        (status = 503, description = "a dependency is down (`unavailable`); also, within about 500 ms, when the order \
            is not in Postgres and Redis (which knows pending orders) does not answer", body = ErrorBody),
    ))]
pub(crate) async fn get(
    State(state): State<AppState>,
    user: AuthUser,
    PathId(order_id): PathId<OrderId>,
) -> AppResult<Json<OrderResponse>> {
    match find_order(&state, &user, order_id).await? {
        Found::Stored(row) => Ok(Json(OrderResponse::for_caller(row, &user))),
        Found::Pending(p) => {
            let windows = vouchers::pay_windows(&state.db, &[p.voucher_id]).await?;
            let window = windows.get(&p.voucher_id).copied();
            Ok(Json(OrderResponse::pending(p, window)))
        }
    }
}

/// An order the caller may see.
enum Found {
    /// Written to Postgres.
    Stored(OrderRow),
    /// Admitted, only Redis knows it yet.
    Pending(PendingOrder),
}

/// The order if the caller may see it (its owner, or an admin): from Postgres, else
/// pending in Redis; `not_found` when it is unknown or somebody else's.
async fn find_order(state: &AppState, user: &AuthUser, order_id: OrderId) -> AppResult<Found> {
    let not_found = || AppError::NotFound(format!("order {order_id} not found"));
    let visible = |owner: UserId| user.admin || owner == user.user_id;
    if let Some(row) = orders::get(&state.db, order_id).await? {
        return if visible(row.user_id) {
            Ok(Found::Stored(row))
        } else {
            Err(not_found())
        };
    }
    match pending(state, user, order_id).await? {
        Some(p) if visible(p.user_id) => Ok(Found::Pending(p)),
        _ => Err(not_found()),
    }
}

/// An order not (yet) in Postgres, as Redis knows it: admitted orders are found through
/// the caller's buyer records; an administrator's lookup scans the stream instead.
/// Without Redis it cannot be told whether the order is pending: 503 at once, not 404.
async fn pending(
    state: &AppState,
    user: &AuthUser,
    order_id: OrderId,
) -> AppResult<Option<PendingOrder>> {
    let redis_down = || {
        AppError::Unavailable(format!(
            "order {order_id} is not in Postgres, and Redis, which holds pending orders, \
             is unavailable; try again"
        ))
    };
    let mut conn = state.redis.clone();
    if user.admin {
        // The scan may take longer than the read deadline: only the first answer must
        // come within it.
        let ping = redis::cmd("PING");
        redis_read("ping", ping.query_async::<String>(&mut conn))
            .await
            .ok_or_else(redis_down)?;
        Ok(admission::find_in_stream(&mut conn, &state.keys, order_id, ADMIN_STREAM_SCAN).await?)
    } else {
        let sales = recent_sales(state).await?;
        let lookup = admission::orders_of(&mut conn, &state.keys, user.user_id, &sales);
        Ok(redis_read("pending orders", lookup)
            .await
            .ok_or_else(redis_down)?
            .into_iter()
            .find(|p| p.order_id == order_id))
    }
}

/// The caller's order as Postgres holds it, before a transition: `order_pending` while
/// only Redis knows it, `not_found` when it is unknown or somebody else's.
async fn own_order(state: &AppState, user: &AuthUser, order_id: OrderId) -> AppResult<OrderRow> {
    match find_order(state, user, order_id).await? {
        Found::Stored(row) => Ok(row),
        Found::Pending(_) => Err(AppError::OrderPending(order_id)),
    }
}

/// The answer to a move the order's status did not allow: which code says why.
fn refused(row: OrderRow) -> AppError {
    match row.status {
        OrderStatus::Paid | OrderStatus::Refunding | OrderStatus::Refunded => {
            AppError::OrderPaid(row.id)
        }
        OrderStatus::Used => AppError::OrderUsed(row.id),
        OrderStatus::Created | OrderStatus::Pending => AppError::OrderUnpaid(row.id),
        OrderStatus::Cancelled | OrderStatus::Expired => AppError::OrderClosed(row.id, row.status),
    }
}

#[utoipa::path(post, path = "/orders/{order_id}/checkout", operation_id = "checkoutOrder", tag = "orders", security(("bearer" = [])),
    params(("order_id" = String, Path, description = "order id: 64-bit, as a string of digits (as in bodies)", pattern = "^[1-9][0-9]{0,18}$")),
    responses(
        (status = 200, description = "what the client hands to the payment provider: the order, its amount and \
            deadline. The order is paid once the provider's signed notification arrives (`POST /payments/notifications`)", body = Checkout),
        (status = 400, description = "not a valid id (`validation`)", body = ErrorBody),
        (status = 404, description = "no such order, or somebody else's (`not_found`)", body = ErrorBody),
        (status = 409, description = "`order_pending` (not written yet; retry after `Retry-After`), `order_paid` \
            (paid already), `order_used`, or `order_closed` (cancelled or expired: past `pay_before` it is never paid)", body = ErrorBody,
            headers(("Retry-After" = u32, description = "seconds, with `order_pending`"))),
        Authed,
    ))]
pub(crate) async fn checkout(
    State(state): State<AppState>,
    user: AuthUser,
    PathId(order_id): PathId<OrderId>,
) -> AppResult<Json<Checkout>> {
    let row = own_order(&state, &user, order_id).await?;
    if row.user_id != user.user_id {
        // An administrator sees the order; only its owner pays it.
        return Err(AppError::NotFound(format!("order {order_id} not found")));
    }
    if row.status != OrderStatus::Created {
        return Err(refused(row));
    }
    // A payment that waited for the order pays it now; one past its deadline (by
    // Postgres's clock and the one rule for due) expires now.
    let mut conn = state.redis.clone();
    let replicas = state.settings.replicas;
    lifecycle::payments::settle_waiting_for(&state.db, &mut conn, &state.keys, replicas, row.id)
        .await?;
    let row = match lifecycle::expire_if_due(&state.db, &mut conn, &state.keys, replicas, row.id)
        .await?
    {
        Transition::Moved(row) => return Err(AppError::OrderClosed(row.id, row.status)),
        Transition::Unchanged(row) if row.status != OrderStatus::Created => {
            return Err(refused(row))
        }
        Transition::Unchanged(row) => row,
        Transition::Missing => {
            return Err(AppError::NotFound(format!("order {order_id} not found")))
        }
    };
    let price = vouchers::get(&state.db, row.voucher_id)
        .await?
        .map(|v| v.terms.pay_value)
        .ok_or_else(|| AppError::Internal(anyhow::anyhow!("order {order_id} has no voucher")))?;
    Ok(Json(Checkout {
        order_id: row.id,
        amount: price,
        currency: CURRENCY,
        pay_before: row.pay_before,
    }))
}

#[utoipa::path(post, path = "/orders/{order_id}/pay", operation_id = "payOrder", tag = "orders", security(("bearer" = [])),
    params(("order_id" = String, Path, description = "order id: 64-bit, as a string of digits (as in bodies)", pattern = "^[1-9][0-9]{0,18}$")),
    request_body(content = ManualPayment, description = "why the order is marked paid by hand", content_type = "application/json"),
    responses(
        (status = 200, description = "the order, `paid` (recorded as a manual payment, with the reason; paying a \
            `paid` order again is 200 and changes nothing). Shoppers pay through the payment provider", body = OrderResponse),
        (status = 400, description = "not a valid id or unreadable body (`validation`)", body = ErrorBody),
        (status = 404, description = "no such order (`not_found`)", body = ErrorBody),
        (status = 409, description = "`order_pending` (not written yet; retry after `Retry-After`), `order_used`, or \
            `order_closed` (cancelled, or expired: an unpaid order past `pay_before` is never paid)", body = ErrorBody,
            headers(("Retry-After" = u32, description = "seconds, with `order_pending`"))),
        (status = 422, description = "a body of the wrong shape, or `reason` out of range (`validation`)", body = ErrorBody),
        AdminOnly,
    ))]
pub(crate) async fn pay(
    State(state): State<AppState>,
    user: AuthUser,
    PathId(order_id): PathId<OrderId>,
    MaybeJson(body): MaybeJson<ManualPayment>,
) -> AppResult<Json<OrderResponse>> {
    if !user.admin {
        return Err(AppError::Forbidden);
    }
    let body = body.ok_or_else(|| {
        AppError::invalid("the body must be {\"reason\": \"<why it is paid by hand>\"}")
    })?;
    let reason = text("reason", &body.reason, MAX_PAY_REASON, Needed::Required)?;
    let row = own_order(&state, &user, order_id).await?;
    let mut conn = state.redis.clone();
    let payment = Payment::Manual { reason: &reason };
    let done = lifecycle::pay(
        &state.db,
        &mut conn,
        &state.keys,
        state.settings.replicas,
        row.id,
        payment,
    )
    .await?;
    match done {
        Transition::Moved(row) => Ok(Json(row.into())),
        Transition::Unchanged(row) if row.status == OrderStatus::Paid => Ok(Json(row.into())),
        Transition::Unchanged(row) if row.status == OrderStatus::Created => Err(
            AppError::Internal(anyhow::anyhow!("order {order_id} neither payable nor due")),
        ),
        Transition::Unchanged(row) => Err(refused(row)),
        Transition::Missing => Err(AppError::NotFound(format!("order {order_id} not found"))),
    }
}

#[utoipa::path(post, path = "/orders/{order_id}/redeem", operation_id = "redeemOrder", tag = "orders", security(("bearer" = [])),
    params(("order_id" = String, Path, description = "order id: 64-bit, as a string of digits (as in bodies)", pattern = "^[1-9][0-9]{0,18}$")),
    request_body(content = RedeemOrder, description = "the code the coupon's owner shows", content_type = "application/json"),
    responses(
        (status = 200, description = "the order, `used`: redeemed now. Once only: a second redemption is `order_used`", body = OrderResponse),
        (status = 400, description = "not a valid id or unreadable body (`validation`)", body = ErrorBody),
        (status = 403, description = "not staff of the voucher's shop, nor an administrator (`forbidden`)", body = ErrorBody),
        (status = 404, description = "no such order (`not_found`)", body = ErrorBody),
        (status = 409, description = "`order_used` (redeemed already), `order_unpaid`, `order_paid` (refunding or \
            refunded), `order_pending` or `order_closed`", body = ErrorBody),
        (status = 422, description = "a body of the wrong shape, or a code that is not this order's (`validation`)", body = ErrorBody),
        (status = 429, description = "too many attempts (`rate_limited`); retry after `Retry-After`", body = ErrorBody,
            headers(("Retry-After" = u32, description = "seconds"))),
        Authed,
    ))]
pub(crate) async fn redeem(
    State(state): State<AppState>,
    user: AuthUser,
    PathId(order_id): PathId<OrderId>,
    MaybeJson(body): MaybeJson<RedeemOrder>,
) -> AppResult<Json<OrderResponse>> {
    let by = match (user.admin, user.shop) {
        (true, _) => Redeemer::Admin,
        (false, Some(shop)) => Redeemer::Staff(shop),
        (false, None) => return Err(AppError::Forbidden),
    };
    let body = body.ok_or_else(|| {
        AppError::invalid("the body must be {\"code\": \"<the coupon's redeem_code>\"}")
    })?;
    // Guessing codes costs the guesser: each attempt counts against their rate.
    state
        .redeem_attempts
        .check(&user.user_id)
        .map_err(|wait| AppError::RateLimited {
            retry_after_secs: wait.as_secs_f64().ceil() as u64,
        })?;
    match lifecycle::redeem(&state.db, order_id, &body.code, by, user.user_id).await? {
        Redemption::Used(row) => Ok(Json(row.into())),
        Redemption::Refused(row) => Err(refused(row)),
        Redemption::Missing => Err(AppError::NotFound(format!(
            "order {order_id} not found (a pending order is not paid yet)"
        ))),
        Redemption::OtherShop => Err(AppError::Forbidden),
        Redemption::WrongCode => Err(AppError::invalid(format!(
            "the code is not order {order_id}'s redemption code"
        ))),
    }
}

#[utoipa::path(post, path = "/orders/{order_id}/refund", operation_id = "refundOrder", tag = "orders", security(("bearer" = [])),
    params(("order_id" = String, Path, description = "order id: 64-bit, as a string of digits (as in bodies)", pattern = "^[1-9][0-9]{0,18}$")),
    responses(
        (status = 200, description = "the order, `refunding` (now, or before: asking again is 200 and changes \
            nothing); `refunded` once the payment provider confirms the refund. A refunded coupon's unit goes back \
            on sale if its sale is still open", body = OrderResponse),
        (status = 400, description = "not a valid id (`validation`)", body = ErrorBody),
        (status = 404, description = "no such order, or somebody else's (`not_found`)", body = ErrorBody),
        (status = 409, description = "`not_refundable` (the voucher is not refundable, or the order is not paid), \
            `order_used` (redeemed already), `order_pending`, or `order_closed`", body = ErrorBody,
            headers(("Retry-After" = u32, description = "seconds, with `order_pending`"))),
        Authed,
    ))]
pub(crate) async fn refund(
    State(state): State<AppState>,
    user: AuthUser,
    PathId(order_id): PathId<OrderId>,
) -> AppResult<Json<OrderResponse>> {
    let row = own_order(&state, &user, order_id).await?;
    let reason = if user.admin {
        RefundReason::Admin
    } else {
        let refundable = vouchers::get(&state.db, row.voucher_id)
            .await?
            .is_some_and(|v| v.terms.refundable);
        if !refundable {
            return Err(AppError::NotRefundable(format!(
                "voucher {} is not refundable",
                row.voucher_id
            )));
        }
        RefundReason::Requested
    };
    match lifecycle::ask_refund(&state.db, row.id, reason).await? {
        Transition::Moved(row) => Ok(Json(OrderResponse::for_caller(row, &user))),
        Transition::Unchanged(row)
            if matches!(row.status, OrderStatus::Refunding | OrderStatus::Refunded)
                && row.refund_reason != Some(RefundReason::LatePayment) =>
        {
            Ok(Json(OrderResponse::for_caller(row, &user)))
        }
        Transition::Unchanged(row) => Err(match row.status {
            OrderStatus::Used => AppError::OrderUsed(row.id),
            OrderStatus::Cancelled | OrderStatus::Expired => {
                AppError::OrderClosed(row.id, row.status)
            }
            _ => AppError::NotRefundable(format!("order {order_id} is {}, not paid", row.status)),
        }),
        Transition::Missing => Err(AppError::NotFound(format!("order {order_id} not found"))),
    }
}

#[utoipa::path(post, path = "/orders/{order_id}/cancel", operation_id = "cancelOrder", tag = "orders", security(("bearer" = [])),
    params(("order_id" = String, Path, description = "order id: 64-bit, as a string of digits (as in bodies)", pattern = "^[1-9][0-9]{0,18}$")),
    responses(
        (status = 200, description = "the order, `cancelled` (now, or before: cancelling again is 200 and changes \
            nothing). Its unit is back on sale, and its owner may grab the voucher again while the sale is open", body = OrderResponse),
        (status = 400, description = "not a valid id (`validation`)", body = ErrorBody),
        (status = 404, description = "no such order, or somebody else's (`not_found`)", body = ErrorBody),
        (status = 409, description = "`order_pending` (not written yet; retry after `Retry-After`), `order_paid`, or \
            `order_closed` (expired, also when its deadline passed before the cancel)", body = ErrorBody,
            headers(("Retry-After" = u32, description = "seconds, with `order_pending`"))),
        Authed,
    ))]
pub(crate) async fn cancel(
    State(state): State<AppState>,
    user: AuthUser,
    PathId(order_id): PathId<OrderId>,
) -> AppResult<Json<OrderResponse>> {
    let row = own_order(&state, &user, order_id).await?;
    let mut conn = state.redis.clone();
    let replicas = state.settings.replicas;
    if row.status == OrderStatus::Created {
        // A payment that waited for the order pays it: it is not cancelled then.
        lifecycle::payments::settle_waiting_for(
            &state.db,
            &mut conn,
            &state.keys,
            replicas,
            row.id,
        )
        .await?;
    }
    match lifecycle::cancel(&state.db, &mut conn, &state.keys, replicas, row.id).await? {
        Transition::Moved(row) | Transition::Unchanged(row)
            if row.status == OrderStatus::Cancelled =>
        {
            Ok(Json(row.into()))
        }
        // A payment received in time waits for it and is being applied (by the sweeper).
        Transition::Unchanged(row) if row.status == OrderStatus::Created => {
            Err(AppError::OrderPending(row.id))
        }
        Transition::Unchanged(row) if !row.status.is_closed() => Err(refused(row)),
        Transition::Moved(row) | Transition::Unchanged(row) => {
            Err(AppError::OrderClosed(row.id, row.status))
        }
        Transition::Missing => Err(AppError::NotFound(format!("order {order_id} not found"))),
    }
}

#[utoipa::path(get, path = "/orders", operation_id = "listMyOrders", tag = "orders", security(("bearer" = [])),
    responses(
        (status = 200, description = "the caller's orders, newest first. If Redis does not answer within 500 ms, \
            only the orders already written to Postgres, and the answer carries `x-seckill-fallback: postgres`", body = [OrderResponse],
            headers(("x-seckill-fallback" = String, description = "`postgres` when Redis did not answer: `pending` orders are missing"))),
        Authed,
    ))]
pub(crate) async fn list_mine(
    State(state): State<AppState>,
    user: AuthUser,
) -> AppResult<(HeaderMap, Json<Vec<OrderResponse>>)> {
    let sales = recent_sales(&state).await?;
    let mut conn = state.redis.clone();
    // Redis before Postgres: an order written in between is then in the second read.
    let lookup = admission::orders_of(&mut conn, &state.keys, user.user_id, &sales);
    let admitted = redis_read("pending orders", lookup).await;
    let headers = fallback_headers(admitted.is_none());
    let admitted = admitted.unwrap_or_default();
    let stored = orders::list_by_user(&state.db, user.user_id).await?;
    let mut all: Vec<OrderResponse> = stored
        .into_iter()
        .map(|row| OrderResponse::for_caller(row, &user))
        .collect();
    // Written already: Postgres's row is the one to show.
    let admitted: Vec<PendingOrder> = admitted
        .into_iter()
        .filter(|p| !all.iter().any(|o| o.order_id == p.order_id))
        .collect();
    let sales: Vec<VoucherId> = admitted.iter().map(|p| p.voucher_id).collect();
    let windows = vouchers::pay_windows(&state.db, &sales).await?;
    for p in admitted {
        let window = windows.get(&p.voucher_id).copied();
        all.push(OrderResponse::pending(p, window));
    }
    all.sort_by(|a, b| {
        b.created_at
            .cmp(&a.created_at)
            .then(b.order_id.cmp(&a.order_id))
    });
    Ok((headers, Json(all)))
}
