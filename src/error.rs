//! One error type for the whole HTTP surface, rendered as the contract's JSON:
//! `{"error": {"code": "...", "message": "..."}}`. Internal causes are logged, never sent.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

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
    AlreadyOrdered { order_id: i64 },
    #[error("conflict: {0}")]
    Conflict(String),
    /// A dependency is down or not ready; nothing was reserved.
    #[error("unavailable: {0}")]
    Unavailable(String),
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("internal: {0}")]
    Internal(#[from] anyhow::Error),
}

pub type AppResult<T> = Result<T, AppError>;

impl AppError {
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::Validation {
            status: StatusCode::UNPROCESSABLE_ENTITY,
            message: message.into(),
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::Validation {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
        }
    }

    fn parts(&self) -> (StatusCode, &'static str, String) {
        use AppError::*;
        match self {
            Unauthorized(why) => (StatusCode::UNAUTHORIZED, "unauthorized", why.to_string()),
            Forbidden => (
                StatusCode::FORBIDDEN,
                "forbidden",
                "this endpoint is for administrators".into(),
            ),
            NotFound(what) => (StatusCode::NOT_FOUND, "not_found", what.clone()),
            Validation { status, message } => (*status, "validation", message.clone()),
            NotStarted => (
                StatusCode::CONFLICT,
                "not_started",
                "the sale has not started yet".into(),
            ),
            Ended => (StatusCode::CONFLICT, "ended", "the sale has ended".into()),
            SoldOut => (
                StatusCode::CONFLICT,
                "sold_out",
                "no stock left for this voucher".into(),
            ),
            AlreadyOrdered { .. } => (
                StatusCode::CONFLICT,
                "already_ordered",
                "you already hold an order for this voucher".into(),
            ),
            Conflict(what) => (StatusCode::CONFLICT, "conflict", what.clone()),
            Unavailable(what) => (StatusCode::SERVICE_UNAVAILABLE, "unavailable", what.clone()),
            Database(e) if is_unique_violation(e) => (
                StatusCode::CONFLICT,
                "conflict",
                "the record already exists".into(),
            ),
            Database(e) if is_connectivity(e) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                "the database is unavailable, try again".into(),
            ),
            Redis(_) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                "the admission store is unavailable, try again; nothing was reserved".into(),
            ),
            Database(_) | Internal(_) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "internal error".into(),
            ),
        }
    }
}

/// Errors that say the database could not be reached, as opposed to a bad query.
pub fn is_connectivity(e: &sqlx::Error) -> bool {
    matches!(
        e,
        sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::WorkerCrashed
            | sqlx::Error::Protocol(_)
    )
}

pub fn is_unique_violation(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.is_unique_violation())
}

impl IntoResponse for AppError {
    fn into_response(self) -> Response {
        let (status, code, message) = self.parts();
        match &self {
            AppError::Database(_) | AppError::Redis(_) | AppError::Internal(_) => {
                tracing::error!(error = %self, "request failed")
            }
            AppError::Unavailable(_) => tracing::warn!(error = %self, "request failed"),
            _ => {}
        }
        let mut body = json!({"error": {"code": code, "message": message}});
        if let AppError::AlreadyOrdered { order_id } = &self {
            body["error"]["order_id"] = json!(order_id.to_string());
        }
        let mut response = (status, axum::Json(body)).into_response();
        if status == StatusCode::SERVICE_UNAVAILABLE {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}
