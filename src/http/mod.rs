//! The HTTP surface: routes, middleware and the JSON error format.

pub mod extract;
pub mod health;
pub mod orders;
pub mod seckill;
pub mod vouchers;

use std::time::Duration;

use axum::routing::{get, post};
use axum::Router;
use tower_http::timeout::TimeoutLayer;
use tower_http::trace::TraceLayer;

use crate::error::AppError;
use crate::state::AppState;

/// Largest request body accepted (a voucher is well under 1 KiB).
pub const BODY_LIMIT: usize = 64 * 1024;
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

pub fn build_app(state: AppState) -> Router {
    // Install the metrics recorder before the first request records anything.
    crate::metrics::handle();
    Router::new()
        .route("/vouchers", post(vouchers::create))
        .route("/vouchers/{id}", get(vouchers::get))
        .route("/vouchers/{id}/seckill", post(seckill::grab))
        .route("/shops/{shop_id}/vouchers", get(vouchers::list_by_shop))
        .route("/orders", get(orders::list_mine))
        .route("/orders/{order_id}", get(orders::get))
        .route("/healthz", get(health::healthz))
        .route("/readyz", get(health::readyz))
        .route("/metrics", get(health::metrics))
        .fallback(|| async { AppError::NotFound("no such route".into()) })
        .method_not_allowed_fallback(|| async {
            AppError::Validation {
                status: axum::http::StatusCode::METHOD_NOT_ALLOWED,
                message: "method not allowed on this route".into(),
            }
        })
        .layer(
            tower::ServiceBuilder::new()
                .layer(TraceLayer::new_for_http())
                .layer(TimeoutLayer::with_status_code(
                    axum::http::StatusCode::SERVICE_UNAVAILABLE,
                    REQUEST_TIMEOUT,
                ))
                // Enforced by the body extractors, so a 413 still speaks our JSON.
                .layer(axum::extract::DefaultBodyLimit::max(BODY_LIMIT)),
        )
        .with_state(state)
}
