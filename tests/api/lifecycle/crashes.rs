//! Crashes and races at the deadline: a crash between the Postgres commit and the
//! Redis release, and cancel, pay and expiry racing with workers killed.

use super::*;

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_crash_between_the_postgres_commit_and_the_redis_release_releases_once_after_restart(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    // A worker and an API whose Redis is reached through a proxy that will be cut.
    let redis_addr: std::net::SocketAddr = "127.0.0.1:6379".parse().unwrap();
    let proxy = Proxy::start(redis_addr).await;
    let via_proxy = format!("redis://{}", proxy.addr);
    let mut worker = Process::spawn(
        "worker",
        &via_proxy,
        app.keys.prefix(),
        &database_url(&app.db, None),
        &[
            ("EXPIRY_SWEEP_MS", "100".into()),
            ("EXPIRY_BATCH", "3".into()),
        ],
    );
    let (mut api, api_base) = app
        .spawn_server("api", &[("REDIS_URL", via_proxy.clone())])
        .await;

    let (expiring, kept, cancelled) = sell_ten_to_expire_and_one_to_cancel(&app).await;

    proxy.cut();
    // The cut API commits the cancel in Postgres and cannot make the release: still a
    // 200 (Postgres decided), the release owed.
    let resp = app
        .client
        .post(format!("{api_base}/orders/{cancelled}/cancel"))
        .bearer_auth(app.token(1))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    wait_all_expired_within_5s_of_the_deadline(&app, expiring).await;
    worker.kill9();
    api.kill9();
    println!(
        "after the crash: {:?}, owed {}",
        app.pg_statuses(expiring).await,
        app.owed_releases().await
    );
    assert_eq!(app.owed_releases().await, 11, "every release still owed");
    assert_eq!(
        stocks(&app, expiring).await,
        (20, Some(10)),
        "Redis not yet told"
    );
    assert_eq!(stocks(&app, kept).await, (5, Some(4)));

    // The books explain the difference while the releases are owed.
    let (code, books) = app.cli(&["reconcile"]);
    assert_eq!(code, 0, "owed releases are not drift:\n{books}");

    a_new_worker_makes_the_owed_releases_once(&app, &proxy, expiring, kept).await;
}

/// Returns sale `expiring`, sale `kept`, and the order of `kept` to cancel.
async fn sell_ten_to_expire_and_one_to_cancel(app: &TestApp) -> (i64, i64, String) {
    // Sale `expiring`: ten unpaid orders due in 2 s. Sale `kept`: one order to cancel.
    let expiring = app.open_sale_paying(20, 2).await;
    let kept = app.open_sale(5).await;
    for user in 1..=10 {
        grab_id(app, expiring, user).await;
    }
    let cancelled = grab_id(app, kept, 1).await;
    // Written by this drain or by the worker process, whichever reads them first.
    app.drain().await;
    for (sale, n) in [(expiring, 10), (kept, 1)] {
        assert_eq!(
            app.wait_for_orders(sale, n, Duration::from_secs(10)).await,
            n
        );
    }
    assert_eq!(stocks(app, expiring).await, (10, Some(10)));
    assert_eq!(stocks(app, kept).await, (4, Some(4)));
    (expiring, kept, cancelled)
}

async fn wait_all_expired_within_5s_of_the_deadline(app: &TestApp, expiring: i64) {
    // The cut worker's sweeper commits the expiries — all of them, three per
    // transaction, within 5 s of the deadline although Redis is down — and cannot make
    // their releases.
    let last_due: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT max(pay_before) FROM voucher_orders WHERE voucher_id = $1")
            .bind(expiring)
            .fetch_one(&app.db)
            .await
            .unwrap();
    while app
        .pg_statuses(expiring)
        .await
        .get("expired")
        .copied()
        .unwrap_or(0)
        < 10
    {
        assert!(
            chrono::Utc::now() < last_due + chrono::Duration::seconds(5),
            "not expired within 5 s of the deadline with Redis down: {:?}",
            app.pg_statuses(expiring).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn a_new_worker_makes_the_owed_releases_once(
    app: &TestApp,
    proxy: &Proxy,
    expiring: i64,
    kept: i64,
) {
    // A new worker makes the owed releases, once.
    proxy.heal();
    let _worker = Process::spawn(
        "worker",
        &app.redis_url,
        app.keys.prefix(),
        &database_url(&app.db, None),
        &[("EXPIRY_SWEEP_MS", "100".into())],
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while app.owed_releases().await > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "releases never made"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(stocks(app, expiring).await, (20, Some(20)));
    assert_eq!(stocks(app, kept).await, (5, Some(5)));
    assert_eq!(app.sweep().await.returned, 0);
    let (code, books) = app.cli(&["reconcile"]);
    assert_eq!(code, 0, "{books}");
    // Every shopper is free again: 20 units, 25 shoppers, exactly 20 sold.
    let mut sold = 0;
    for user in 1..=25 {
        if app.grab(expiring, user).await.0 == StatusCode::ACCEPTED {
            sold += 1;
        }
    }
    assert_eq!(sold, 20);
}

/// What a shopper asked for, and what came back.
#[derive(Debug)]
struct Answer {
    order: String,
    action: &'static str,
    status: StatusCode,
    code: Option<String>,
}

const UNITS: i64 = 300;

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn cancel_pay_and_expiry_racing_at_the_deadline_with_workers_killed_return_each_unit_once(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    // Ten seconds to pay: room for the workers to start and write every unit before
    // the race, which begins 800 ms before the deadline.
    let voucher = app.open_sale_paying(UNITS, 10).await;
    let spawn_worker = || {
        Process::spawn(
            "worker",
            &app.redis_url,
            app.keys.prefix(),
            &database_url(&app.db, None),
            &[
                ("EXPIRY_SWEEP_MS", "50".into()),
                ("EXPIRY_BATCH", "16".into()),
                ("WORKER_CLAIM_IDLE_MS", "500".into()),
            ],
        )
    };
    let mut workers: Vec<Process> = (0..3).map(|_| spawn_worker()).collect();
    let orders = grab_every_unit(&app, voucher).await;
    let deadline: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT min(pay_before) FROM voucher_orders WHERE voucher_id = $1")
            .bind(voucher)
            .fetch_one(&app.db)
            .await
            .unwrap();
    let until = |offset_ms: i64| {
        let at = deadline + chrono::Duration::milliseconds(offset_ms);
        (at - chrono::Utc::now()).to_std().unwrap_or_default()
    };

    assert!(
        until(-800) > Duration::ZERO,
        "every unit was written only after the race should have begun"
    );
    let (answers, resold) =
        race_at_the_deadline(&app, voucher, &orders, until, &mut workers, spawn_worker).await;

    wait_until_everything_settles(&app, voucher, &resold).await;
    let (final_status, paid_ok, cancelled_ok) =
        final_statuses_matching_the_answers(&app, voucher, &answers).await;
    let statuses = app.pg_statuses(voucher).await;
    let count = |s: &str| statuses.get(s).copied().unwrap_or(0);
    let (paid, cancelled, expired) = (count("paid"), count("cancelled"), count("expired"));
    // Payments after the close: kept, refunding, their unit not taken again.
    let late = count("refunding");
    assert_eq!(
        paid + cancelled + expired + late,
        UNITS + resold.len() as i64,
        "every order final: {statuses:?}"
    );
    for id in &resold {
        assert_eq!(
            final_status[id], "expired",
            "every 202 of the live sale landed"
        );
    }
    let dead: i64 = app
        .redis_cmd(redis::cmd("XLEN").arg(app.keys.dead_letters(app.keys.shard_of(vid(voucher)))))
        .await;
    assert_eq!(dead, 0, "nothing dead-lettered: no 202 beyond stock");
    assert_eq!(
        paid as usize,
        paid_ok.len(),
        "every paid order was answered 200"
    );
    assert_eq!(cancelled as usize, cancelled_ok.len());
    let (pg_stock, redis_stock) = stocks(&app, voucher).await;
    println!(
        "race at the deadline ({} pay/cancel requests, {} units resold meanwhile, 2 of 3 \
         workers killed mid-way):\n\
         {:>6} {:>10} {:>8} {:>12} {:>9} {:>11}\n{paid:>6} {cancelled:>10} {expired:>8} {late:>12} {pg_stock:>9} {:>11}",
        answers.len(),
        resold.len(),
        "paid",
        "cancelled",
        "expired",
        "late (refunding)",
        "pg_stock",
        "redis_stock",
        redis_stock.unwrap_or(-1),
    );
    assert!(paid > 0 && cancelled > 0 && expired > 0, "{statuses:?}");
    assert_eq!(pg_stock, UNITS - paid, "postgres stock = initial - paid");
    assert_eq!(
        redis_stock,
        Some(UNITS - paid),
        "live stock = initial - paid"
    );
    let (code, books) = app.cli(&["reconcile", "--voucher", &voucher.to_string()]);
    assert_eq!(code, 0, "{books}");

    the_freed_units_sell_again_exactly(&app, voucher, paid).await;
}

/// Every unit grabbed by its own shopper and written; returns `(user, order id)` of each.
async fn grab_every_unit(app: &TestApp, voucher: i64) -> Vec<(i64, String)> {
    let grabs = crate::common::press_all(app, &app.base, voucher, 1..=UNITS, 64).await;
    let orders: Vec<(i64, String)> = grabs
        .into_iter()
        .map(|(user, answer)| {
            let (status, body) = answer.expect("an answer");
            assert_eq!(status, StatusCode::ACCEPTED, "{body}");
            (user, body["order_id"].as_str().unwrap().to_string())
        })
        .collect();
    assert_eq!(
        app.wait_for_orders(voucher, UNITS as usize, Duration::from_secs(30))
            .await,
        UNITS as usize
    );
    orders
}

/// The race around the deadline; returns every pay/cancel answer and the orders of the
/// live sale's storm meanwhile.
async fn race_at_the_deadline(
    app: &TestApp,
    voucher: i64,
    orders: &[(i64, String)],
    until: impl Fn(i64) -> Duration + Copy,
    workers: &mut Vec<Process>,
    spawn_worker: impl Fn() -> Process,
) -> (Vec<Answer>, Vec<String>) {
    use futures::StreamExt;
    // Around the deadline, per order: pay; cancel; pay and cancel at once; or nothing
    // (it expires). Some shoppers press twice. Meanwhile two workers die by SIGKILL
    // and a new one starts.
    let mut plans = Vec::new();
    for (i, (user, order)) in orders.iter().enumerate() {
        // Spread from 800 ms before to 300 ms after: cancels and expiries of one sale
        // queue on its row lock, so requests near the deadline land a little late.
        let offset = (i as i64 * 37) % 1100 - 800;
        let actions: &[&'static str] = match i % 5 {
            0 => &["pay"],
            1 => &["cancel"],
            2 => &["pay", "cancel"],
            3 => &["pay", "pay"],
            _ => &[],
        };
        for &action in actions {
            plans.push((*user, order.clone(), action, offset));
        }
    }
    let app_ref = app;
    let requests = futures::stream::iter(plans)
        .map(|(user, order, action, offset)| async move {
            tokio::time::sleep(until(offset)).await;
            // A payment is the provider's notification (of the sale's price, 5000).
            let (status, body) = if action == "pay" {
                app_ref.provider_pays(&order, 5000).await
            } else {
                let (status, _, body) = app_ref
                    .order_action(&order, action, &app_ref.token(user), None)
                    .await;
                (status, body)
            };
            Answer {
                order,
                action,
                status,
                // What a notification did, or the error's code.
                code: (body["outcome"].as_str())
                    .or(body["error"]["code"].as_str())
                    .map(String::from),
            }
        })
        .buffer_unordered(512)
        .collect::<Vec<Answer>>();
    // And a live sale meanwhile: new shoppers keep pressing while units come back.
    let storm = futures::stream::iter(1001..=1000 + 2 * UNITS)
        .map(|user| async move {
            let offset = (user * 53) % 1400 - 450; // from -450 ms to +950 ms
            tokio::time::sleep(until(offset)).await;
            let (status, body) = app_ref.grab(voucher, user).await;
            match status {
                StatusCode::ACCEPTED => Some(body["order_id"].as_str().unwrap().to_string()),
                StatusCode::CONFLICT => None,
                other => panic!("grab during the race: {other} {body}"),
            }
        })
        .buffer_unordered(512)
        .filter_map(|id| async move { id })
        .collect::<Vec<String>>();
    let killer = async {
        tokio::time::sleep(until(150)).await;
        workers[0].kill9();
        tokio::time::sleep(Duration::from_millis(40)).await;
        workers[1].kill9();
        tokio::time::sleep(Duration::from_millis(200)).await;
        workers.push(spawn_worker());
    };
    let (answers, resold, ()) = tokio::join!(requests, storm, killer);
    (answers, resold)
}

async fn wait_until_everything_settles(app: &TestApp, voucher: i64, resold: &[String]) {
    // Everything settles: every order final (the resold ones expire unpaid in turn),
    // every release made.
    let limit = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let statuses = app.pg_statuses(voucher).await;
        let total: i64 = statuses.values().sum();
        if total == UNITS + resold.len() as i64
            && !statuses.contains_key("created")
            && app.owed_releases().await == 0
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < limit,
            "never settled: {statuses:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every order's final status, each answer checked against it; returns the statuses and
/// the orders answered 200 to a payment and to a cancel.
async fn final_statuses_matching_the_answers(
    app: &TestApp,
    voucher: i64,
    answers: &[Answer],
) -> (
    std::collections::HashMap<String, String>,
    std::collections::HashSet<String>,
    std::collections::HashSet<String>,
) {
    let final_status: std::collections::HashMap<String, String> =
        sqlx::query_as::<_, (i64, String)>(
            "SELECT id, status FROM voucher_orders WHERE voucher_id = $1",
        )
        .bind(voucher)
        .fetch_all(&app.db)
        .await
        .unwrap()
        .into_iter()
        .map(|(id, s)| (id.to_string(), s))
        .collect();
    let mut paid_ok = std::collections::HashSet::new();
    let mut cancelled_ok = std::collections::HashSet::new();
    for a in answers {
        let now = &final_status[&a.order];
        let paid_late = || now == "refunding";
        match (a.action, a.status, a.code.as_deref()) {
            ("pay", StatusCode::OK, Some("paid")) => {
                assert_eq!(now, "paid", "a payment applied is paid: {a:?}");
                paid_ok.insert(a.order.clone());
            }
            // The other payment of a shopper who paid twice: money to give back.
            ("pay", StatusCode::OK, Some("already_paid")) => {
                assert!(now == "paid" || paid_late(), "{a:?} but {now}")
            }
            // After the close: kept, the order refunding, no unit taken again.
            ("pay", StatusCode::OK, Some("late_payment")) => {
                assert!(paid_late(), "{a:?} but {now}")
            }
            ("cancel", StatusCode::OK, _) if paid_late() => {}
            ("cancel", StatusCode::OK, _) => {
                assert_eq!(now, "cancelled", "a 200 cancel is cancelled: {a:?}");
                cancelled_ok.insert(a.order.clone());
            }
            ("cancel", StatusCode::CONFLICT, Some("order_paid")) => {
                assert!(now == "paid" || paid_late(), "{a:?} but {now}")
            }
            ("cancel", StatusCode::CONFLICT, Some("order_closed")) => {
                assert!(now == "expired" || paid_late(), "{a:?} but {now}")
            }
            _ => panic!("unexpected answer {a:?} (order now {now})"),
        }
    }
    assert!(
        paid_ok.is_disjoint(&cancelled_ok),
        "paid and cancelled both"
    );
    (final_status, paid_ok, cancelled_ok)
}

async fn the_freed_units_sell_again_exactly(app: &TestApp, voucher: i64, paid: i64) {
    // The freed units sell again, exactly: to the first shoppers and to new ones.
    let again = crate::common::press_all(app, &app.base, voucher, 1..=2 * UNITS, 64).await;
    let sold = again
        .iter()
        .filter(|(_, a)| a.as_ref().is_some_and(|(s, _)| *s == StatusCode::ACCEPTED))
        .count() as i64;
    assert_eq!(sold, UNITS - paid);
    let expected = UNITS as usize;
    let limit = tokio::time::Instant::now() + Duration::from_secs(30);
    while app.pg_orders(voucher).await.len() < expected {
        assert!(
            tokio::time::Instant::now() < limit,
            "resold orders never written"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(stocks(app, voucher).await, (0, Some(0)));
}
