//! A master killed mid-storm on a cluster with replicas: no 202 lost, and it heals by
//! itself.

use super::*;

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_master_killed_mid_storm_on_a_cluster_with_replicas_loses_no_202_and_heals_by_itself(
    db: PgPool,
) {
    let mut cluster = PrivateCluster::start_with_replicas(3);
    let (env, servers, bases) = start_two_servers(&cluster, &db).await;

    let jwt = JwtKeys::new(crate::common::SECRET).unwrap();
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(200)
        .build()
        .unwrap();
    // Enough units that nothing sells out: every refusal below is the failover's.
    let stock = 3000i64;
    let mut sales = Vec::new();
    for _ in 0..6 {
        sales.push(crate::common::open_sale_at(&http, &bases[0], stock).await);
    }
    let keys = seckill::keys::Keys::with_shards("", 3).unwrap();
    let victim = cluster.master_of(&keys.voucher(vid(sales[0]))).await;
    let replica = cluster.replica_of(victim).await;
    let mut on_victim = Vec::new();
    for &sale in &sales {
        if cluster.master_of(&keys.voucher(vid(sale))).await == victim {
            on_victim.push(sale);
        }
    }
    assert!(on_victim.len() < sales.len(), "sales on other masters too");
    let warm_up = warm_up_both_apis(&http, &jwt, &bases, &sales).await;

    let failover = Failover {
        victim,
        replica,
        on_victim: &on_victim,
    };
    let (mut presses, killed, promoted, restarted, rejoined) =
        storm_through_a_failover(&http, &jwt, &bases, &sales, &mut cluster, &failover).await;

    let (given, unavailable, unknown) = given_and_refusals(&presses);
    let admitted_after =
        |p: &&Press| p.sent >= killed && p.answer.as_ref().unwrap().0 == StatusCode::ACCEPTED;
    let alone: Vec<&Press> = presses
        .iter()
        .filter(admitted_after)
        .filter(|p| on_victim.contains(&p.voucher) && p.answered < restarted)
        .collect();
    assert_eq!(
        alone.len(),
        0,
        "202s on the promoted master before it had a replica again"
    );
    let elsewhere = presses
        .iter()
        .filter(admitted_after)
        .filter(|p| !on_victim.contains(&p.voucher) && p.answered < restarted)
        .count();
    presses.extend(warm_up);
    let first_admission = presses
        .iter()
        .filter(|p| on_victim.contains(&p.voucher) && p.sent >= killed)
        .filter(|p| matches!(p.answer, Some((StatusCode::ACCEPTED, _))))
        .map(|p| p.answered - killed)
        .min()
        .unwrap();

    let (all_given, lost, oversold) = written_and_oversold(&db, &sales, &given, stock).await;
    let healed = healed_counts_once_the_books_balance(&http, &bases, &env).await;
    drop(servers);

    println!(
        "cluster failover, REDIS_WAIT_REPLICAS=1: 202s {}, units {}, 202s lost {lost}, \
         oversold {oversold}, first admission after the kill {:.1} s",
        all_given.len(),
        stock * sales.len() as i64,
        first_admission.as_secs_f64(),
    );
    println!(
        "  after the kill: replica promoted {:.1} s, the killed master (restarted 2 s \
         after the promotion) replicating it {:.1} s; 503s {unavailable} ({unknown} \
         unknown); 202s on the other masters' sales until the restart {elsewhere}; \
         rollbacks healed counted {healed:?}",
        promoted.as_secs_f64(),
        rejoined.as_secs_f64(),
    );
    assert!(
        given.contains_key(&sales[0]),
        "the storm reached the victim's sale"
    );
    assert_eq!(lost, 0, "every 202 in Postgres");
    assert_eq!(oversold, 0);
    assert!(
        healed.iter().any(|h| *h >= 1.0),
        "the promotion was healed: {healed:?}"
    );
}

/// Two `serve` processes on the cluster, waiting for one replica, ready; returns their
/// environment, the processes and their base URLs.
async fn start_two_servers(
    cluster: &PrivateCluster,
    db: &PgPool,
) -> (Vec<(&'static str, String)>, Vec<Process>, Vec<String>) {
    let url = faults::database_url(db, None);
    let env = vec![
        ("DATABASE_URL", url.clone()),
        ("REDIS_CLUSTER_URLS", cluster.urls()),
        ("STREAM_SHARDS", "3".to_string()),
        ("REDIS_WAIT_REPLICAS", "1".to_string()),
    ];
    let ports = [faults::free_port(), faults::free_port()];
    let servers: Vec<Process> = ports
        .iter()
        .map(|p| {
            let mut env = env.clone();
            env.extend([
                ("BIND", format!("127.0.0.1:{p}")),
                ("WORKER_BLOCK_MS", "300".to_string()),
            ]);
            Process::spawn("serve", "redis://127.0.0.1:1", "", &url, &env)
        })
        .collect();
    let bases: Vec<String> = ports
        .iter()
        .map(|p| format!("http://127.0.0.1:{p}"))
        .collect();
    for base in &bases {
        faults::wait_ready(base).await;
    }
    (env, servers, bases)
}

async fn warm_up_both_apis(
    http: &reqwest::Client,
    jwt: &JwtKeys,
    bases: &[String],
    sales: &[i64],
) -> Vec<Press> {
    // Each API mints order ids before the storm (a fresh server's term is young, so a
    // first lease waits a few seconds): every refusal below is the failover's.
    let mut warm_up = Vec::new();
    for (i, base) in bases.iter().enumerate() {
        let began = Instant::now();
        for user in (20_000_000 + 1000 * i as i64).. {
            let p = press(http, jwt, base, sales[1], user).await;
            let admitted = matches!(p.answer, Some((StatusCode::ACCEPTED, _)));
            warm_up.push(p);
            if admitted {
                break;
            }
            assert!(
                began.elapsed() < Duration::from_secs(60),
                "{base} never admits"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    warm_up
}

/// The master killed (its port), the replica promoted in its place, and the sales the
/// victim held.
struct Failover<'a> {
    victim: u16,
    replica: u16,
    on_victim: &'a [i64],
}

/// Both APIs stormed while the victim is killed, its replica promoted, and the victim
/// restarted as its replica; returns every press, when the victim was killed, how long
/// the promotion took, when the victim restarted and how long it took to rejoin.
async fn storm_through_a_failover(
    http: &reqwest::Client,
    jwt: &JwtKeys,
    bases: &[String],
    sales: &[i64],
    cluster: &mut PrivateCluster,
    failover: &Failover<'_>,
) -> (Vec<Press>, Instant, Duration, Instant, Duration) {
    let Failover {
        victim,
        replica,
        on_victim,
    } = *failover;
    let stop = CancellationToken::new();
    let storm = {
        let (http, jwt, bases, sales, stop) = (http, jwt, bases, sales, stop.clone());
        async move {
            let mut presses = Vec::new();
            let mut next = 1i64;
            while !stop.is_cancelled() {
                // Distinct shoppers, every sale, both APIs in turn.
                let batch: Vec<(i64, i64, usize)> = (next..next + 24)
                    .map(|user| {
                        let n = user as usize;
                        (sales[n % sales.len()], user, (n / sales.len()) % 2)
                    })
                    .collect();
                next += 24;
                let got: Vec<Press> = futures::stream::iter(batch)
                    .map(|(sale, user, api)| press(http, jwt, &bases[api], sale, user))
                    .buffer_unordered(24)
                    .collect()
                    .await;
                presses.extend(got);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            presses
        }
    };
    let fault = {
        let (http, jwt, bases, stop, cluster) = (http, jwt, bases, stop.clone(), cluster);
        let sale = on_victim[0];
        async move {
            tokio::time::sleep(Duration::from_secs(2)).await;
            cluster.kill(victim);
            let killed = Instant::now();
            let promoted = cluster.wait_promoted(replica).await;
            // The promoted master alone for a while: no replica can acknowledge a grab
            // on its slots, so none may be answered 202 (WAIT runs on that node).
            tokio::time::sleep(Duration::from_secs(2)).await;
            // The killed master comes back and rejoins as the promoted one's replica.
            let restarted = Instant::now();
            cluster.restart(victim).await;
            cluster.wait_replicating(victim, replica).await;
            let rejoined = killed.elapsed();
            // Until a new shopper of a sale on the promoted node is admitted.
            let mut probes = Vec::new();
            for user in 10_000_000.. {
                let p = press(http, jwt, &bases[user as usize % 2], sale, user).await;
                let admitted = matches!(p.answer, Some((StatusCode::ACCEPTED, _)));
                probes.push(p);
                if admitted {
                    break;
                }
                assert!(
                    killed.elapsed() < Duration::from_secs(90),
                    "the sale on the killed master never admitted again: {:?}",
                    probes.last().unwrap().answer
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            tokio::time::sleep(Duration::from_secs(3)).await;
            stop.cancel();
            (killed, promoted, restarted, rejoined, probes)
        }
    };
    let (mut presses, (killed, promoted, restarted, rejoined, probes)) = tokio::join!(storm, fault);
    presses.extend(probes);
    (presses, killed, promoted, restarted, rejoined)
}

/// The orders given per sale, and the refusals (all the failover's): how many, and how
/// many of unknown outcome.
fn given_and_refusals(presses: &[Press]) -> (HashMap<i64, HashSet<i64>>, i32, i32) {
    let mut given: HashMap<i64, HashSet<i64>> = HashMap::new();
    let (mut unavailable, mut unknown) = (0, 0);
    for p in presses {
        let (status, body) = p.answer.as_ref().expect("every press answered");
        if *status == StatusCode::ACCEPTED {
            let id = body["order_id"].as_str().unwrap().parse().unwrap();
            given.entry(p.voucher).or_default().insert(id);
        } else {
            // The failover's refusals only: nothing sells out, nobody presses twice.
            assert!(status.is_server_error(), "{status} {body}");
            assert_eq!(body["error"]["code"], "unavailable", "{status} {body}");
            unavailable += 1;
            if body["error"]["outcome"] == "unknown" {
                unknown += 1;
            }
        }
    }
    (given, unavailable, unknown)
}

/// Waits for whatever the workers can write, checks each sale's books, and returns every
/// order given, how many of them Postgres lost, and how many units were oversold.
async fn written_and_oversold(
    db: &PgPool,
    sales: &[i64],
    given: &HashMap<i64, HashSet<i64>>,
    stock: i64,
) -> (HashSet<i64>, usize, i64) {
    // Whatever the workers can write, written.
    let all_given: HashSet<i64> = given.values().flatten().copied().collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    let stored: HashSet<i64> = loop {
        let ids: Vec<i64> = sqlx::query_scalar("SELECT id FROM voucher_orders")
            .fetch_all(db)
            .await
            .unwrap();
        let ids: HashSet<i64> = ids.into_iter().collect();
        if all_given.is_subset(&ids) || Instant::now() > deadline {
            break ids;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let lost = all_given.difference(&stored).count();
    let mut oversold = 0;
    for &sale in sales {
        let (active, users, pg_stock): (i64, i64, i32) = sqlx::query_as(
            "SELECT count(*), count(DISTINCT user_id), \
                 (SELECT stock FROM seckill_vouchers WHERE voucher_id = $1) \
             FROM voucher_orders WHERE voucher_id = $1 AND status IN ('created', 'paid')",
        )
        .bind(sale)
        .fetch_one(db)
        .await
        .unwrap();
        assert_eq!(users, active, "sale {sale}: no user twice");
        assert_eq!(
            pg_stock as i64,
            stock - active,
            "sale {sale}: stock = initial - orders"
        );
        let sale_given = given.get(&sale).map_or(0, HashSet::len) as i64;
        oversold += (sale_given - stock).max(0) + (active - stock).max(0);
    }
    (all_given, lost, oversold)
}

async fn healed_counts_once_the_books_balance(
    http: &reqwest::Client,
    bases: &[String],
    env: &[(&'static str, String)],
) -> Vec<f64> {
    let mut healed = Vec::new();
    for base in bases {
        let metrics = metrics_at(http, base).await;
        assert_eq!(
            metric_value(&metrics, "seckill_dead_lettered_total{kind=\"no_stock\"}"),
            Some(0.0),
            "{base}: a 202 beyond the stock"
        );
        healed.push(metric_value(&metrics, "seckill_redis_rollbacks_healed_total").unwrap());
    }
    // Healed by itself: nobody runs --repair.
    let began = Instant::now();
    loop {
        let (code, out) = reconcile(env).await;
        if code == 0 {
            assert!(out.contains("books balance"), "{out}");
            break;
        }
        assert!(
            began.elapsed() < Duration::from_secs(30),
            "never balanced:\n{out}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    healed
}
