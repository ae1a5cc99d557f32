//! Abuse limits on the seckill route: a per-user (on by default) and a per-IP (off by
//! default) rate limit.
//!
//! The limiter is in-process (`governor`'s keyed GCRA, one small map entry per active
//! key): with several API instances each enforces its own limit, so a user behind a
//! round-robin load balancer gets up to N times the rate. It costs no Redis round trip on
//! the hot path.

use std::hash::Hash;
use std::num::NonZeroU32;
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::middleware::NoOpMiddleware;
use governor::state::keyed::DashMapStateStore;
use governor::Quota;

/// How often keys whose limit is back to its fresh state are dropped: the map holds only
/// the keys seen in about the last second plus their window, whatever the churn of users.
pub(crate) const FORGET_IDLE_EVERY: Duration = Duration::from_secs(1);

/// Generic cell rate algorithm: `rate` requests per second on average, bursts of up to
/// `burst` at once. With the default clock the inner limiter is governor's
/// `DefaultKeyedRateLimiter<K>`; tests drive it with a fake clock.
pub(crate) struct RateLimiter<K: Hash + Eq + Clone, C: Clock = DefaultClock> {
    inner: governor::RateLimiter<K, DashMapStateStore<K>, C, NoOpMiddleware<C::Instant>>,
}

impl<K: Hash + Eq + Clone> RateLimiter<K> {
    /// `None` when `per_second` is 0 (the limit is off).
    pub(crate) fn new(per_second: u32, burst: u32) -> Option<Self> {
        Self::with_clock(per_second, burst, DefaultClock::default())
    }
}

impl<K: Hash + Eq + Clone, C: Clock> RateLimiter<K, C> {
    fn with_clock(per_second: u32, burst: u32, clock: C) -> Option<Self> {
        let burst = NonZeroU32::new(burst).unwrap_or(NonZeroU32::MIN);
        let quota = Quota::per_second(NonZeroU32::new(per_second)?).allow_burst(burst);
        Some(Self {
            inner: governor::RateLimiter::dashmap_with_clock(quota, clock),
        })
    }

    /// Counts one request of `key`; `Err(wait)` if it is over the limit.
    pub(crate) fn check(&self, key: &K) -> Result<(), Duration> {
        self.inner
            .check_key(key)
            .map_err(|not_until| not_until.wait_time_from(self.inner.clock().now()))
    }

    /// Drops the keys whose state is indistinguishable from a fresh one (governor never
    /// drops any by itself).
    pub(crate) fn forget_idle(&self) {
        self.inner.retain_recent();
    }

    /// Keys currently tracked (for tests: memory stays bounded).
    #[cfg(test)]
    pub(crate) fn tracked(&self) -> usize {
        self.inner.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use governor::clock::FakeRelativeClock;
    use proptest::prelude::*;

    fn limiter(rate: u32, burst: u32) -> (RateLimiter<u64, FakeRelativeClock>, FakeRelativeClock) {
        let clock = FakeRelativeClock::default();
        (
            RateLimiter::with_clock(rate, burst, clock.clone()).unwrap(),
            clock,
        )
    }

    #[test]
    fn a_burst_passes_then_the_steady_rate_applies() {
        let (limiter, clock) = limiter(10, 5);
        for _ in 0..5 {
            assert!(limiter.check(&1).is_ok());
        }
        let wait = limiter.check(&1).unwrap_err();
        assert_eq!(wait, Duration::from_millis(100));
        clock.advance(Duration::from_millis(100));
        assert!(limiter.check(&1).is_ok());
        assert!(limiter.check(&1).is_err());
        // Other users are not affected.
        assert!(limiter.check(&2).is_ok());
    }

    #[test]
    fn zero_means_off() {
        assert!(RateLimiter::<u64>::new(0, 10).is_none());
    }

    #[test]
    fn memory_stays_bounded_with_many_one_time_users() {
        let (limiter, clock) = limiter(10, 20);
        let gap = Duration::from_micros(100);
        let forget_every = 10_000; // users, i.e. one second of the fake clock
        let mut most = 0;
        for user in 0..1_000_000u64 {
            limiter.check(&user).unwrap();
            clock.advance(gap);
            if user % forget_every == 0 {
                limiter.forget_idle();
            }
            most = most.max(limiter.tracked());
        }
        // A key lives at most its window (2 x 100 ms here) past the last forgetting.
        assert!(most <= forget_every as usize + 2_000 + 1, "{most}");
    }

    proptest! {
        /// Over any window, no key gets more than burst + rate x window requests.
        #[test]
        fn never_more_than_burst_plus_rate(
            rate in 1u32..1000,
            burst in 1u32..100,
            gaps in proptest::collection::vec(0u64..50_000_000, 1..400),
        ) {
            let (limiter, clock) = limiter(rate, burst);
            let mut now = 0;
            let mut allowed = 0u64;
            for gap in gaps {
                now += gap;
                clock.advance(Duration::from_nanos(gap));
                if limiter.check(&7).is_ok() {
                    allowed += 1;
                }
            }
            let bound = burst as u64 + (now as u128 * rate as u128 / 1_000_000_000) as u64 + 1;
            prop_assert!(allowed <= bound, "{allowed} > {bound}");
        }

        /// A request refused is told how long to wait, and after that wait it passes.
        #[test]
        fn the_wait_it_names_is_enough(rate in 1u32..1000, burst in 1u32..20) {
            let (limiter, clock) = limiter(rate, burst);
            loop {
                match limiter.check(&9) {
                    Ok(()) => {}
                    Err(wait) => {
                        clock.advance(wait);
                        prop_assert!(limiter.check(&9).is_ok());
                        break;
                    }
                }
            }
        }
    }
}
