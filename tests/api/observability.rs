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

#[test]
fn queries_are_read_with_their_selectors_matchers_groupings_and_quantiles() {
    let q = r#"histogram_quantile(0.99, sum by (route, le) (rate(a_seconds_bucket{route!="/x{y}", s=~"5..", k="v"}[$__rate_interval])))
        / on (shard) group_left (kind) max without (instance) (b_total offset 5m) > bool 0
        and histogram_quantile(0.5, sum(rate(c_bucket[5m]))) unless count(d{k='z"'}) or topk(3, e:rule)"#;
    let asked = asks(q);
    let asks = &asked;
    let names: Vec<&str> = asks.selectors.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        ["a_seconds_bucket", "b_total", "c_bucket", "d", "e:rule"]
    );
    let a = &asks.selectors[0];
    assert!(a.rated);
    assert_eq!(a.labels, ["route", "s", "k"]);
    assert_eq!(a.equal, [("k".to_string(), "v".to_string())]);
    assert!(!asks.selectors[1].rated);
    assert!(asks
        .groupings
        .iter()
        .any(|(l, below)| l == &["route", "le"] && below == &["a_seconds_bucket"]));
    assert!(asks.groupings.iter().any(|(l, _)| l == &["shard", "kind"]));
    assert_eq!(asks.quantiles_without_le.len(), 1, "{asks:?}");
    assert!(asks.quantiles_without_le[0].contains("c_bucket"));
    let refused = std::panic::catch_unwind(|| self::asks("sum by (le (rate(x[1m]))"));
    assert!(refused.is_err(), "a malformed query is refused");
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

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn every_metric_the_dashboard_queries_is_on_a_live_metrics_page_with_its_help(db: PgPool) {
    let queries = dashboard_queries();
    let mut asked: Vec<Asks> = queries.iter().map(|q| asks(q)).collect();
    for asks in &mut asked {
        asks.selectors
            .retain(|s| !PROMETHEUS_OWN.contains(&s.name.as_str()));
    }
    let wanted: BTreeSet<String> = asked
        .iter()
        .flat_map(|a| a.selectors.iter().map(|s| s.name.clone()))
        .collect();
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
        "seckill_dead_lettered_total{kind=\"no_stock\"} 0",
        "seckill_dead_lettered_total{kind=\"duplicate_id\"} 0",
        "seckill_worker_batch_errors_total 0",
        "seckill_worker_schema_errors_total 0",
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
        let all_there = wanted.iter().all(|n| live.samples.contains_key(n));
        if all_there || Instant::now() > deadline {
            break (text, live);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let missing: Vec<&String> = wanted
        .iter()
        .filter(|n| !live.samples.contains_key(*n))
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
    // Every label a query matches or groups by is on the series it reads, every value
    // it asks for with `=` exists, rates read counters (or a histogram's parts), and
    // quantiles keep `le`: a typo in any of them is an empty panel, not an error.
    let mut wrong = Vec::new();
    let mut checks = 0;
    for (query, asks) in queries.iter().zip(&asked) {
        for s in &asks.selectors {
            for label in &s.labels {
                checks += 1;
                if !live.has(&s.name, label, None) {
                    wrong.push(format!(
                        "{query}: no series of {} has label {label}",
                        s.name
                    ));
                }
            }
            for (label, value) in &s.equal {
                checks += 1;
                if !live.has(&s.name, label, Some(value)) {
                    wrong.push(format!(
                        "{query}: no series {}{{{label}=\"{value}\"}}",
                        s.name
                    ));
                }
            }
            if s.rated {
                checks += 1;
                let family = live.family(&s.name);
                let kind = live.types.get(family).map(String::as_str);
                let counter_like = kind == Some("counter")
                    || (family != s.name && matches!(kind, Some("histogram" | "summary")));
                if !counter_like {
                    wrong.push(format!(
                        "{query}: a rate of {} ({kind:?}), not a counter",
                        s.name
                    ));
                }
            }
        }
        for (labels, below) in &asks.groupings {
            for label in labels {
                checks += 1;
                if !below.iter().any(|name| live.has(name, label, None)) {
                    wrong.push(format!(
                        "{query}: groups by {label}, which none of {below:?} has"
                    ));
                }
            }
        }
        for q in &asks.quantiles_without_le {
            wrong.push(format!("{query}: {q} drops the le label"));
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}\nagainst\n{text}");
    println!(
        "dashboard and alerting rules: {} queries, {} metric names, {checks} label and type checks, all met by a live /metrics",
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

/// A `seckill worker` alone has figures no API process has (batches, commits, dead
/// letters): with `METRICS_BIND` it serves them, counted from its first batch.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_worker_serves_its_own_figures_on_metrics_bind(db: PgPool) {
    use crate::common::{faults, metric_value};
    let app = TestApp::spawn(db.clone()).await;
    let voucher = app.open_sale(3).await;
    for user in 1..=3 {
        let (status, body) = app.grab(voucher, user).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    }
    let port = faults::free_port();
    let _worker = faults::Process::spawn(
        "worker",
        &app.redis_url,
        app.keys.prefix(),
        &faults::database_url(&db, None),
        &[
            ("METRICS_BIND", format!("127.0.0.1:{port}")),
            ("WORKER_BLOCK_MS", "200".to_string()),
        ],
    );
    assert_eq!(
        app.wait_for_orders(voucher, 3, Duration::from_secs(20))
            .await,
        3
    );
    let base = format!("http://127.0.0.1:{port}");
    let health = app
        .client
        .get(format!("{base}/healthz"))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), StatusCode::OK);
    // The counts follow the commit by a moment: wait, boundedly.
    let deadline = Instant::now() + Duration::from_secs(10);
    let text = loop {
        let text = crate::common::metrics_at(&app.client, &base).await;
        let inserted = metric_value(&text, "seckill_worker_orders_total{result=\"inserted\"}");
        if inserted == Some(3.0) || Instant::now() > deadline {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        metric_value(&text, "seckill_worker_orders_total{result=\"inserted\"}"),
        Some(3.0),
        "{text}"
    );
    let batches = metric_value(&text, "seckill_worker_batch_size_count").unwrap_or(0.0);
    let entries = metric_value(&text, "seckill_worker_batch_size_sum").unwrap_or(0.0);
    assert!(
        batches >= 1.0 && entries == 3.0,
        "{batches} batches of {entries} entries"
    );
    assert_eq!(
        metric_value(&text, "seckill_dead_lettered_total{kind=\"no_stock\"}"),
        Some(0.0)
    );
    let other = app
        .client
        .get(format!("{base}/vouchers/1"))
        .send()
        .await
        .unwrap();
    assert_eq!(other.status(), StatusCode::NOT_FOUND, "metrics only");
}

/// Orders that fell due while no process ran are expired by a starting process's first
/// sweeper pass, before it serves anything: that pass is counted too.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn what_a_starting_process_expires_first_is_counted(db: PgPool) {
    use crate::common::metric_value;
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale_paying(3, 1).await;
    for user in 1..=3 {
        let (status, body) = app.grab(voucher, user).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    }
    app.drain().await;
    assert_eq!(app.pg_orders(voucher).await.len(), 3);
    tokio::time::sleep(Duration::from_millis(1500)).await;

    let (_serve, base) = app.spawn_server("serve", &[]).await;
    let expired = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM voucher_orders WHERE voucher_id = $1 AND status = 'expired'",
        )
        .bind(voucher)
        .fetch_one(&app.db)
        .await
        .unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while expired().await < 3 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(expired().await, 3);
    let text = crate::common::metrics_at(&app.client, &base).await;
    assert_eq!(
        metric_value(&text, "seckill_order_transitions_total{to=\"expired\"}"),
        Some(3.0),
        "{text}"
    );
}
