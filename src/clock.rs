//! The one clock of the decisions that must agree across processes.
//!
//! Every process reads Redis's clock (`TIME`) at each look of its term watcher, once a
//! second, and carries it forward between looks with its own monotonic clock: [`now`]
//! is the authority's time as this process knows it, whatever its wall clock says
//! (minutes off, stepped by NTP). Which clock decides what:
//! - **Redis's**, inside the admission function: a sale's window, a lottery's entries
//!   and draw (its `drawn_at`), a stream entry's admission time.
//! - **Redis's, through [`now`]**, in a process: how long a lottery's held press waits
//!   for its window's end, whether a sale has ended, a token's expiry, a new voucher's
//!   times, the minting time an order id carries, a segmented draw's `drawn_at`.
//! - **Postgres's `now()`**, inside the transaction: every time an order or payment
//!   stores (`created_at`, `pay_before`, `closed_at`, ...) and every judgement of one
//!   (due, late, expired).
//!
//! A process's own clock measures only its own waits (timeouts, backoff, leases' renewal
//! windows) and a payment notification's age against the provider's timestamp.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{LazyLock, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use chrono::{DateTime, Utc};

/// The monotonic clock's origin.
static ORIGIN: LazyLock<Instant> = LazyLock::new(Instant::now);

/// This process's reading of the authority.
static AUTHORITY: Authority = Authority::new();

const UNHEARD: i64 = i64::MIN;

/// A reading whose round trip is this many times the one in use, plus 1 ms, says less
/// than it (a stalled reply); it replaces it only once that one is older than
/// [`TRUST_US`].
const SLOWER: i64 = 2;
const TRUST_US: i64 = 10_000_000;

/// What a process knows of the authority's clock.
struct Authority {
    /// Its time minus the monotonic clock's, in µs; [`UNHEARD`] until heard.
    offset_us: AtomicI64,
    /// The reading in use: when it was taken (monotonic µs) and its round trip (µs).
    reading: Mutex<(i64, i64)>,
}

impl Authority {
    const fn new() -> Self {
        Self {
            offset_us: AtomicI64::new(UNHEARD),
            reading: Mutex::new((0, 0)),
        }
    }

    fn heard(&self, sent: Instant, received: Instant, server_us: i64) {
        let (sent, received) = (mono_us(sent), mono_us(received));
        let trip = (received - sent).max(0);
        let midway = sent + trip / 2;
        let mut reading = self.reading.lock().unwrap_or_else(|e| e.into_inner());
        let (at, used_trip) = *reading;
        if self.heard_yet() && trip > SLOWER * used_trip + 1_000 && midway - at < TRUST_US {
            return;
        }
        *reading = (midway, trip);
        self.offset_us.store(server_us - midway, Ordering::Release);
    }

    fn heard_yet(&self) -> bool {
        self.offset_us.load(Ordering::Acquire) != UNHEARD
    }

    fn now_us(&self) -> i64 {
        match self.offset_us.load(Ordering::Acquire) {
            UNHEARD => own_us(),
            offset => mono_us(Instant::now()) + offset,
        }
    }
}

fn mono_us(at: Instant) -> i64 {
    at.saturating_duration_since(*ORIGIN).as_micros() as i64
}

fn own_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

/// The authority answered `server_us` (µs since the Unix epoch) to a request sent at
/// `sent` and answered at `received`: taken as its time halfway between.
pub(crate) fn heard(sent: Instant, received: Instant, server_us: i64) {
    AUTHORITY.heard(sent, received, server_us);
    if let Some(skew) = skew_secs() {
        metrics::gauge!(crate::metrics::CLOCK_SKEW).set(skew);
    }
}

/// Reads Redis's `TIME` once (a process without a term watcher: `reconcile`).
pub async fn sync<C: redis::aio::ConnectionLike + Send>(conn: &mut C) -> redis::RedisResult<()> {
    let sent = Instant::now();
    let time: (i64, i64) = redis::cmd("TIME").query_async(conn).await?;
    heard(sent, Instant::now(), of_time(time));
    Ok(())
}

/// A `TIME` reply (seconds, microseconds) in µs.
pub(crate) fn of_time((secs, micros): (i64, i64)) -> i64 {
    secs * 1_000_000 + micros
}

/// Whether the authority was heard: before, [`now`] is this process's own clock.
pub fn heard_yet() -> bool {
    AUTHORITY.heard_yet()
}

/// The authority's time now, in µs since the Unix epoch.
pub fn now_us() -> i64 {
    AUTHORITY.now_us()
}

/// The authority's time now, in ms since the Unix epoch.
pub fn now_ms() -> i64 {
    now_us().div_euclid(1_000)
}

/// The authority's time now.
pub fn now() -> DateTime<Utc> {
    DateTime::from_timestamp_micros(now_us()).unwrap_or_else(Utc::now)
}

/// How far this process's own clock is ahead of the authority's, in seconds (`None`:
/// not heard yet).
pub fn skew_secs() -> Option<f64> {
    heard_yet().then(|| (own_us() - now_us()) as f64 / 1e6)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_authority_heard_decides_and_a_slow_reading_does_not_replace_a_fresh_one() {
        let clock = Authority::new();
        assert!(!clock.heard_yet());
        let sent = Instant::now();
        let received = sent + Duration::from_millis(2);
        // An authority five minutes behind this process's clock.
        clock.heard(sent, received, own_us() - 300_000_000);
        assert!(clock.heard_yet());
        let behind = |c: &Authority| (own_us() - c.now_us()) as f64 / 1e6;
        assert!(
            (299.0..301.0).contains(&behind(&clock)),
            "{}",
            behind(&clock)
        );
        // A reply that took a second is worth less than the one in use.
        clock.heard(received, received + Duration::from_secs(1), own_us());
        assert!((299.0..301.0).contains(&behind(&clock)));
        // A quick one replaces it.
        let later = Instant::now();
        clock.heard(later, later, own_us());
        assert!(behind(&clock).abs() < 1.0, "{}", behind(&clock));
    }
}
