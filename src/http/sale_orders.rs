//! The administrators' `GET /vouchers/{id}/orders` (one page of a sale's orders) and
//! a shop's `GET /shops/{shop_id}/orders` (its staff's, or an administrator's), their
//! query read by hand so that every mistake is a `validation` error in our format.

use axum::extract::{RawQuery, State};
use axum::Json;
use serde::Serialize;
use utoipa::ToSchema;

use crate::auth::{Admin, AuthUser};
use crate::domain::{OrderId, OrderStatus, ShopId, VoucherId};
use crate::http::error::{AdminOnly, AppError, AppResult, Authed, ErrorBody};
use crate::http::extract::PathId;
use crate::http::orders::OrderResponse;
use crate::http::state::AppState;
use crate::store::{orders, vouchers};

/// One page of a sale's orders.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct OrderPage {
    /// Newest first.
    items: Vec<OrderResponse>,
    /// Pass as `after` for the next page; `null` on the last page.
    #[schema(value_type = Option<String>, pattern = "^[1-9][0-9]{0,18}$")]
    next: Option<OrderId>,
}

impl OrderPage {
    /// The page of `rows`, read one more than `limit`: whether a next page exists,
    /// without an empty last page.
    fn of(mut rows: Vec<orders::OrderRow>, limit: i64) -> Self {
        let more = rows.len() as i64 > limit;
        rows.truncate(limit as usize);
        let next = more.then(|| rows.last().map(|r| r.id)).flatten();
        Self {
            items: rows.into_iter().map(Into::into).collect(),
            next,
        }
    }
}

/// The query of `GET /vouchers/{id}/orders`, checked by hand so every mistake is a
/// `validation` error in our format.
struct PageQuery {
    status: Option<ListedStatus>,
    limit: i64,
    after: Option<OrderId>,
}

const PAGE_DEFAULT: i64 = 100;
const PAGE_MAX: i64 = 1000;
/// The statuses a sale's orders can be listed by: those Postgres holds (a `pending`
/// order is not written yet).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ToSchema)]
#[schema(
    description = "The statuses a sale's orders can be listed by: those Postgres holds (a `pending` order is not written yet, so it is not listed)."
)]
pub(crate) enum ListedStatus {
    #[schema(rename = "created")]
    Created,
    #[schema(rename = "paid")]
    Paid,
    #[schema(rename = "used")]
    Used,
    #[schema(rename = "refunding")]
    Refunding,
    #[schema(rename = "refunded")]
    Refunded,
    #[schema(rename = "cancelled")]
    Cancelled,
    #[schema(rename = "expired")]
    Expired,
}

impl ListedStatus {
    pub(crate) const ALL: [ListedStatus; 7] = [
        Self::Created,
        Self::Paid,
        Self::Used,
        Self::Refunding,
        Self::Refunded,
        Self::Cancelled,
        Self::Expired,
    ];

    fn parse(value: &str) -> AppResult<Self> {
        Self::ALL
            .into_iter()
            .find(|s| OrderStatus::from(*s).as_str() == value)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL
                    .iter()
                    .map(|s| OrderStatus::from(*s).as_str())
                    .collect();
                AppError::bad_request(format!(
                    "status must be one of {} (pending orders are not written yet)",
                    names.join(", ")
                ))
            })
    }
}

impl From<ListedStatus> for OrderStatus {
    fn from(s: ListedStatus) -> Self {
        match s {
            ListedStatus::Created => OrderStatus::Created,
            ListedStatus::Paid => OrderStatus::Paid,
            ListedStatus::Used => OrderStatus::Used,
            ListedStatus::Refunding => OrderStatus::Refunding,
            ListedStatus::Refunded => OrderStatus::Refunded,
            ListedStatus::Cancelled => OrderStatus::Cancelled,
            ListedStatus::Expired => OrderStatus::Expired,
        }
    }
}

/// The parameters the listing takes: any other is refused, not ignored (a misspelt
/// `stauts=paid` would otherwise list every order).
const PARAMS: [&str; 3] = ["status", "limit", "after"];

impl PageQuery {
    fn parse(raw: Option<&str>) -> AppResult<Self> {
        let mut query = PageQuery {
            status: None,
            limit: PAGE_DEFAULT,
            after: None,
        };
        let mut seen = Vec::with_capacity(PARAMS.len());
        for (key, value) in form_urlencoded::parse(raw.unwrap_or("").as_bytes()) {
            let Some(&name) = PARAMS.iter().find(|p| **p == key) else {
                return Err(AppError::bad_request(format!(
                    "unknown query parameter `{}`: this list takes {}",
                    shown(&key),
                    PARAMS.map(|p| format!("`{p}`")).join(", ")
                )));
            };
            // Which of two values was meant is anyone's guess: neither is picked.
            if seen.contains(&name) {
                return Err(AppError::bad_request(format!(
                    "query parameter `{name}` is given more than once"
                )));
            }
            seen.push(name);
            match name {
                "status" if value.is_empty() => {}
                "status" => query.status = Some(ListedStatus::parse(&value)?),
                "limit" => {
                    query.limit = Some(value.as_ref())
                        .filter(|v| v.len() <= 4 && v.bytes().all(|b| b.is_ascii_digit()))
                        .and_then(|v| v.parse::<i64>().ok())
                        .filter(|n| (1..=PAGE_MAX).contains(n))
                        .ok_or_else(|| {
                            AppError::bad_request(format!("limit must be 1 to {PAGE_MAX}"))
                        })?
                }
                "after" => {
                    query.after =
                        Some(value.parse().map_err(|_| {
                            AppError::bad_request("after is not a cursor of this list")
                        })?)
                }
                _ => unreachable!("every name in PARAMS is read"),
            }
        }
        Ok(query)
    }
}

/// A parameter name as quoted back: at most 40 characters, control characters escaped.
fn shown(name: &str) -> String {
    let mut out: String = name.chars().take(40).flat_map(char::escape_debug).collect();
    if name.chars().count() > 40 {
        out.push('…');
    }
    out
}

#[utoipa::path(get, path = "/vouchers/{id}/orders", operation_id = "listSaleOrders", tag = "vouchers",
    security(("bearer" = [])),
    params(
        ("id" = i64, Path, description = "voucher id", minimum = 1),
        ("status" = Option<ListedStatus>, Query, description = "only orders in this status"),
        ("limit" = Option<i64>, Query, description = "orders per page, 1 to 1000 (default 100)", minimum = 1, maximum = 1000),
        ("after" = Option<String>, Query, description = "the `next` of the previous page", pattern = "^[1-9][0-9]{0,18}$"),
    ),
    responses(
        (status = 200, description = "a page of the sale's orders written to Postgres, newest first \
            (keyset pagination: pages neither repeat nor skip an order while the sale goes on; an order \
            written after its page was read, with an older id, is not in later pages)", body = OrderPage),
        (status = 400, description = "bad id, status, limit or cursor, or an unknown or repeated query parameter (`validation`)", body = ErrorBody),
        (status = 404, description = "no such voucher (`not_found`)", body = ErrorBody),
        AdminOnly,
    ))]
pub(crate) async fn list_orders(
    State(state): State<AppState>,
    _admin: Admin,
    PathId(id): PathId<VoucherId>,
    RawQuery(raw): RawQuery,
) -> AppResult<Json<OrderPage>> {
    let query = PageQuery::parse(raw.as_deref())?;
    vouchers::get(&state.db, id)
        .await?
        .ok_or_else(|| AppError::no_voucher(id))?;
    // One more than asked: whether a next page exists, without an empty last page.
    let rows = orders::page_of_sale(
        &state.db,
        id,
        query.status.map(Into::into),
        query.after,
        query.limit + 1,
    )
    .await?;
    Ok(Json(OrderPage::of(rows, query.limit)))
}

#[utoipa::path(get, path = "/shops/{shop_id}/orders", operation_id = "listShopOrders", tag = "orders",
    security(("bearer" = [])),
    params(
        ("shop_id" = i64, Path, description = "shop id", minimum = 1),
        ("status" = Option<ListedStatus>, Query, description = "only orders in this status"),
        ("limit" = Option<i64>, Query, description = "orders per page, 1 to 1000 (default 100)", minimum = 1, maximum = 1000),
        ("after" = Option<String>, Query, description = "the `next` of the previous page", pattern = "^[1-9][0-9]{0,18}$"),
    ),
    responses(
        (status = 200, description = "a page of the orders of the shop's vouchers written to Postgres, newest first \
            (keyset pagination, as `GET /vouchers/{id}/orders`); redemption codes are never shown here", body = OrderPage),
        (status = 400, description = "bad id, status, limit or cursor, or an unknown or repeated query parameter (`validation`)", body = ErrorBody),
        (status = 403, description = "not staff of this shop, nor an administrator (`forbidden`)", body = ErrorBody),
        Authed,
    ))]
pub(crate) async fn list_shop_orders(
    State(state): State<AppState>,
    user: AuthUser,
    PathId(shop_id): PathId<ShopId>,
    RawQuery(raw): RawQuery,
) -> AppResult<Json<OrderPage>> {
    if !user.admin && user.shop != Some(shop_id) {
        return Err(AppError::Forbidden);
    }
    let query = PageQuery::parse(raw.as_deref())?;
    let rows = orders::page_of_shop(
        &state.db,
        shop_id,
        query.status.map(Into::into),
        query.after,
        query.limit + 1,
    )
    .await?;
    Ok(Json(OrderPage::of(rows, query.limit)))
}
