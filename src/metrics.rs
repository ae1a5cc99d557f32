//! Prometheus metrics: recorded with the `metrics` facade, rendered at `GET /metrics`.
//!
//! Every metric is a const below and has a line in [`DESCRIBED`], which gives its
//! `# HELP`; the counters whose labels are known in advance exist at zero from the
//! recorder's installation ([`register_known_series`]), so an alert on them sees `0`,
//! not "no data", before the first event.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use metrics::{KeyName, Recorder, SharedString, Unit};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use redis::aio::ConnectionLike;

use crate::keys::Keys;

pub(crate) const ADMISSIONS: &str = "seckill_admissions_total";
pub(crate) const ADMISSION_SECONDS: &str = "seckill_admission_duration_seconds";
pub(crate) const WORKER_ORDERS: &str = "seckill_worker_orders_total";
pub(crate) const WORKER_BATCH_ERRORS: &str = "seckill_worker_batch_errors_total";
/// Worker turns Postgres refused because its schema is not the one the binary expects.
pub(crate) const WORKER_SCHEMA_ERRORS: &str = "seckill_worker_schema_errors_total";
pub(crate) const DEAD_LETTERED: &str = "seckill_dead_lettered_total";
pub(crate) const STREAM_LENGTH: &str = "seckill_stream_length";
pub(crate) const STREAM_PENDING: &str = "seckill_stream_pending";
pub(crate) const DEAD_LETTERS: &str = "seckill_dead_letters";
pub(crate) const STREAM_LAG: &str = "seckill_stream_lag";
pub(crate) const HTTP_REQUESTS: &str = "seckill_http_requests_total";
pub(crate) const HTTP_SECONDS: &str = "seckill_http_request_duration_seconds";
pub(crate) const SHED: &str = "seckill_http_shed_total";
pub(crate) const WORKER_BATCH_SIZE: &str = "seckill_worker_batch_size";
pub(crate) const WORKER_COMMIT_SECONDS: &str = "seckill_worker_commit_seconds";
pub(crate) const DEPENDENCY_ERRORS: &str = "seckill_dependency_errors_total";
pub(crate) const TRANSITIONS: &str = "seckill_order_transitions_total";
pub(crate) const UNITS_RETURNED: &str = "seckill_units_returned_total";
pub(crate) const RELEASES_OWED: &str = "seckill_releases_owed";
/// Why a payment notification was refused before anything was recorded.
pub(crate) const REFUSED_NOTIFICATIONS: [&str; 2] = ["bad_signature", "malformed"];
/// Payment provider notifications, by `outcome`: what a signed one did
/// (`store::payments::Outcome`), or why one was refused (`bad_signature`, `malformed`).
pub(crate) const PAYMENT_NOTIFICATIONS: &str = "seckill_payment_notifications_total";
/// Fetches of the identity provider's keys (`JWT_JWKS_URL`), by `outcome`: `ok`, `error`
/// (unreachable, timed out, not 2xx) or `invalid` (not a key set, too large, no usable key).
pub(crate) const JWKS_FETCHES: &str = "seckill_jwks_fetches_total";
/// Snapshots the live view's producer built (one per second while pages are open,
/// however many).
pub(crate) const LIVE_SNAPSHOTS: &str = "seckill_live_snapshots_total";
/// Pages watching `/live/events` now.
pub(crate) const LIVE_VIEWERS: &str = "seckill_live_viewers";
/// Times this process saw a Redis server come back in a new term (restarted, failed
/// over, restored: it may have lost writes) and rebuilt its sales from Postgres.
pub(crate) const ROLLBACKS_HEALED: &str = "seckill_redis_rollbacks_healed_total";
/// Sales whose Redis state this process rebuilt because it was stale or missing.
pub(crate) const SALES_REBUILT: &str = "seckill_sales_rebuilt_total";
/// Units this process moved between the segments of segmented sales (credited to the
/// segment that ran dry; see `admission::segments`).
pub(crate) const SEGMENT_UNITS_MOVED: &str = "seckill_segment_units_moved_total";
/// 202s this instance gave that Redis lost with every copy and that could not be admitted
/// again where their sale lives (see `admission::promises`).
pub(crate) const PROMISES_BROKEN: &str = "seckill_promises_broken_total";
/// 202s this instance gave that Redis lost with every copy, admitted again where their
/// sale lives (see `admission::promises`).
pub(crate) const PROMISES_READMITTED: &str = "seckill_promises_readmitted_total";
/// 202s this instance keeps until their entry is acknowledged.
pub(crate) const PROMISES_KEPT: &str = "seckill_promises_kept";
/// Grabs this instance answered by itself, without Redis (see `admission::edge`).
pub(crate) const EDGE_ANSWERS: &str = "seckill_edge_answers_total";
/// Announcements of sale changes this instance heard (see `sale_changes`).
pub(crate) const SALE_CHANGES_HEARD: &str = "seckill_sale_changes_heard_total";
/// Whether a Redis server this process uses may evict keys (`maxmemory-policy` not
/// `noeviction`): its admissions are refused (see `admission::guard`).
pub(crate) const REDIS_MAY_EVICT: &str = "seckill_redis_may_evict";
/// Whether a Redis server this process uses is out of memory: it refuses writes.
pub(crate) const REDIS_MEMORY_FULL: &str = "seckill_redis_memory_full";
/// How far this process's own clock is ahead of Redis's, the one it decides by (see
/// `clock`).
pub(crate) const CLOCK_SKEW: &str = "seckill_clock_skew_seconds";
/// How long after its lottery window a held press was answered (see `admission::lottery`).
pub(crate) const LOTTERY_ANSWER_SECONDS: &str = "seckill_lottery_answer_delay_seconds";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// One metric's type, unit and `# HELP` text.
pub(crate) struct Described {
    pub name: &'static str,
    pub kind: Kind,
    pub unit: Option<Unit>,
    pub help: &'static str,
}

const fn m(name: &'static str, kind: Kind, unit: Option<Unit>, help: &'static str) -> Described {
    Described {
        name,
        kind,
        unit,
        help,
    }
}

/// Every metric the service records (a unit test checks that no const is missing).
#[rustfmt::skip]
pub(crate) const DESCRIBED: &[Described] = &[
    m(ADMISSIONS, Kind::Counter, None,
        "Grab attempts by outcome: admitted, sold_out, already_ordered, not_started, ended, not_loaded, not_found (no such sale, answered from the instance's memory), stale (the sale's state predates the server's term and is being rebuilt), corrupt, held (a new term not opened yet), fenced (the sale was rebuilt on another Redis server), rate_limited, redis_error, not_ready (not tried: no order-id lease yet, or the shopper's earlier 202 is being recovered), entered (a lottery entry held until the draw), drawing (a segmented lottery's segment not rebuilt after its draw yet), evicting (the Redis server's maxmemory-policy may evict keys: nothing decided). Those answered at the edge are counted here too."),
    m(EDGE_ANSWERS, Kind::Counter, None,
        "Grabs this instance answered by itself from what Redis last told it, without asking Redis, by outcome: sold_out, not_started, ended, not_found."),
    m(SALE_CHANGES_HEARD, Kind::Counter, None,
        "Announcements that a sale's state changed (a unit came back, a load, a close) this instance heard; each makes it forget what it remembered of the sale. Flat while units come back means the subscription is not hearing them."),
    m(ADMISSION_SECONDS, Kind::Histogram, Some(Unit::Seconds),
        "Time from a grab's turn at admission to the script's answer, per grab: the wait for its shard's call in flight, then the script's round trip in Redis."),
    m(LOTTERY_ANSWER_SECONDS, Kind::Histogram, Some(Unit::Seconds),
        "Time from a lottery sale's window end to the decision of a press held in it, per held press: the draw, its record in Postgres, and the wake-up of the held presses. The contract bounds it at 0.5 s; the client's own reading comes on top."),
    m(HTTP_REQUESTS, Kind::Counter, None,
        "HTTP requests answered, by route template (\"unmatched\" for unknown paths) and status code."),
    m(HTTP_SECONDS, Kind::Histogram, Some(Unit::Seconds),
        "Time from a request's arrival to its answer's headers, by route template and status code."),
    m(SHED, Kind::Counter, None,
        "Requests refused with 503 at once because the concurrency limit was reached."),
    m(WORKER_ORDERS, Kind::Counter, None,
        "Stream entries the worker settled, by result: inserted, already_there, dead_lettered, adopted (an order the fence refused as stale, or whose entry Redis lost, admitted again into its sale's current state)."),
    m(WORKER_BATCH_SIZE, Kind::Histogram, Some(Unit::Count),
        "Stream entries per batch the worker wrote to Postgres in one transaction."),
    m(WORKER_COMMIT_SECONDS, Kind::Histogram, Some(Unit::Seconds),
        "Time to write one batch of orders to Postgres, commit included."),
    m(WORKER_BATCH_ERRORS, Kind::Counter, None,
        "Worker turns that failed (the batch stays pending and is retried)."),
    m(WORKER_SCHEMA_ERRORS, Kind::Counter, None,
        "Worker turns that failed because the database schema is newer or older than the worker expects (a NOT NULL column it does not fill, a column or table it names missing): the batch stays pending and is retried, nothing is dead-lettered."),
    m(DEPENDENCY_ERRORS, Kind::Counter, None,
        "Errors of a dependency (redis, postgres, other) seen in the api or the worker."),
    m(DEAD_LETTERED, Kind::Counter, None,
        "Stream entries dead-lettered, by kind: malformed, poison, rejected (their units go back on sale), no_stock (Postgres had no unit: an admitted order not written, nothing returned), duplicate_id (its order id belongs to another order: an admitted order not written, its unit goes back on sale), stale_epoch (admitted by a Redis state that is no longer its sale's, an old primary after a failover: never an order, no unit taken)."),
    m(DEAD_LETTERS, Kind::Gauge, None,
        "Entries in the dead-letter stream, per shard, sampled at scrape time."),
    m(STREAM_LENGTH, Kind::Gauge, None,
        "Entries in the order stream, per shard, sampled at scrape time."),
    m(STREAM_PENDING, Kind::Gauge, None,
        "Order stream entries delivered to a worker and not yet acknowledged, per shard, sampled at scrape time."),
    m(STREAM_LAG, Kind::Gauge, None,
        "Order stream entries not yet delivered to any worker, per shard, sampled at scrape time."),
    m(TRANSITIONS, Kind::Counter, None,
        "Order transitions made, by new status: paid, used, refunding, refunded, cancelled, expired."),
    m(PAYMENT_NOTIFICATIONS, Kind::Counter, None,
        "Payment provider notifications, by outcome (each counted when first recorded): paid, late_payment, already_paid, amount_mismatch, awaiting_order, no_order, refunded, not_refunding, id_conflict (its transaction or event id recorded for another order: refused, kept); refused and not recorded: bad_signature, malformed."),
    m(UNITS_RETURNED, Kind::Counter, None,
        "Units of stock given back (cancel, expiry, refund while the sale is open), by store: postgres (order closed), redis (release made)."),
    m(RELEASES_OWED, Kind::Gauge, None,
        "Closed orders whose unit Redis has not been given back yet, sampled by each sweeper pass."),
    m(JWKS_FETCHES, Kind::Counter, None,
        "Fetches of the identity provider's key set (JWT_JWKS_URL), by outcome: ok, error, invalid."),
    m(LIVE_SNAPSHOTS, Kind::Counter, None,
        "Snapshots of all open sales the live view built (one a second while any page watches)."),
    m(LIVE_VIEWERS, Kind::Gauge, None,
        "Pages watching /live/events now."),
    m(ROLLBACKS_HEALED, Kind::Counter, None,
        "Times this process saw a Redis server in a new term (restarted, failed over or restored: it may have lost acknowledged writes) and rebuilt the sales on it from Postgres."),
    m(SALES_REBUILT, Kind::Counter, None,
        "Sales whose Redis state this process rebuilt from Postgres because it was stale (built in an earlier term of the server) or missing."),
    m(SEGMENT_UNITS_MOVED, Kind::Counter, None,
        "Units this process moved between the segments of segmented sales (credited to a segment that had run dry)."),
    m(REDIS_MAY_EVICT, Kind::Gauge, None,
        "1 while a Redis server this process uses may evict keys (maxmemory-policy other than noeviction): every grab there is refused (outcome evicting, nothing reserved) and /readyz is not ready; 0 otherwise. Read by the term watcher every second."),
    m(REDIS_MEMORY_FULL, Kind::Gauge, None,
        "1 while a Redis server this process uses is out of memory (used_memory above maxmemory, noeviction): it refuses every write, grabs included; 0 otherwise. Read by the term watcher every second."),
    m(CLOCK_SKEW, Kind::Gauge, None,
        "How far this process's own clock is ahead of Redis's (TIME), in seconds; negative: behind. No decision uses the process's clock, so a skew changes no answer; a large one means time sync is failing on its host. Read by the term watcher every second."),
    m(PROMISES_KEPT, Kind::Gauge, None,
        "202s this instance gave whose stream entry is not yet known acknowledged (written to Postgres): kept, to admit them again should Redis lose them."),
    m(PROMISES_READMITTED, Kind::Counter, None,
        "202s this instance gave that Redis lost with every copy of their entry (a failover to a lagging replica, a restart from an older snapshot), admitted again under their own ids where their sale lives: kept promises."),
    m(PROMISES_BROKEN, Kind::Counter, None,
        "202s this instance gave that Redis lost with every copy of their entry and that could not be admitted again where their sale lives (no unit left, or their user held another order): broken promises."),
];

/// Buckets of the `_seconds` histograms: sub-millisecond Redis round trips up to past
/// the default request timeout (10 s), so timed-out answers and stalled commits are not
/// all lumped into +Inf.
const SECONDS_BUCKETS: &[f64; 17] = &[
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 30.0,
    60.0,
];

/// Buckets of the batch size: powers of two, so a full batch of the default 2048 (or of
/// any power of two) lands on a bound; `WORKER_BATCH_SIZE` goes up to 10,000 (+Inf).
const BATCH_SIZE_BUCKETS: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0,
];

/// The process-wide recorder (installed on first use, with a thread doing its upkeep:
/// without it histogram samples would pile up in memory between scrapes).
pub(crate) fn handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)
                .expect("static buckets are valid")
                .set_buckets_for_metric(Matcher::Full(WORKER_BATCH_SIZE.into()), BATCH_SIZE_BUCKETS)
                .expect("static buckets are valid")
                .build_recorder();
            for d in DESCRIBED {
                let (name, unit, help) = (
                    KeyName::from_const_str(d.name),
                    d.unit,
                    SharedString::const_str(d.help),
                );
                match d.kind {
                    Kind::Counter => recorder.describe_counter(name, unit, help),
                    Kind::Gauge => recorder.describe_gauge(name, unit, help),
                    Kind::Histogram => recorder.describe_histogram(name, unit, help),
                }
            }
            let handle = recorder.handle();
            metrics::set_global_recorder(recorder).expect("no other metrics recorder is installed");
            register_known_series();
            let upkeep = handle.clone();
            std::thread::Builder::new()
                .name("metrics-upkeep".into())
                .spawn(move || loop {
                    std::thread::sleep(std::time::Duration::from_secs(5));
                    upkeep.run_upkeep();
                })
                .expect("spawn the metrics upkeep thread");
            handle
        })
        .clone()
}

/// This process's admission waits so far, as `/metrics` shows them: for each bucket of
/// [`ADMISSION_SECONDS`], its upper bound and how many waits were at most that long
/// (`+Inf` last). Kept beside the recorder's histogram by [`record_admission_wait`]:
/// reading it back from the recorder would render every series each time.
pub(crate) fn admission_waits() -> Vec<(f64, u64)> {
    let mut below = 0;
    SECONDS_BUCKETS
        .iter()
        .copied()
        .chain([f64::INFINITY])
        .zip(&ADMISSION_WAITS)
        .map(|(le, n)| {
            below += n.load(Ordering::Relaxed);
            (le, below)
        })
        .collect()
}

/// Each bucket's own count of admission waits (not cumulative; the last above every bound).
static ADMISSION_WAITS: [AtomicU64; SECONDS_BUCKETS.len() + 1] =
    [const { AtomicU64::new(0) }; SECONDS_BUCKETS.len() + 1];

/// Records one admission's wait in `histogram` ([`ADMISSION_SECONDS`]) and in the copy
/// the live view reads ([`admission_waits`]).
pub(crate) fn record_admission_wait(histogram: &metrics::Histogram, secs: f64) {
    histogram.record(secs);
    let bucket = SECONDS_BUCKETS.partition_point(|&le| le < secs);
    ADMISSION_WAITS[bucket].fetch_add(1, Ordering::Relaxed);
}

/// Records how long after its window (`secs`) a held lottery press was decided.
pub(crate) fn record_lottery_answer(secs: f64) {
    metrics::histogram!(LOTTERY_ANSWER_SECONDS).record(secs);
}

/// Registers, at zero, every series whose labels are known before anything happens
/// (registering does not change a value), and the unlabelled histograms (empty). Not
/// here: the HTTP series (their routes and statuses come with traffic) and the sampled
/// gauges, which appear once sampled: a `0` from a process that never samples them
/// (`seckill_releases_owed` in `seckill api`) would be a claim, not a count.
fn register_known_series() {
    metrics::counter!(ROLLBACKS_HEALED).increment(0);
    metrics::counter!(SALE_CHANGES_HEARD).increment(0);
    metrics::counter!(SALES_REBUILT).increment(0);
    metrics::counter!(SEGMENT_UNITS_MOVED).increment(0);
    metrics::counter!(PROMISES_BROKEN).increment(0);
    metrics::counter!(PROMISES_READMITTED).increment(0);
    // (The grab's outcomes are registered by `admission::hot`, in the processes that
    // admit.)
    for result in ["inserted", "already_there", "dead_lettered", "adopted"] {
        metrics::counter!(WORKER_ORDERS, "result" => result).increment(0);
    }
    for kind in [
        "malformed",
        "poison",
        "rejected",
        "no_stock",
        "duplicate_id",
        "stale_epoch",
    ] {
        metrics::counter!(DEAD_LETTERED, "kind" => kind).increment(0);
    }
    for (dependency, within) in [
        ("redis", "api"),
        ("postgres", "api"),
        ("redis", "worker"),
        ("postgres", "worker"),
        ("other", "worker"),
    ] {
        metrics::counter!(DEPENDENCY_ERRORS, "dependency" => dependency, "in" => within)
            .increment(0);
    }
    for to in crate::domain::OrderStatus::ALL.into_iter().skip(2) {
        metrics::counter!(TRANSITIONS, "to" => to.as_str()).increment(0);
    }
    for outcome in crate::store::payments::Outcome::ALL {
        metrics::counter!(PAYMENT_NOTIFICATIONS, "outcome" => outcome.as_str()).increment(0);
    }
    for refused in REFUSED_NOTIFICATIONS {
        metrics::counter!(PAYMENT_NOTIFICATIONS, "outcome" => refused).increment(0);
    }
    for store in ["postgres", "redis"] {
        metrics::counter!(UNITS_RETURNED, "store" => store).increment(0);
    }
    for outcome in ["ok", "error", "invalid"] {
        metrics::counter!(JWKS_FETCHES, "outcome" => outcome).increment(0);
    }
    metrics::counter!(WORKER_BATCH_ERRORS).increment(0);
    metrics::counter!(WORKER_SCHEMA_ERRORS).increment(0);
    metrics::counter!(SHED).increment(0);
    metrics::counter!(LIVE_SNAPSHOTS).increment(0);
    metrics::gauge!(LIVE_VIEWERS).increment(0.0);
    // (Set by every term watcher's look; 0 until one sees a Redis in trouble.)
    metrics::gauge!(REDIS_MAY_EVICT).increment(0.0);
    metrics::gauge!(REDIS_MEMORY_FULL).increment(0.0);
    let _ = metrics::histogram!(ADMISSION_SECONDS);
    let _ = metrics::histogram!(WORKER_BATCH_SIZE);
    let _ = metrics::histogram!(WORKER_COMMIT_SECONDS);
    let _ = metrics::histogram!(LOTTERY_ANSWER_SECONDS);
}

/// How long a scrape waits for the streams' figures (every shard together).
pub(crate) const SAMPLE_DEADLINE: std::time::Duration = std::time::Duration::from_secs(1);

/// Samples the streams (length, pending entries, lag, dead letters) into gauges; done at
/// scrape time so an API-only process reports them too. All shards within
/// [`SAMPLE_DEADLINE`], or every shard's gauges become NaN: an old figure exported
/// as current would read as "no backlog" exactly while Redis struggles.
pub(crate) async fn sample_streams<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
) -> redis::RedisResult<()> {
    let sampled = tokio::time::timeout(SAMPLE_DEADLINE, async {
        let mut all = Vec::new();
        for shard in keys.shards() {
            all.push((shard.0, crate::stream::stats(conn, keys, shard).await?));
        }
        Ok::<_, redis::RedisError>(all)
    })
    .await
    .unwrap_or_else(|_| Err(std::io::Error::from(std::io::ErrorKind::TimedOut).into()));
    let set = |shard: String, [lag, len, pending, dead]: [f64; 4]| {
        metrics::gauge!(STREAM_LAG, "shard" => shard.clone()).set(lag);
        metrics::gauge!(STREAM_LENGTH, "shard" => shard.clone()).set(len);
        metrics::gauge!(STREAM_PENDING, "shard" => shard.clone()).set(pending);
        metrics::gauge!(DEAD_LETTERS, "shard" => shard).set(dead);
    };
    match sampled {
        Ok(all) => {
            for (shard, stats) in all {
                let crate::stream::StreamStats {
                    length,
                    pending,
                    lag,
                    dead_letters,
                } = stats;
                // A lag Redis cannot tell is NaN, not 0 ("all delivered").
                let lag = lag.map_or(f64::NAN, |n| n as f64);
                set(
                    shard.to_string(),
                    [lag, length as f64, pending as f64, dead_letters as f64],
                );
            }
            Ok(())
        }
        Err(e) => {
            for shard in keys.shards() {
                set(shard.0.to_string(), [f64::NAN; 4]);
            }
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The metric-name consts of this file, read from its source.
    fn consts() -> Vec<&'static str> {
        include_str!("metrics.rs")
            .lines()
            .filter_map(|l| l.strip_prefix("pub(crate) const "))
            .filter_map(|l| l.split_once(": &str = \"")?.1.strip_suffix("\";"))
            .collect()
    }

    #[test]
    fn every_metric_const_is_described_once() {
        let consts = consts();
        assert!(consts.len() >= 21, "{consts:?}");
        for name in &consts {
            let n = DESCRIBED.iter().filter(|d| d.name == *name).count();
            assert_eq!(n, 1, "{name} is described {n} times");
        }
        assert_eq!(
            DESCRIBED.len(),
            consts.len(),
            "a description without a const"
        );
    }

    #[test]
    fn every_metric_has_its_help_and_type_in_the_rendered_output() {
        let handle = handle();
        // The series that appear only with traffic or sampling, as they would.
        metrics::counter!(HTTP_REQUESTS, "route" => "/healthz", "status" => "200").increment(1);
        metrics::histogram!(HTTP_SECONDS, "route" => "/healthz", "status" => "200").record(0.001);
        for gauge in [STREAM_LENGTH, STREAM_PENDING, STREAM_LAG, DEAD_LETTERS] {
            metrics::gauge!(gauge, "shard" => "0").set(0.0);
        }
        metrics::gauge!(RELEASES_OWED).set(0.0);
        metrics::gauge!(PROMISES_KEPT).set(0.0);
        metrics::gauge!(REDIS_MAY_EVICT).set(0.0);
        metrics::gauge!(REDIS_MEMORY_FULL).set(0.0);
        metrics::gauge!(CLOCK_SKEW).set(0.0);
        // (Registered by the admitting processes: `admission::hot`.)
        metrics::counter!(ADMISSIONS, "outcome" => "admitted").increment(0);
        metrics::counter!(EDGE_ANSWERS, "outcome" => "sold_out").increment(0);
        let text = handle.render();
        for d in DESCRIBED {
            let help = format!("# HELP {} {}\n", d.name, d.help);
            assert!(text.contains(&help), "no {help:?} in\n{text}");
            let kind = match d.kind {
                Kind::Counter => "counter",
                Kind::Gauge => "gauge",
                Kind::Histogram => "histogram",
            };
            let type_line = format!("# TYPE {} {kind}\n", d.name);
            assert!(text.contains(&type_line), "no {type_line:?} in\n{text}");
        }
    }

    #[test]
    fn counters_with_known_labels_exist_from_the_recorders_installation() {
        let text = handle().render();
        for series in [
            "seckill_dead_lettered_total{kind=\"poison\"} ",
            "seckill_dead_lettered_total{kind=\"malformed\"} ",
            "seckill_dead_lettered_total{kind=\"rejected\"} ",
            "seckill_dead_lettered_total{kind=\"no_stock\"} ",
            "seckill_dead_lettered_total{kind=\"duplicate_id\"} ",
            "seckill_dead_lettered_total{kind=\"stale_epoch\"} ",
            "seckill_worker_batch_errors_total ",
            "seckill_worker_schema_errors_total ",
            "seckill_dependency_errors_total{dependency=\"postgres\",in=\"worker\"} ",
            "seckill_order_transitions_total{to=\"expired\"} ",
            "seckill_http_shed_total ",
            "seckill_live_viewers ",
        ] {
            assert!(
                text.lines().any(|l| l.starts_with(series)),
                "{series} missing from\n{text}"
            );
        }
    }

    #[test]
    fn the_admission_waits_are_counted_in_the_recorders_buckets() {
        let before = admission_waits();
        let bounds: Vec<f64> = before.iter().map(|&(le, _)| le).collect();
        let mut want = SECONDS_BUCKETS.to_vec();
        want.push(f64::INFINITY);
        assert_eq!(bounds, want);
        record_admission_wait(&metrics::histogram!(ADMISSION_SECONDS), 0.003);
        let after = admission_waits();
        // (Other tests may record too: at least this one, in the buckets from 5 ms.)
        for ((le, was), (_, is)) in before.into_iter().zip(after) {
            assert!(is >= was + u64::from(le >= 0.005), "{le}: {was} -> {is}");
        }
    }

    #[test]
    fn the_batch_size_is_a_histogram_of_entries_not_of_seconds() {
        let handle = handle();
        metrics::histogram!(WORKER_BATCH_SIZE).record(2048.0);
        let text = handle.render();
        for line in [
            "seckill_worker_batch_size_bucket{le=\"1\"} ",
            "seckill_worker_batch_size_bucket{le=\"2048\"} ",
            "seckill_worker_batch_size_bucket{le=\"+Inf\"} ",
            "seckill_worker_batch_size_count ",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
        assert!(
            !text.contains("seckill_worker_batch_size{quantile"),
            "a summary"
        );
        assert!(!text.contains("seckill_worker_batch_size_bucket{le=\"0.0005\"}"));
    }

    /// Every `counter!`/`gauge!`/`histogram!` in the crate names its metric through a
    /// const of this file, so [`DESCRIBED`] cannot miss one.
    #[test]
    fn no_metric_is_recorded_under_a_name_that_is_not_a_const() {
        fn walk(dir: &std::path::Path, files: &mut Vec<std::path::PathBuf>) {
            for entry in std::fs::read_dir(dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    walk(&path, files);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    files.push(path);
                }
            }
        }
        let mut files = Vec::new();
        walk(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
            &mut files,
        );
        assert!(files.len() > 10);
        for file in files {
            let source = std::fs::read_to_string(&file).unwrap();
            for kind in ["counter", "gauge", "histogram"] {
                let macro_ = format!("{kind}!(");
                for (at, _) in source.match_indices(&macro_) {
                    let arg = source[at + macro_.len()..].trim_start();
                    assert!(
                        !arg.starts_with('"'),
                        "{}: {macro_} with a literal name: {}",
                        file.display(),
                        arg.lines().next().unwrap_or("")
                    );
                }
            }
        }
    }
}
