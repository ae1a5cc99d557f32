//! The p99 admission wait of the live view: this process's own, from the buckets of
//! `seckill_admission_duration_seconds` (all sales together; a copy kept beside the
//! recorder's, cheap to read) sampled once a second, watched or not, so that a page's
//! first snapshot has it.

use std::collections::VecDeque;
use std::time::Instant;

use super::RATE_WINDOW;

/// The recorder's cumulative buckets, as sampled over the last [`RATE_WINDOW`].
#[derive(Default)]
pub(super) struct Waits(VecDeque<(Instant, Vec<(f64, u64)>)>);

impl Waits {
    /// Samples this process's admission waits now (`metrics::admission_waits`).
    pub(super) fn sample(&mut self, now: Instant) {
        self.keep(now, crate::metrics::admission_waits());
    }

    fn keep(&mut self, now: Instant, buckets: Vec<(f64, u64)>) {
        self.0.push_back((now, buckets));
        while self
            .0
            .front()
            .is_some_and(|(t, _)| now.duration_since(*t) > RATE_WINDOW)
        {
            self.0.pop_front();
        }
    }

    /// The 99th percentile of the waits between the first sample and the last, in
    /// milliseconds to a hundredth; `None` without a wait then.
    pub(super) fn p99_ms(&self) -> Option<f64> {
        let ((_, first), (_, last)) = (self.0.front()?, self.0.back()?);
        let window: Vec<(f64, u64)> = last
            .iter()
            .map(|&(le, n)| {
                let before = first.iter().find(|(b, _)| *b == le).map_or(0, |b| b.1);
                (le, n.saturating_sub(before))
            })
            .collect();
        quantile(0.99, &window).map(|secs| (secs * 1e5).round() / 100.0)
    }
}

/// The `q`-quantile of cumulative `buckets` (upper bound, count at most it; `+Inf`
/// last), as Prometheus's `histogram_quantile` estimates it: linear within a bucket,
/// the last finite bound when it falls above it. `None` without a count.
fn quantile(q: f64, buckets: &[(f64, u64)]) -> Option<f64> {
    let total = buckets.last()?.1;
    if total == 0 {
        return None;
    }
    let rank = q.clamp(0.0, 1.0) * total as f64;
    let (mut lower, mut below) = (0.0, 0);
    for &(upper, n) in buckets {
        if n as f64 >= rank && n > below {
            if upper.is_infinite() {
                return Some(lower);
            }
            return Some(lower + (upper - lower) * (rank - below as f64) / (n - below) as f64);
        }
        (lower, below) = (upper, n);
    }
    Some(lower)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_quantile_is_estimated_from_the_buckets_as_prometheus_does() {
        let inf = f64::INFINITY;
        assert_eq!(quantile(0.99, &[(0.001, 0), (inf, 0)]), None, "no wait");
        // 90 waits up to 0.5 ms, 10 between 1 and 2 ms.
        let buckets = [(0.0005, 90), (0.001, 90), (0.002, 100), (inf, 100)];
        let p99 = quantile(0.99, &buckets).unwrap();
        assert!((p99 - 0.0019).abs() < 1e-9, "{p99}");
        let p50 = quantile(0.5, &buckets).unwrap();
        assert!((p50 - 0.0005 * 50.0 / 90.0).abs() < 1e-9, "{p50}");
        // Above the last bound: the last bound.
        assert_eq!(quantile(0.99, &[(10.0, 1), (inf, 1000)]), Some(10.0));
    }

    #[test]
    fn the_p99_is_of_the_waits_within_the_window_only() {
        let inf = f64::INFINITY;
        let t0 = Instant::now();
        let mut waits = Waits::default();
        waits.keep(t0, vec![(0.001, 0), (1.0, 100), (inf, 100)]);
        assert_eq!(waits.p99_ms(), None, "one sample: no wait within it");
        // 100 waits of up to 1 ms since.
        waits.keep(
            t0 + RATE_WINDOW / 2,
            vec![(0.001, 100), (1.0, 200), (inf, 200)],
        );
        assert_eq!(waits.p99_ms(), Some(0.99));
        // The slow ones leave the window; nothing new: no wait.
        let later = t0 + RATE_WINDOW * 2;
        waits.keep(later, vec![(0.001, 100), (1.0, 200), (inf, 200)]);
        assert_eq!(waits.p99_ms(), None);
    }
}
