//! The Grafana dashboard's queries: parsed with their selectors, and every metric they
//! query present on a live metrics page with its help.

use super::*;

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

    the_counters_alerts_watch_are_there_at_zero(&app, &base).await;

    sell_a_small_sale(&app, &base).await;

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
    let (wrong, checks) = what_the_queries_ask_that_is_wrong(&queries, &asked, &live);
    assert!(wrong.is_empty(), "{wrong:#?}\nagainst\n{text}");
    println!(
        "dashboard and alerting rules: {} queries, {} metric names, {checks} label and type checks, all met by a live /metrics",
        queries.len(),
        wanted.len()
    );
}

async fn the_counters_alerts_watch_are_there_at_zero(app: &TestApp, base: &str) {
    // Before anything happened, the counters alerts watch are there, at zero.
    let fresh = crate::common::metrics_at(&app.client, base).await;
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
}

async fn sell_a_small_sale(app: &TestApp, base: &str) {
    // A small sale: two admitted, one sold out, both written by the process's worker.
    let voucher = crate::common::open_sale_at(&app.client, base, 2).await;
    let answers = crate::common::press_all(app, base, voucher, [1, 2, 3], 3).await;
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
}

/// Each query's labels, values, rates, groupings and quantiles checked against the live
/// page; returns what is wrong and how many checks were made.
fn what_the_queries_ask_that_is_wrong(
    queries: &[String],
    asked: &[Asks],
    live: &Exposition,
) -> (Vec<String>, i32) {
    // Every label a query matches or groups by is on the series it reads, every value
    // it asks for with `=` exists, rates read counters (or a histogram's parts), and
    // quantiles keep `le`: a typo in any of them is an empty panel, not an error.
    let mut wrong = Vec::new();
    let mut checks = 0;
    for (query, asks) in queries.iter().zip(asked) {
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
    (wrong, checks)
}
