//! `POST /vouchers/{id}/seckill`: the hot path. Authenticate, mint an order id, run the
//! admission script, answer. Postgres is touched only when the sale is not in Redis.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use chrono::Utc;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::admission::{self, loader, Outcome};
use crate::auth::AuthUser;
use crate::error::{AppError, AppResult, ErrorBody};
use crate::http::extract::PathId;
use crate::state::AppState;
use crate::store::vouchers;

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct Admitted {
    /// 64-bit, as a string (JavaScript loses precision above 2^53).
    #[schema(pattern = "^[1-9][0-9]{0,18}$", example = "117514385399746560")]
    pub order_id: String,
    /// Always `pending`: the order is written to Postgres moments later.
    #[schema(example = "pending")]
    pub status: String,
}

/// The client's address, when the server was started with connect info.
pub struct PeerIp(pub Option<std::net::IpAddr>);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for PeerIp {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _: &S,
    ) -> Result<Self, Self::Rejection> {
        Ok(PeerIp(
            parts
                .extensions
                .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
                .map(|c| c.0.ip()),
        ))
    }
}

fn limited(wait: std::time::Duration) -> AppError {
    crate::metrics::HotPath::get()
        .outcome("rate_limited")
        .increment(1);
    AppError::RateLimited {
        retry_after_secs: wait.as_secs_f64().ceil() as u64,
    }
}

#[utoipa::path(post, path = "/vouchers/{id}/seckill", tag = "seckill", security(("bearer" = [])),
    params(("id" = i64, Path, description = "voucher id", minimum = 1)),
    responses(
        (status = 202, description = "admitted: the order id, written to Postgres moments later", body = Admitted),
        (status = 400, description = "not a valid id (`validation`)", body = ErrorBody),
        (status = 401, description = "no or bad token (`unauthorized`)", body = ErrorBody),
        (status = 404, description = "no such flash-sale voucher (`not_found`)", body = ErrorBody),
        (status = 409, description = "`not_started`, `ended`, `sold_out`, or `already_ordered` (with the caller's `order_id`)", body = ErrorBody),
        (status = 429, description = "too many grabs (`rate_limited`); see `Retry-After`", body = ErrorBody,
            headers(("Retry-After" = u64, description = "seconds to wait"))),
        (status = 503, description = "Redis is down or the sale is being loaded (`unavailable`); nothing was reserved", body = ErrorBody,
            headers(("Retry-After" = u64, description = "seconds to wait"))),
    ))]
pub async fn grab(
    State(state): State<AppState>,
    PeerIp(ip): PeerIp,
    user: AuthUser,
    PathId(voucher_id): PathId,
) -> AppResult<(StatusCode, Json<Admitted>)> {
    if let (Some(limiter), Some(ip)) = (&state.per_ip, ip) {
        limiter.check(ip).map_err(limited)?;
    }
    if let Some(limiter) = &state.per_user {
        limiter.check(user.user_id).map_err(limited)?;
    }
    let order_id = state.ids.next().ok_or_else(|| {
        AppError::Unavailable("order ids are not ready yet (waiting for redis)".into())
    })?;
    let mut conn = state.redis.clone();
    let started = std::time::Instant::now();
    let outcome =
        admission::admit(&mut conn, &state.keys, voucher_id, user.user_id, order_id).await;
    let hot = crate::metrics::HotPath::get();
    hot.admission_seconds
        .record(started.elapsed().as_secs_f64());
    let label = match &outcome {
        Ok(o) => o.label(),
        Err(_) => "redis_error",
    };
    hot.outcome(label).increment(1);
    match outcome? {
        Outcome::Admitted { order_id } => Ok((
            StatusCode::ACCEPTED,
            Json(Admitted {
                order_id: order_id.to_string(),
                status: "pending".into(),
            }),
        )),
        Outcome::NotStarted => Err(AppError::NotStarted),
        Outcome::Ended => Err(AppError::Ended),
        Outcome::SoldOut => Err(AppError::SoldOut),
        Outcome::AlreadyOrdered { order_id } => Err(AppError::AlreadyOrdered { order_id }),
        Outcome::NotLoaded => Err(not_loaded(&state, voucher_id).await),
    }
}

/// The sale is not in Redis: an unknown voucher, an ended sale whose state expired, or
/// state lost with Redis. Only the last is worth a reload; until it is done, fail closed.
async fn not_loaded(state: &AppState, voucher_id: i64) -> AppError {
    match vouchers::sale(&state.db, voucher_id).await {
        Ok(None) => AppError::NotFound(format!("voucher {voucher_id} has no flash sale")),
        Ok(Some(sale)) if sale.end_time <= Utc::now() => AppError::Ended,
        Ok(Some(_)) => {
            loader::reload_in_background(state, voucher_id);
            AppError::Unavailable("the sale is being loaded, try again shortly".into())
        }
        Err(e) => e.into(),
    }
}
