//! `GET /healthz` (the process runs), `GET /readyz` (Redis and Postgres answer, and
//! Redis keeps every key: `maxmemory-policy noeviction`, room left) and
//! `GET /metrics` (Prometheus text).

use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::admission::guard::{self, Memory};
use crate::http::error::AppError;
use crate::http::state::AppState;

#[utoipa::path(get, path = "/healthz", operation_id = "healthz", tag = "operations",
    responses((status = 200, description = "the process runs", body = Object, example = json!({"status": "ok"}))))]
pub(crate) async fn healthz() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

#[utoipa::path(get, path = "/readyz", operation_id = "readyz", tag = "operations",
    responses(
        (status = 200, description = "Redis and Postgres answer (and the schema is this release's); Redis keeps every \
            key (`redis_memory`: `noeviction`, or `unknown` where INFO is not allowed); the instance holds an order-id node \
            (`order_ids`: `leased`)", body = Object,
            example = json!({"status": "ready", "checks": {"redis": "up", "postgres": "up", "migrations": "applied", "redis_memory": "noeviction", "order_ids": "leased"}})),
        (status = 503, description = "a dependency is down, the migrations wait for Postgres, or Redis may evict keys \
            (`redis_memory`: `may_evict`, admissions refused) or is out of memory (`full`, writes refused), or no order-id \
            node is leased yet (`order_ids`: `waiting`, every grab 503; a young Redis term is waited out first); `checks` \
            names it and the message says why. The process serves meanwhile what it can: grabs of sales Redis holds \
            while Postgres is away", body = Object,
            example = json!({"status": "not_ready", "checks": {"redis": "up", "postgres": "down", "migrations": "pending", "redis_memory": "noeviction", "order_ids": "leased"},
                "error": {"code": "unavailable", "message": "not ready: postgres down, migrations pending"}})),
    ))]
pub(crate) async fn readyz(State(state): State<AppState>) -> (StatusCode, Json<Value>) {
    let timeout = Duration::from_secs(2);
    let postgres = async { sqlx::query("SELECT 1").execute(&state.db).await.is_ok() };
    let (redis, postgres) = tokio::join!(
        tokio::time::timeout(timeout, redis_memory(&state)),
        tokio::time::timeout(timeout, postgres)
    );
    let memory = redis.ok().flatten();
    let redis = if memory.is_some() { "up" } else { "down" };
    let postgres = if postgres == Ok(true) { "up" } else { "down" };
    let migrations = match state.migrated.is_cancelled() {
        true => "applied",
        false => "pending",
    };
    // Until its order-id node is leased (a young Redis term is waited out first) the
    // instance answers every grab 503: not ready for a balancer either.
    let order_ids = match state.admission.ids.node() {
        Some(_) => "leased",
        None => "waiting",
    };
    let mut checks = json!({"redis": redis, "postgres": postgres, "migrations": migrations,
        "order_ids": order_ids});
    if let Some(memory) = &memory {
        checks["redis_memory"] = memory.label().into();
    }
    let down: Vec<String> = [("redis", redis), ("postgres", postgres)]
        .into_iter()
        .filter(|(_, s)| *s == "down")
        .map(|(name, _)| format!("{name} down"))
        .chain(memory.as_ref().and_then(|m| m.trouble()))
        .chain((migrations == "pending").then(|| "migrations pending".to_string()))
        .chain((order_ids == "waiting").then(|| "order ids not leased yet".to_string()))
        .collect();
    if down.is_empty() {
        (
            StatusCode::OK,
            Json(json!({"status": "ready", "checks": checks})),
        )
    } else {
        let message = format!("not ready: {}", down.join(", "));
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({
                "status": "not_ready",
                "checks": checks,
                "error": {"code": crate::http::error::ErrorCode::Unavailable, "message": message},
            })),
        )
    }
}

/// The memory of every Redis server the instance uses, the worst first (a server in
/// trouble names it); `None`: some server does not answer.
async fn redis_memory(state: &AppState) -> Option<Memory> {
    let mut conn = state.redis.clone();
    let mut worst = Memory::Keeps;
    for (shard, _) in state.redis.servers(&state.keys) {
        let memory = guard::memory(&mut conn, &state.keys, shard).await.ok()?;
        if memory.trouble().is_some() || worst == Memory::Keeps {
            worst = memory;
        }
    }
    Some(worst)
}

#[utoipa::path(get, path = "/metrics", operation_id = "metrics", tag = "operations", security(("bearer" = [])),
    responses(
        (status = 200, description = "Prometheus text format. Served without a token by the internal listener \
            (`ADMIN_BIND`); on the API port, to an administrator only", content_type = "text/plain", body = String),
        (status = 401, description = "no or bad token on the API port (`unauthorized`)", body = crate::http::error::ErrorBody),
        (status = 403, description = "not an administrator (`forbidden`)", body = crate::http::error::ErrorBody),
    ))]
pub(crate) async fn metrics(State(state): State<AppState>) -> impl axum::response::IntoResponse {
    let mut conn = state.redis.clone();
    if let Err(e) = crate::metrics::sample_streams(&mut conn, &state.keys).await {
        tracing::debug!(error = %e, "stream gauges not sampled");
    }
    render()
}

/// `GET /metrics` and `GET /healthz` alone, for `seckill worker --metrics-bind`: the
/// worker's counters and histograms live only in its own process. Served with the same
/// connection limits as the API (slow or idle scrapers cannot pile up); stops with
/// `shutdown`.
pub(crate) async fn serve_metrics(listener: tokio::net::TcpListener, shutdown: CancellationToken) {
    let app = Router::new()
        .route("/metrics", get(|| async { render() }))
        .route("/healthz", get(healthz))
        .fallback(|| async { AppError::NotFound("no such route".into()) });
    let limits = super::server::ServerLimits {
        max_connections: 64,
        ..(&crate::config::ServerArgs::default()).into()
    };
    super::server::serve(listener, app, limits, shutdown).await;
}

fn render() -> impl axum::response::IntoResponse {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        crate::metrics::handle().render(),
    )
}
