//! The Grafana dashboard against the real binary: every metric its queries use is on a
//! live `/metrics` of `seckill serve`, with a `# HELP`; the counters alerts watch exist at
//! zero before anything happened; HTTP series are labelled by route template.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::Value;
use sqlx::PgPool;

use crate::common::TestApp;

mod dashboard;
mod metrics;

const DASHBOARD: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/deploy/grafana/dashboards/seckill.json"
);

/// The `expr` of every query: every panel's (rows' panels included), every templating
/// variable's and every annotation's.
fn dashboard_queries() -> Vec<String> {
    fn walk(panels: &Value, out: &mut Vec<String>) {
        for panel in panels.as_array().into_iter().flatten() {
            for target in panel["targets"].as_array().into_iter().flatten() {
                if let Some(expr) = target["expr"].as_str() {
                    out.push(expr.to_string());
                }
            }
            walk(&panel["panels"], out);
        }
    }
    let text = std::fs::read_to_string(DASHBOARD).expect("the dashboard is in the repository");
    let dashboard: Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    for variable in dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let query = &variable["query"];
        if let Some(q) = query.as_str().or_else(|| query["query"].as_str()) {
            out.push(q.to_string());
        }
    }
    for annotation in dashboard["annotations"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if let Some(expr) = annotation["expr"].as_str() {
            out.push(expr.to_string());
        }
    }
    out.extend(alert_rules());
    out
}

const ALERTS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/prometheus/alerts.yml");

/// The `expr` of every alerting rule (one line each, as the file says).
fn alert_rules() -> Vec<String> {
    let text = std::fs::read_to_string(ALERTS).expect("the alerting rules are in the repository");
    let exprs: Vec<String> = text
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("expr:"))
        .map(|e| {
            let e = e.trim();
            assert!(
                !e.starts_with(['>', '|']),
                "{ALERTS}: keep each expr on one line: {e}"
            );
            e.trim_matches(|c| c == '\'' || c == '"').to_string()
        })
        .collect();
    let rules = text
        .lines()
        .filter(|l| l.trim_start().starts_with("- alert:"))
        .count();
    assert!(rules >= 5, "{ALERTS}: {rules} rules");
    assert_eq!(exprs.len(), rules, "{ALERTS}: one expr per rule");
    exprs
}

/// Series Prometheus makes itself rather than scraping them.
const PROMETHEUS_OWN: &[&str] = &["up"];

/// One series selector of a query: the metric, its label matchers, and whether a
/// rate-like function (`rate`, `increase`, ...) reads it, which needs a counter.
#[derive(Debug)]
struct Selector {
    name: String,
    /// `label = "value"` matchers: the value must exist, or the panel is empty.
    equal: Vec<(String, String)>,
    /// Every label a matcher names (`=`, `!=`, `=~`, `!~`).
    labels: Vec<String>,
    rated: bool,
}

/// What a query asks of the series it reads.
#[derive(Debug, Default)]
struct Asks {
    selectors: Vec<Selector>,
    /// Each `by (...)` / `without (...)` / `on (...)` list, with the metrics below it.
    groupings: Vec<(Vec<String>, Vec<String>)>,
    /// `histogram_quantile` calls whose buckets lost their `le` label on the way.
    quantiles_without_le: Vec<String>,
}

/// Parses a dashboard query (Grafana's `$__…` range variables made durations) with a
/// real PromQL parser: a query Prometheus would refuse fails here.
fn asks(query: &str) -> Asks {
    use promql_parser::parser;
    let promql = query
        .replace("$__rate_interval", "1m")
        .replace("$__interval", "1m")
        .replace("$__range", "1h");
    let ast = parser::parse(&promql).unwrap_or_else(|e| panic!("{query:?} is not PromQL: {e}"));
    let mut asks = Asks::default();
    walk(&ast, false, &mut asks);
    asks
}

fn walk(expr: &promql_parser::parser::Expr, rated: bool, out: &mut Asks) {
    use promql_parser::label::MatchOp;
    use promql_parser::parser::{Expr, LabelModifier};
    let selector = |vs: &promql_parser::parser::VectorSelector| {
        let matchers = vs
            .matchers
            .matchers
            .iter()
            .chain(vs.matchers.or_matchers.iter().flatten());
        let (mut equal, mut labels) = (Vec::new(), Vec::new());
        for m in matchers.filter(|m| m.name != "__name__") {
            labels.push(m.name.clone());
            if matches!(m.op, MatchOp::Equal) {
                equal.push((m.name.clone(), m.value.clone()));
            }
        }
        Selector {
            name: vs.name.clone().expect("every selector names its metric"),
            equal,
            labels,
            rated,
        }
    };
    let names_below = |e: &Expr| {
        let mut below = Asks::default();
        walk(e, false, &mut below);
        below.selectors.into_iter().map(|s| s.name).collect()
    };
    match expr {
        Expr::Aggregate(a) => {
            if let Some(m) = &a.modifier {
                out.groupings
                    .push((m.labels().labels.clone(), names_below(&a.expr)));
            }
            walk(&a.expr, false, out);
            if let Some(param) = &a.param {
                walk(param, false, out);
            }
        }
        Expr::Binary(b) => {
            if let Some(m) = &b.modifier {
                let mut labels: Vec<String> = m
                    .matching
                    .iter()
                    .flat_map(|l| l.labels().labels.clone())
                    .collect();
                labels.extend(m.card.labels().into_iter().flat_map(|l| l.labels.clone()));
                if !labels.is_empty() {
                    let mut below: Vec<String> = names_below(&b.lhs);
                    below.extend(names_below(&b.rhs));
                    out.groupings.push((labels, below));
                }
            }
            walk(&b.lhs, false, out);
            walk(&b.rhs, false, out);
        }
        Expr::Unary(u) => walk(&u.expr, rated, out),
        Expr::Paren(p) => walk(&p.expr, rated, out),
        Expr::Subquery(s) => walk(&s.expr, false, out),
        Expr::VectorSelector(vs) => out.selectors.push(selector(vs)),
        Expr::MatrixSelector(ms) => out.selectors.push(selector(&ms.vs)),
        Expr::Call(call) => {
            let name = call.func.name;
            if name == "histogram_quantile" {
                let mut buckets = &*call.args.args[1];
                while let Expr::Paren(p) = buckets {
                    buckets = &p.expr;
                }
                let keeps_le = match buckets {
                    Expr::Aggregate(a) => match &a.modifier {
                        Some(LabelModifier::Include(l)) => l.labels.iter().any(|l| l == "le"),
                        Some(LabelModifier::Exclude(l)) => !l.labels.iter().any(|l| l == "le"),
                        None => false,
                    },
                    _ => true,
                };
                if !keeps_le {
                    out.quantiles_without_le.push(expr.to_string());
                }
            }
            let rate_like = matches!(
                name,
                "rate" | "irate" | "increase" | "resets" | "delta" | "idelta"
            );
            // delta/idelta are for gauges; the others for counters.
            let needs_counter = rate_like && !matches!(name, "delta" | "idelta");
            for arg in &call.args.args {
                walk(arg, needs_counter, out);
            }
        }
        _ => {}
    }
}

/// A Prometheus text exposition: each sample name's label sets, `# HELP` names, `# TYPE`s.
struct Exposition {
    samples: BTreeMap<String, Vec<BTreeMap<String, String>>>,
    help: BTreeSet<String>,
    types: BTreeMap<String, String>,
}

/// `k="v",k2="v2"` (the inside of a sample's braces; values may hold `,`, `{`, `"`).
fn label_set(inside: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut rest = inside;
    while let Some((key, after)) = rest.split_once("=\"") {
        let (mut value, mut chars, mut end) = (String::new(), after.char_indices(), after.len());
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => value.extend(chars.next().map(|(_, c)| if c == 'n' { '\n' } else { c })),
                '"' => {
                    end = i + 1;
                    break;
                }
                c => value.push(c),
            }
        }
        out.insert(key.trim_start_matches(',').trim().to_string(), value);
        rest = &after[end..];
    }
    out
}

impl Exposition {
    fn parse(text: &str) -> Self {
        let mut out = Self {
            samples: BTreeMap::new(),
            help: BTreeSet::new(),
            types: BTreeMap::new(),
        };
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let name = rest.split(' ').next().unwrap_or_default();
                out.help.insert(name.to_string());
            } else if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap_or((rest, ""));
                out.types.insert(name.to_string(), kind.to_string());
            } else if !line.starts_with('#') && !line.is_empty() {
                let (name, labels) = match line.split_once('{') {
                    Some((name, rest)) => (name, label_set(&rest[..rest.rfind('}').unwrap_or(0)])),
                    None => (line.split(' ').next().unwrap_or_default(), BTreeMap::new()),
                };
                out.samples
                    .entry(name.to_string())
                    .or_default()
                    .push(labels);
            }
        }
        out
    }

    /// Whether any series of `name` has label `label` (with `value`, when given).
    fn has(&self, name: &str, label: &str, value: Option<&str>) -> bool {
        self.samples.get(name).into_iter().flatten().any(|set| {
            set.get(label)
                .is_some_and(|v| value.is_none_or(|want| want == v))
        })
    }

    /// The family a sample name belongs to: `x_bucket`, `x_sum` and `x_count` are
    /// histogram (or summary) `x`'s; any other name is its own family (a counter may
    /// end in `_count`).
    fn family<'a>(&self, name: &'a str) -> &'a str {
        for suffix in ["_bucket", "_sum", "_count"] {
            if let Some(base) = name.strip_suffix(suffix) {
                let kind = self.types.get(base).map(String::as_str);
                if matches!(kind, Some("histogram" | "summary")) {
                    return base;
                }
            }
        }
        name
    }
}
