//! The HTTP surface: routes, middleware and the JSON error format.

pub(crate) mod draws;
pub mod error;
pub mod extract;
pub mod health;
pub mod live;
pub mod openapi;
pub mod orders;
pub(crate) mod payments;
pub(crate) mod sale_orders;
pub mod seckill;
pub mod server;
pub mod state;
pub(crate) mod text;
pub mod vouchers;

use std::time::Duration;

use axum::error_handling::HandleErrorLayer;
use axum::extract::{MatchedPath, Request};
use axum::http::{header, HeaderName, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{BoxError, Router};
use tower::ServiceBuilder;
use tower_http::cors::{AllowOrigin, CorsLayer};
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::TraceLayer;

use crate::http::error::AppError;
use crate::http::state::AppState;

/// Largest request body accepted (a voucher is well under 1 KiB).
pub(crate) const BODY_LIMIT: usize = 64 * 1024;
/// Most headers, and most bytes of request target and headers, a request may have; more
/// is a 431 in the JSON error format. The server refuses such a head as it comes in,
/// before hyper (whose own, higher limits would answer a bare 431) has parsed it.
pub(crate) const MAX_HEADERS: usize = 100;
pub(crate) const MAX_HEADER_BYTES: usize = 32 * 1024;
/// Longest URL (path and query) a request may have; longer is a 414 in the JSON error
/// format, refused as it comes in, below hyper's own (fixed) 64 KiB.
pub(crate) const MAX_URL_BYTES: usize = MAX_HEADER_BYTES;

const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// How long a read path waits for Redis (live stock, pending orders) before it answers
/// from Postgres alone: a Redis that is down must not cost a read its whole timeout.
pub(crate) const REDIS_READ_DEADLINE: Duration = Duration::from_millis(500);

/// Set to `postgres` on a read answered without Redis (see the OpenAPI descriptions).
pub(crate) const FALLBACK_HEADER: HeaderName = HeaderName::from_static("x-seckill-fallback");

/// A read path's Redis look-ups, under [`REDIS_READ_DEADLINE`]; `None` if Redis failed
/// or was too slow, and the caller answers from Postgres alone.
pub(crate) async fn redis_read<T>(
    what: &'static str,
    lookups: impl std::future::Future<Output = redis::RedisResult<T>>,
) -> Option<T> {
    let error = match tokio::time::timeout(REDIS_READ_DEADLINE, lookups).await {
        Ok(Ok(value)) => return Some(value),
        Ok(Err(e)) => e.to_string(),
        Err(_) => format!("no answer within {REDIS_READ_DEADLINE:?}"),
    };
    metrics::counter!(crate::metrics::DEPENDENCY_ERRORS, "dependency" => "redis", "in" => "api")
        .increment(1);
    tracing::debug!(what, error, "redis unavailable; answering from postgres");
    None
}

/// The headers of a read answer: [`FALLBACK_HEADER`] when Redis was left out.
pub(crate) fn fallback_headers(fell_back: bool) -> axum::http::HeaderMap {
    let mut headers = axum::http::HeaderMap::new();
    if fell_back {
        headers.insert(
            FALLBACK_HEADER,
            axum::http::HeaderValue::from_static("postgres"),
        );
    }
    headers
}

/// The internal listener's routes (`ADMIN_BIND`, loopback by default): the metrics and
/// the live view for operators and Prometheus, without a token. On the API port the
/// same routes need an administrator's.
pub fn build_admin_app(state: AppState) -> Router {
    crate::metrics::handle();
    Router::new()
        .route("/metrics", get(health::metrics))
        .route("/healthz", get(health::healthz))
        .route("/live", get(live::page))
        .route("/live/app.js", get(live::script))
        .route("/live/app.css", get(live::style))
        .route("/live/favicon.svg", get(live::icon))
        .route("/live/events", get(live::events))
        .fallback(|| async {
            AppError::NotFound(
                "no such route: the internal listener serves /metrics, /live, /live/events".into(),
            )
        })
        .layer(
            ServiceBuilder::new()
                .layer(SetRequestIdLayer::new(REQUEST_ID, MakeRequestUuid))
                .layer(PropagateRequestIdLayer::new(REQUEST_ID))
                .layer(middleware::from_fn(log_failures)),
        )
        .with_state(state)
}

/// What the internal listener serves, kept from anonymous callers on the API port:
/// only an administrator's token passes.
async fn admin_only(
    axum::extract::State(state): axum::extract::State<AppState>,
    req: Request,
    next: Next,
) -> Response {
    use axum::extract::FromRequestParts;
    let (mut parts, body) = req.into_parts();
    match crate::auth::Admin::from_request_parts(&mut parts, &state).await {
        Ok(_) => next.run(Request::from_parts(parts, body)).await,
        Err(refused) => refused.into_response(),
    }
}

pub fn build_app(state: AppState) -> Router {
    // Install the metrics recorder before the first request records anything.
    crate::metrics::handle();
    let admin_only = || middleware::from_fn_with_state(state.clone(), admin_only);
    let limits = &state.settings.limits;
    let timeout = Duration::from_secs(limits.request_timeout_secs);
    // One semaphore for the whole process: `Router::layer` builds the stack once per
    // route, and `concurrency_limit` would give each its own (the layer's clones share).
    let concurrency =
        tower::limit::GlobalConcurrencyLimitLayer::new(limits.max_concurrent_requests as usize);
    let stack = |timeout| {
        ServiceBuilder::new()
            // Overload answers 503 at once rather than queueing without end; a request
            // that takes too long answers 503 too.
            .layer(HandleErrorLayer::new(overloaded))
            .load_shed()
            .layer(concurrency.clone())
            .timeout(timeout)
            // Enforced by the body extractors, so a 413 still speaks our JSON.
            .layer(axum::extract::DefaultBodyLimit::max(BODY_LIMIT))
    };
    // A lottery's press is held through its window and the draw: its route waits that
    // much longer.
    let grab_timeout = timeout
        + Duration::from_millis(*crate::domain::Opening::WINDOW_MS.end() as u64)
        + crate::admission::lottery::ANSWER_WITHIN;
    // Everything but /metrics shares the process's concurrency limit and timeout.
    let limited = Router::new()
        .route("/vouchers", post(vouchers::create))
        .route("/vouchers/{id}", get(vouchers::get))
        .route("/vouchers/{id}/draw", get(draws::get))
        .route("/vouchers/{id}/orders", get(sale_orders::list_orders))
        .route("/vouchers/{id}/close", post(vouchers::close))
        .route("/shops/{shop_id}/vouchers", get(vouchers::list_by_shop))
        .route("/orders", get(orders::list_mine))
        .route("/orders/{order_id}", get(orders::get))
        .route("/orders/{order_id}/checkout", post(orders::checkout))
        .route("/orders/{order_id}/pay", post(orders::pay))
        .route("/orders/{order_id}/redeem", post(orders::redeem))
        .route("/orders/{order_id}/refund", post(orders::refund))
        .route("/orders/{order_id}/cancel", post(orders::cancel))
        .route(
            "/shops/{shop_id}/orders",
            get(sale_orders::list_shop_orders),
        )
        .route("/payments/notifications", post(payments::notify))
        .route("/payments", get(payments::list))
        .route("/healthz", get(health::healthz))
        .route("/readyz", get(health::readyz))
        .route("/openapi.json", get(openapi::openapi_json))
        .route("/docs", get(openapi::docs))
        .route("/docs/{asset}", get(openapi::docs_asset))
        .route("/live", get(live::page).route_layer(admin_only()))
        .route("/live/app.js", get(live::script))
        .route("/live/app.css", get(live::style))
        .route("/live/favicon.svg", get(live::icon))
        .route("/live/events", get(live::events).route_layer(admin_only()))
        .fallback(|| async { AppError::NotFound("no such route".into()) })
        .layer(stack(timeout))
        .route(
            "/vouchers/{id}/seckill",
            post(seckill::grab).layer(stack(grab_timeout)),
        );
    // Scrapes have a small limit of their own: a sale that fills the process's limit
    // must not blind Prometheus (series gone stale exactly at peak), and a flood of
    // scrapes cannot take the grabs' places.
    let scrape = ServiceBuilder::new()
        .layer(HandleErrorLayer::new(overloaded))
        .load_shed()
        .layer(tower::limit::GlobalConcurrencyLimitLayer::new(
            METRICS_CONCURRENCY,
        ))
        .timeout(METRICS_TIMEOUT);
    limited
        .route(
            "/metrics",
            get(health::metrics).layer(scrape).route_layer(admin_only()),
        )
        // After every route: it applies only to the routes already there.
        .method_not_allowed_fallback(|| async {
            AppError::Validation {
                status: StatusCode::METHOD_NOT_ALLOWED,
                message: "method not allowed on this route".into(),
            }
        })
        .layer(
            ServiceBuilder::new()
                // Accept the caller's x-request-id or make a UUID v4 (from the thread's
                // generator: uuid's `fast-rng`); it is in every log line of the request
                // and in the answer.
                .layer(SetRequestIdLayer::new(REQUEST_ID, MakeRequestUuid))
                .layer(PropagateRequestIdLayer::new(REQUEST_ID))
                // Per-request spans and events at DEBUG only: the hot path logs nothing
                // at the default level.
                .layer(TraceLayer::new_for_http().make_span_with(|req: &Request| {
                    let id = req
                        .headers()
                        .get(REQUEST_ID)
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("");
                    tracing::debug_span!("request", method = %req.method(), uri = %req.uri(), request_id = %id)
                })
                // Every 5xx at DEBUG here too: `log_failures` logs the real ones with
                // their cause, and an ERROR per expected 503 (a sale's shedding, pages
                // refused beyond LIVE_MAX_VIEWERS) would bury them.
                .on_failure(tower_http::trace::DefaultOnFailure::new().level(tracing::Level::DEBUG)))
                .layer(middleware::from_fn(observe_requests))
                .layer(middleware::from_fn(log_failures))
                .layer(middleware::from_fn(limit_headers)),
        )
        .layer(cors(&state.settings.cors_allowed_origins))
        .with_state(state)
}

/// Scrapes of `/metrics` in flight at most (beyond: 503 at once), outside the process's
/// `MAX_CONCURRENT_REQUESTS`.
const METRICS_CONCURRENCY: usize = 4;
/// A scrape's whole time, below Prometheus's shortest usual scrape timeout (5 s).
const METRICS_TIMEOUT: Duration = Duration::from_secs(4);

/// CORS for the configured origins, outermost so that a preflight is answered before
/// routing (without it, `OPTIONS` is a 405). Other origins get no CORS headers, so the
/// browser refuses them; with no origins configured the layer adds nothing.
fn cors(origins: &[String]) -> tower::util::Either<CorsLayer, tower::layer::util::Identity> {
    if origins.is_empty() {
        return tower::util::Either::Right(tower::layer::util::Identity::new());
    }
    let origins: Vec<HeaderValue> = origins
        .iter()
        .map(|o| HeaderValue::from_str(o).expect("origins are checked at start-up"))
        .collect();
    tower::util::Either::Left(
        CorsLayer::new()
            .allow_origin(AllowOrigin::list(origins))
            .allow_methods([Method::GET, Method::POST])
            .allow_headers([header::AUTHORIZATION, header::CONTENT_TYPE, REQUEST_ID])
            .expose_headers([REQUEST_ID, header::RETRY_AFTER, FALLBACK_HEADER])
            .max_age(Duration::from_secs(600)),
    )
}

/// 414 `validation` for a URL over [`MAX_URL_BYTES`]; 431 `validation` for a head over
/// [`MAX_HEADERS`] or [`MAX_HEADER_BYTES`] (URL and headers together). The server judges
/// heads by the same counts as they come in (`server::head`); this catches those on a
/// connection it stopped following (after an upgrade, say).
async fn limit_headers(req: Request, next: Next) -> Response {
    let headers = req.headers();
    let target = req.uri().path_and_query().map_or(0, |p| p.as_str().len());
    if target > MAX_URL_BYTES {
        return url_too_long().into_response();
    }
    let bytes: usize = target
        + headers
            .iter()
            .map(|(name, value)| name.as_str().len() + value.len() + 4)
            .sum::<usize>();
    if headers.len() > MAX_HEADERS || bytes > MAX_HEADER_BYTES {
        return head_too_large().into_response();
    }
    next.run(req).await
}

/// The 414, from the middleware or the server's judging of heads.
pub(crate) fn url_too_long() -> AppError {
    AppError::Validation {
        status: StatusCode::URI_TOO_LONG,
        message: format!(
            "URL too long: at most {} KiB of path and query",
            MAX_URL_BYTES / 1024
        ),
    }
}

/// The 431, from the middleware or the server's judging of heads.
pub(crate) fn head_too_large() -> AppError {
    AppError::Validation {
        status: StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
        message: format!(
            "request headers too large: at most {MAX_HEADERS} headers and {} KiB with the URL",
            MAX_HEADER_BYTES / 1024
        ),
    }
}

async fn overloaded(err: BoxError) -> AppError {
    if err.is::<tower::timeout::error::Elapsed>() {
        AppError::Unavailable("the request took too long".into())
    } else if err.is::<tower::load_shed::error::Overloaded>() {
        metrics::counter!(crate::metrics::SHED).increment(1);
        AppError::Unavailable("the server is at capacity, try again".into())
    } else {
        AppError::Internal(anyhow::anyhow!("middleware error: {err}"))
    }
}

/// Logs and counts the failures handlers left in their responses (see
/// [`crate::http::error::Failure`]), inside the request's span.
async fn log_failures(req: Request, next: Next) -> Response {
    let response = next.run(req).await;
    if let Some(failure) = response.extensions().get::<crate::http::error::Failure>() {
        if let Some(dependency) = failure.dependency {
            metrics::counter!(crate::metrics::DEPENDENCY_ERRORS, "dependency" => dependency, "in" => "api")
                .increment(1);
        }
        if failure.serious {
            tracing::error!(error = %failure.cause, "request failed");
        } else {
            tracing::warn!(error = %failure.cause, "request failed");
        }
    }
    response
}

/// `seckill_http_requests_total{route, status}` and
/// `seckill_http_request_duration_seconds{route, status}` (arrival to the answer's
/// headers; a `/live/events` stream counts until it starts). The route is the matched
/// template (`/orders/{order_id}`), or `unmatched`, so ids never multiply the series.
/// Handles are cached: a request costs a lookup and two atomic adds, not registry
/// lookups.
async fn observe_requests(req: Request, next: Next) -> Response {
    type Series = std::sync::RwLock<Vec<(u16, String, metrics::Counter, metrics::Histogram)>>;
    static SERIES: std::sync::LazyLock<Series> = std::sync::LazyLock::new(Default::default);
    let started = std::time::Instant::now();
    let route = req.extensions().get::<MatchedPath>().cloned();
    let response = next.run(req).await.into_response();
    let seconds = started.elapsed().as_secs_f64();
    let route = route.as_ref().map_or("unmatched", |p| p.as_str());
    let status = response.status().as_u16();
    let cached = SERIES
        .read()
        .expect("poisoned")
        .iter()
        .find(|(s, r, _, _)| *s == status && r == route)
        .map(|(_, _, c, h)| (c.clone(), h.clone()));
    let (counter, histogram) = cached.unwrap_or_else(|| {
        let labels = [
            metrics::Label::new("route", route.to_owned()),
            metrics::Label::new("status", status.to_string()),
        ];
        let counter = metrics::counter!(crate::metrics::HTTP_REQUESTS, labels.iter());
        let histogram = metrics::histogram!(crate::metrics::HTTP_SECONDS, labels.iter());
        SERIES.write().expect("poisoned").push((
            status,
            route.to_owned(),
            counter.clone(),
            histogram.clone(),
        ));
        (counter, histogram)
    });
    counter.increment(1);
    histogram.record(seconds);
    response
}
