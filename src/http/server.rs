//! The HTTP server: hyper's HTTP/1 connection loop with the limits `axum::serve` lacks.
//! A request's headers must arrive within a deadline, an idle keep-alive connection is
//! closed, and open connections are capped below the descriptor limit, so slow or idle
//! clients cannot starve well-behaved ones (and `/healthz`) of descriptors.
//!
//! The deadlines are a watchdog per connection rather than hyper's `header_read_timeout`:
//! hyper's also runs while a keep-alive connection waits for its next request, so it
//! cannot give a short header deadline and a long idle timeout at once.
//!
//! A response the client does not take is bounded too: a connection whose writes make
//! no progress for [`WRITE_STALL`] (or the idle timeout, if shorter) is closed, and for a
//! second only once shutdown has begun. Without it a client that never reads (an open
//! `/live/events` page, say) would hold its connection, hyper's buffers and the
//! process's shutdown for as long as it liked.
//!
//! Each request's head is judged on its way in, before hyper parses it ([`head`]): one
//! over our limits, or not HTTP at all, is answered here in the JSON error format every
//! other error has, and the connection closed. hyper's own limits are set above ours
//! ([`PARSER_MAX_HEADERS`], [`PARSER_MAX_HEAD_BYTES`]; its 64 KiB for a URL is fixed), so
//! its bare answers, without a body, are left for what our judging does not follow.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use axum::Router;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::{Service, ServiceExt};

use crate::http::error::AppError;
use head::Refusal;
use watched::{Activity, Tracked, Watched};

mod head;
mod watched;

/// Headers hyper parses before it refuses a request with its own bare 431: above
/// [`super::MAX_HEADERS`], which [`head`] enforces first.
const PARSER_MAX_HEADERS: usize = 4 * super::MAX_HEADERS;
/// Bytes of a head hyper takes before its own bare 431: above
/// [`super::MAX_HEADER_BYTES`] and [`super::MAX_URL_BYTES`], which [`head`] enforces first.
const PARSER_MAX_HEAD_BYTES: usize = 4 * super::MAX_HEADER_BYTES;
/// hyper refuses a URL over this with its own bare 414, whatever it is told.
const PARSER_MAX_URL_BYTES: usize = u16::MAX as usize - 1;
const _: () = assert!(super::MAX_URL_BYTES < PARSER_MAX_URL_BYTES);
/// How long a refused client may go on sending (read and dropped) after its answer:
/// closing a socket with unread bytes resets it, and the reset can beat the answer.
const LINGER: Duration = Duration::from_secs(2);
/// Descriptors kept free of client connections: Postgres and Redis connections, the
/// listener, the runtime, logs.
const RESERVED_DESCRIPTORS: u64 = 64;
/// A response's writes may stall this long (the client reads nothing) before the
/// connection is closed.
pub(crate) const WRITE_STALL: Duration = Duration::from_secs(30);
/// The same once shutdown has begun: responses still being sent get this long to make
/// progress, so a client that stopped reading cannot hold the process.
const WRITE_STALL_DRAINING: Duration = Duration::from_secs(1);
/// A peer that vanished without a FIN (a phone that lost its network) is noticed within
/// about this long, by TCP itself: unacknowledged data (TCP_USER_TIMEOUT, Linux) or
/// keep-alive probes unanswered. Otherwise an open `/live/events` keeps writing into
/// the kernel's send buffer for minutes, holding a viewer slot and a connection.
pub(crate) const DEAD_PEER: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, Copy)]
pub(crate) struct ServerLimits {
    pub header_read_timeout: Duration,
    pub keepalive_idle: Duration,
    pub max_connections: usize,
}

impl From<&crate::config::ServerArgs> for ServerLimits {
    fn from(args: &crate::config::ServerArgs) -> Self {
        Self {
            header_read_timeout: Duration::from_secs(args.http_header_read_timeout_secs),
            keepalive_idle: Duration::from_secs(args.http_keepalive_idle_secs),
            max_connections: args.http_max_connections as usize,
        }
    }
}

/// Serves `router` on `listener` until `shutdown`, then lets requests in progress
/// finish and returns once every connection is closed.
pub(crate) async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ServerLimits,
    shutdown: CancellationToken,
) {
    let max_connections = fit_descriptor_limit(limits.max_connections);
    let slots = Arc::new(Semaphore::new(max_connections));
    let connections = TaskTracker::new();
    let mut make_service = router.into_make_service_with_connect_info::<SocketAddr>();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.max_headers(PARSER_MAX_HEADERS)
        .max_header_size(PARSER_MAX_HEAD_BYTES)
        // The watchdog below keeps the time (see the module comment).
        .header_read_timeout(None);
    loop {
        // At the cap, stop accepting: new clients wait in the kernel's listen backlog
        // until a slot frees (slow clients lose theirs within the header deadline),
        // instead of failing at the descriptor limit.
        let permit = tokio::select! {
            permit = slots.clone().acquire_owned() => permit.expect("never closed"),
            _ = shutdown.cancelled() => break,
        };
        let (tcp, remote) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    accept_error(e).await;
                    continue;
                }
            },
            _ = shutdown.cancelled() => break,
        };
        // Small responses go out at once instead of waiting on Nagle's algorithm.
        let _ = tcp.set_nodelay(true);
        detect_dead_peers(&tcp);
        let service = make_service
            .call(remote)
            .await
            .unwrap_or_else(|e: Infallible| match e {});
        connections.spawn(connection(
            http.clone(),
            tcp,
            service,
            limits,
            shutdown.clone(),
            permit,
        ));
    }
    // New connections are refused from here on; those open finish their requests.
    drop(listener);
    connections.close();
    connections.wait().await;
}

/// Keep-alive probes after 15 s of silence, every 5 s, 3 of them (so an idle peer that
/// vanished is gone within [`DEAD_PEER`]), and on Linux a [`DEAD_PEER`] limit on data
/// left unacknowledged (a busy stream to a vanished peer). Best effort: a socket that
/// refuses keeps the other limits (write stall, idle timeout).
fn detect_dead_peers(tcp: &TcpStream) {
    let sock = socket2::SockRef::from(tcp);
    let probes = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(15))
        .with_interval(Duration::from_secs(5));
    #[cfg(any(target_os = "linux", target_os = "android"))]
    let probes = probes.with_retries(3);
    if let Err(e) = sock.set_tcp_keepalive(&probes) {
        tracing::debug!(error = %e, "TCP keep-alive not set");
    }
    #[cfg(any(target_os = "linux", target_os = "android"))]
    if let Err(e) = sock.set_tcp_user_timeout(Some(DEAD_PEER)) {
        tracing::debug!(error = %e, "TCP_USER_TIMEOUT not set");
    }
}

async fn accept_error(e: std::io::Error) {
    use std::io::ErrorKind::*;
    if matches!(
        e.kind(),
        ConnectionRefused | ConnectionAborted | ConnectionReset
    ) {
        return; // that client is gone; the next one is not affected
    }
    // Out of descriptors or memory: wait for some to be released.
    tracing::error!(error = %e, "accept failed");
    tokio::time::sleep(Duration::from_millis(100)).await;
}

/// The connection cap, lowered to leave [`RESERVED_DESCRIPTORS`] below the process's
/// descriptor limit: at that limit even `/healthz` could not be accepted.
fn fit_descriptor_limit(wanted: usize) -> usize {
    let using = effective_max_connections(wanted);
    if using < wanted {
        tracing::warn!(
            wanted,
            descriptor_limit = descriptor_limit(),
            using,
            "HTTP_MAX_CONNECTIONS exceeds what the descriptor limit (ulimit -n) allows; lowered"
        );
    }
    using
}

/// The connection cap [`serve`] will use for `wanted` (`HTTP_MAX_CONNECTIONS`), without
/// its warning: what start-up sizes other limits by.
pub(crate) fn effective_max_connections(wanted: usize) -> usize {
    let Some(limit) = descriptor_limit() else {
        return wanted;
    };
    let room = limit
        .saturating_sub(RESERVED_DESCRIPTORS)
        .max(limit / 2)
        .max(1) as usize;
    wanted.min(room)
}

/// The soft limit on open files, from `/proc/self/limits` (Linux; `None` elsewhere).
fn descriptor_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Serves one connection, closing it when a deadline of [`Activity`] passes, and
/// answering a request refused before hyper read it.
async fn connection<S>(
    http: hyper::server::conn::http1::Builder,
    tcp: TcpStream,
    service: S,
    limits: ServerLimits,
    shutdown: CancellationToken,
    _slot: OwnedSemaphorePermit,
) where
    S: Service<Request, Response = Response, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send,
{
    let activity = Arc::new(Activity::new());
    let io = TokioIo::new(Watched::new(tcp, activity.clone()));
    let hyper_service = hyper::service::service_fn({
        let activity = activity.clone();
        move |req: hyper::Request<hyper::body::Incoming>| {
            let busy = activity.begin_request();
            let response = service.clone().oneshot(req.map(Body::new));
            async move {
                let response = response.await?;
                // Busy until the body is sent (or dropped), so a stream is not idle.
                Ok::<_, Infallible>(response.map(|body| Body::new(Tracked { body, _busy: busy })))
            }
        }
    });
    let mut conn = http.serve_connection(io, hyper_service);
    let mut draining = false;
    loop {
        let deadline = activity.deadline(&limits, draining);
        tokio::select! {
            result = &mut conn => {
                if let Err(e) = result {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
                break;
            }
            _ = shutdown.cancelled(), if !draining => {
                draining = true;
                std::pin::Pin::new(&mut conn).graceful_shutdown();
            }
            _ = tokio::time::sleep_until(deadline) => {
                if activity.deadline(&limits, draining) <= Instant::now() {
                    tracing::debug!("connection too slow, idle or not reading; closed");
                    return; // dropping the connection closes the socket
                }
            }
        }
    }
    let watched = conn.into_parts().io.into_inner();
    if let Some(refusal) = watched.refused {
        tokio::select! {
            _ = refuse(watched.inner, refusal) => {}
            // Shutdown cuts the linger short, not the answer: it is sent within a second.
            _ = async { shutdown.cancelled().await; tokio::time::sleep(WRITE_STALL_DRAINING).await } => {}
        }
    }
}

/// Answers a request refused before hyper read its head, then closes the connection:
/// hyper has ended (its input did), after writing every answer before this one.
async fn refuse(mut tcp: TcpStream, refusal: Refusal) {
    let answer = closing_answer(refusal.error()).await;
    let sent = tokio::time::timeout(WRITE_STALL_DRAINING, async {
        tcp.write_all(&answer).await?;
        tcp.shutdown().await
    })
    .await;
    if !matches!(sent, Ok(Ok(()))) {
        return;
    }
    let until = Instant::now() + LINGER;
    let mut dropped = [0u8; 4096];
    while let Ok(Ok(1..)) = tokio::time::timeout_at(until, tcp.read(&mut dropped)).await {}
}

/// `error`'s answer as HTTP/1.1 bytes, with `connection: close` and the `date`.
async fn closing_answer(error: AppError) -> Vec<u8> {
    let (parts, body) = error.into_response().into_parts();
    let body = axum::body::to_bytes(body, usize::MAX)
        .await
        .unwrap_or_default();
    let mut bytes = format!("HTTP/1.1 {}\r\n", parts.status).into_bytes();
    for (name, value) in &parts.headers {
        bytes.extend_from_slice(
            &[name.as_str().as_bytes(), b": ", value.as_bytes(), b"\r\n"].concat(),
        );
    }
    let date = chrono::Utc::now().format("%a, %d %b %Y %H:%M:%S GMT");
    let tail = format!(
        "content-length: {}\r\nconnection: close\r\ndate: {date}\r\n\r\n",
        body.len()
    );
    bytes.extend_from_slice(tail.as_bytes());
    bytes.extend_from_slice(&body);
    bytes
}

#[cfg(test)]
mod tests;
