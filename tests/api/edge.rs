//! The edge: an API instance answers presses that can win nothing (sold out, not yet
//! open, ended) from what Redis last told it, and a unit that comes back is grabbable
//! through every instance within a second, announcement or not. Two API instances (the
//! test's own, A, and a `seckill api` process, B) on one Redis and one database.

use std::ops::RangeFrom;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::Value;
use sqlx::PgPool;

use crate::common::faults::{Process, Proxy};
use crate::common::{metric_value, metrics_at, press_all, vid, TestApp};

/// How long a memory stands unconfirmed by default (`EDGE_VERDICT_TTL_MS`).
const TTL: Duration = Duration::from_millis(500);

/// Instance B: a `seckill api` process on the test's stores, believing a memory for a
/// second (the longest allowed), so that a change it sees well within that was heard,
/// not waited out.
async fn instance_b(app: &TestApp, extra: &[(&str, String)]) -> (Process, String) {
    let mut env = vec![("EDGE_VERDICT_TTL_MS", "1000".to_string())];
    env.extend_from_slice(extra);
    app.spawn_server("api", &env).await
}

/// Well within instance B's time to live.
const HEARD_WITHIN: Duration = Duration::from_millis(500);

async fn grab_at(app: &TestApp, base: &str, voucher: i64, user: i64) -> (StatusCode, Value) {
    let req = app
        .client
        .post(format!("{base}/vouchers/{voucher}/seckill"))
        .bearer_auth(app.token(user));
    app.send(req).await
}

/// Grabs `base` answered by itself so far with `outcome`.
async fn at_edge(app: &TestApp, base: &str, outcome: &str) -> f64 {
    let text = metrics_at(&app.client, base).await;
    metric_value(
        &text,
        &format!("seckill_edge_answers_total{{outcome=\"{outcome}\"}}"),
    )
    .unwrap_or(0.0)
}

/// Announcements of sale changes `base` heard so far.
async fn heard(app: &TestApp, base: &str) -> f64 {
    let text = metrics_at(&app.client, base).await;
    metric_value(&text, "seckill_sale_changes_heard_total").unwrap_or(0.0)
}

/// Presses with fresh shoppers until `base` answers one with `outcome` by itself (it
/// learned the sale's state); every answer meanwhile must be that outcome's 409.
async fn until_remembered(
    app: &TestApp,
    base: &str,
    voucher: i64,
    outcome: &str,
    users: &mut RangeFrom<i64>,
) {
    let began = Instant::now();
    loop {
        let before = at_edge(app, base, outcome).await;
        let (status, body) = grab_at(app, base, voucher, users.next().unwrap()).await;
        assert_eq!(status, StatusCode::CONFLICT, "{body}");
        assert_eq!(body["error"]["code"], outcome, "{body}");
        if at_edge(app, base, outcome).await > before {
            return;
        }
        assert!(
            began.elapsed() < Duration::from_secs(10),
            "{base} never answered {outcome} by itself"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Presses with fresh shoppers every 10 ms until one is admitted through `base`: how
/// long after `since` that was, and the order id. Every other answer must be a refusal
/// that reserved nothing.
async fn until_admitted(
    app: &TestApp,
    base: &str,
    voucher: i64,
    users: &mut RangeFrom<i64>,
    since: Instant,
) -> (Duration, String) {
    loop {
        let (status, body) = grab_at(app, base, voucher, users.next().unwrap()).await;
        match status {
            StatusCode::ACCEPTED => {
                return (since.elapsed(), body["order_id"].as_str().unwrap().into())
            }
            StatusCode::CONFLICT | StatusCode::SERVICE_UNAVAILABLE => {}
            other => panic!("unexpected {other}: {body}"),
        }
        assert!(
            since.elapsed() < Duration::from_secs(10),
            "the returned unit was never admitted through {base}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A sale of `stock` sold out through B (users 1..=stock), its orders written, and B
/// answering sold-out presses by itself. Returns the winners' order ids.
async fn sold_out_on(app: &TestApp, b: &str, sale: i64, stock: i64) -> Vec<String> {
    let mut orders = Vec::new();
    for user in 1..=stock {
        let (status, body) = grab_at(app, b, sale, user).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{body}");
        orders.push(body["order_id"].as_str().unwrap().to_string());
    }
    app.drain().await;
    until_remembered(app, b, sale, "sold_out", &mut (100..)).await;
    // A winner pressing again still hears Redis: already ordered, with their own id.
    let (status, body) = grab_at(app, b, sale, 1).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(body["error"]["code"], "already_ordered", "{body}");
    assert_eq!(body["error"]["order_id"], orders[0].as_str(), "{body}");
    orders
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_unit_cancelled_through_one_instance_is_grabbed_through_another_that_remembered_the_sale_sold_out(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let (_b, b) = instance_b(&app, &[]).await;
    let sale = app.open_sale(2).await;
    let orders = sold_out_on(&app, &b, sale, 2).await;

    let heard = heard(&app, &b).await;
    let (status, body) = app.cancel(&orders[0], 1).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (took, _) = until_admitted(&app, &b, sale, &mut (1000..), Instant::now()).await;
    println!(
        "a unit cancelled through A admitted through B {} ms later",
        took.as_millis()
    );
    assert!(took < HEARD_WITHIN, "{took:?}");
    assert!(
        self::heard(&app, &b).await > heard,
        "B heard no announcement"
    );

    // A winner pressing again through B hears Redis: already ordered, with their id.
    let (status, body) = grab_at(&app, &b, sale, 2).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(body["error"]["code"], "already_ordered", "{body}");
    assert_eq!(body["error"]["order_id"], orders[1].as_str(), "{body}");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_unit_cancelled_while_the_announcement_is_lost_is_grabbable_everywhere_within_the_bound(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let (proxy, _b, b, sale, orders) = sold_out_behind_a_proxy(&app).await;

    // B's subscription stays open but hears nothing more.
    proxy.freeze();
    let heard_before = heard(&app, &b).await;
    // B's memory expires; the next press asks Redis and B reads the sale again.
    tokio::time::sleep(TTL + Duration::from_millis(100)).await;
    let mut users = 1000..;
    until_remembered(&app, &b, sale, "sold_out", &mut users).await;

    let (status, body) = app.cancel(&orders[0], 1).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let cancelled = Instant::now();
    // The announcement did not reach B: it still answers sold out by itself...
    let before = at_edge(&app, &b, "sold_out").await;
    let (status, body) = grab_at(&app, &b, sale, users.next().unwrap()).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (StatusCode::CONFLICT, Some("sold_out"))
    );
    assert!(at_edge(&app, &b, "sold_out").await > before);
    // ...but only until its memory's time to live is over.
    let (took, _) = until_admitted(&app, &b, sale, &mut users, cancelled).await;
    println!(
        "announcement lost: the cancelled unit admitted through B {} ms after the cancel",
        took.as_millis()
    );
    assert!(took < Duration::from_secs(1), "{took:?}");
    assert_eq!(
        heard(&app, &b).await,
        heard_before,
        "the cut let an announcement through"
    );
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn an_expired_unit_is_grabbable_through_every_instance_within_a_second_of_its_return(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let (_b, b) = instance_b(&app, &[]).await;
    let sale = app.open_sale_paying(1, 1).await;
    sold_out_on(&app, &b, sale, 1).await;

    // Past the payment deadline, the sweeper expires the order and returns its unit.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let began = Instant::now();
    loop {
        if app.sweep().await.expired > 0 {
            break;
        }
        assert!(began.elapsed() < Duration::from_secs(5), "nothing expired");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (took, _) = until_admitted(&app, &b, sale, &mut (1000..), Instant::now()).await;
    println!(
        "an expired unit admitted through B {} ms after the sweeper returned it",
        took.as_millis()
    );
    assert!(took < HEARD_WITHIN, "{took:?}");
}

/// Redis says sold out while Postgres still has units (a lost write); B remembers it.
async fn wrongly_sold_out(app: &TestApp, b: &str, sale: i64) {
    let (status, body) = grab_at(app, b, sale, 1).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    app.drain().await;
    app.redis_cmd::<()>(
        redis::cmd("HSET")
            .arg(app.keys.voucher(vid(sale)))
            .arg("stock")
            .arg(0),
    )
    .await;
    until_remembered(app, b, sale, "sold_out", &mut (100..)).await;
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_repair_that_brings_units_back_is_heard_by_every_instance(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let (_b, b) = instance_b(&app, &[]).await;
    let sale = app.open_sale(3).await;
    wrongly_sold_out(&app, &b, sale).await;

    let (code, out) = app.cli_async(&["reconcile", "--repair"], &[]).await;
    assert_eq!(code, 0, "{out}");
    let repaired = Instant::now();
    let mut users = 1000..;
    let (took, _) = until_admitted(&app, &b, sale, &mut users, repaired).await;
    println!(
        "after a repair: admitted through B {} ms later",
        took.as_millis()
    );
    assert!(took < HEARD_WITHIN, "{took:?}");
    // Both units the repair brought back, and no more.
    let (status, body) = grab_at(&app, &b, sale, users.next().unwrap()).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let (status, body) = grab_at(&app, &b, sale, users.next().unwrap()).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (StatusCode::CONFLICT, Some("sold_out"))
    );
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_sale_reloaded_after_its_state_was_lost_sells_through_an_instance_that_remembered_it_sold_out(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let (_b, b) = app.spawn_server("api", &[]).await;
    let sale = app.open_sale(3).await;
    wrongly_sold_out(&app, &b, sale).await;

    // The state is lost: the next press that reaches Redis reloads it from Postgres.
    app.redis_cmd::<()>(redis::cmd("DEL").arg(app.keys.voucher(vid(sale))))
        .await;
    let lost = Instant::now();
    let (took, _) = until_admitted(&app, &b, sale, &mut (1000..), lost).await;
    println!(
        "after a reload: admitted through B {} ms later",
        took.as_millis()
    );
    // (The next press after the memory's time to live reloads the sale.)
    assert!(took < Duration::from_secs(3), "{took:?}");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_sale_closed_through_one_instance_is_ended_on_another_that_remembered_it_not_open(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let (_b, b) = instance_b(&app, &[]).await;
    let now = chrono::Utc::now();
    let sale = app
        .create_sale(
            5,
            now + chrono::Duration::hours(1),
            now + chrono::Duration::hours(2),
        )
        .await;
    let mut users = 1..;
    until_remembered(&app, &b, sale, "not_started", &mut users).await;

    let (status, body) = app
        .post_json(
            &format!("/vouchers/{sale}/close"),
            Some(&app.admin_token()),
            &serde_json::json!({}),
        )
        .await;
    assert!(status.is_success(), "{status} {body}");
    let closed = Instant::now();
    loop {
        let (status, body) = grab_at(&app, &b, sale, users.next().unwrap()).await;
        assert_eq!(status, StatusCode::CONFLICT, "{body}");
        if body["error"]["code"] == "ended" {
            break;
        }
        assert_eq!(body["error"]["code"], "not_started", "{body}");
        assert!(closed.elapsed() < HEARD_WITHIN, "B still says not started");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    println!(
        "a close through A heard by B {} ms later",
        closed.elapsed().as_millis()
    );
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_sale_opening_while_an_instance_is_stormed_admits_nobody_early_and_opens_on_time(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let (_b, b) = app.spawn_server("api", &[]).await;
    let begin = chrono::Utc::now() + chrono::Duration::milliseconds(2500);
    let sale = app
        .create_sale(5, begin, begin + chrono::Duration::hours(1))
        .await;
    let begin_ms: i64 = app
        .redis_cmd::<Option<String>>(
            redis::cmd("HGET")
                .arg(app.keys.voucher(vid(sale)))
                .arg("begin_ms"),
        )
        .await
        .map(|v| v.parse().unwrap())
        .unwrap_or(begin.timestamp_millis());

    // Eight shoppers' streams of fresh presses until well after the opening.
    let until = Instant::now() + Duration::from_millis(4000);
    let presses = (0..8).map(|lane| {
        let (app, b) = (&app, b.as_str());
        async move {
            let mut answers = Vec::new();
            let mut user = 10_000 + lane * 100_000;
            while Instant::now() < until {
                user += 1;
                let (status, body) = grab_at(app, b, sale, user).await;
                answers.push((status, body));
            }
            answers
        }
    });
    let answers: Vec<(StatusCode, Value)> = futures::future::join_all(presses)
        .await
        .into_iter()
        .flatten()
        .collect();
    let admitted = answers
        .iter()
        .filter(|(s, _)| *s == StatusCode::ACCEPTED)
        .count();
    for (status, body) in &answers {
        assert!(
            *status == StatusCode::ACCEPTED
                || (*status == StatusCode::CONFLICT
                    && ["not_started", "sold_out"]
                        .contains(&body["error"]["code"].as_str().unwrap())),
            "{status} {body}"
        );
    }
    assert_eq!(admitted, 5, "every unit sold once the sale opened");

    // Redis's clock stamped each admission: none before the opening, the first soon after.
    let entries: Vec<(String, Vec<(String, String)>)> = app
        .redis_cmd(
            redis::cmd("XRANGE")
                .arg(app.keys.stream(app.keys.shard_of(vid(sale))))
                .arg("-")
                .arg("+"),
        )
        .await;
    // An entry holds one admission call's orders, each admitted at the entry's time.
    let stamps: Vec<i64> = entries
        .iter()
        .filter(|(_, fields)| {
            fields
                .iter()
                .any(|(k, v)| k == "voucher_id" && *v == sale.to_string())
        })
        .flat_map(|(_, fields)| {
            let at: i64 = fields
                .iter()
                .find(|(k, _)| k == "admitted_ms")
                .and_then(|(_, v)| v.parse().ok())
                .expect("admitted_ms");
            let orders = fields.iter().filter(|(k, _)| k == "order_id").count();
            std::iter::repeat_n(at, orders)
        })
        .collect();
    assert_eq!(stamps.len(), 5);
    let first = *stamps.iter().min().unwrap();
    assert!(first >= begin_ms, "admitted {} ms early", begin_ms - first);
    println!(
        "opening under a storm of {} presses: first admission {} ms after the opening; {} answered not_started by B itself",
        answers.len(),
        first - begin_ms,
        at_edge(&app, &b, "not_started").await
    );
    assert!(
        first - begin_ms < 500,
        "first admission {} ms late",
        first - begin_ms
    );
    assert!(at_edge(&app, &b, "not_started").await > 0.0);
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn two_stormed_instances_with_units_coming_back_admit_exactly_the_units_there_are(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let (_b, b) = app.spawn_server("api", &[]).await;
    let sale = app.open_sale(30).await;
    let admitted = |answers: &[(i64, Option<(StatusCode, Value)>)]| {
        answers
            .iter()
            .filter_map(|(user, a)| match a {
                Some((StatusCode::ACCEPTED, body)) => {
                    Some((*user, body["order_id"].as_str().unwrap().to_string()))
                }
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    let (on_a, on_b) = tokio::join!(
        press_all(&app, &app.base, sale, 1..=200, 16),
        press_all(&app, &b, sale, 201..=400, 16),
    );
    let mut winners = admitted(&on_a);
    winners.extend(admitted(&on_b));
    assert_eq!(winners.len(), 30, "the first storm takes every unit");

    // Five winners cancel while the crowd presses on through both instances.
    app.drain().await;
    let cancels = async {
        for (user, order) in &winners[..5] {
            let (status, body) = app.cancel(order, *user).await;
            assert_eq!(status, StatusCode::OK, "{body}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let storm = async {
        let mut again = Vec::new();
        for round in 0..10 {
            let from = 1000 + round * 100;
            let (a, b_answers) = tokio::join!(
                press_all(&app, &app.base, sale, from..from + 50, 8),
                press_all(&app, &b, sale, from + 50..from + 100, 8),
            );
            again.extend(admitted(&a));
            again.extend(admitted(&b_answers));
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        again
    };
    let ((), again) = tokio::join!(cancels, storm);
    // Units the presses had not met yet by the storm's end come back to the next ones.
    let mut again = again;
    let mut users = 5000..;
    while again.len() < 5 {
        let since = Instant::now();
        let (_, order) = until_admitted(&app, &b, sale, &mut users, since).await;
        again.push((0, order));
    }
    assert_eq!(again.len(), 5, "exactly the five units that came back");
    let (status, body) = grab_at(&app, &b, sale, users.next().unwrap()).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (StatusCode::CONFLICT, Some("sold_out"))
    );

    app.drain().await;
    let live = app.assert_consistent(sale, 30).await;
    assert_eq!(
        live.len(),
        30,
        "25 first orders and the 5 that took the returned units"
    );
    let statuses = app.pg_statuses(sale).await;
    assert_eq!(statuses.get("cancelled"), Some(&5), "{statuses:?}");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_shopper_who_won_a_returned_unit_elsewhere_while_announcements_were_lost_still_hears_their_order(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let (proxy, _b, b, sale, orders) = sold_out_behind_a_proxy(&app).await;

    // B hears nothing more; a unit comes back and a fresh shopper takes it through A.
    proxy.freeze();
    let (status, body) = app.cancel(&orders[0], 1).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (_, order) = until_admitted(&app, &app.base, sale, &mut (500..), Instant::now()).await;
    let fields: Vec<(String, String)> = app
        .redis_cmd(redis::cmd("HGETALL").arg(app.keys.voucher(vid(sale))))
        .await;
    let winner: i64 = fields
        .iter()
        .find(|(_, v)| *v == order)
        .and_then(|(k, _)| k.strip_prefix("u:")?.parse().ok())
        .unwrap();

    // Once B's memory expired, it reads the sale again: sold out again, with a buyer
    // it never heard of. The winner pressing through B hears their own order.
    tokio::time::sleep(TTL + Duration::from_millis(100)).await;
    until_remembered(&app, &b, sale, "sold_out", &mut (2000..)).await;
    let (status, body) = grab_at(&app, &b, sale, winner).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(body["error"]["code"], "already_ordered", "{body}");
    assert_eq!(body["error"]["order_id"], order.as_str(), "{body}");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn an_instance_whose_subscription_drops_forgets_every_sale(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let proxy = Proxy::start(redis_addr(&app)).await;
    let (_b, b) = instance_b(&app, &[listening_through(&proxy)]).await;
    let sale = app.open_sale(3).await;
    wrongly_sold_out(&app, &b, sale).await;

    // Redis is set right without an announcement: B would believe its memory for up
    // to a second. Its subscription drops, and it forgets at once.
    app.redis_cmd::<()>(
        redis::cmd("HSET")
            .arg(app.keys.voucher(vid(sale)))
            .arg("stock")
            .arg(2),
    )
    .await;
    proxy.cut();
    let cut = Instant::now();
    let (took, _) = until_admitted(&app, &b, sale, &mut (1000..), cut).await;
    println!(
        "subscription dropped: B forgot the sale {} ms later",
        took.as_millis()
    );
    assert!(took < HEARD_WITHIN, "{took:?}");
}

/// The setting that makes an instance listen for announcements through `proxy` (which
/// a test can then freeze or cut).
/// Instance B hearing announcements through a proxy the test can freeze, and a sale of
/// two units it has seen sold out: (the proxy, B, its address, the sale, its orders).
async fn sold_out_behind_a_proxy(app: &TestApp) -> (Proxy, Process, String, i64, Vec<String>) {
    let proxy = Proxy::start(redis_addr(app)).await;
    let (b_process, b) = app.spawn_server("api", &[listening_through(&proxy)]).await;
    let sale = app.open_sale(2).await;
    let orders = sold_out_on(app, &b, sale, 2).await;
    (proxy, b_process, b, sale, orders)
}

fn listening_through(proxy: &Proxy) -> (&'static str, String) {
    ("REDIS_PUBSUB_URL", format!("redis://{}", proxy.addr))
}

fn redis_addr(app: &TestApp) -> std::net::SocketAddr {
    app.redis_url
        .trim_start_matches("redis://")
        .trim_end_matches('/')
        .parse()
        .unwrap()
}
