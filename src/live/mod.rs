//! The live view of every open sale (`GET /live`, `GET /live/events`).
//!
//! One producer per process reads the stores once a second, and only while someone is
//! watching: Postgres (the sales, their orders by status, dead letters, releases owed:
//! one statement), Redis (each sale's live stock and grab counts, each shard's stream).
//! It serialises one JSON snapshot and publishes it on a `watch` channel that every
//! open page reads, so a thousand pages cost what one does. Every figure comes from the
//! shared stores (grab counts too: see `admission::tally`), so every API instance, in
//! cluster mode as well, shows the same numbers; so do the rates over the last seconds
//! (grabs, 503s), which Redis keeps by its own clock, so that a page's first snapshot
//! has them. The one figure of this instance's own is the p99 admission wait, from its
//! Prometheus recorder (see `waits`). Sales still selling come first (by Redis's stock,
//! the live one), then upcoming, sold out and ended ones: `LIVE_MAX_SALES` never leaves
//! out a selling sale for another.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use sqlx::PgPool;
use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;

use crate::admission::tally::{self, Tally};
use crate::domain::VoucherId;
use crate::keys::Keys;
use crate::redis_conn::RedisConn;
use crate::store::live as store;
use crate::stream::StreamStats;

mod snapshot;
mod waits;
use snapshot::{rank, view, Figures};
pub use snapshot::{Orders, Outcomes, SaleView, Snapshot};
use waits::Waits;

/// A snapshot at least this often while someone watches; grab counts flushed as often.
pub const EVERY: Duration = Duration::from_secs(1);
/// Grabs per second are averaged over this long (each instance adds its counts once a
/// second, so a shorter window would flicker): the recent figures Redis keeps (see
/// `admission::tally`), and the producer's own history of the totals when Redis has
/// none (counts added by a process of an earlier release, which keeps no recent ones).
/// The p99 admission wait is over this long too (see `waits`).
const RATE_WINDOW: Duration = Duration::from_secs(tally::WINDOW_SECS);
/// A store's reads give up after this long; the snapshot says which store is missing.
const READ_DEADLINE: Duration = Duration::from_millis(800);
/// At shutdown, how long the last flush waits for the server's last request (bounded by
/// the request timeout) and then for Redis.
const LAST_FLUSH_WAIT: Duration = Duration::from_secs(15);
const LAST_FLUSH_DEADLINE: Duration = Duration::from_secs(2);

/// The process's live view: the latest snapshot and who watches it. Cheap to clone.
#[derive(Clone)]
pub struct Live(Arc<Inner>);

struct Inner {
    latest: watch::Sender<Option<Arc<str>>>,
    /// Wakes the producer when the first page opens.
    watched: Notify,
    viewers: AtomicUsize,
    max_viewers: usize,
    /// Sales in a snapshot at most (`LIVE_MAX_SALES`).
    max_sales: i64,
    cancel: CancellationToken,
}

/// One page's subscription; counted until dropped.
pub struct Viewer {
    pub updates: watch::Receiver<Option<Arc<str>>>,
    pub cancel: CancellationToken,
    live: Live,
}

impl Drop for Viewer {
    fn drop(&mut self) {
        self.live.0.viewers.fetch_sub(1, Ordering::Relaxed);
        metrics::gauge!(crate::metrics::LIVE_VIEWERS).decrement(1.0);
    }
}

impl Live {
    /// Pages watching at once are at most `max_viewers`, each shown at most `max_sales`
    /// sales; their streams end when `cancel` fires.
    pub fn new(max_viewers: usize, max_sales: i64, cancel: CancellationToken) -> Self {
        Self(Arc::new(Inner {
            latest: watch::Sender::new(None),
            watched: Notify::new(),
            viewers: AtomicUsize::new(0),
            max_viewers,
            max_sales,
            cancel,
        }))
    }

    /// A new page's subscription, or `None` when [`Live::new`]'s limit is reached.
    pub fn watch(&self) -> Option<Viewer> {
        let inner = &self.0;
        let before = inner.viewers.fetch_add(1, Ordering::Relaxed);
        metrics::gauge!(crate::metrics::LIVE_VIEWERS).increment(1.0);
        // Built before the check: dropping it when over the limit undoes the count.
        let mut viewer = Viewer {
            updates: inner.latest.subscribe(),
            cancel: inner.cancel.clone(),
            live: self.clone(),
        };
        if before >= inner.max_viewers {
            return None;
        }
        if viewer.updates.borrow().is_some() {
            // Less than a second old (the producer clears it when nobody watches): the
            // page starts with it, and opening pages never costs a snapshot.
            viewer.updates.mark_changed();
        } else {
            inner.watched.notify_one();
        }
        Some(viewer)
    }

    fn watched(&self) -> bool {
        self.0.viewers.load(Ordering::Relaxed) > 0
    }

    /// The producer (and the flush of this process's grab counts): every [`EVERY`]
    /// until cancelled; then one last flush once `served` fires (the last request has
    /// been answered), so that no count is lost at shutdown.
    pub async fn run(
        self,
        db: PgPool,
        redis: RedisConn,
        keys: Keys,
        tally: Arc<Tally>,
        served: CancellationToken,
    ) {
        let mut producer = Producer::default();
        let cancel = self.0.cancel.clone();
        // Flushed on a task of its own: a slow flush would hold snapshots back.
        let stop = {
            let cancel = cancel.clone();
            async move {
                cancel.cancelled().await;
                let _ = tokio::time::timeout(LAST_FLUSH_WAIT, served.cancelled()).await;
            }
        };
        // Aborted if this producer panics (it is restarted with a flusher of its own).
        let mut flusher = AbortOnDrop(tokio::spawn(tally.keep_flushing(
            redis.clone(),
            keys.clone(),
            EVERY,
            READ_DEADLINE,
            stop,
            LAST_FLUSH_DEADLINE,
        )));
        let mut every = tokio::time::interval(EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let ticked = tokio::select! {
                _ = cancel.cancelled() => {
                    // The process's last flush: this task ends after it.
                    let _ = (&mut flusher.0).await;
                    return;
                }
                _ = every.tick() => true,
                // A page opened with no snapshot to start from: it gets one at once.
                _ = self.0.watched.notified() => false,
            };
            if ticked {
                // Watched or not: a page's first snapshot has the last seconds' waits.
                producer.waits.sample(Instant::now());
            }
            if !self.watched() {
                // Nobody watches: no snapshot, and the last one goes (it would be stale
                // for the next page).
                if self.0.latest.borrow().is_some() {
                    self.0.latest.send_replace(None);
                }
                continue;
            }
            if !ticked && self.0.latest.borrow().is_some() {
                // Woken by a page that has one already: pages opening and closing in a
                // loop cost at most one extra snapshot a second.
                continue;
            }
            let snapshot = producer
                .snapshot(&db, &redis, &keys, self.0.max_sales)
                .await;
            metrics::counter!(crate::metrics::LIVE_SNAPSHOTS).increment(1);
            match serde_json::to_string(&snapshot) {
                Ok(json) => {
                    self.0.latest.send_replace(Some(json.into()));
                }
                Err(e) => tracing::error!(error = %e, "live snapshot not serialised"),
            }
        }
    }
}

async fn timeout<T, E: std::fmt::Display>(
    read: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, String> {
    match tokio::time::timeout(READ_DEADLINE, read).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no answer within {READ_DEADLINE:?}")),
    }
}

/// The producer's memory between snapshots: the last figures (shown again, marked,
/// when a store does not answer), recent grab totals for the rates and this process's
/// recent admission waits.
#[derive(Default)]
struct Producer {
    sales: store::Sales,
    redis: HashMap<VoucherId, Figures>,
    worker: StreamStats,
    totals: HashMap<VoucherId, VecDeque<(Instant, u64)>>,
    waits: Waits,
    /// Postgres's clock less ours at the last read: a snapshot's `at` is Postgres's
    /// time, like its sales' states, so that every instance's page counts down alike.
    clock_offset: chrono::TimeDelta,
    /// The sales Redis said had no unit left, with Postgres's stock then: Postgres
    /// still counts the units of orders in flight, so without this a sale sold out in
    /// Redis could take a selling sale's place when not every sale can be shown (see
    /// `store::live::sales`).
    sold_out: HashMap<VoucherId, i32>,
}

/// Sales remembered sold out, at most (beyond it the memory starts again).
const SOLD_OUT_REMEMBERED: usize = 10_000;

impl Producer {
    async fn snapshot(
        &mut self,
        db: &PgPool,
        redis: &RedisConn,
        keys: &Keys,
        max_sales: i64,
    ) -> Snapshot {
        let mut unavailable = Vec::new();
        // Read again (twice at most) when Redis shows that Postgres's stock put a sale
        // sold out among the selling ones and some sale was left out for it.
        for _ in 0..3 {
            unavailable.clear();
            self.read(db, redis, keys, max_sales, &mut unavailable)
                .await;
            let misplaced = !unavailable.contains(&"redis") && self.learn_sold_out();
            if !(misplaced && self.sales.total > self.sales.rows.len() as i64) {
                break;
            }
        }
        let ids: Vec<VoucherId> = self.sales.rows.iter().map(|s| s.voucher_id).collect();
        let now = Utc::now() + self.clock_offset;
        let clock = Instant::now();
        let fresh = unavailable.is_empty();
        self.totals.retain(|id, _| ids.contains(id));
        let p99 = self.waits.p99_ms();
        let mut sales: Vec<SaleView> = self
            .sales
            .rows
            .iter()
            .map(|s| {
                let figures = self.redis.get(&s.voucher_id).copied();
                let Some(figures) = figures else {
                    // Redis has not answered for it yet: no rate, rather than 0.
                    return view(s, Figures::default(), None, None, fresh);
                };
                let history = rate(
                    self.totals.entry(s.voucher_id).or_default(),
                    clock,
                    figures.outcomes.total(),
                );
                let grabs_per_sec = if figures.recent.grabs > 0 {
                    figures.recent.grabs_per_sec()
                } else {
                    history
                };
                view(s, figures, Some(grabs_per_sec), p99, fresh)
            })
            .collect();
        // Selling first, then upcoming, then sold out, then ended, the soonest ending
        // first within each (as the store reads them, but by Redis's stock, the live one).
        sales.sort_by_key(|s| (rank(s), s.end_time, s.id));
        Snapshot {
            at: now,
            worker: self.worker,
            open_total: self.sales.total,
            truncated: self.sales.total > sales.len() as i64,
            sales,
            unavailable,
        }
    }
}

impl Producer {
    /// Both stores' figures of the sales on show; the stores that did not answer go to
    /// `unavailable` (their last figures stay).
    async fn read(
        &mut self,
        db: &PgPool,
        redis: &RedisConn,
        keys: &Keys,
        max_sales: i64,
        unavailable: &mut Vec<&'static str>,
    ) {
        let asked = Utc::now();
        let sold_out: Vec<(VoucherId, i32)> = self.sold_out.iter().map(|(&v, &s)| (v, s)).collect();
        match timeout(store::sales(db, max_sales, &sold_out)).await {
            Ok(sales) => {
                // Postgres read its clock somewhere within the round trip: take the
                // middle, so the offset is off by at most half a read, not a whole one.
                let answered = Utc::now();
                self.clock_offset = sales.now - (asked + (answered - asked) / 2);
                self.sales = sales;
            }
            Err(e) => {
                tracing::debug!(error = %e, "live view: postgres did not answer");
                unavailable.push("postgres");
            }
        }
        let ids: Vec<VoucherId> = self.sales.rows.iter().map(|s| s.voucher_id).collect();
        let segments: Vec<u8> = self.sales.rows.iter().map(|s| s.segments as u8).collect();
        let entering: Vec<bool> = self
            .sales
            .rows
            .iter()
            .map(|s| s.lottery_window_ms.is_some() && s.drawn_at.is_none())
            .collect();
        match timeout(read_redis(redis, keys, &ids, &segments, &entering)).await {
            Ok((figures, worker)) => {
                self.redis = ids.iter().copied().zip(figures).collect();
                self.worker = worker;
            }
            Err(e) => {
                tracing::debug!(error = %e, "live view: redis did not answer");
                unavailable.push("redis");
            }
        }
    }

    /// Remembers which sales on show Redis has sold out (see [`Producer::sold_out`]);
    /// whether one of them was read as one with units left (open, with Postgres's stock
    /// above what was remembered).
    fn learn_sold_out(&mut self) -> bool {
        if self.sold_out.len() > SOLD_OUT_REMEMBERED {
            self.sold_out.clear();
        }
        let mut misplaced = false;
        for row in &self.sales.rows {
            let remaining = self.redis.get(&row.voucher_id).and_then(|f| f.remaining);
            match remaining {
                Some(left) if left <= 0 => {
                    let before = self.sold_out.insert(row.voucher_id, row.stock);
                    let read_as_selling = row.state == "open"
                        && row.stock > 0
                        && before.is_none_or(|stock| row.stock > stock);
                    misplaced |= read_as_selling;
                }
                _ => {
                    self.sold_out.remove(&row.voucher_id);
                }
            }
        }
        misplaced
    }
}

/// Each sale's live stock and grab counts (and, for a lottery not drawn, its entrants so
/// far: `entering`), and the streams.
async fn read_redis(
    redis: &RedisConn,
    keys: &Keys,
    ids: &[VoucherId],
    segments: &[u8],
    entering: &[bool],
) -> redis::RedisResult<(Vec<Figures>, StreamStats)> {
    let stocks = ids.iter().zip(segments).map(|(&id, &segments)| {
        let mut conn = redis.clone();
        async move { crate::admission::redis_stock(&mut conn, keys, id, segments).await }
    });
    let stocks = futures_util::future::try_join_all(stocks).await?;
    let entrants = ids
        .iter()
        .zip(segments)
        .zip(entering)
        .map(|((&id, &segments), &entering)| {
            let mut conn = redis.clone();
            async move {
                match entering {
                    true => {
                        crate::admission::lottery::entrants_so_far(&mut conn, keys, id, segments)
                            .await
                    }
                    false => Ok(None),
                }
            }
        });
    let entrants = futures_util::future::try_join_all(entrants).await?;
    let counts = tally::read(redis, keys, ids).await?;
    // Summed from nothing: a lag of 0, known.
    let mut worker = StreamStats {
        lag: Some(0),
        ..StreamStats::default()
    };
    let mut conn = redis.clone();
    for shard in keys.shards() {
        worker += crate::stream::stats(&mut conn, keys, shard).await?;
    }
    let figures = stocks
        .into_iter()
        .zip(counts)
        .zip(entrants)
        .map(|((stock, counts), entrants)| (stock, counts, entrants).into())
        .collect();
    Ok((figures, worker))
}

/// Grabs per second over the last [`RATE_WINDOW`], `history` holding recent totals.
fn rate(history: &mut VecDeque<(Instant, u64)>, now: Instant, total: u64) -> f64 {
    history.push_back((now, total));
    while history
        .front()
        .is_some_and(|(t, _)| now.duration_since(*t) > RATE_WINDOW)
    {
        history.pop_front();
    }
    let (since, first) = history[0];
    let secs = now.duration_since(since).as_secs_f64();
    if secs < 0.5 {
        return 0.0;
    }
    // Counts restart from zero if Redis lost them: never a negative rate.
    (total.saturating_sub(first) as f64 / secs * 10.0).round() / 10.0
}

/// A task that ends with its handle: dropped (say, by a panic unwinding the task that
/// holds it), it is aborted rather than left running.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rate_is_grabs_over_the_window_and_never_negative() {
        let mut h = VecDeque::new();
        let t0 = Instant::now();
        assert_eq!(rate(&mut h, t0, 100), 0.0, "one sample: no rate yet");
        assert_eq!(rate(&mut h, t0 + Duration::from_secs(2), 300), 100.0);
        assert_eq!(rate(&mut h, t0 + Duration::from_secs(4), 500), 100.0);
        // The first sample leaves the window: the rate is over the last 5 s.
        assert_eq!(rate(&mut h, t0 + Duration::from_secs(6), 1500), 300.0);
        // Counts lost (a Redis restart) restart from zero.
        assert_eq!(rate(&mut h, t0 + Duration::from_secs(7), 0), 0.0);
    }
}
