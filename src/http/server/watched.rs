//! The connection's socket as hyper sees it: what it reads and writes tells the
//! watchdog ([`Activity`]) how the connection is doing, and each request's head is
//! judged on its way in ([`Heads`]).

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, HttpBody};
use futures_util::task::AtomicWaker;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::head::{Heads, Refusal};
use super::{ServerLimits, WRITE_STALL, WRITE_STALL_DRAINING};

/// What a connection is doing, for its watchdog. Reads, requests and responses all
/// happen on the connection's one task; atomics only make it shareable.
pub(super) struct Activity {
    opened: Instant,
    /// Requests whose response is not yet fully sent.
    busy: AtomicUsize,
    /// Since when (ms after `opened`) the connection waits for headers or sits idle.
    since_ms: AtomicU64,
    /// Whether it waits for headers (bytes of a request came, or it is new) rather than
    /// idling between requests.
    reading_head: AtomicBool,
    /// Since when (ms after `opened`) a write has been waiting for the client to take
    /// bytes; [`NOT_STALLED`] while writes go through.
    stalled_ms: AtomicU64,
    /// hyper's read of a refused connection, waiting for its writes to end.
    parked: AtomicWaker,
}

const NOT_STALLED: u64 = u64::MAX;

impl Activity {
    pub(super) fn new() -> Self {
        Self {
            opened: Instant::now(),
            busy: AtomicUsize::new(0),
            since_ms: AtomicU64::new(0),
            reading_head: AtomicBool::new(true),
            stalled_ms: AtomicU64::new(NOT_STALLED),
            parked: AtomicWaker::new(),
        }
    }

    fn now_ms(&self) -> u64 {
        self.opened.elapsed().as_millis() as u64
    }

    /// When the connection is to be closed unless something happens first.
    pub(super) fn deadline(&self, limits: &ServerLimits, draining: bool) -> Instant {
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
            self.parked.wake();
        }
    }

    /// The end of the input, for hyper's read once a request is refused: only after the
    /// responses before it are written (hyper would drop them at an early end), so until
    /// then the read waits, woken when a response ends or a stalled write goes through.
    fn end_of_input(&self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.parked.register(cx.waker());
        let busy = self.busy.load(Ordering::Relaxed) > 0;
        if busy || self.stalled_ms.load(Ordering::Relaxed) != NOT_STALLED {
            return Poll::Pending;
        }
        Poll::Ready(Ok(()))
    }

    pub(super) fn begin_request(self: &Arc<Self>) -> Busy {
        self.busy.fetch_add(1, Ordering::Relaxed);
        self.reading_head.store(false, Ordering::Relaxed);
        Busy(self.clone())
    }
}

/// A request in progress; its drop (the response sent or abandoned) may start idling.
pub(super) struct Busy(Arc<Activity>);

impl Drop for Busy {
    fn drop(&mut self) {
        if self.0.busy.fetch_sub(1, Ordering::Relaxed) == 1 {
            self.0.since_ms.store(self.0.now_ms(), Ordering::Relaxed);
            self.0.parked.wake();
        }
    }
}

/// The socket, telling [`Activity`] when bytes arrive and leave, and judging each
/// request's head on its way in ([`Heads`]).
pub(super) struct Watched {
    pub(super) inner: TcpStream,
    activity: Arc<Activity>,
    heads: Heads,
    /// The request refused before hyper could read its head: hyper reads no more, and
    /// the connection answers it once hyper is done.
    pub(super) refused: Option<Refusal>,
}

impl Watched {
    pub(super) fn new(inner: TcpStream, activity: Arc<Activity>) -> Self {
        Self {
            inner,
            activity,
            heads: Heads::new(),
            refused: None,
        }
    }
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.refused.is_some() {
            return self.activity.end_of_input(cx);
        }
        let before = buf.filled().len();
        let poll = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.on_read();
            if let Err((at, refusal)) = self.heads.feed(&buf.filled()[before..]) {
                tracing::debug!(?refusal, "request refused before its head was parsed");
                // hyper gets the bytes before the refused one: never a whole head.
                buf.set_filled(before + at);
                self.refused = Some(refusal);
                if at == 0 {
                    return self.activity.end_of_input(cx);
                }
            }
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
        let poll = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.activity.on_write(&poll);
        poll
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
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
        if self.refused.is_some() {
            return Poll::Ready(Ok(())); // the answer to the refusal comes first
        }
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A response body that keeps its request [`Busy`] until it is sent or dropped.
pub(super) struct Tracked {
    pub(super) body: Body,
    /// Never read: dropping it ends the request's busy time.
    pub(super) _busy: Busy,
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
