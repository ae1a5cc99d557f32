//! The payment provider's side: `POST /payments/notifications` (signed, see
//! [`crate::lifecycle::signature`]) and the administrators' `GET /payments`, every
//! notification recorded and what it did.

use axum::body::Bytes;
use axum::extract::{RawQuery, State};
use axum::http::HeaderMap;
use axum::Json;
use chrono::Utc;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::auth::Admin;
use crate::domain::OrderId;
use crate::http::error::{AdminOnly, AppError, AppResult, ErrorBody};
use crate::http::state::AppState;
use crate::lifecycle::{self, signature};
use crate::metrics::PAYMENT_NOTIFICATIONS;
use crate::store::payments::{self, EventRow, Kind, Outcome};

/// A notification as the provider sends it (documentation of the raw body, which is
/// checked against its signature before it is read).
#[derive(Debug, Deserialize, ToSchema)]
#[allow(dead_code)]
pub(crate) struct Notification {
    /// The event's id: 1 to 128 visible ASCII characters; a second notification with
    /// it is a replay.
    id: String,
    #[serde(rename = "type")]
    kind: Kind,
    #[schema(value_type = String, pattern = "^[1-9][0-9]{0,18}$")]
    order_id: OrderId,
    /// Cents; a payment must equal the voucher's `pay_value`.
    amount: i64,
    #[schema(example = "CNY")]
    currency: String,
    /// The provider's transaction: a second notification with it is a replay.
    transaction_id: String,
}

/// What a notification did.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Notified {
    pub event_id: String,
    pub outcome: Outcome,
    #[schema(value_type = String, pattern = "^[1-9][0-9]{0,18}$")]
    pub order_id: OrderId,
    /// Recorded before: this one changed nothing.
    pub replay: bool,
}

#[utoipa::path(post, path = "/payments/notifications", operation_id = "receivePaymentNotification", tag = "payments",
    params(("Seckill-Signature" = String, Header,
        description = "`t=<unix seconds>,v1=<hex HMAC-SHA256(secret, \"<t>.<raw body>\")>` (several `v1=` allowed), \
            with a secret of PAYMENT_WEBHOOK_SECRETS; `t` within 300 s of the server's clock")),
    request_body(content = Notification, content_type = "application/json"),
    responses(
        (status = 200, description = "applied or recorded: `paid`; `late_payment` (the order had closed: it is \
            `refunding` now, no unit taken); `already_paid` or `no_order` (money to give back, listed in \
            `GET /payments`); `awaiting_order` (not written yet: applied once it is, and in time if received \
            before `pay_before`); `refunded`. A replay (the same `id` with the same content, or the same \
            `transaction_id` for the same order) answers as the first did, with `replay: true`, and changes \
            nothing", body = Notified),
        (status = 400, description = "a body that is not a notification (`validation`)", body = ErrorBody),
        (status = 401, description = "no, malformed, stale or wrong signature, or no secret configured (`bad_signature`); nothing recorded", body = ErrorBody),
        (status = 409, description = "a refund for an order that is not `refunding` (`not_refundable`); recorded, \
            the order unchanged. Or `id_conflict`: the `transaction_id` or `id` is recorded for another order (or \
            the `id` for another notification); recorded once as `id_conflict`, nothing applied", body = ErrorBody),
        (status = 422, description = "the amount or currency is not the order's price (`validation`); recorded as \
            money to give back, the order unchanged; its `transaction_id` stays free for a corrected notification", body = ErrorBody),
        (status = 503, description = "a dependency is down (`unavailable`): nothing recorded, send it again", body = ErrorBody),
    ))]
pub(crate) async fn notify(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Bytes,
) -> AppResult<Json<Notified>> {
    let header = headers
        .get(signature::HEADER)
        .map(|v| v.to_str().unwrap_or(""));
    if let Err(why) = (state.payment_secrets).verify(header, &body, Utc::now().timestamp()) {
        refused("bad_signature");
        return Err(AppError::BadSignature(why.to_string()));
    }
    let event = lifecycle::payments::parse(&body).map_err(|e| {
        refused("malformed");
        AppError::bad_request(e.0)
    })?;
    let mut conn = state.redis.clone();
    let replicas = state.settings.replicas;
    let received =
        lifecycle::payments::receive(&state.db, &mut conn, &state.keys, replicas, &event).await?;
    let order_id = event.order_id;
    match received.outcome {
        Outcome::AmountMismatch => Err(AppError::invalid(format!(
            "{} {} is not the price of order {order_id}: recorded, the order is unchanged",
            event.amount, event.currency
        ))),
        Outcome::NotRefunding => Err(AppError::NotRefundable(format!(
            "order {order_id} is not refunding: no refund to confirm (recorded)"
        ))),
        Outcome::IdConflict => {
            let first = received.conflicts_with.as_ref();
            let (held, by) = match first {
                Some(c) if c.same_event => (format!("event id {}", event.event_id), c),
                Some(c) => (format!("transaction {}", event.transaction_id), c),
                None => return Err(AppError::Internal(anyhow::anyhow!("a conflict unnamed"))),
            };
            Err(AppError::IdConflict(format!(
                "{held} is recorded for order {} (event {}): this notification for order \
                 {order_id} is refused and recorded, nothing applied",
                by.order_id, by.event_id
            )))
        }
        outcome => Ok(Json(Notified {
            event_id: event.event_id,
            outcome,
            order_id,
            replay: received.replay,
        })),
    }
}

fn refused(why: &'static str) {
    metrics::counter!(PAYMENT_NOTIFICATIONS, "outcome" => why).increment(1);
}

/// A page of recorded notifications.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct PaymentPage {
    /// Newest first.
    items: Vec<EventRow>,
    /// Pass as `after` for the next page; `null` on the last page.
    next: Option<String>,
}

const PAGE_DEFAULT: i64 = 100;
const PAGE_MAX: i64 = 1000;

#[utoipa::path(get, path = "/payments", operation_id = "listPayments", tag = "payments", security(("bearer" = [])),
    params(
        ("outcome" = Option<Outcome>, Query, description = "only notifications with this outcome: \
            `late_payment`, `already_paid`, `no_order` and `amount_mismatch` are money to give back; \
            `id_conflict` is a notification to take up with the provider"),
        ("money_back" = Option<bool>, Query, description = "`true`: only the money to give back with no order to \
            carry its refund (`already_paid`, `no_order`, `amount_mismatch`)"),
        ("limit" = Option<i64>, Query, description = "notifications per page, 1 to 1000 (default 100)", minimum = 1, maximum = 1000),
        ("after" = Option<String>, Query, description = "the `next` of the previous page (an unknown one is a 400)"),
    ),
    responses(
        (status = 200, description = "the payment provider's notifications, newest first", body = PaymentPage),
        (status = 400, description = "bad outcome, money_back, limit or cursor (one no page gave), or an unknown or \
            repeated query parameter (`validation`)", body = ErrorBody),
        AdminOnly,
    ))]
pub(crate) async fn list(
    State(state): State<AppState>,
    _admin: Admin,
    RawQuery(raw): RawQuery,
) -> AppResult<Json<PaymentPage>> {
    let (mut outcome, mut limit, mut after, mut money_back) = (None, PAGE_DEFAULT, None, false);
    let mut seen: Vec<String> = Vec::new();
    for (key, value) in form_urlencoded::parse(raw.unwrap_or_default().as_bytes()) {
        if seen.iter().any(|k| *k == key) {
            return Err(AppError::bad_request(format!(
                "query parameter `{key}` is given more than once"
            )));
        }
        seen.push(key.to_string());
        match key.as_ref() {
            "outcome" => {
                outcome = Some(
                    Outcome::ALL
                        .into_iter()
                        .find(|o| o.as_str() == value)
                        .ok_or_else(|| {
                            let all: Vec<&str> = Outcome::ALL.iter().map(|o| o.as_str()).collect();
                            AppError::bad_request(format!(
                                "outcome must be one of {}",
                                all.join(", ")
                            ))
                        })?,
                )
            }
            "limit" => {
                limit = value
                    .parse::<i64>()
                    .ok()
                    .filter(|n| (1..=PAGE_MAX).contains(n))
                    .ok_or_else(|| {
                        AppError::bad_request(format!("limit must be 1 to {PAGE_MAX}"))
                    })?
            }
            "money_back" => {
                money_back = value
                    .parse::<bool>()
                    .map_err(|_| AppError::bad_request("money_back must be true or false"))?
            }
            "after" => {
                let cursor = value.parse::<i64>().ok().filter(|n| *n > 0);
                after = Some(cursor.ok_or_else(|| {
                    AppError::bad_request("after must be the `next` of a previous page")
                })?)
            }
            _ => {
                return Err(AppError::bad_request(
                    "unknown query parameter: this list takes `outcome`, `money_back`, `limit`, \
                     `after`",
                ))
            }
        }
    }
    if let Some(cursor) = after {
        if !payments::recorded(&state.db, cursor).await? {
            return Err(AppError::bad_request(format!(
                "after={cursor} is not a cursor of this list: pass the `next` of a previous page"
            )));
        }
    }
    let outcomes: Option<Vec<Outcome>> = match (outcome, money_back) {
        (Some(o), _) => Some(vec![o]),
        (None, true) => Some(
            Outcome::ALL
                .into_iter()
                .filter(|o| o.owes_money_back())
                .collect(),
        ),
        (None, false) => None,
    };
    if outcome.is_some_and(|o| money_back && !o.owes_money_back()) {
        return Err(AppError::bad_request(format!(
            "outcome={} is not money to give back: drop money_back or the outcome",
            outcome.map_or("", |o| o.as_str())
        )));
    }
    let mut rows = payments::page(&state.db, outcomes.as_deref(), after, limit + 1).await?;
    let more = rows.len() as i64 > limit;
    rows.truncate(limit as usize);
    let next = more
        .then(|| rows.last().map(|r| r.seq.to_string()))
        .flatten();
    Ok(Json(PaymentPage { items: rows, next }))
}
