//! What the metrics pages say: HTTP latency by route template, a worker's own figures,
//! and what a starting process expires first.

use super::*;

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
