//! One error type for the whole HTTP surface, rendered as the contract's JSON:
//! `{"error": {"code": "...", "message": "..."}}`. Internal causes are logged, never sent.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

use crate::domain::{OrderId, OrderStatus, VoucherId};

/// Every error answer: `{"error": {"code": "...", "message": "..."}}`.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct ErrorBody {
    pub error: ErrorDetail,
}

/// The answers a route that needs a token may give besides its own (OpenAPI only:
/// never built).
#[derive(utoipa::IntoResponses)]
#[allow(dead_code)]
pub(crate) enum Authed {
    /// no or bad token (`unauthorized`)
    #[response(status = 401)]
    Unauthorized(ErrorBody),
    /// a dependency is down (`unavailable`)
    #[response(status = 503)]
    Unavailable(ErrorBody),
}

/// The answers an administrators' route may give besides its own (OpenAPI only).
#[derive(utoipa::IntoResponses)]
#[allow(dead_code)]
pub(crate) enum AdminOnly {
    /// no or bad token (`unauthorized`)
    #[response(status = 401)]
    Unauthorized(ErrorBody),
    /// not an administrator (`forbidden`)
    #[response(status = 403)]
    Forbidden(ErrorBody),
    /// a dependency is down (`unavailable`)
    #[response(status = 503)]
    Unavailable(ErrorBody),
}

#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct ErrorDetail {
    /// Machine-readable: one of the codes the `ErrorCode` schema lists.
    pub code: ErrorCode,
    /// For humans.
    pub message: String,
    /// With `already_ordered`: the caller's existing order. With `"outcome": "unknown"`:
    /// the id the grab's order has if it went through (`GET /orders/{id}` tells).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>, pattern = "^[1-9][0-9]{0,18}$")]
    pub order_id: Option<OrderId>,
    /// `unknown` on a grab's 503 whose Redis call failed after it was sent: the order
    /// may exist. Retrying tells (202, or `already_ordered` with its `order_id`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub outcome: Option<GrabOutcome>,
}

/// What a `503` knows of a grab's outcome: `unknown` (the call reached Redis and its
/// answer did not come back: the order may exist).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub(crate) enum GrabOutcome {
    Unknown,
}

// Every `code` an error answer can carry: the one list that `AppError`'s mapping answers
// from and the document's `ErrorCode` schema is generated from, so the two cannot drift
// apart (a generated client refuses a code its enum does not list).
/// What went wrong, for programs (the `message` is for humans): `unauthorized` (401),
/// `forbidden` (403), `not_found` (404), `validation` (400, 405, 413, 414, 422, 431),
/// `not_started`, `ended`, `sold_out`, `already_ordered`, `order_pending`, `order_paid`,
/// `order_closed`, `order_used`, `order_unpaid`, `not_refundable`, `conflict`,
/// `id_conflict` (409),
/// `rate_limited` (429), `unavailable` (503), `internal` (500), `bad_signature` (401).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
#[schema(example = "sold_out")]
pub(crate) enum ErrorCode {
    /// 401: no, malformed, expired or wrongly signed token (the message says which rule failed).
    Unauthorized,
    /// 403: a shopper on an administrator's route; staff of another shop.
    Forbidden,
    /// 404: unknown voucher, order or route (or somebody else's order).
    NotFound,
    /// 400, 405, 413, 414, 422 or 431: the request is malformed, too large or out of range.
    Validation,
    /// 409: a grab before the sale's `begin_time`.
    NotStarted,
    /// 409: a grab after the sale's end.
    Ended,
    /// 409: no stock left.
    SoldOut,
    /// 409: the caller already holds an order for this voucher (`order_id` names it).
    AlreadyOrdered,
    /// 409: the order is admitted but not written yet; retry after `Retry-After`.
    OrderPending,
    /// 409: the order is paid and cannot be cancelled.
    OrderPaid,
    /// 409: the order is cancelled or expired.
    OrderClosed,
    /// 409: the coupon was redeemed already.
    OrderUsed,
    /// 409: the order is not paid (yet), and the move needs a paid one.
    OrderUnpaid,
    /// 409: the voucher is not refundable, or the order is not paid.
    NotRefundable,
    /// 429: too many requests; retry after `Retry-After`.
    RateLimited,
    /// 503: a dependency is down, a limit is reached or the sale is being loaded.
    Unavailable,
    /// 409: the record already exists.
    Conflict,
    /// 500: a bug.
    Internal,
    /// 401: a payment notification whose signature, timestamp or secret does not hold.
    BadSignature,
    /// 409: a payment notification whose transaction id (or event id) is recorded for
    /// another order (or its event id for another notification): kept, nothing applied.
    IdConflict,
}

impl ErrorCode {
    /// Every code, in the order the document lists them.
    #[cfg(test)]
    pub(crate) const ALL: [ErrorCode; 20] = [
        ErrorCode::Unauthorized,
        ErrorCode::Forbidden,
        ErrorCode::NotFound,
        ErrorCode::Validation,
        ErrorCode::NotStarted,
        ErrorCode::Ended,
        ErrorCode::SoldOut,
        ErrorCode::AlreadyOrdered,
        ErrorCode::OrderPending,
        ErrorCode::OrderPaid,
        ErrorCode::OrderClosed,
        ErrorCode::OrderUsed,
        ErrorCode::OrderUnpaid,
        ErrorCode::NotRefundable,
        ErrorCode::RateLimited,
        ErrorCode::Unavailable,
        ErrorCode::Conflict,
        ErrorCode::Internal,
        ErrorCode::BadSignature,
        ErrorCode::IdConflict,
    ];
}

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error("unauthorized: {0}")]
    Unauthorized(&'static str),
    #[error("forbidden")]
    Forbidden,
    #[error("not found: {0}")]
    NotFound(String),
    /// Malformed or out-of-range input; `status` is 400 (unreadable) or 422 (invalid).
    #[error("validation: {message}")]
    Validation { status: StatusCode, message: String },
    #[error("the sale has not started")]
    NotStarted,
    #[error("the sale has ended")]
    Ended,
    #[error("sold out")]
    SoldOut,
    #[error("already ordered: {order_id}")]
    AlreadyOrdered { order_id: OrderId },
    /// The order is admitted but not written to Postgres yet: retry shortly.
    #[error("order {0} is still pending")]
    OrderPending(OrderId),
    #[error("order {0} is paid")]
    OrderPaid(OrderId),
    /// Cancelled or expired (the status says which).
    #[error("order {0} is {1}")]
    OrderClosed(OrderId, OrderStatus),
    #[error("order {0} is used")]
    OrderUsed(OrderId),
    #[error("order {0} is not paid")]
    OrderUnpaid(OrderId),
    #[error("not refundable: {0}")]
    NotRefundable(String),
    /// A payment notification's signature does not hold (the message says why).
    #[error("bad signature: {0}")]
    BadSignature(String),
    /// A payment notification's ids are another notification's (the message says whose).
    #[error("id conflict: {0}")]
    IdConflict(String),
    /// Too many requests; try again after this many seconds.
    #[error("rate limited")]
    RateLimited { retry_after_secs: u64 },
    /// A dependency is down or not ready; nothing was reserved.
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// A 503 that is expected back-pressure, not a fault (too many live pages): the
    /// same answer as [`AppError::Unavailable`], logged at debug only, since thousands
    /// of refused viewers retrying would otherwise flood the log like an outage.
    #[error("busy: {0}")]
    Busy(String),
    /// The admission script was sent but no answer came (timeout, connection lost): it
    /// may have run, so the order, minted with this id, may exist.
    #[error("admission outcome unknown (order {order_id})")]
    OutcomeUnknown { order_id: OrderId },
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("internal: {0}")]
    Internal(anyhow::Error),
}

/// Orchestration below the handlers returns `anyhow`: a Postgres or Redis error inside
/// keeps its own variant (so a dependency that is down is a 503, not a 500).
impl From<anyhow::Error> for AppError {
    fn from(e: anyhow::Error) -> Self {
        match e.downcast::<sqlx::Error>() {
            Ok(db) => AppError::Database(db),
            Err(e) => match e.downcast::<redis::RedisError>() {
                Ok(redis) => AppError::Redis(redis),
                Err(e) => AppError::Internal(e),
            },
        }
    }
}

pub(crate) type AppResult<T> = Result<T, AppError>;

impl From<crate::auth::Unauthorized> for AppError {
    fn from(e: crate::auth::Unauthorized) -> Self {
        AppError::Unauthorized(e.0)
    }
}

/// A bad token is a 401; an identity provider's token before its keys were ever fetched
/// is a 503 (`unavailable`, `Retry-After: 1`): the token may be good.
impl From<crate::auth::Refused> for AppError {
    fn from(e: crate::auth::Refused) -> Self {
        match e {
            crate::auth::Refused::Unauthorized(why) => AppError::Unauthorized(why),
            crate::auth::Refused::KeysNotLoaded => AppError::Unavailable(
                "identity provider keys not loaded yet, try again shortly".into(),
            ),
        }
    }
}

impl AppError {
    /// 404 for a voucher id no voucher has.
    pub(crate) fn no_voucher(id: VoucherId) -> Self {
        Self::NotFound(format!("voucher {id} not found"))
    }

    /// 404 for a voucher that has no flash sale.
    pub(crate) fn no_sale(id: VoucherId) -> Self {
        Self::NotFound(format!("voucher {id} has no flash sale"))
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Self::Validation {
            status: StatusCode::UNPROCESSABLE_ENTITY,
            message: message.into(),
        }
    }

    pub(crate) fn bad_request(message: impl Into<String>) -> Self {
        Self::Validation {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
        }
    }

    fn parts(&self) -> (StatusCode, ErrorCode, String) {
        use AppError::*;
        use ErrorCode as C;
        match self {
            Unauthorized(why) => (StatusCode::UNAUTHORIZED, C::Unauthorized, why.to_string()),
            Forbidden => (
                StatusCode::FORBIDDEN,
                C::Forbidden,
                "not allowed: this is for administrators (or, where the route says so, staff \
                 of the voucher's shop)"
                    .into(),
            ),
            NotFound(what) => (StatusCode::NOT_FOUND, C::NotFound, what.clone()),
            Validation { status, message } => (*status, C::Validation, message.clone()),
            NotStarted => (
                StatusCode::CONFLICT,
                C::NotStarted,
                "the sale has not started yet".into(),
            ),
            Ended => (StatusCode::CONFLICT, C::Ended, "the sale has ended".into()),
            SoldOut => (
                StatusCode::CONFLICT,
                C::SoldOut,
                "no stock left for this voucher".into(),
            ),
            AlreadyOrdered { .. } => (
                StatusCode::CONFLICT,
                C::AlreadyOrdered,
                "you already hold an order for this voucher".into(),
            ),
            OrderPending(id) => (
                StatusCode::CONFLICT,
                C::OrderPending,
                format!(
                    "order {id} is admitted but not written yet; retry after the \
                     Retry-After delay"
                ),
            ),
            OrderPaid(id) => (
                StatusCode::CONFLICT,
                C::OrderPaid,
                format!(
                    "order {id} has been paid: it is not paid or cancelled again (a paid \
                     coupon may be refunded)"
                ),
            ),
            OrderUsed(id) => (
                StatusCode::CONFLICT,
                C::OrderUsed,
                format!("order {id} was redeemed at the shop already"),
            ),
            OrderUnpaid(id) => (
                StatusCode::CONFLICT,
                C::OrderUnpaid,
                format!("order {id} is not paid"),
            ),
            NotRefundable(why) => (StatusCode::CONFLICT, C::NotRefundable, why.clone()),
            BadSignature(why) => (StatusCode::UNAUTHORIZED, C::BadSignature, why.clone()),
            IdConflict(why) => (StatusCode::CONFLICT, C::IdConflict, why.clone()),
            OrderClosed(id, status) => (
                StatusCode::CONFLICT,
                C::OrderClosed,
                format!("order {id} is {status}"),
            ),
            RateLimited { .. } => (
                StatusCode::TOO_MANY_REQUESTS,
                C::RateLimited,
                "too many requests, slow down".into(),
            ),
            Unavailable(what) | Busy(what) => (
                StatusCode::SERVICE_UNAVAILABLE,
                C::Unavailable,
                what.clone(),
            ),
            Database(e) if is_unique_violation(e) => (
                StatusCode::CONFLICT,
                C::Conflict,
                "the record already exists".into(),
            ),
            Database(e) if crate::store::is_connectivity(e) => (
                StatusCode::SERVICE_UNAVAILABLE,
                C::Unavailable,
                "the database is unavailable, try again".into(),
            ),
            Redis(_) => (
                StatusCode::SERVICE_UNAVAILABLE,
                C::Unavailable,
                "the admission store is unavailable, try again".into(),
            ),
            OutcomeUnknown { .. } => (
                StatusCode::SERVICE_UNAVAILABLE,
                C::Unavailable,
                "the admission store did not answer in time: your grab may or may not have \
                 gone through. Retry: a retry answers 202, or `already_ordered` with the \
                 order id if it went through"
                    .into(),
            ),
            Database(_) | Internal(_) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                C::Internal,
                "internal error".into(),
            ),
        }
    }
}

pub(crate) fn is_unique_violation(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.is_unique_violation())
}

impl IntoResponse for AppError {
    fn into_response(self) -> Response {
        let (status, code, message) = self.parts();
        // The cause stays on the server: logged and counted by the middleware that finds
        // it in the response (`http::log_failures`), never sent.
        let failure = match &self {
            AppError::Database(_) => Some(Failure::new(&self, Some("postgres"), true)),
            AppError::Redis(_) | AppError::OutcomeUnknown { .. } => {
                Some(Failure::new(&self, Some("redis"), true))
            }
            AppError::Internal(_) => Some(Failure::new(&self, None, true)),
            AppError::Unavailable(_) => Some(Failure::new(&self, None, false)),
            AppError::Busy(why) => {
                tracing::debug!(reason = %why, "request refused (back-pressure)");
                None
            }
            _ => None,
        };
        let order_id = match &self {
            AppError::AlreadyOrdered { order_id } | AppError::OutcomeUnknown { order_id, .. } => {
                Some(*order_id)
            }
            _ => None,
        };
        let body = ErrorBody {
            error: ErrorDetail {
                code,
                message,
                order_id,
                outcome: matches!(self, AppError::OutcomeUnknown { .. })
                    .then_some(GrabOutcome::Unknown),
            },
        };
        let mut response = (status, axum::Json(body)).into_response();
        let retry_after = match &self {
            AppError::RateLimited { retry_after_secs } => Some(*retry_after_secs),
            AppError::OrderPending(_) => Some(1),
            // A page refused for too many viewers: the page itself waits 3 s at first;
            // other clients that obey the header should not come back sooner.
            AppError::Busy(_) => Some(3),
            _ if status == StatusCode::SERVICE_UNAVAILABLE => Some(1),
            _ => None,
        };
        if let Some(secs) = retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs.max(1)));
        }
        if let Some(failure) = failure {
            response.extensions_mut().insert(failure);
        }
        response
    }
}

/// What a failed request leaves in its response's extensions for the middleware that
/// logs and counts failures.
#[derive(Debug, Clone)]
pub(crate) struct Failure {
    /// The dependency at fault, for `seckill_dependency_errors_total`.
    pub dependency: Option<&'static str>,
    /// Logged as an error (a dependency or a bug) rather than a warning.
    pub serious: bool,
    pub cause: std::sync::Arc<str>,
}

impl Failure {
    fn new(error: &AppError, dependency: Option<&'static str>, serious: bool) -> Self {
        Self {
            dependency,
            serious,
            cause: error.to_string().into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each kind of error answers a JSON body whose `code` is one of [`ErrorCode::ALL`]
    /// (the document's enum), and every code but `conflict` (a unique violation, which
    /// needs a database) is answered by some kind.
    #[tokio::test]
    async fn every_error_answers_a_code_of_the_one_enum() {
        let redis = || redis::RedisError::from(std::io::Error::other("gone"));
        let seven = OrderId::new(7).unwrap();
        let errors = [
            AppError::Unauthorized("missing bearer token"),
            AppError::Forbidden,
            AppError::NotFound("voucher 1 not found".into()),
            AppError::bad_request("bad"),
            AppError::invalid("invalid"),
            AppError::NotStarted,
            AppError::Ended,
            AppError::SoldOut,
            AppError::AlreadyOrdered { order_id: seven },
            AppError::OrderPending(seven),
            AppError::OrderPaid(seven),
            AppError::OrderClosed(seven, OrderStatus::Expired),
            AppError::OrderUsed(seven),
            AppError::OrderUnpaid(seven),
            AppError::NotRefundable("voucher 1 is not refundable".into()),
            AppError::BadSignature("no Seckill-Signature header".into()),
            AppError::IdConflict("transaction tx_1 paid order 8".into()),
            AppError::RateLimited {
                retry_after_secs: 1,
            },
            AppError::Unavailable("down".into()),
            AppError::Busy("busy".into()),
            AppError::OutcomeUnknown { order_id: seven },
            AppError::Database(sqlx::Error::PoolTimedOut),
            AppError::Database(sqlx::Error::RowNotFound),
            AppError::Redis(redis()),
            AppError::Internal(anyhow::anyhow!("bug")),
        ];
        let listed: Vec<serde_json::Value> = ErrorCode::ALL
            .iter()
            .map(|c| serde_json::to_value(c).unwrap())
            .collect();
        let mut answered = std::collections::BTreeSet::new();
        for error in errors {
            let what = format!("{error:?}");
            let response = error.into_response();
            let body = axum::body::to_bytes(response.into_body(), 1 << 16)
                .await
                .unwrap();
            let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
            let code = body["error"]["code"].clone();
            assert!(listed.contains(&code), "{what}: {body}");
            answered.insert(code.as_str().unwrap().to_string());
        }
        let mut unanswered: Vec<&str> = listed
            .iter()
            .filter_map(|c| c.as_str())
            .filter(|c| !answered.contains(*c))
            .collect();
        unanswered.sort();
        assert_eq!(unanswered, ["conflict"]);
    }
}
