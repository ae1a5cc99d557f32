//! `GET /orders/{order_id}` and `GET /orders`: an order is `pending` while only Redis
//! knows it and `created` once the worker has written it to Postgres.

use axum::extract::State;
use axum::http::HeaderMap;
use axum::Json;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::admission::{self, PendingOrder};
use crate::auth::AuthUser;
use crate::http::error::{AppError, AppResult, ErrorBody};
use crate::http::extract::PathId;
use crate::http::state::AppState;
use crate::http::{fallback_headers, redis_read};
use crate::store::orders::{self, OrderRow};

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub(crate) struct OrderResponse {
    /// 64-bit, as a string.
    #[schema(pattern = "^[1-9][0-9]{0,18}$")]
    pub order_id: String,
    pub voucher_id: i64,
    pub user_id: i64,
    /// `pending` until the worker has written it to Postgres, then `created`.
    #[schema(example = "created")]
    pub status: String,
    /// Admission time.
    pub created_at: DateTime<Utc>,
}

impl From<OrderRow> for OrderResponse {
    fn from(row: OrderRow) -> Self {
        Self {
            order_id: row.id.to_string(),
            voucher_id: row.voucher_id,
            user_id: row.user_id,
            status: row.status,
            created_at: row.created_at,
        }
    }
}

impl From<PendingOrder> for OrderResponse {
    fn from(p: PendingOrder) -> Self {
        Self {
            order_id: p.order_id.to_string(),
            voucher_id: p.voucher_id,
            user_id: p.user_id,
            status: "pending".into(),
            created_at: DateTime::from_timestamp_millis(p.admitted_ms).unwrap_or_default(),
        }
    }
}

/// Sales whose Redis state may still hold buyer records (not ended longer ago than the
/// retention).
async fn recent_sales(state: &AppState) -> AppResult<Vec<i64>> {
    let since = chrono::Utc::now()
        - chrono::Duration::from_std(state.settings.sale_state_retention).unwrap_or_default();
    Ok(crate::store::vouchers::sales_ending_after(&state.db, since).await?)
}

/// Most stream entries an administrator's lookup of a pending order scans.
const ADMIN_STREAM_SCAN: usize = 200_000;

#[utoipa::path(get, path = "/orders/{order_id}", tag = "orders", security(("bearer" = [])),
    params(("order_id" = i64, Path, description = "order id", minimum = 1)),
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
    PathId(order_id): PathId,
) -> AppResult<Json<OrderResponse>> {
    let not_found = || AppError::NotFound(format!("order {order_id} not found"));
    let visible = |owner: i64| user.admin || owner == user.user_id;
    if let Some(row) = orders::get(&state.db, order_id).await? {
        return if visible(row.user_id) {
            Ok(Json(row.into()))
        } else {
            Err(not_found())
        };
    }
    // Not in Postgres (yet): admitted orders are found through the caller's buyer
    // records; an administrator's lookup scans the stream instead. Without Redis it
    // cannot be told whether the order is pending: 503 at once, not 404.
    let redis_down = || {
        AppError::Unavailable(format!(
            "order {order_id} is not in Postgres, and Redis, which holds pending orders, \
             is unavailable; try again"
        ))
    };
    let mut conn = state.redis.clone();
    let pending = if user.admin {
        // The scan may take longer than the read deadline: only the first answer must
        // come within it.
        let ping = redis::cmd("PING");
        redis_read("ping", ping.query_async::<String>(&mut conn))
            .await
            .ok_or_else(redis_down)?;
        admission::find_in_stream(&mut conn, &state.keys, order_id, ADMIN_STREAM_SCAN).await?
    } else {
        let sales = recent_sales(&state).await?;
        let lookup = admission::orders_of(&mut conn, &state.keys, user.user_id, &sales);
        redis_read("pending orders", lookup)
            .await
            .ok_or_else(redis_down)?
            .into_iter()
            .find(|p| p.order_id == order_id)
    };
    match pending {
        Some(p) if visible(p.user_id) => Ok(Json(p.into())),
        _ => Err(not_found()),
    }
}

#[utoipa::path(get, path = "/orders", tag = "orders", security(("bearer" = [])),
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
    for p in admitted {
        // Written already: Postgres's row is the one to show.
        if !all.iter().any(|o| o.order_id == p.order_id.to_string()) {
            all.push(p.into());
        }
    }
    all.sort_by(|a, b| {
        b.created_at
            .cmp(&a.created_at)
            .then(b.order_id.cmp(&a.order_id))
    });
    Ok((headers, Json(all)))
}
