//! The Grafana dashboard against the real binary: every metric its queries use is on a
//! live `/metrics` of `seckill serve`, with a `# HELP`; the counters alerts watch exist at
//! zero before anything happened; HTTP series are labelled by route template.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::Value;
use sqlx::PgPool;

use crate::common::TestApp;

const DASHBOARD: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/deploy/grafana/dashboards/seckill.json"
);

/// The `expr` of every query of every panel (rows' panels included).
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
    out
}

/// PromQL words that are never metric names wherever they stand.
const KEYWORDS: &[&str] = &["and", "or", "unless", "bool", "offset", "atan2"];
/// Followed by a parenthesised list of label names, not of expressions.
const GROUPINGS: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];
const AGGREGATIONS: &[&str] = &[
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
];

/// The metric names a PromQL expression selects, as written (`x_bucket` stays so):
/// strings, label matchers (`{...}`), ranges (`[...]`), grouping label lists, function
/// and aggregation names, keywords, numbers and Grafana variables (`$__interval`) are not.
fn metric_names(expr: &str) -> BTreeSet<String> {
    // Blank out quoted strings, then everything inside braces and brackets.
    let mut plain = String::new();
    let (mut quote, mut escaped, mut depth) = (None, false, 0usize);
    for c in expr.chars() {
        if let Some(q) = quote {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == q {
                quote = None;
            }
            plain.push(' ');
            continue;
        }
        match c {
            '"' | '\'' | '`' => quote = Some(c),
            '{' | '[' => depth += 1,
            '}' | ']' => depth = depth.saturating_sub(1),
            _ if depth == 0 => {
                plain.push(c);
                continue;
            }
            _ => {}
        }
        plain.push(' ');
    }
    // Words, with what follows each.
    let bytes = plain.as_bytes();
    let word_char = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b':';
    let mut words: Vec<(&str, bool)> = Vec::new(); // (word, is a name rather than a number/variable)
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if word_char(b) || b == b'$' || b == b'.' {
            let start = i;
            i += 1;
            while i < bytes.len() && (word_char(bytes[i]) || bytes[i] == b'.') {
                i += 1;
            }
            let word = &plain[start..i];
            let first = word.as_bytes()[0];
            words.push((word, first.is_ascii_alphabetic() || first == b'_'));
        } else {
            if !b.is_ascii_whitespace() {
                words.push((&plain[i..i + 1], false));
            }
            i += 1;
        }
    }
    let mut names = BTreeSet::new();
    let mut skip_list = false;
    let mut list_depth = 0;
    for (k, &(word, is_name)) in words.iter().enumerate() {
        let next = words.get(k + 1).map(|w| w.0);
        if skip_list {
            // Inside `by (a, b)` and the like: label names until the closing paren.
            match word {
                "(" => list_depth += 1,
                ")" => {
                    list_depth -= 1;
                    if list_depth == 0 {
                        skip_list = false;
                    }
                }
                _ => {}
            }
            continue;
        }
        if !is_name || KEYWORDS.contains(&word) {
            continue;
        }
        if GROUPINGS.contains(&word) {
            if next == Some("(") {
                skip_list = true;
            }
            continue;
        }
        let aggregation =
            AGGREGATIONS.contains(&word) && next.is_some_and(|n| n == "by" || n == "without");
        if next == Some("(") || aggregation {
            continue;
        }
        names.insert(word.to_string());
    }
    names
}

#[test]
fn metric_names_are_read_out_of_promql_and_nothing_else_is() {
    let expr = r#"histogram_quantile(0.99, sum by (route, le) (rate(a_seconds_bucket{route!="/x{y}", s=~"5.."}[$__rate_interval])))
        / on (shard) group_left (kind) max without (instance) (b_total offset 5m) > bool 0
        and sum(c) by (le) unless count(d{k='z"'}) or topk(3, e:rule) * 1.5e3"#;
    let expected = ["a_seconds_bucket", "b_total", "c", "d", "e:rule"];
    assert_eq!(
        metric_names(expr),
        expected
            .iter()
            .map(|s| s.to_string())
            .collect::<BTreeSet<_>>()
    );
}

/// A Prometheus text exposition: sample names, `# HELP` names, `# TYPE`s.
struct Exposition {
    samples: BTreeSet<String>,
    help: BTreeSet<String>,
    types: BTreeMap<String, String>,
}

impl Exposition {
    fn parse(text: &str) -> Self {
        let mut out = Self {
            samples: BTreeSet::new(),
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
                let name = line.split(['{', ' ']).next().unwrap_or_default();
                out.samples.insert(name.to_string());
            }
        }
        out
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

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn every_metric_the_dashboard_queries_is_on_a_live_metrics_page_with_its_help(db: PgPool) {
    let queries = dashboard_queries();
    let wanted: BTreeSet<String> = queries.iter().flat_map(|q| metric_names(q)).collect();
    assert!(
        queries.len() >= 10 && wanted.len() >= 10,
        "the dashboard reads as {} queries over {wanted:?}",
        queries.len()
    );

    let app = TestApp::spawn(db).await;
    let (_serve, base) = app
        .spawn_server("serve", &[("WORKER_BLOCK_MS", "200".to_string())])
        .await;

    // Before anything happened, the counters alerts watch are there, at zero.
    let fresh = crate::common::metrics_at(&app.client, &base).await;
    for series in [
        "seckill_dead_lettered_total{kind=\"malformed\"} 0",
        "seckill_dead_lettered_total{kind=\"poison\"} 0",
        "seckill_dead_lettered_total{kind=\"rejected\"} 0",
        "seckill_worker_batch_errors_total 0",
        "seckill_dependency_errors_total{dependency=\"postgres\",in=\"worker\"} 0",
    ] {
        assert!(
            fresh.lines().any(|l| l == series),
            "{series} missing at start-up from\n{fresh}"
        );
    }

    // A small sale: two admitted, one sold out, both written by the process's worker.
    let voucher = crate::common::open_sale_at(&app.client, &base, 2).await;
    let answers = crate::common::press_all(&app, &base, voucher, [1, 2, 3], 3).await;
    let admitted = answers
        .iter()
        .filter(|(_, a)| a.as_ref().is_some_and(|(s, _)| *s == StatusCode::ACCEPTED))
        .count();
    assert_eq!(admitted, 2, "{answers:?}");
    assert_eq!(
        app.wait_for_orders(voucher, 2, Duration::from_secs(10))
            .await,
        2
    );

    // Sampled gauges (stream, releases owed) come with the scrape and the sweeper's
    // passes: wait for them, boundedly.
    let deadline = Instant::now() + Duration::from_secs(10);
    let (text, live) = loop {
        let text = crate::common::metrics_at(&app.client, &base).await;
        let live = Exposition::parse(&text);
        let all_there = wanted.iter().all(|n| live.samples.contains(n));
        if all_there || Instant::now() > deadline {
            break (text, live);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let missing: Vec<&String> = wanted
        .iter()
        .filter(|n| !live.samples.contains(*n))
        .collect();
    assert!(
        missing.is_empty(),
        "the dashboard queries {missing:?}, not on /metrics:\n{text}"
    );
    let no_help: Vec<&str> = wanted
        .iter()
        .map(|n| live.family(n))
        .filter(|f| !live.help.contains(*f))
        .collect();
    assert!(no_help.is_empty(), "no # HELP for {no_help:?} in\n{text}");
    for name in wanted.iter().filter(|n| n.ends_with("_bucket")) {
        assert_eq!(
            live.types.get(live.family(name)).map(String::as_str),
            Some("histogram"),
            "{name}"
        );
    }
    println!(
        "dashboard: {} queries, {} metric names, all present in a live /metrics",
        queries.len(),
        wanted.len()
    );
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn http_latency_is_labelled_by_route_template_so_ids_never_add_series(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let (_serve, base) = app.spawn_server("serve", &[]).await;
    let voucher = crate::common::open_sale_at(&app.client, &base, 1).await;
    let answers = crate::common::press_all(&app, &base, voucher, [7], 1).await;
    let (status, body) = answers[0].1.clone().expect("an answer");
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let order = body["order_id"].as_str().unwrap().to_string();
    // Two ids that exist and one that does not, on one route; and a path no route has.
    for path in [
        format!("/vouchers/{voucher}"),
        format!("/vouchers/{}", voucher + 1000),
        format!("/orders/{order}"),
    ] {
        app.client
            .get(format!("{base}{path}"))
            .send()
            .await
            .unwrap();
    }
    let resp = app
        .client
        .get(format!("{base}/no/such/{order}"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);

    let text = crate::common::metrics_at(&app.client, &base).await;
    for series in [
        "seckill_http_request_duration_seconds_count{route=\"/vouchers/{id}\",status=\"200\"} 1",
        "seckill_http_request_duration_seconds_count{route=\"/vouchers/{id}\",status=\"404\"} 1",
        "seckill_http_request_duration_seconds_count{route=\"/vouchers/{id}/seckill\",status=\"202\"} 1",
        "seckill_http_request_duration_seconds_count{route=\"unmatched\",status=\"404\"} 1",
        "seckill_http_requests_total{route=\"unmatched\",status=\"404\"} 1",
    ] {
        assert!(
            text.lines().any(|l| l == series),
            "{series} missing from\n{text}"
        );
    }
    assert!(
        text.lines().any(|l| l.starts_with(
            "seckill_http_request_duration_seconds_bucket{route=\"/orders/{order_id}\",status="
        )),
        "{text}"
    );
    let leaked: Vec<&str> = text
        .lines()
        .filter(|l| l.contains(&order) || l.contains(&format!("/vouchers/{voucher}")))
        .collect();
    assert!(leaked.is_empty(), "ids in labels: {leaked:?}");
}
