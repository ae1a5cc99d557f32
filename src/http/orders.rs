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
use crate::domain::{OrderId, OrderStatus, UserId, VoucherId};
use crate::http::error::{AppError, AppResult, ErrorBody};
use crate::http::extract::{MaybeJson, PathId};
use crate::http::state::AppState;
use crate::http::text::{text, Needed};
use crate::http::{fallback_headers, redis_read};
use crate::lifecycle;
use crate::store::lifecycle::Transition;
use crate::store::orders::{self, OrderRow};
use crate::store::vouchers;

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub(crate) struct OrderResponse {
    /// 64-bit, as a string.
    #[schema(value_type = String, pattern = "^[1-9][0-9]{0,18}$")]
    pub order_id: OrderId,
    #[schema(inline)]
    pub voucher_id: VoucherId,
    #[schema(inline)]
    pub user_id: UserId,
    /// `pending` until the worker has written it to Postgres, then `created`; then
    /// `paid`, `cancelled` or `expired` (final).
    #[schema(example = "created")]
    pub status: OrderStatus,
    /// Admission time.
    pub created_at: DateTime<Utc>,
    /// Payment deadline: admission time + the sale's `pay_within_secs`. An unpaid order
    /// expires within a few seconds after it.
    pub pay_before: Option<DateTime<Utc>>,
    pub paid_at: Option<DateTime<Utc>>,
    /// When it was cancelled or expired.
    pub closed_at: Option<DateTime<Utc>>,
    /// The reference given with the payment, if any.
    pub payment_ref: Option<String>,
}

impl From<OrderRow> for OrderResponse {
    fn from(row: OrderRow) -> Self {
        Self {
            order_id: row.id,
            voucher_id: row.voucher_id,
            user_id: row.user_id,
            status: row.status,
            created_at: row.created_at,
            pay_before: Some(row.pay_before),
            paid_at: row.paid_at,
            closed_at: row.closed_at,
            payment_ref: row.payment_ref,
        }
    }
}

impl OrderResponse {
    /// A pending order; `pay_within_secs` is its sale's payment window, if known.
    fn pending(p: PendingOrder, pay_within_secs: Option<i32>) -> Self {
        let created_at = DateTime::from_timestamp_millis(p.admitted_ms).unwrap_or_default();
        Self {
            order_id: p.order_id,
            voucher_id: p.voucher_id,
            user_id: p.user_id,
            status: OrderStatus::Pending,
            created_at,
            pay_before: pay_within_secs.map(|s| created_at + chrono::Duration::seconds(s.into())),
            paid_at: None,
            closed_at: None,
            payment_ref: None,
        }
    }
}

/// Optional body of `POST /orders/{order_id}/pay`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct PayOrder {
    /// The payment provider's reference: 1 to 128 characters, no NUL, at least one of
    /// them visible (not only whitespace or invisible characters).
    #[schema(
        min_length = 1,
        max_length = 128,
        pattern = "^[^\\u0000]*[^\\s\\u0000\\u00AD\\u034F\\u061C\\u115F\\u1160\\u17B4\\u17B5\\u180B-\\u180F\\u200B-\\u200F\\u202A-\\u202E\\u2060-\\u206F\\u3164\\uFE00-\\uFE0F\\uFEFF\\uFFA0\\uFFF0-\\uFFF8][^\\u0000]*$"
    )]
    pub payment_ref: Option<String>,
}

const MAX_PAYMENT_REF: usize = 128;

impl PayOrder {
    fn payment_ref(self) -> AppResult<Option<String>> {
        self.payment_ref
            .map(|r| text("payment_ref", &r, MAX_PAYMENT_REF, Needed::Required))
            .transpose()
    }
}

/// Sales whose Redis state may still hold buyer records (not ended longer ago than the
/// retention).
async fn recent_sales(state: &AppState) -> AppResult<Vec<(VoucherId, u8)>> {
    let since = chrono::Utc::now()
        - chrono::Duration::from_std(state.settings.sale_state_retention).unwrap_or_default();
    Ok(crate::store::vouchers::sales_ending_after(&state.db, since)
        .await?
        .into_iter()
        .map(|s| (s.voucher_id, s.parts()))
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
        Found::Stored(row) => Ok(Json(row.into())),
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

#[utoipa::path(post, path = "/orders/{order_id}/pay", operation_id = "payOrder", tag = "orders", security(("bearer" = [])),
    params(("order_id" = String, Path, description = "order id: 64-bit, as a string of digits (as in bodies)", pattern = "^[1-9][0-9]{0,18}$")),
    request_body(content = Option<PayOrder>, description = "optional (no body at all is fine): the payment's reference", content_type = "application/json"),
    responses(
        (status = 200, description = "the order, `paid` (now, or before: paying again is 200 and changes nothing)", body = OrderResponse),
        (status = 400, description = "not a valid id or unreadable body (`validation`)", body = ErrorBody),
        (status = 401, description = "no or bad token (`unauthorized`)", body = ErrorBody),
        (status = 404, description = "no such order, or somebody else's (`not_found`)", body = ErrorBody),
        (status = 409, description = "`order_pending` (not written yet; retry after `Retry-After`), or `order_closed` \
            (cancelled, or expired: an unpaid order past `pay_before` is never paid)", body = ErrorBody,
            headers(("Retry-After" = u32, description = "seconds, with `order_pending`"))),
        (status = 422, description = "a body of the wrong shape, or `payment_ref` out of range (`validation`)", body = ErrorBody),
        (status = 503, description = "a dependency is down (`unavailable`)", body = ErrorBody),
    ))]
pub(crate) async fn pay(
    State(state): State<AppState>,
    user: AuthUser,
    PathId(order_id): PathId<OrderId>,
    MaybeJson(body): MaybeJson<PayOrder>,
) -> AppResult<Json<OrderResponse>> {
    let payment_ref = match body {
        Some(body) => body.payment_ref()?,
        None => None,
    };
    let row = own_order(&state, &user, order_id).await?;
    let mut conn = state.redis.clone();
    let done = lifecycle::pay(
        &state.db,
        &mut conn,
        &state.keys,
        state.settings.replicas,
        row.id,
        payment_ref.as_deref(),
    )
    .await?;
    match done {
        Transition::Moved(row) => Ok(Json(row.into())),
        Transition::Unchanged(row) if row.status == OrderStatus::Paid => Ok(Json(row.into())),
        Transition::Unchanged(row) if row.status == OrderStatus::Created => Err(
            AppError::Internal(anyhow::anyhow!("order {order_id} neither payable nor due")),
        ),
        Transition::Unchanged(row) => Err(AppError::OrderClosed(row.id, row.status)),
        Transition::Missing => Err(AppError::NotFound(format!("order {order_id} not found"))),
    }
}

#[utoipa::path(post, path = "/orders/{order_id}/cancel", operation_id = "cancelOrder", tag = "orders", security(("bearer" = [])),
    params(("order_id" = String, Path, description = "order id: 64-bit, as a string of digits (as in bodies)", pattern = "^[1-9][0-9]{0,18}$")),
    responses(
        (status = 200, description = "the order, `cancelled` (now, or before: cancelling again is 200 and changes \
            nothing). Its unit is back on sale, and its owner may grab the voucher again while the sale is open", body = OrderResponse),
        (status = 400, description = "not a valid id (`validation`)", body = ErrorBody),
        (status = 401, description = "no or bad token (`unauthorized`)", body = ErrorBody),
        (status = 404, description = "no such order, or somebody else's (`not_found`)", body = ErrorBody),
        (status = 409, description = "`order_pending` (not written yet; retry after `Retry-After`), `order_paid`, or \
            `order_closed` (expired, also when its deadline passed before the cancel)", body = ErrorBody,
            headers(("Retry-After" = u32, description = "seconds, with `order_pending`"))),
        (status = 503, description = "a dependency is down (`unavailable`)", body = ErrorBody),
    ))]
pub(crate) async fn cancel(
    State(state): State<AppState>,
    user: AuthUser,
    PathId(order_id): PathId<OrderId>,
) -> AppResult<Json<OrderResponse>> {
    let row = own_order(&state, &user, order_id).await?;
    let mut conn = state.redis.clone();
    let replicas = state.settings.replicas;
    match lifecycle::cancel(&state.db, &mut conn, &state.keys, replicas, row.id).await? {
        Transition::Moved(row) | Transition::Unchanged(row)
            if row.status == OrderStatus::Cancelled =>
        {
            Ok(Json(row.into()))
        }
        Transition::Unchanged(row) if row.status == OrderStatus::Paid => {
            Err(AppError::OrderPaid(row.id))
        }
        Transition::Unchanged(row) if row.status == OrderStatus::Created => Err(
            AppError::Internal(anyhow::anyhow!("order {order_id} was not closed")),
        ),
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
        (status = 401, description = "no or bad token (`unauthorized`)", body = ErrorBody),
        (status = 503, description = "a dependency is down (`unavailable`)", body = ErrorBody),
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
    let mut all: Vec<OrderResponse> = stored.into_iter().map(Into::into).collect();
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
