//! The figures a campaign prints: faults by kind, requests by kind and answer, what the
//! checker counted, and each violation with the faults around it.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::checker::{Drawn, Verdict, Violation};
use super::history::{Kind, Phase, Record};
use super::world::Executed;

pub struct Summary<'a> {
    pub seed: u64,
    pub duration_secs: u64,
    pub planned: usize,
    pub executed: &'a [Executed],
    pub history: &'a [Record],
    pub verdict: &'a Verdict,
    pub reconcile: &'a (Option<i32>, String),
    pub admit_again: &'a [(i64, Option<f64>)],
    pub settled: bool,
}

impl Summary<'_> {
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "seed {}, {} s", self.seed, self.duration_secs);
        self.faults(&mut out);
        self.requests(&mut out);
        self.checks(&mut out);
        self.ending(&mut out);
        let v = &self.verdict.violations;
        let _ = writeln!(out, "violations: {}", v.len());
        // The faults around a violation, each list once (violations come in bursts).
        let mut shown: Vec<f64> = Vec::new();
        for violation in v {
            let _ = writeln!(out, "  [{}] {}", violation.check, violation.detail);
            let near = around(self.executed, violation);
            let starts: Vec<f64> = near.iter().map(|f| f.start_ms).collect();
            if starts != shown {
                for f in near {
                    let _ = writeln!(out, "      near: {:.1} s {}", f.start_ms / 1000.0, f.detail);
                }
                shown = starts;
            }
        }
        out
    }

    fn faults(&self, out: &mut String) {
        let mut by_kind: BTreeMap<&str, usize> = BTreeMap::new();
        for f in self.executed {
            *by_kind.entry(&f.kind).or_default() += 1;
        }
        let _ = writeln!(
            out,
            "faults: {} struck of {} planned (the rest found nothing to hit, or the run ended)",
            self.executed.len(),
            self.planned
        );
        for (kind, n) in by_kind {
            let _ = writeln!(out, "  {n:>5}  {kind}");
        }
    }

    fn requests(&self, out: &mut String) {
        let mut by: BTreeMap<(String, String), usize> = BTreeMap::new();
        for r in self.history {
            let phase = if r.phase == Phase::Probe {
                " (after the last heal)"
            } else {
                ""
            };
            *by.entry((format!("{}{phase}", r.kind.name()), r.answer_label()))
                .or_default() += 1;
        }
        let _ = writeln!(out, "requests: {}", self.history.len());
        for ((kind, answer), n) in by {
            let _ = writeln!(out, "  {n:>6}  {kind}: {answer}");
        }
    }

    /// A draw, and what the presses sent in its window were answered.
    fn lottery(&self, d: &Drawn) -> String {
        let (begin, end) = d.window_ms;
        let mut answers: BTreeMap<String, usize> = BTreeMap::new();
        for r in self.history.iter().filter(|r| {
            r.kind == Kind::Grab && r.voucher == d.voucher && (begin..end).contains(&r.sent_ms)
        }) {
            let answer = match (r.status, &r.code) {
                (Some(status), Some(code)) => format!("{status} {code}"),
                (Some(status), None) => status.to_string(),
                (None, _) => "no answer".into(),
            };
            *answers.entry(answer).or_default() += 1;
        }
        let answers: Vec<String> = answers.iter().map(|(a, n)| format!("{a}: {n}")).collect();
        format!(
            "voucher {}, window {:.1}-{:.1} s: {} winners of {} entrants; presses sent in the window: {}",
            d.voucher,
            begin / 1000.0,
            end / 1000.0,
            d.winners,
            d.entrants,
            if answers.is_empty() { "none".into() } else { answers.join(", ") }
        )
    }

    fn checks(&self, out: &mut String) {
        let v = self.verdict;
        let u = &v.unknowns;
        let _ = writeln!(
            out,
            "202s: {} (order ids promised, with already_ordered: {})",
            v.admitted, v.promised
        );
        let _ = writeln!(
            out,
            "unknowns: {} ({} named their order id): {} became an order, {} none, {} a dead letter, {} ambiguous",
            u.total, u.by_id, u.order, u.none, u.dead, u.ambiguous
        );
        let _ = writeln!(out, "lost: {}", v.lost);
        let _ = writeln!(out, "oversold: {} units", v.oversold_units);
        let _ = writeln!(out, "order ids twice: {}", v.duplicates);
        let _ = writeln!(out, "two live orders: {}", v.two_live);
        let _ = writeln!(out, "orders nobody was promised: {}", v.phantoms);
        let _ = writeln!(out, "lottery draws recorded: {}", v.draws.len());
        for d in &v.draws {
            let _ = writeln!(out, "  {}", self.lottery(d));
        }
        let dead: Vec<String> = v
            .dead_by_reason
            .iter()
            .map(|(r, n)| format!("{r} {n}"))
            .collect();
        let _ = writeln!(
            out,
            "dead letters: {}",
            if dead.is_empty() {
                "none".into()
            } else {
                dead.join(", ")
            }
        );
    }

    fn ending(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "settled (stream drained, no release owed): {}",
            self.settled
        );
        let (exit, text) = self.reconcile;
        let _ = writeln!(out, "reconcile (no --repair): exit {exit:?}");
        for line in text.lines().filter(|l| !l.trim().is_empty()).take(40) {
            let _ = writeln!(out, "  | {line}");
        }
        let _ = write!(out, "seconds to admit again:");
        for (voucher, secs) in self.admit_again {
            let shown = secs.map_or("never".to_string(), |s| format!("{s:.1}"));
            let _ = write!(out, " {voucher}: {shown};");
        }
        let _ = writeln!(out);
    }
}

/// The faults running within 10 s either side of a violation (a 202 is lost by what
/// comes after it as much as by what came before).
fn around<'a>(executed: &'a [Executed], v: &Violation) -> Vec<&'a Executed> {
    let Some(at) = v.at_ms else {
        return Vec::new();
    };
    executed
        .iter()
        .filter(|f| {
            f.start_ms <= at + 10_000.0 && f.healed_ms.unwrap_or(f64::INFINITY) >= at - 10_000.0
        })
        .collect()
}
