//! `GET /live`: one page, its script and style built into the binary (nothing from a
//! CDN), fed by `GET /live/events`, a server-sent event stream of the snapshots the
//! process's one producer makes (see [`crate::live`]).

use std::convert::Infallible;
use std::time::Duration;

use axum::extract::State;
use axum::http::header::{self, HeaderValue};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::IntoResponse;

use crate::http::error::AppError;
use crate::http::state::AppState;

/// Only our own files, and the stream from our own origin.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
                   connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; \
                   frame-ancestors 'none'";

/// How long a browser waits before reconnecting a dropped stream.
const RECONNECT: Duration = Duration::from_secs(2);

fn asset(content_type: &'static str, body: &'static str) -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, HeaderValue::from_static(content_type)),
            (
                header::CONTENT_SECURITY_POLICY,
                HeaderValue::from_static(CSP),
            ),
            (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
            (
                header::X_CONTENT_TYPE_OPTIONS,
                HeaderValue::from_static("nosniff"),
            ),
        ],
        body,
    )
}

#[utoipa::path(get, path = "/live", operation_id = "livePage", tag = "live", security(("bearer" = [])),
    responses(
        (status = 200, description = "an HTML page showing every open sale live (no external assets). Served without a \
            token by the internal listener (`ADMIN_BIND`); on the API port, to an administrator only", content_type = "text/html", body = String),
        (status = 401, description = "no or bad token on the API port (`unauthorized`)", body = crate::http::error::ErrorBody),
        (status = 403, description = "not an administrator (`forbidden`)", body = crate::http::error::ErrorBody),
    ))]
pub(crate) async fn page() -> impl IntoResponse {
    asset(
        "text/html; charset=utf-8",
        include_str!("live_page/index.html"),
    )
}

pub(crate) async fn script() -> impl IntoResponse {
    asset(
        "text/javascript; charset=utf-8",
        include_str!("live_page/app.js"),
    )
}

pub(crate) async fn style() -> impl IntoResponse {
    asset("text/css; charset=utf-8", include_str!("live_page/app.css"))
}

pub(crate) async fn icon() -> impl IntoResponse {
    asset("image/svg+xml", include_str!("live_page/favicon.svg"))
}

#[utoipa::path(get, path = "/live/events", operation_id = "liveEvents", tag = "live", security(("bearer" = [])),
    responses(
        (status = 401, description = "no or bad token on the API port (`unauthorized`); the internal listener (`ADMIN_BIND`) needs none", body = crate::http::error::ErrorBody),
        (status = 403, description = "not an administrator (`forbidden`)", body = crate::http::error::ErrorBody),
        (status = 200, description = "`text/event-stream`: an event `snapshot` at least every second while the stream is open, \
            its data one JSON object: `at` (by Postgres's clock), `worker` (`length`, `pending`, `lag` (null when Redis cannot tell it), `dead_letters` of the order streams), \
            `sales` (selling first, then upcoming, sold out, ended; per sale: `id`, `title`, `state`, `sold_out`, `begin_time`, `end_time`, `initial_stock`, `remaining`, \
            `grabs_per_sec`, `errors_per_sec` (over the last 5 s, every instance's; null when unknown), `admission_p99_ms` (over the same seconds, this instance's grabs of every sale; null for a sale without grabs then), \
            `outcomes` (with the 503s: `unavailable`, `unknown`), `orders` (`admitted` = `persisted` + `in_flight` + `dead_letters`; `persisted` = `created` + `paid` + `used` + `refunding` + `refunded` + `cancelled` + `expired`; `units_back`, `late_payments`), `dead_letters` (of them `stale_epoch`: admitted by a Redis state that was no longer the sale's), `releases_owed`, \
            `lottery` (null for a first-come sale; else `window_ms`, `window_end`, `entrants` (so far, then the draw's; null until the sale is loaded), `drawn_at` and `winners` (null until the draw is recorded)); \
            `state` by Postgres's clock), `open_total` (sales qualifying: open, upcoming, \
            ended in the last 5 minutes), `truncated` (true when `sales` holds fewer than `open_total`: at most `LIVE_MAX_SALES` are sent) \
            and `unavailable` (stores that did not answer)", content_type = "text/event-stream", body = String),
        (status = 503, description = "too many pages are watching this instance (`unavailable`)", body = crate::http::error::ErrorBody),
    ))]
pub(crate) async fn events(State(state): State<AppState>) -> Result<impl IntoResponse, AppError> {
    let viewer = state.live.watch().ok_or_else(|| {
        AppError::Busy("too many pages are watching this instance; try again".into())
    })?;
    // Waits for the next snapshot (opening the stream woke the producer), then one
    // event per snapshot until the page goes or the process stops.
    let stream = futures_util::stream::unfold((viewer, true), |(mut viewer, first)| async move {
        loop {
            tokio::select! {
                _ = viewer.cancel.cancelled() => return None,
                changed = viewer.updates.changed() => changed.ok()?,
            }
            let latest = viewer.updates.borrow_and_update().clone();
            if let Some(json) = latest {
                let mut event = Event::default().event("snapshot").data(&*json);
                if first {
                    event = event.retry(RECONNECT);
                }
                return Some((Ok::<_, Infallible>(event), (viewer, false)));
            }
        }
    });
    // A proxy must pass each event on at once (nginx buffers responses unless told
    // not to), and no cache may keep the stream.
    let headers = [
        (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
        (
            header::HeaderName::from_static("x-accel-buffering"),
            HeaderValue::from_static("no"),
        ),
        (
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        ),
    ];
    Ok((headers, Sse::new(stream).keep_alive(KeepAlive::default())))
}
