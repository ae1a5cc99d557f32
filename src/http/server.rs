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
//! What hyper refuses before the router sees it (a URL over 64 KiB: 414; more headers
//! than its parser takes, or a head over its buffer: 431; a request that is not HTTP:
//! 400) it answers itself, without a body. Those answers are rewritten on their way
//! out into the JSON error format every other error has (see [`Replacement`]).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, HttpBody};
use axum::extract::Request;
use axum::response::Response;
use axum::Router;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::{Service, ServiceExt};

/// Headers hyper parses before it refuses a request with its own bare 431; above the
/// limit the middleware enforces ([`super::MAX_HEADERS`]), so that limit answers JSON.
const PARSER_MAX_HEADERS: usize = 4 * super::MAX_HEADERS;
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

/// Serves one connection, closing it when a deadline of [`Activity`] passes.
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
    let io = TokioIo::new(Watched {
        inner: tcp,
        activity: activity.clone(),
        replacing: None,
    });
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
    let mut conn = pin!(http.serve_connection(io, hyper_service));
    let mut draining = false;
    loop {
        let deadline = activity.deadline(&limits, draining);
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(e) = result {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
                return;
            }
            _ = shutdown.cancelled(), if !draining => {
                draining = true;
                conn.as_mut().graceful_shutdown();
            }
            _ = tokio::time::sleep_until(deadline) => {
                if activity.deadline(&limits, draining) <= Instant::now() {
                    tracing::debug!("connection too slow, idle or not reading; closed");
                    return; // dropping the connection closes the socket
                }
            }
        }
    }
}

/// What a connection is doing, for its watchdog. Reads, requests and responses all
/// happen on the connection's one task; atomics only make it shareable.
struct Activity {
    opened: Instant,
    /// Requests whose response is not yet fully sent.
    busy: AtomicUsize,
    /// Since when (ms after `opened`) the connection waits for headers or sits idle.
    since_ms: AtomicU64,
    /// Whether it waits for headers (bytes of a request came, or it is new) rather than
    /// idling between requests.
    reading_head: std::sync::atomic::AtomicBool,
    /// Since when (ms after `opened`) a write has been waiting for the client to take
    /// bytes; [`NOT_STALLED`] while writes go through.
    stalled_ms: AtomicU64,
}

const NOT_STALLED: u64 = u64::MAX;

impl Activity {
    fn new() -> Self {
        Self {
            opened: Instant::now(),
            busy: AtomicUsize::new(0),
            since_ms: AtomicU64::new(0),
            reading_head: std::sync::atomic::AtomicBool::new(true),
            stalled_ms: AtomicU64::new(NOT_STALLED),
        }
    }

    fn now_ms(&self) -> u64 {
        self.opened.elapsed().as_millis() as u64
    }

    /// When the connection is to be closed unless something happens first.
    fn deadline(&self, limits: &ServerLimits, draining: bool) -> Instant {
        // First: bytes waiting for the client, whether or not their request still
        // counts as busy (hyper takes a whole body into its buffer before writing it).
        let stalled = self.stalled_ms.load(Ordering::Relaxed);
        if stalled != NOT_STALLED {
            let limit = if draining {
                WRITE_STALL_DRAINING
            } else {
                WRITE_STALL.min(limits.keepalive_idle)
            };
            return self.opened + Duration::from_millis(stalled) + limit;
        }
        if self.busy.load(Ordering::Relaxed) > 0 {
            // The request timeout bounds the handler; look again soon, since a stall
            // that begins meanwhile does not wake the watchdog.
            return Instant::now() + WRITE_STALL_DRAINING.min(limits.keepalive_idle);
        }
        let since = self.opened + Duration::from_millis(self.since_ms.load(Ordering::Relaxed));
        if self.reading_head.load(Ordering::Relaxed) {
            since + limits.header_read_timeout
        } else {
            since + limits.keepalive_idle
        }
    }

    fn on_read(&self) {
        if self.busy.load(Ordering::Relaxed) == 0 && !self.reading_head.load(Ordering::Relaxed) {
            // The first bytes of the next request: its header deadline starts.
            self.since_ms.store(self.now_ms(), Ordering::Relaxed);
            self.reading_head.store(true, Ordering::Relaxed);
        }
    }

    /// A write's outcome: `Pending` starts (or continues) a stall, anything else ends it.
    fn on_write<T>(&self, poll: &Poll<T>) {
        if poll.is_pending() {
            if self.stalled_ms.load(Ordering::Relaxed) == NOT_STALLED {
                self.stalled_ms.store(self.now_ms(), Ordering::Relaxed);
            }
        } else {
            self.stalled_ms.store(NOT_STALLED, Ordering::Relaxed);
        }
    }

    fn begin_request(self: &Arc<Self>) -> Busy {
        self.busy.fetch_add(1, Ordering::Relaxed);
        self.reading_head.store(false, Ordering::Relaxed);
        Busy(self.clone())
    }
}

/// A request in progress; its drop (the response sent or abandoned) may start idling.
struct Busy(Arc<Activity>);

impl Drop for Busy {
    fn drop(&mut self) {
        if self.0.busy.fetch_sub(1, Ordering::Relaxed) == 1 {
            self.0.since_ms.store(self.0.now_ms(), Ordering::Relaxed);
        }
    }
}

/// The socket, telling [`Activity`] when bytes arrive and leave, and sending hyper's
/// own bare refusals as [`Replacement`]s.
struct Watched {
    inner: TcpStream,
    activity: Arc<Activity>,
    /// A replacement being written.
    replacing: Option<Replacement>,
}

impl Watched {
    /// Writes on: the replacement in progress, or the one `buf` (the start of what hyper
    /// writes) calls for. `None` when `buf` is no bare refusal of hyper's.
    fn replace(
        &mut self,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Option<Poll<std::io::Result<usize>>> {
        if self.replacing.is_none() {
            // hyper refuses a request only between requests: never while one of this
            // connection's responses is still being produced.
            if self.activity.busy.load(Ordering::Relaxed) != 0 {
                return None;
            }
            self.replacing = Some(Replacement::of(buf)?);
        }
        let replacing = self.replacing.as_mut().expect("just set");
        while replacing.sent < replacing.bytes.len() {
            let poll = Pin::new(&mut self.inner).poll_write(cx, &replacing.bytes[replacing.sent..]);
            self.activity.on_write(&poll);
            match poll {
                Poll::Ready(Ok(0)) => {
                    return Some(Poll::Ready(Err(std::io::ErrorKind::WriteZero.into())))
                }
                Poll::Ready(Ok(n)) => replacing.sent += n,
                Poll::Ready(Err(e)) => return Some(Poll::Ready(Err(e))),
                Poll::Pending => return Some(Poll::Pending),
            }
        }
        let written = replacing.stands_for;
        self.replacing = None;
        Some(Poll::Ready(Ok(written)))
    }
}

/// The answer sent instead of one hyper wrote itself for a request it could not parse:
/// the same status line and `date`, and the JSON error body (`validation`). hyper's
/// own is recognised by its form, which no answer of the router has: status 400, 414
/// or 431, `content-length: 0` and no `content-type` (every error of the router is
/// JSON), the whole head in one write.
struct Replacement {
    bytes: Vec<u8>,
    sent: usize,
    /// How many of hyper's bytes (its head) it stands for.
    stands_for: usize,
}

impl Replacement {
    fn of(written: &[u8]) -> Option<Self> {
        let status = written.strip_prefix(b"HTTP/1.1 ")?.get(..4)?;
        let message = match status {
            b"400 " => "malformed request: not valid HTTP/1.1".to_string(),
            b"414 " => super::url_too_long(),
            b"431 " => super::head_too_large(),
            _ => return None,
        };
        let end = written.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
        let head = std::str::from_utf8(&written[..end - 4]).ok()?;
        let mut lines = head.split("\r\n");
        let status_line = lines.next()?;
        let mut kept = Vec::new();
        let mut empty = false;
        for line in lines {
            let lower = line.to_ascii_lowercase();
            if lower.starts_with("content-type:") {
                return None;
            }
            if lower == "content-length: 0" {
                empty = true;
            } else if !lower.starts_with("content-length:") && !lower.starts_with("connection:") {
                kept.push(line);
            }
        }
        if !empty {
            return None;
        }
        let body =
            crate::http::error::error_json(crate::http::error::ErrorCode::Validation, message);
        let mut bytes = format!(
            "{status_line}\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n",
            body.len()
        )
        .into_bytes();
        for line in kept {
            bytes.extend_from_slice(line.as_bytes());
            bytes.extend_from_slice(b"\r\n");
        }
        bytes.extend_from_slice(b"\r\n");
        bytes.extend_from_slice(&body);
        Some(Self {
            bytes,
            sent: 0,
            stands_for: end,
        })
    }
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let poll = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.on_read();
        }
        poll
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if let Some(poll) = self.replace(cx, buf) {
            return poll;
        }
        let poll = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.activity.on_write(&poll);
        poll
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let first = bufs
            .iter()
            .find(|b| !b.is_empty())
            .map_or(&[][..], |b| &b[..]);
        if let Some(poll) = self.replace(cx, first) {
            return poll;
        }
        let poll = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.activity.on_write(&poll);
        poll
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A response body that keeps its request [`Busy`] until it is sent or dropped.
struct Tracked {
    body: Body,
    /// Never read: dropping it ends the request's busy time.
    _busy: Busy,
}

impl HttpBody for Tracked {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests;
