//! Sales on a three-master Redis cluster selling exactly their stock.

use super::*;

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_dozen_sales_on_a_three_master_cluster_sell_exactly_their_stock(db: PgPool) {
    let cluster = PrivateCluster::start(3);
    let (_apis, _workers, bases) = start_apis_and_workers(&cluster, &db).await;

    let jwt = JwtKeys::new(crate::common::SECRET).unwrap();
    let http = reqwest::Client::new();
    let stock = 40i64;
    let mut vouchers = Vec::new();
    for _ in 0..12 {
        vouchers.push(crate::common::open_sale_at(&http, &bases[0], stock).await);
    }

    let (results, admitted) = storm_every_sale(&http, &jwt, &bases, &vouchers).await;

    assert_each_sale_persisted_exactly_its_stock(&db, &vouchers, &admitted, stock).await;
    cancel_each_first_buyer_and_resell_the_unit(&http, &jwt, &bases, &vouchers, &results).await;

    assert_both_live_views_agree(&http, &bases, &vouchers, stock).await;

    assert_sales_and_streams_spread_over_nodes(&cluster);
}

/// Two APIs and two workers on the cluster, ready; returns them and the APIs' base URLs.
pub(crate) async fn start_apis_and_workers(
    cluster: &PrivateCluster,
    db: &PgPool,
) -> (Vec<Process>, Vec<Process>, Vec<String>) {
    let url = faults::database_url(db, None);
    let env = |extra: Vec<(&'static str, String)>| {
        let mut env = vec![
            ("REDIS_CLUSTER_URLS", cluster.urls()),
            ("STREAM_SHARDS", "6".to_string()),
            ("WORKER_BLOCK_MS", "300".to_string()),
        ];
        env.extend(extra);
        env
    };
    let ports = [faults::free_port(), faults::free_port()];
    let _apis: Vec<Process> = ports
        .iter()
        .map(|p| {
            Process::spawn(
                "api",
                "redis://127.0.0.1:1",
                "",
                &url,
                &env(vec![("BIND", format!("127.0.0.1:{p}"))]),
            )
        })
        .collect();
    let _workers: Vec<Process> = (0..2)
        .map(|_| Process::spawn("worker", "redis://127.0.0.1:1", "", &url, &env(vec![])))
        .collect();
    let bases: Vec<String> = ports
        .iter()
        .map(|p| format!("http://127.0.0.1:{p}"))
        .collect();
    for base in &bases {
        faults::wait_ready(base).await;
    }
    (_apis, _workers, bases)
}

/// Every sale stormed at once; returns each press and the orders admitted per sale.
async fn storm_every_sale(
    http: &reqwest::Client,
    jwt: &JwtKeys,
    bases: &[String],
    vouchers: &[i64],
) -> (
    Vec<(i64, i64, StatusCode, Value)>,
    HashMap<i64, HashSet<i64>>,
) {
    // 60 shoppers per sale (each a different user), all sales at once, alternating
    // between the two APIs.
    let presses: Vec<(i64, i64, usize)> = vouchers
        .iter()
        .flat_map(|&v| (1..=60).map(move |u| (v, v * 1000 + u)))
        .enumerate()
        .map(|(i, (v, u))| (v, u, i % 2))
        .collect();
    let results: Vec<(i64, i64, StatusCode, Value)> = futures::stream::iter(presses)
        .map(|(voucher, user, api)| {
            let req = http
                .post(format!("{}/vouchers/{voucher}/seckill", bases[api]))
                .bearer_auth(jwt.mint(user, false, 600).unwrap());
            async move {
                let resp = req.send().await.unwrap();
                let status = resp.status();
                (voucher, user, status, resp.json::<Value>().await.unwrap())
            }
        })
        .buffer_unordered(64)
        .collect()
        .await;
    let mut admitted: HashMap<i64, HashSet<i64>> = HashMap::new();
    for (voucher, _, status, body) in &results {
        assert!(!status.is_server_error(), "{status} {body}");
        if *status == StatusCode::ACCEPTED {
            admitted
                .entry(*voucher)
                .or_default()
                .insert(body["order_id"].as_str().unwrap().parse().unwrap());
        } else {
            assert_eq!(body["error"]["code"], "sold_out", "{body}");
        }
    }
    (results, admitted)
}

async fn assert_each_sale_persisted_exactly_its_stock(
    db: &PgPool,
    vouchers: &[i64],
    admitted: &HashMap<i64, HashSet<i64>>,
    stock: i64,
) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    for &voucher in vouchers {
        let ids = &admitted[&voucher];
        assert_eq!(
            ids.len() as i64,
            stock,
            "voucher {voucher}: admitted = stock"
        );
        let stored = loop {
            let rows: Vec<(i64, i64)> =
                sqlx::query_as("SELECT id, user_id FROM voucher_orders WHERE voucher_id = $1")
                    .bind(voucher)
                    .fetch_all(db)
                    .await
                    .unwrap();
            if rows.len() as i64 >= stock || tokio::time::Instant::now() > deadline {
                break rows;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let stored_ids: HashSet<i64> = stored.iter().map(|(id, _)| *id).collect();
        let users: HashSet<i64> = stored.iter().map(|(_, u)| *u).collect();
        assert_eq!(&stored_ids, ids, "voucher {voucher}: persisted = admitted");
        assert_eq!(
            users.len(),
            stored.len(),
            "voucher {voucher}: no user twice"
        );
        let pg_stock: i32 =
            sqlx::query_scalar("SELECT stock FROM seckill_vouchers WHERE voucher_id = $1")
                .bind(voucher)
                .fetch_one(db)
                .await
                .unwrap();
        assert_eq!(pg_stock, 0);
    }
}

async fn cancel_each_first_buyer_and_resell_the_unit(
    http: &reqwest::Client,
    jwt: &JwtKeys,
    bases: &[String],
    vouchers: &[i64],
    results: &[(i64, i64, StatusCode, Value)],
) {
    // The lifecycle on the cluster: each sale's first buyer cancels; the unit goes back
    // to the sale's live stock on its node, and a new shopper gets it.
    let heard = |text: String| {
        crate::common::metric_value(&text, "seckill_sale_changes_heard_total").unwrap_or(0.0)
    };
    let heard_before = heard(crate::common::metrics_at(http, &bases[1]).await);
    for &voucher in vouchers {
        let (user, order) = results
            .iter()
            .find(|(v, _, s, _)| *v == voucher && *s == StatusCode::ACCEPTED)
            .map(|(_, u, _, b)| (*u, b["order_id"].as_str().unwrap().to_string()))
            .unwrap();
        let resp = http
            .post(format!("{}/orders/{order}/cancel", bases[0]))
            .bearer_auth(jwt.mint(user, false, 600).unwrap())
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::OK, "voucher {voucher}");
        let sale: Value = http
            .get(format!("{}/vouchers/{voucher}", bases[1]))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(sale["stock"], 1, "voucher {voucher}: the unit is back");
        // (The other instance may still remember the sale sold out for the moment its
        // announcement takes: fresh shoppers press until one wins.)
        let since = std::time::Instant::now();
        let mut shopper = voucher * 1000 + 900;
        loop {
            let resp = http
                .post(format!("{}/vouchers/{voucher}/seckill", bases[1]))
                .bearer_auth(jwt.mint(shopper, false, 600).unwrap())
                .send()
                .await
                .unwrap();
            if resp.status() == StatusCode::ACCEPTED {
                break;
            }
            assert_eq!(resp.status(), StatusCode::CONFLICT, "voucher {voucher}");
            assert!(
                since.elapsed() < Duration::from_secs(1),
                "voucher {voucher}: the unit never came back"
            );
            shopper += 1;
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    // Each return was announced through the cluster to the other instance (which may
    // have remembered the sale sold out), whichever node it listens to.
    let heard_after = heard(crate::common::metrics_at(http, &bases[1]).await);
    assert!(
        heard_after - heard_before >= 12.0,
        "the other instance heard {} of 12 returns",
        heard_after - heard_before
    );
}

async fn assert_both_live_views_agree(
    http: &reqwest::Client,
    bases: &[String],
    vouchers: &[i64],
    stock: i64,
) {
    // The live view of both instances: the same figures for every sale, from the
    // cluster's nodes and Postgres.
    let mut pages = [
        crate::live::Events::open(http, &bases[0]).await,
        crate::live::Events::open(http, &bases[1]).await,
    ];
    for &voucher in vouchers {
        let settled = |v: &Value| {
            v["outcomes"]["admitted"] == stock + 1
                // (and any press that met a memory not yet told of the cancel)
                && v["outcomes"]["sold_out"].as_i64() >= Some(60 - stock)
                && v["orders"]["persisted"] == stock + 1
                && v["orders"]["cancelled"] == 1
                && v["remaining"] == 0
        };
        let a = pages[0]
            .until(voucher, Duration::from_secs(30), settled)
            .await;
        let b = pages[1]
            .until(voucher, Duration::from_secs(30), settled)
            .await;
        assert_eq!(a["outcomes"], b["outcomes"], "voucher {voucher}");
        assert_eq!(a["orders"], b["orders"], "voucher {voucher}");
    }
    println!("live view: both instances show the same figures for all 12 sales");
}

fn assert_sales_and_streams_spread_over_nodes(cluster: &PrivateCluster) {
    let per_node = cluster.keys_per_node("seckill:*:voucher:*");
    println!("sale keys per node: {per_node:?}");
    assert_eq!(per_node.iter().sum::<usize>(), 12);
    assert!(
        per_node.iter().filter(|n| **n > 0).count() > 1,
        "sales spread over nodes: {per_node:?}"
    );
    let streams = cluster.keys_per_node("stream.orders:*");
    println!("streams per node: {streams:?}");
    assert!(
        streams.iter().all(|n| *n >= 2),
        "every node holds shards: {streams:?}"
    );
}
