//! The grab's metric handles, registered once per process that admits: recording
//! through them is an atomic add, not a registry lookup. Their labels are
//! [`Outcome::LABELS`].

use std::sync::OnceLock;

use super::Outcome;
use crate::metrics::{ADMISSIONS, ADMISSION_SECONDS, EDGE_ANSWERS};

/// Handles of the hot path's metrics, registered once: recording through them is an
/// atomic add, not a registry lookup.
pub(crate) struct HotPath {
    pub admission_seconds: metrics::Histogram,
    /// Per [`Outcome::index`].
    outcomes: [metrics::Counter; Outcome::LABELS.len()],
    /// Per [`Outcome::index`], for the outcomes the edge answers.
    edge: [Option<metrics::Counter>; Outcome::LABELS.len()],
}

impl HotPath {
    /// The outcomes an instance answers at the edge ([`Outcome::describe`]).
    pub(crate) const EDGE_OUTCOMES: [Outcome; 4] = {
        const EDGE: [Outcome; 4] = [
            Outcome::SoldOut,
            Outcome::NotStarted,
            Outcome::Ended,
            Outcome::NotFound,
        ];
        let mut i = 0;
        while i < EDGE.len() {
            assert!(
                EDGE[i].describe().at_edge,
                "an outcome the edge never answers"
            );
            i += 1;
        }
        EDGE
    };

    pub(crate) fn get() -> &'static HotPath {
        static HOT: OnceLock<HotPath> = OnceLock::new();
        HOT.get_or_init(|| {
            crate::metrics::handle();
            let hot = HotPath {
                admission_seconds: metrics::histogram!(ADMISSION_SECONDS),
                outcomes: Outcome::LABELS.map(|o| metrics::counter!(ADMISSIONS, "outcome" => o)),
                edge: std::array::from_fn(|i| {
                    Self::EDGE_OUTCOMES
                        .iter()
                        .any(|o| o.index() == i)
                        .then(|| metrics::counter!(EDGE_ANSWERS, "outcome" => Outcome::LABELS[i]))
                }),
            };
            // Every series at zero from the start (registering changes no value).
            for counter in hot.outcomes.iter().chain(hot.edge.iter().flatten()) {
                counter.increment(0);
            }
            hot
        })
    }

    /// A grab answered with `outcome`.
    pub(crate) fn count(&self, outcome: &Outcome) {
        self.outcomes[outcome.index()].increment(1);
    }

    /// A grab answered at the edge with `outcome`.
    pub(crate) fn at_edge(&self, outcome: &Outcome) {
        self.count(outcome);
        if let Some(counter) = &self.edge[outcome.index()] {
            counter.increment(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process that admits shows every outcome's series, at zero, before its first
    /// grab.
    #[test]
    fn every_outcome_is_on_the_metrics_page_once_the_handles_are_made() {
        HotPath::get();
        let text = crate::metrics::handle().render();
        for label in Outcome::LABELS {
            let series = format!("seckill_admissions_total{{outcome=\"{label}\"}} ");
            assert!(
                text.lines().any(|l| l.starts_with(&series)),
                "{series} missing"
            );
        }
        for outcome in HotPath::EDGE_OUTCOMES {
            let label = Outcome::LABELS[outcome.index()];
            let series = format!("seckill_edge_answers_total{{outcome=\"{label}\"}} ");
            assert!(
                text.lines().any(|l| l.starts_with(&series)),
                "{series} missing"
            );
        }
    }
}
