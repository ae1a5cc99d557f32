//! `POST /vouchers/{id}/seckill`: the hot path. Authenticate, mint an order id, run the
//! admission script, answer. Postgres is touched only when the sale is not in Redis.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use chrono::Utc;
use serde::{Deserialize, Serialize};

use crate::admission::{self, loader, Outcome};
use crate::auth::AuthUser;
use crate::error::{AppError, AppResult};
use crate::http::extract::PathId;
use crate::state::AppState;
use crate::store::vouchers;

#[derive(Debug, Serialize, Deserialize)]
pub struct Admitted {
    pub order_id: String,
    pub status: String,
}

pub async fn grab(
    State(state): State<AppState>,
    user: AuthUser,
    PathId(voucher_id): PathId,
) -> AppResult<(StatusCode, Json<Admitted>)> {
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
