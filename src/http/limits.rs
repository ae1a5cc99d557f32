//! Abuse limits on the seckill route: a per-user (on by default) and a per-IP (off by
//! default) rate limit.
//!
//! The limiter is in-process (GCRA, one small map entry per active key): with several
//! API instances each enforces its own limit, so a user behind a round-robin load
//! balancer gets up to N times the rate. It costs no Redis round trip on the hot path.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const SHARDS: usize = 32;
/// A shard this full sheds the entries whose window has passed before growing further.
const PURGE_ABOVE: usize = 4096;

/// Generic cell rate algorithm: `rate` requests per second on average, bursts of up to
/// `burst` at once.
pub struct RateLimiter {
    interval: u64,
    tolerance: u64,
    epoch: Instant,
    shards: Vec<Mutex<HashMap<u64, u64>>>,
}

impl RateLimiter {
    /// `None` when `per_second` is 0 (the limit is off).
    pub fn new(per_second: u32, burst: u32) -> Option<Self> {
        if per_second == 0 {
            return None;
        }
        let interval = 1_000_000_000 / per_second as u64;
        Some(Self {
            interval,
            tolerance: interval * (burst.max(1) as u64 - 1),
            epoch: Instant::now(),
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
        })
    }

    /// Counts one request of `key`; `Err(wait)` if it is over the limit.
    pub fn check(&self, key: impl Hash) -> Result<(), Duration> {
        self.check_at(key, self.epoch.elapsed().as_nanos() as u64)
    }

    fn check_at(&self, key: impl Hash, now: u64) -> Result<(), Duration> {
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        key.hash(&mut hasher);
        let hash = hasher.finish();
        let mut shard = self.shards[hash as usize % SHARDS]
            .lock()
            .expect("rate limiter poisoned");
        // TAT: the theoretical arrival time of the next request at the steady rate.
        let tat = shard.get(&hash).copied().unwrap_or(now).max(now);
        let allowed_from = tat.saturating_sub(self.tolerance);
        if now < allowed_from {
            return Err(Duration::from_nanos(allowed_from - now));
        }
        if shard.len() >= PURGE_ABOVE {
            shard.retain(|_, t| *t > now);
        }
        shard.insert(hash, tat + self.interval);
        Ok(())
    }

    /// Keys currently tracked (for tests: memory stays bounded).
    pub fn tracked(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().expect("poisoned").len())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const SEC: u64 = 1_000_000_000;

    #[test]
    fn a_burst_passes_then_the_steady_rate_applies() {
        let limiter = RateLimiter::new(10, 5).unwrap();
        for _ in 0..5 {
            assert!(limiter.check_at(1, 0).is_ok());
        }
        let wait = limiter.check_at(1, 0).unwrap_err();
        assert_eq!(wait, Duration::from_millis(100));
        assert!(limiter.check_at(1, SEC / 10).is_ok());
        assert!(limiter.check_at(1, SEC / 10).is_err());
        // Other users are not affected.
        assert!(limiter.check_at(2, 0).is_ok());
    }

    #[test]
    fn zero_means_off() {
        assert!(RateLimiter::new(0, 10).is_none());
    }

    #[test]
    fn memory_stays_bounded_with_many_one_time_users() {
        let limiter = RateLimiter::new(10, 20).unwrap();
        for user in 0..1_000_000u64 {
            limiter.check_at(user, user * 1_000).unwrap();
        }
        assert!(limiter.tracked() <= SHARDS * PURGE_ABOVE);
    }

    proptest! {
        /// Over any window, no key gets more than burst + rate x window requests.
        #[test]
        fn never_more_than_burst_plus_rate(
            rate in 1u32..1000,
            burst in 1u32..100,
            gaps in proptest::collection::vec(0u64..50_000_000, 1..400),
        ) {
            let limiter = RateLimiter::new(rate, burst).unwrap();
            let mut now = 0;
            let mut allowed = 0u64;
            for gap in gaps {
                now += gap;
                if limiter.check_at(7, now).is_ok() {
                    allowed += 1;
                }
            }
            let bound = burst as u64 + (now as u128 * rate as u128 / SEC as u128) as u64 + 1;
            prop_assert!(allowed <= bound, "{allowed} > {bound}");
        }

        /// A request refused is told how long to wait, and after that wait it passes.
        #[test]
        fn the_wait_it_names_is_enough(rate in 1u32..1000, burst in 1u32..20) {
            let limiter = RateLimiter::new(rate, burst).unwrap();
            let mut now = 0;
            loop {
                match limiter.check_at(9, now) {
                    Ok(()) => {}
                    Err(wait) => {
                        now += wait.as_nanos() as u64;
                        prop_assert!(limiter.check_at(9, now).is_ok());
                        break;
                    }
                }
            }
        }
    }
}
