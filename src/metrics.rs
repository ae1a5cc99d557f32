//! Prometheus metrics: recorded with the `metrics` facade, rendered at `GET /metrics`.

use std::sync::OnceLock;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use redis::aio::ConnectionLike;

use crate::keys::Keys;

pub(crate) const ADMISSIONS: &str = "seckill_admissions_total";
pub(crate) const ADMISSION_SECONDS: &str = "seckill_admission_duration_seconds";
pub(crate) const WORKER_ORDERS: &str = "seckill_worker_orders_total";
pub(crate) const WORKER_BATCH_ERRORS: &str = "seckill_worker_batch_errors_total";
pub(crate) const DEAD_LETTERED: &str = "seckill_dead_lettered_total";
pub(crate) const STREAM_LENGTH: &str = "seckill_stream_length";
pub(crate) const STREAM_PENDING: &str = "seckill_stream_pending";
pub(crate) const DEAD_LETTERS: &str = "seckill_dead_letters";
pub(crate) const STREAM_LAG: &str = "seckill_stream_lag";
pub(crate) const HTTP_REQUESTS: &str = "seckill_http_requests_total";
pub(crate) const SHED: &str = "seckill_http_shed_total";
pub(crate) const WORKER_BATCH_SIZE: &str = "seckill_worker_batch_size";
pub(crate) const WORKER_COMMIT_SECONDS: &str = "seckill_worker_commit_seconds";
pub(crate) const DEPENDENCY_ERRORS: &str = "seckill_dependency_errors_total";
pub(crate) const TRANSITIONS: &str = "seckill_order_transitions_total";
pub(crate) const UNITS_RETURNED: &str = "seckill_units_returned_total";
pub(crate) const RELEASES_OWED: &str = "seckill_releases_owed";
/// Fetches of the identity provider's keys (`JWT_JWKS_URL`), by `outcome`: `ok`, `error`
/// (unreachable, timed out, not 2xx) or `invalid` (not a key set, too large, no usable key).
pub(crate) const JWKS_FETCHES: &str = "seckill_jwks_fetches_total";
/// Snapshots the live view's producer built (one per second while pages are open,
/// however many).
pub(crate) const LIVE_SNAPSHOTS: &str = "seckill_live_snapshots_total";
/// Pages watching `/live/events` now.
pub(crate) const LIVE_VIEWERS: &str = "seckill_live_viewers";

/// The process-wide recorder (installed on first use, with a thread doing its upkeep:
/// without it histogram samples would pile up in memory between scrapes).
pub(crate) fn handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let handle = PrometheusBuilder::new()
                .set_buckets_for_metric(
                    Matcher::Suffix("_seconds".into()),
                    &[
                        0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                    ],
                )
                .expect("static buckets are valid")
                .install_recorder()
                .expect("no other metrics recorder is installed");
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

/// Handles of the hot path's metrics, registered once: recording through them is an
/// atomic add, not a registry lookup.
pub(crate) struct HotPath {
    pub admission_seconds: metrics::Histogram,
    outcomes: [metrics::Counter; 8],
}

impl HotPath {
    pub(crate) const OUTCOMES: [&'static str; 8] = [
        "rate_limited",
        "admitted",
        "not_loaded",
        "not_started",
        "ended",
        "already_ordered",
        "sold_out",
        "redis_error",
    ];

    pub(crate) fn get() -> &'static HotPath {
        static HOT: OnceLock<HotPath> = OnceLock::new();
        HOT.get_or_init(|| {
            handle();
            HotPath {
                admission_seconds: metrics::histogram!(ADMISSION_SECONDS),
                outcomes: Self::OUTCOMES.map(|o| metrics::counter!(ADMISSIONS, "outcome" => o)),
            }
        })
    }

    pub(crate) fn outcome(&self, label: &str) -> &metrics::Counter {
        let i = Self::OUTCOMES
            .iter()
            .position(|o| *o == label)
            .unwrap_or(Self::OUTCOMES.len() - 1);
        &self.outcomes[i]
    }
}

/// Samples the streams (length, pending entries, dead letters) into gauges; done at
/// scrape time so an API-only process reports them too.
pub(crate) async fn sample_streams<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
) -> redis::RedisResult<()> {
    for shard in keys.shards() {
        let shard_label = shard.0.to_string();
        let crate::stream::StreamStats {
            length: len,
            pending,
            lag,
            dead_letters: dead,
        } = crate::stream::stats(conn, keys, shard).await?;
        metrics::gauge!(STREAM_LAG, "shard" => shard_label.clone()).set(lag as f64);
        metrics::gauge!(STREAM_LENGTH, "shard" => shard_label.clone()).set(len as f64);
        metrics::gauge!(STREAM_PENDING, "shard" => shard_label.clone()).set(pending as f64);
        metrics::gauge!(DEAD_LETTERS, "shard" => shard_label).set(dead as f64);
    }
    Ok(())
}
