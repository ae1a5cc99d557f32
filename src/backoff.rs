//! Capped exponential backoff with jitter, for every retry loop (worker, upkeep).

use std::time::Duration;

/// Capped exponential backoff with jitter.
#[derive(Debug)]
pub(crate) struct Backoff {
    base: Duration,
    cap: Duration,
    attempt: u32,
}

impl Backoff {
    pub(crate) fn new(base: Duration, cap: Duration) -> Self {
        Self {
            base,
            cap,
            attempt: 0,
        }
    }

    pub(crate) fn next_delay(&mut self) -> Duration {
        let exp = self.base.saturating_mul(1 << self.attempt.min(16));
        self.attempt += 1;
        let capped = exp.min(self.cap);
        // Jitter over the upper half keeps many workers from retrying in step.
        let half = capped / 2;
        half + half.mul_f64(rand::random::<f64>())
    }

    pub(crate) fn reset(&mut self) {
        self.attempt = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_stays_under_its_cap() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        let first = b.next_delay();
        assert!(first <= Duration::from_millis(100));
        for _ in 0..30 {
            assert!(b.next_delay() <= Duration::from_secs(5));
        }
        assert!(b.next_delay() >= Duration::from_millis(2500));
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }
}
