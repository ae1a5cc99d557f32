//! A lottery opening: every shopper who presses in the window is an entrant, one draw
//! picks min(stock, entrants) winners, every held press is answered with the draw's
//! result, and anyone can check the draw against the commitment published with the sale.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use chrono::Utc;
use futures::StreamExt;
use reqwest::StatusCode;
use serde_json::{json, Value};
use sqlx::PgPool;

use crate::common::faults::{database_url, postgres_addr, PrivateRedis, Process, Proxy};
use crate::common::{vid, TestApp};
use crate::live::Events;
use crate::recovery::rollback::press_through_503s;

mod crowd;
mod failover;
mod segmented;

/// A lottery sale opening `in_ms` from now with a window of `window_ms`; its voucher.
async fn lottery_sale(app: &TestApp, stock: i64, in_ms: i64, window_ms: i64) -> Value {
    let opening = json!({"mode": "lottery", "window_ms": window_ms});
    sale_opening(app, stock, in_ms, opening).await
}

/// A sale opening `in_ms` from now as `opening` says; its voucher.
async fn sale_opening(app: &TestApp, stock: i64, in_ms: i64, opening: Value) -> Value {
    sale_in_segments(app, stock, in_ms, opening, 1).await
}

/// A sale in `segments` segments opening `in_ms` from now as `opening` says; its voucher.
async fn sale_in_segments(
    app: &TestApp,
    stock: i64,
    in_ms: i64,
    opening: Value,
    segments: u8,
) -> Value {
    let begin = Utc::now() + chrono::Duration::milliseconds(in_ms);
    let body = json!({
        "shop_id": 1, "title": "drawn", "pay_value": 100, "actual_value": 200,
        "seckill": {"stock": stock, "begin_time": begin, "end_time": begin + chrono::Duration::hours(1),
                    "segments": segments, "opening": opening},
    });
    let (status, voucher) = app
        .post_json("/vouchers", Some(&app.admin_token()), &body)
        .await;
    assert_eq!(status, StatusCode::CREATED, "{voucher}");
    voucher
}

/// A time the API answered (RFC 3339).
fn time_at(v: &Value) -> chrono::DateTime<Utc> {
    chrono::DateTime::parse_from_rfc3339(v.as_str().unwrap())
        .unwrap()
        .with_timezone(&Utc)
}

/// Sleeps until `ms` after the voucher's `begin_time`.
pub(crate) async fn until_after_begin(voucher: &Value, ms: u64) {
    let at = time_at(&voucher["seckill"]["begin_time"]) + chrono::Duration::milliseconds(ms as i64);
    tokio::time::sleep((at - Utc::now()).to_std().unwrap_or_default()).await;
}

/// A user's press: its answer (`None`: none came), and how long it took.
pub(crate) type Pressed = (i64, Option<(StatusCode, Value)>, Duration);

/// Each user presses once against one of `bases` (in turn), all at once.
pub(crate) async fn press_together(
    app: &TestApp,
    bases: &[String],
    voucher: i64,
    users: impl IntoIterator<Item = i64>,
) -> Vec<Pressed> {
    let users: Vec<i64> = users.into_iter().collect();
    let n = users.len();
    futures::stream::iter(users)
        .map(|user| {
            let base = &bases[user as usize % bases.len()];
            let req = app
                .client
                .post(format!("{base}/vouchers/{voucher}/seckill"))
                .bearer_auth(app.token(user))
                .timeout(Duration::from_secs(30));
            async move {
                let sent = Instant::now();
                let answer = match req.send().await {
                    Ok(resp) => {
                        let status = resp.status();
                        resp.json::<Value>().await.ok().map(|body| (status, body))
                    }
                    Err(_) => None,
                };
                (user, answer, sent.elapsed())
            }
        })
        .buffer_unordered(n)
        .collect()
        .await
}

/// Two `seckill api` processes (the test's own runtime only sends and reads) and a
/// worker writing the draw's stream entries as the draw is recorded, as deployed; the
/// processes (killed when dropped) and the instances' base URLs.
async fn two_instances_and_a_worker(app: &TestApp) -> (Vec<Process>, [String; 2]) {
    let (one, one_base) = app.spawn_server("api", &[]).await;
    let (two, two_base) = app.spawn_server("api", &[]).await;
    (vec![one, two, worker_process(app)], [one_base, two_base])
}

/// A `seckill api` process that reaches Postgres through a proxy the test can cut: the
/// proxy, the process (killed when dropped) and its base URL.
async fn an_instance_behind_a_postgres_proxy(app: &TestApp) -> (Proxy, Process, String) {
    let postgres = Proxy::start(postgres_addr(&app.db)).await;
    let via_proxy = [("DATABASE_URL", database_url(&app.db, Some(postgres.addr)))];
    let (api, base) = app.spawn_server("api", &via_proxy).await;
    (postgres, api, base)
}

/// A `seckill worker` process of the test's database and key space.
fn worker_process(app: &TestApp) -> Process {
    Process::spawn(
        "worker",
        &app.redis_url,
        app.keys.prefix(),
        &database_url(&app.db, None),
        &[],
    )
}

/// The users whose orders for `voucher` are in Postgres once the worker has written
/// everything admitted.
async fn written_buyers(app: &TestApp, voucher: i64) -> BTreeSet<i64> {
    app.drain().await;
    let users: Vec<i64> =
        sqlx::query_scalar("SELECT user_id FROM voucher_orders WHERE voucher_id = $1")
            .bind(voucher)
            .fetch_all(&app.db)
            .await
            .unwrap();
    let buyers: BTreeSet<i64> = users.iter().copied().collect();
    assert_eq!(buyers.len(), users.len(), "one order per user");
    buyers
}

/// How many draws Postgres records for `voucher` (0 or 1).
async fn draws_recorded(app: &TestApp, voucher: i64) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM sale_draws WHERE voucher_id = $1")
        .bind(voucher)
        .fetch_one(&app.db)
        .await
        .unwrap()
}

/// `scripts/verify-draw` with `args` (asynchronously: the app answers it from this
/// test's runtime).
async fn verify_draw(args: &[&str]) -> (bool, String) {
    let out = tokio::process::Command::new("scripts/verify-draw")
        .args(args)
        .output()
        .await
        .expect("scripts/verify-draw runs");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// Users 1..=`entrants` press `voucher`'s lottery through `base` while `redis` saves a
/// snapshot 300 ms before its window ends (every entry in it, nothing drawn); each
/// answer is a 202 or `sold_out`. The winners and their order ids.
async fn press_with_a_snapshot_late_in_the_window(
    app: &TestApp,
    redis: &PrivateRedis,
    base: &str,
    voucher: &Value,
    entrants: i64,
) -> HashMap<i64, String> {
    let id = voucher["id"].as_i64().unwrap();
    let window_ms = voucher["seckill"]["opening"]["window_ms"].as_u64().unwrap();
    let snapshot = async {
        until_after_begin(voucher, window_ms - 300).await;
        redis.save();
    };
    let bases = [base.to_owned()];
    let (answers, ()) = tokio::join!(press_together(app, &bases, id, 1..=entrants), snapshot);
    let mut won = HashMap::new();
    for (user, answer, _) in answers {
        let (status, body) = answer.expect("every press is answered");
        match status {
            StatusCode::ACCEPTED => {
                won.insert(user, body["order_id"].as_str().unwrap().to_owned());
            }
            _ => assert_eq!(body["error"]["code"], "sold_out", "user {user}: {body}"),
        }
    }
    won
}

#[sqlx::test(migrations = "./migrations")]
async fn a_lottery_through_two_instances_admits_exactly_its_stock_and_anyone_can_verify_the_draw(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let (_processes, bases) = two_instances_and_a_worker(&app).await;
    let (stock, entrants, window_ms) = (50, 1_000, 3_000);
    let voucher = lottery_sale(&app, stock, 2_000, window_ms).await;
    let id = voucher["id"].as_i64().unwrap();
    assert_eq!(
        voucher["seckill"]["opening"],
        json!({"mode": "lottery", "window_ms": window_ms})
    );
    let commitment = voucher["seckill"]["draw_commitment"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(commitment.len(), 64, "{voucher}");
    let (status, before) = app.get(&format!("/vouchers/{id}/draw"), None).await;
    assert_eq!(status, StatusCode::OK, "{before}");
    assert_eq!(
        before,
        json!({"commitment": commitment, "seed": null, "entrants": [], "winners": []})
    );

    // Before the window: not started, as any sale.
    let (status, body) = app.grab(id, 999_999).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(body["error"]["code"], "not_started");
    until_after_begin(&voucher, 100).await;

    let answers = press_together(&app, &bases, id, 1..=entrants).await;
    let mut won = BTreeSet::new();
    for (user, answer, took) in &answers {
        let (status, body) = answer.as_ref().expect("every press is answered");
        assert!(
            *took <= Duration::from_millis(window_ms as u64 + 500),
            "user {user} was answered after {took:?}: {body}"
        );
        match status.as_u16() {
            202 => {
                won.insert(*user);
            }
            409 => assert_eq!(body["error"]["code"], "sold_out", "user {user}: {body}"),
            _ => panic!("user {user}: {status} {body}"),
        }
    }
    assert_eq!(won.len(), stock as usize, "exactly the stock is drawn");

    // A winner pressing again holds their order; a loser hears sold out.
    let winner = *won.iter().next().unwrap();
    let (status, body) = app.grab(id, winner).await;
    assert_eq!(body["error"]["code"], "already_ordered", "{status} {body}");
    let loser = (1..=entrants).find(|u| !won.contains(u)).unwrap();
    let (_, body) = app.grab(id, loser).await;
    assert_eq!(body["error"]["code"], "sold_out", "{body}");

    // Every winner's order is in Postgres.
    assert_eq!(written_buyers(&app, id).await, won);

    // The draw as published: the entrants (every press that reached Redis in the window:
    // on a busy machine a few may come later, and then find no unit), the winners among
    // them, the seed behind the commitment.
    let (status, draw) = app.get(&format!("/vouchers/{id}/draw"), None).await;
    assert_eq!(status, StatusCode::OK, "{draw}");
    let listed: Vec<i64> = serde_json::from_value(draw["entrants"].clone()).unwrap();
    let in_order: BTreeSet<i64> = listed.iter().copied().collect();
    assert!(
        listed.iter().copied().eq(in_order.iter().copied()),
        "in increasing order, once each"
    );
    assert!(in_order.is_subset(&(1..=entrants).collect()), "{listed:?}");
    assert!(
        listed.len() > stock as usize,
        "a draw with competition: {} entrants",
        listed.len()
    );
    let drawn: BTreeSet<i64> = serde_json::from_value(draw["winners"].clone()).unwrap();
    assert_eq!(drawn, won);
    assert!(drawn.is_subset(&in_order), "every winner entered");
    println!("{} of {entrants} presses were entries", listed.len());
    let (ok, said) = verify_draw(&[&app.url(""), &id.to_string()]).await;
    assert!(ok, "{said}");
    println!("{said}");

    // A draw with one winner changed is caught.
    let mut forged = draw.clone();
    forged["winners"][0] = json!(loser);
    let file = std::env::temp_dir().join(format!("forged-draw-{id}-{}.json", std::process::id()));
    std::fs::write(&file, forged.to_string()).unwrap();
    let (ok, said) = verify_draw(&[
        "--file",
        file.to_str().unwrap(),
        "--stock",
        &stock.to_string(),
    ])
    .await;
    std::fs::remove_file(&file).unwrap();
    assert!(!ok, "a forged draw passed: {said}");
    assert!(said.contains("winners differ"), "{said}");

    // A winner's unit given back goes on sale, first come: a loser pressing gets it.
    let order = answers
        .iter()
        .find(|(user, _, _)| *user == winner)
        .and_then(|(_, a, _)| a.as_ref()?.1["order_id"].as_str().map(str::to_owned))
        .unwrap();
    let (status, body) = app.cancel(&order, winner).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let press = app
            .client
            .post(format!("{}/vouchers/{id}/seckill", bases[1]))
            .bearer_auth(app.token(loser));
        let (status, body) = app.send(press).await;
        if status == StatusCode::ACCEPTED {
            break;
        }
        assert_eq!(body["error"]["code"], "sold_out", "{body}");
        assert!(
            Instant::now() < deadline,
            "the unit given back never sold again"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[sqlx::test(migrations = "./migrations")]
async fn a_lottery_out_of_range_already_begun_or_ending_in_its_window_is_refused_naming_the_field(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let soon = Utc::now() + chrono::Duration::minutes(5);
    let hour = chrono::Duration::hours(1);
    let cases = [
        (
            json!({"mode": "lottery", "window_ms": 99}),
            soon,
            hour,
            "seckill.opening.window_ms",
        ),
        (
            json!({"mode": "lottery", "window_ms": 10_001}),
            soon,
            hour,
            "seckill.opening.window_ms",
        ),
        (
            json!({"mode": "lottery", "window_ms": 500}),
            Utc::now() - chrono::Duration::minutes(1),
            hour,
            "seckill.begin_time",
        ),
        (
            json!({"mode": "lottery", "window_ms": 500}),
            soon,
            chrono::Duration::milliseconds(400),
            "seckill.end_time",
        ),
    ];
    for (opening, begin, lasting, field) in cases {
        let body = json!({
            "shop_id": 1, "title": "drawn", "pay_value": 100, "actual_value": 200,
            "seckill": {"stock": 10, "begin_time": begin, "end_time": begin + lasting,
                        "segments": 2, "opening": opening},
        });
        let (status, answer) = app
            .post_json("/vouchers", Some(&app.admin_token()), &body)
            .await;
        assert_eq!(
            status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{opening}: {answer}"
        );
        let message = answer["error"]["message"].as_str().unwrap();
        assert!(message.contains(field), "{opening}: {message}");
    }
    let (status, answer) = app
        .post_json(
            "/vouchers",
            Some(&app.admin_token()),
            &json!({"shop_id": 1, "title": "t", "pay_value": 1, "actual_value": 2,
                    "seckill": {"stock": 1, "begin_time": soon, "end_time": soon + chrono::Duration::hours(1),
                                "opening": {"mode": "raffle"}}}),
        )
        .await;
    assert!(status.is_client_error(), "{status} {answer}");
    assert!(
        answer["error"]["message"]
            .as_str()
            .unwrap()
            .contains("opening"),
        "{answer}"
    );
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM vouchers")
        .fetch_one(&app.db)
        .await
        .unwrap();
    assert_eq!(count, 0, "a refused voucher changes nothing");
}

#[sqlx::test(migrations = "./migrations")]
async fn a_draw_happens_once_when_an_instance_holding_presses_is_killed_at_the_windows_end(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let (mut one, base_one) = app.spawn_server("api", &[]).await;
    let (_two, base_two) = app.spawn_server("api", &[]).await;
    let bases = [base_one, base_two.clone()];
    let (stock, entrants, window_ms) = (30, 400, 2_000);
    let voucher = lottery_sale(&app, stock, 2_000, window_ms).await;
    let id = voucher["id"].as_i64().unwrap();
    until_after_begin(&voucher, 100).await;

    // Instance one is killed a moment before the window ends, its held presses with it.
    let kill = async {
        until_after_begin(&voucher, window_ms as u64 - 100).await;
        one.kill9();
    };
    let (answers, ()) = tokio::join!(press_together(&app, &bases, id, 1..=entrants), kill);
    let mut won = BTreeSet::new();
    let mut unanswered = Vec::new();
    for (user, answer, _) in answers {
        match answer {
            Some((StatusCode::ACCEPTED, _)) => {
                won.insert(user);
            }
            Some((_, body)) => assert_eq!(body["error"]["code"], "sold_out", "user {user}: {body}"),
            None => unanswered.push(user),
        }
    }
    assert!(
        !unanswered.is_empty(),
        "the killed instance held presses ({} won, {} unanswered)",
        won.len(),
        unanswered.len()
    );
    // Those whose instance died learn their result by pressing again elsewhere.
    for user in &unanswered {
        let press = app
            .client
            .post(format!("{base_two}/vouchers/{id}/seckill"))
            .bearer_auth(app.token(*user));
        let (status, body) = app.send(press).await;
        match body["error"]["code"].as_str() {
            Some("already_ordered") => {
                won.insert(*user);
            }
            Some("sold_out") => {}
            _ => panic!("user {user}: {status} {body}"),
        }
    }
    assert_eq!(won.len(), stock as usize, "one draw, exactly the stock");

    assert_eq!(written_buyers(&app, id).await, won);
    let (_, draw) = app.get(&format!("/vouchers/{id}/draw"), None).await;
    let drawn: BTreeSet<i64> = serde_json::from_value(draw["winners"].clone()).unwrap();
    assert_eq!(drawn, won, "the winners are the draw's");
    let (ok, said) = verify_draw(&[&app.url(""), &id.to_string()]).await;
    assert!(ok, "{said}");
    println!(
        "{} presses lost with the instance; {said}",
        unanswered.len()
    );
}

#[sqlx::test(migrations = "./migrations")]
async fn a_draw_redis_loses_after_answering_is_not_drawn_again_and_its_winners_stand(db: PgPool) {
    let mut redis = PrivateRedis::start();
    let app = TestApp::spawn_with(db, redis.url.clone(), true).await;
    // An API instance alone: no worker writes the draw's orders from the stream.
    let (_api, base) = app.spawn_server("api", &[]).await;
    let (stock, entrants, window_ms) = (10, 60, 1_500);
    let voucher = lottery_sale(&app, stock, 1_500, window_ms).await;
    let id = voucher["id"].as_i64().unwrap();
    until_after_begin(&voucher, 100).await;

    let won =
        press_with_a_snapshot_late_in_the_window(&app, &redis, &base, &voucher, entrants).await;
    assert_eq!(won.len(), stock as usize, "exactly the stock is drawn");
    // Answered only once recorded: the winners' orders are rows before any worker ran.
    let rows: HashMap<i64, String> = app
        .pg_orders(id)
        .await
        .into_iter()
        .map(|(order, user)| (user, order.to_string()))
        .collect();
    assert_eq!(
        rows, won,
        "every 202 of the draw is already an order in Postgres"
    );

    // Redis back from the snapshot: its entrants marked, its lottery armed, no draw.
    redis.crash_and_restart();
    let armed: Option<String> = redis.command(
        redis::cmd("HGET")
            .arg(
                app.keys
                    .segment(seckill::keys::SaleSegment::new(vid(id), 0, 1)),
            )
            .arg("lottery_end"),
    );
    assert!(
        armed.is_some(),
        "the snapshot is of the window, before the draw"
    );

    // Everyone presses again: the winners hold their orders, nobody else wins anything.
    let again = press_through_503s(&app, &base, id, 1..=entrants).await;
    for (user, (status, body)) in &again {
        match won.get(user) {
            Some(order) => {
                assert_eq!(
                    body["error"]["code"], "already_ordered",
                    "winner {user}: {status} {body}"
                );
                assert_eq!(
                    body["error"]["order_id"].as_str(),
                    Some(order.as_str()),
                    "{body}"
                );
            }
            None => assert_eq!(
                body["error"]["code"], "sold_out",
                "user {user}: {status} {body}"
            ),
        }
    }
    let fresh = (entrants + 1..=entrants + 20).collect::<Vec<_>>();
    for (user, (_, body)) in press_through_503s(&app, &base, id, fresh).await {
        assert_eq!(body["error"]["code"], "sold_out", "newcomer {user}: {body}");
    }

    // The worker writes whatever the stream still holds: the same orders, no others.
    let buyers = written_buyers(&app, id).await;
    assert_eq!(buyers, won.keys().copied().collect::<BTreeSet<_>>());
    assert_eq!(app.pg_stock(id).await, 0);
    assert_eq!(draws_recorded(&app, id).await, 1);
    let (_, draw) = app.get(&format!("/vouchers/{id}/draw"), None).await;
    let drawn: BTreeSet<i64> = serde_json::from_value(draw["winners"].clone()).unwrap();
    assert_eq!(drawn, buyers, "the published winners are the orders");
    let (ok, said) = verify_draw(&[&app.url(""), &id.to_string()]).await;
    assert!(ok, "{said}");
    println!("redis rolled back to the window after the draw: {} winners stand, none drawn again; {said}", won.len());
}

#[sqlx::test(migrations = "./migrations")]
async fn the_live_view_shows_a_lotterys_window_its_entrants_so_far_and_then_its_draw(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let (stock, entrants, window_ms) = (5, 20, 3_000);
    let voucher = lottery_sale(&app, stock, 1_500, window_ms).await;
    let id = voucher["id"].as_i64().unwrap();
    let begin = time_at(&voucher["seckill"]["begin_time"]);
    let mut events = Events::open(&app.client, &app.url("")).await;
    let upcoming = events
        .until(id, Duration::from_secs(20), |v| !v["lottery"].is_null())
        .await;
    assert_eq!(upcoming["lottery"]["window_ms"], window_ms);
    let window_end = time_at(&upcoming["lottery"]["window_end"]);
    assert_eq!(
        window_end,
        begin + chrono::Duration::milliseconds(window_ms)
    );
    assert!(upcoming["lottery"]["drawn_at"].is_null(), "{upcoming}");

    until_after_begin(&voucher, 100).await;
    let bases = [app.url("")];
    let entered = async {
        events
            .until(id, Duration::from_secs(20), |v| {
                v["lottery"]["entrants"] == entrants && v["lottery"]["drawn_at"].is_null()
            })
            .await
    };
    let (answers, _seen_in_window) =
        tokio::join!(press_together(&app, &bases, id, 1..=entrants), entered);
    let won = answers
        .iter()
        .filter(|(_, a, _)| matches!(a, Some((StatusCode::ACCEPTED, _))))
        .count();
    assert_eq!(won, stock as usize);

    let drawn = events
        .until(id, Duration::from_secs(20), |v| {
            !v["lottery"]["drawn_at"].is_null()
        })
        .await;
    assert_eq!(drawn["lottery"]["entrants"], entrants, "{drawn}");
    assert_eq!(drawn["lottery"]["winners"], stock, "{drawn}");
}

#[sqlx::test(migrations = "./migrations")]
async fn a_redis_back_older_mid_window_draws_once_among_the_entries_it_kept(db: PgPool) {
    let mut redis = PrivateRedis::start();
    let app = TestApp::spawn_with(db, redis.url.clone(), true).await;
    let (_api, base) = app.spawn_server("api", &[]).await;
    let bases = [base.clone()];
    let (stock, window_ms) = (10, 3_000);
    let voucher = lottery_sale(&app, stock, 1_500, window_ms).await;
    let id = voucher["id"].as_i64().unwrap();
    until_after_begin(&voucher, 100).await;

    // Users 1..=30 enter, Redis keeps a snapshot, users 31..=60 enter; then Redis comes
    // back from the snapshot, still inside the window, without the later entries.
    let kept = async {
        let kept = press_together(&app, &bases, id, 1..=30);
        let snapshot_then_more = async {
            until_after_begin(&voucher, 700).await;
            redis.save();
            let more = press_together(&app, &bases, id, 31..=60);
            let crash = async {
                until_after_begin(&voucher, 1_400).await;
                redis.crash_and_restart();
            };
            tokio::join!(more, crash).0
        };
        tokio::join!(kept, snapshot_then_more)
    };
    let (first, later) = kept.await;
    let mut won = BTreeSet::new();
    for (user, answer, _) in first.into_iter().chain(later) {
        let (status, body) = answer.unwrap_or_else(|| panic!("user {user} unanswered"));
        match status {
            StatusCode::ACCEPTED => {
                won.insert(user);
            }
            _ => assert_eq!(
                body["error"]["code"], "sold_out",
                "user {user}: {status} {body}"
            ),
        }
    }
    assert_eq!(won.len(), stock as usize, "one draw, exactly the stock");
    assert!(
        won.iter().all(|u| *u <= 30),
        "drawn among the entries Redis kept: {won:?}"
    );
    assert_eq!(written_buyers(&app, id).await, won);
    let (_, draw) = app.get(&format!("/vouchers/{id}/draw"), None).await;
    let entrants: BTreeSet<i64> = serde_json::from_value(draw["entrants"].clone()).unwrap();
    assert_eq!(
        entrants,
        (1..=30).collect(),
        "the entries the older Redis held"
    );
    let (ok, said) = verify_draw(&[&app.url(""), &id.to_string()]).await;
    assert!(ok, "{said}");
}

#[sqlx::test(migrations = "./migrations")]
async fn a_lottery_whose_held_presses_all_died_is_drawn_with_nobody_pressing_again(db: PgPool) {
    let app = TestApp::spawn(db).await;
    // The only instance shoppers press through is killed before the window ends; the
    // in-process app (another instance) gets no press at all.
    let (mut holder, base) = app.spawn_server("api", &[]).await;
    let (stock, entrants, window_ms) = (5, 40, 1_500);
    let voucher = lottery_sale(&app, stock, 1_500, window_ms).await;
    let id = voucher["id"].as_i64().unwrap();
    until_after_begin(&voucher, 100).await;
    let kill = async {
        until_after_begin(&voucher, window_ms as u64 - 300).await;
        holder.kill9();
    };
    let bases = [base];
    let (answers, ()) = tokio::join!(press_together(&app, &bases, id, 1..=entrants), kill);
    assert!(
        answers.iter().all(|(_, a, _)| a.is_none()),
        "every press held, then lost"
    );

    let deadline = Instant::now() + Duration::from_secs(15);
    let draw = loop {
        let (_, draw) = app.get(&format!("/vouchers/{id}/draw"), None).await;
        if !draw["seed"].is_null() {
            break draw;
        }
        assert!(
            Instant::now() < deadline,
            "no draw 15 s after the window: {draw}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let drawn: BTreeSet<i64> = serde_json::from_value(draw["winners"].clone()).unwrap();
    assert_eq!(drawn.len(), stock as usize, "{draw}");
    assert_eq!(
        written_buyers(&app, id).await,
        drawn,
        "the draw's orders are written"
    );
    let (ok, said) = verify_draw(&[&app.url(""), &id.to_string()]).await;
    assert!(ok, "{said}");
    // Its shoppers learn the result by pressing again.
    for user in 1..=entrants {
        let (_, body) = app.grab(id, user).await;
        let code = body["error"]["code"].as_str();
        match drawn.contains(&user) {
            true => assert_eq!(code, Some("already_ordered"), "winner {user}: {body}"),
            false => assert_eq!(code, Some("sold_out"), "user {user}: {body}"),
        }
    }
}

#[sqlx::test(migrations = "./migrations")]
async fn reconcile_in_a_lottery_window_counts_entrants_as_no_buyers_and_finds_the_books_balanced(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let (stock, entrants, window_ms) = (3, 8, 4_000);
    let voucher = lottery_sale(&app, stock, 1_500, window_ms).await;
    let id = voucher["id"].as_i64().unwrap();
    until_after_begin(&voucher, 100).await;
    let bases = [app.url("")];
    let check = async {
        until_after_begin(&voucher, 1_500).await;
        app.cli_async(&["reconcile"], &[]).await
    };
    let (answers, (code, said)) =
        tokio::join!(press_together(&app, &bases, id, 1..=entrants), check);
    assert_eq!(code, 0, "{said}");
    assert!(said.contains("books balance"), "{said}");
    let won = answers
        .iter()
        .filter(|(_, a, _)| matches!(a, Some((StatusCode::ACCEPTED, _))))
        .count();
    assert_eq!(won, stock as usize);
    let (code, said) = app.cli_async(&["reconcile"], &[]).await;
    assert_eq!(code, 0, "after the draw too: {said}");
}

#[sqlx::test(migrations = "./migrations")]
async fn a_draw_done_while_postgres_is_away_answers_no_202_until_it_is_recorded(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let (postgres, _api, base) = an_instance_behind_a_postgres_proxy(&app).await;
    let (stock, entrants, window_ms) = (4, 20, 2_000);
    let voucher = lottery_sale(&app, stock, 1_500, window_ms).await;
    let id = voucher["id"].as_i64().unwrap();
    until_after_begin(&voucher, 100).await;

    // Postgres away for the instance holding the presses from just before the draw.
    let cut = async {
        until_after_begin(&voucher, window_ms as u64 - 300).await;
        postgres.cut();
    };
    let bases = [base.clone()];
    let (answers, ()) = tokio::join!(press_together(&app, &bases, id, 1..=entrants), cut);
    let entered = answered_unknown(answers);

    // Back: the draw is recorded (by whichever instance gets there first), and each
    // shopper's press again says what it says.
    postgres.heal();
    let again = press_through_503s(&app, &base, id, 1..=entrants).await;
    let (_, draw) = app.get(&format!("/vouchers/{id}/draw"), None).await;
    let drawn: BTreeSet<i64> = serde_json::from_value(draw["winners"].clone()).unwrap();
    assert_eq!(drawn.len(), stock as usize, "{draw}");
    for (user, (status, body)) in &again {
        match drawn.contains(user) {
            true => {
                assert_eq!(
                    body["error"]["code"], "already_ordered",
                    "winner {user}: {status} {body}"
                );
                assert_eq!(
                    body["error"]["order_id"].as_str(),
                    Some(entered[user].as_str())
                );
            }
            false => assert_eq!(
                body["error"]["code"], "sold_out",
                "user {user}: {status} {body}"
            ),
        }
    }
    assert_eq!(written_buyers(&app, id).await, drawn);
}

#[sqlx::test(migrations = "./migrations")]
async fn an_entry_whose_window_postgres_cannot_tell_is_answered_unknown_naming_its_order(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let (postgres, _api, base) = an_instance_behind_a_postgres_proxy(&app).await;
    let window_ms = 2_000;
    let voucher = lottery_sale(&app, 1, 1_500, window_ms).await;
    let id = voucher["id"].as_i64().unwrap();
    until_after_begin(&voucher, 100).await;

    // Postgres away for the instance before its first press of the sale: Redis takes the
    // entry, the instance cannot read the window to hold it.
    postgres.cut();
    let bases = [base.clone()];
    let entered = answered_unknown(press_together(&app, &bases, id, [1]).await);

    // Back, after the window: the one entrant won, under the order its answer named.
    postgres.heal();
    until_after_begin(&voucher, window_ms as u64 + 100).await;
    let again = press_through_503s(&app, &base, id, [1]).await;
    let (status, body) = &again[&1];
    assert_eq!(body["error"]["code"], "already_ordered", "{status} {body}");
    assert_eq!(
        body["error"]["order_id"].as_str(),
        Some(entered[&1].as_str())
    );
    assert_eq!(written_buyers(&app, id).await, BTreeSet::from([1]));
}

/// Held presses answered 503 `unknown` (the draw not recorded by their bound), each naming
/// the order it entered under: those orders, by user.
fn answered_unknown(answers: impl IntoIterator<Item = Pressed>) -> HashMap<i64, String> {
    let mut entered = HashMap::new();
    for (user, answer, _) in answers {
        let (status, body) = answer.unwrap_or_else(|| panic!("user {user} unanswered"));
        assert_eq!(
            status,
            StatusCode::SERVICE_UNAVAILABLE,
            "user {user}: {body}"
        );
        assert_eq!(body["error"]["outcome"], "unknown", "user {user}: {body}");
        entered.insert(user, body["error"]["order_id"].as_str().unwrap().to_owned());
    }
    entered
}

/// `GET /orders` as `user`: its status, whether it left Redis out, and its body.
async fn orders_listed(app: &TestApp, user: i64) -> (StatusCode, bool, Value) {
    let resp = app
        .client
        .get(app.url("/orders"))
        .bearer_auth(app.token(user))
        .send()
        .await
        .unwrap();
    let fell_back = resp.headers().contains_key("x-seckill-fallback");
    (resp.status(), fell_back, resp.json().await.unwrap())
}

/// Whether the sale's Redis state (in one segment) holds `field`.
async fn state_holds(app: &TestApp, voucher: i64, field: &str) -> bool {
    redis::cmd("HEXISTS")
        .arg(
            app.keys
                .segment(seckill::keys::SaleSegment::new(vid(voucher), 0, 1)),
        )
        .arg(field)
        .query_async(&mut app.redis.clone())
        .await
        .unwrap()
}

#[sqlx::test(migrations = "./migrations")]
async fn a_press_after_the_draw_names_no_order_until_postgres_records_the_draw(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let (_api, base) = app.spawn_server("api", &[]).await;
    let (stock, entrants, window_ms) = (10, 4, 1_500);
    let voucher = lottery_sale(&app, stock, 1_500, window_ms).await;
    let id = voucher["id"].as_i64().unwrap();
    let newcomer = 100;
    until_after_begin(&voucher, 100).await;

    // The sale's row held from before the window's end: nothing records the draw.
    let mut held = app.db.begin().await.unwrap();
    let in_the_gap = async {
        until_after_begin(&voucher, window_ms as u64 - 500).await;
        let (status, fell_back, listed) = orders_listed(&app, 1).await;
        assert_eq!(
            (status, fell_back),
            (StatusCode::OK, false),
            "an entrant's mark read as an order: {listed}"
        );
        assert_eq!(listed, json!([]), "an entry is no order yet");
        sqlx::query("SELECT 1 FROM seckill_vouchers WHERE voucher_id = $1 FOR UPDATE")
            .bind(id)
            .execute(&mut *held)
            .await
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !state_holds(&app, id, "drawn_ms").await {
            assert!(Instant::now() < deadline, "never drawn in redis");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(state_holds(&app, id, "unrecorded").await);
        let (status, _, listed) = orders_listed(&app, 1).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(listed, json!([]), "a drawn order Redis could still lose");
        // An entrant pressing again (a second tab), and a newcomer with units left, press
        // through another instance while Redis has drawn and Postgres has not.
        tokio::join!(app.grab(id, 1), app.grab(id, newcomer))
    };
    let bases = [base.clone()];
    let (answers, (entrant, late)) =
        tokio::join!(press_together(&app, &bases, id, 1..=entrants), in_the_gap);
    for (who, (status, body)) in [("an entrant", entrant), ("a newcomer", late)] {
        assert_eq!(
            status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{who} told of an order Redis could still lose: {body}"
        );
        assert_eq!(body["error"]["order_id"], Value::Null, "{who}: {body}");
    }
    let entered = answered_unknown(answers);

    // Released: the draw is recorded, and every press is answered from it.
    held.rollback().await.unwrap();
    let again = press_through_503s(&app, &base, id, (1..=entrants).chain([newcomer])).await;
    for user in 1..=entrants {
        let (status, body) = &again[&user];
        assert_eq!(body["error"]["code"], "already_ordered", "{status} {body}");
        assert_eq!(
            body["error"]["order_id"].as_str(),
            Some(entered[&user].as_str())
        );
    }
    let (status, body) = &again[&newcomer];
    assert_eq!(
        *status,
        StatusCode::ACCEPTED,
        "a unit left sells first come: {body}"
    );
    assert!(!state_holds(&app, id, "unrecorded").await);
    let buyers = written_buyers(&app, id).await;
    assert_eq!(buyers, (1..=entrants).chain([newcomer]).collect());

    // A recorder gone before lifting its mark: an instance's look lifts it.
    let key = app
        .keys
        .segment(seckill::keys::SaleSegment::new(vid(id), 0, 1));
    let _: () = redis::cmd("HSET")
        .arg(&key)
        .arg("unrecorded")
        .arg("1")
        .query_async(&mut app.redis.clone())
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while state_holds(&app, id, "unrecorded").await {
        assert!(Instant::now() < deadline, "the mark was never lifted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, body) = app.grab(id, 1).await;
    assert_eq!(body["error"]["code"], "already_ordered", "{status} {body}");
}

#[sqlx::test(migrations = "./migrations")]
async fn a_redis_back_older_between_the_draw_and_its_record_draws_once_more_and_only_that_draw_is_told(
    db: PgPool,
) {
    let mut redis = PrivateRedis::start();
    let app = TestApp::spawn_with(db, redis.url.clone(), true).await;
    // An API instance alone: no worker writes the first draw's orders from the stream.
    let (_api, base) = app.spawn_server("api", &[]).await;
    let (stock, window_ms) = (3, 1_500);
    let voucher = lottery_sale(&app, stock, 1_500, window_ms).await;
    let id = voucher["id"].as_i64().unwrap();
    let (early, late) = (1..=20, 21..=30);
    until_after_begin(&voucher, 100).await;

    // The early entrants are in the snapshot, the late ones enter after it; the sale's row
    // is held from the snapshot on, so the draw Redis makes is not recorded.
    let bases = [base.clone()];
    let mut held = app.db.begin().await.unwrap();
    let late_in_the_window = async {
        until_after_begin(&voucher, window_ms as u64 - 600).await;
        redis.save();
        sqlx::query("SELECT 1 FROM seckill_vouchers WHERE voucher_id = $1 FOR UPDATE")
            .bind(id)
            .execute(&mut *held)
            .await
            .unwrap();
        until_after_begin(&voucher, window_ms as u64 - 500).await;
        let pressed = press_together(&app, &bases, id, late.clone());
        let gap = async {
            let deadline = Instant::now() + Duration::from_secs(10);
            while !state_holds(&app, id, "drawn_ms").await {
                assert!(Instant::now() < deadline, "never drawn in redis");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            // Every entrant presses again in the gap, through another instance.
            press_together(&app, &[app.url("")], id, 1..=30).await
        };
        tokio::join!(pressed, gap)
    };
    let (first, (second, in_the_gap)) = tokio::join!(
        press_together(&app, &bases, id, early.clone()),
        late_in_the_window
    );
    for (user, answer, _) in in_the_gap {
        let (status, body) = answer.unwrap_or_else(|| panic!("user {user} unanswered"));
        assert_eq!(
            status,
            StatusCode::SERVICE_UNAVAILABLE,
            "user {user}: {body}"
        );
        assert_eq!(
            body["error"]["order_id"],
            Value::Null,
            "user {user}: {body}"
        );
    }
    answered_unknown(first.into_iter().chain(second));
    let entrants_then: String = redis.command(
        redis::cmd("HGET")
            .arg(
                app.keys
                    .segment(seckill::keys::SaleSegment::new(vid(id), 0, 1)),
            )
            .arg("draw_entrants"),
    );
    assert_eq!(entrants_then.split(',').count(), 30, "drew every entrant");

    // Redis back from the snapshot (only the early entries, no draw), then the row free.
    redis.crash_and_restart();
    held.rollback().await.unwrap();
    let everyone = early.clone().chain(late.clone()).collect::<Vec<_>>();
    let again = press_through_503s(&app, &base, id, everyone.clone()).await;

    // One draw, over the entries the older Redis kept: its winners hold their orders,
    // and nobody else was ever told of one.
    let (_, draw) = app.get(&format!("/vouchers/{id}/draw"), None).await;
    let entrants: BTreeSet<i64> = serde_json::from_value(draw["entrants"].clone()).unwrap();
    let drawn: BTreeSet<i64> = serde_json::from_value(draw["winners"].clone()).unwrap();
    assert_eq!(entrants, early.clone().collect(), "{draw}");
    assert_eq!(drawn.len(), stock as usize, "{draw}");
    for (user, (status, body)) in &again {
        match drawn.contains(user) {
            true => assert_eq!(body["error"]["code"], "already_ordered", "{status} {body}"),
            false => assert_eq!(
                body["error"]["code"], "sold_out",
                "user {user}: {status} {body}"
            ),
        }
    }
    let buyers = written_buyers(&app, id).await;
    assert_eq!(buyers, drawn);
    let (ok, said) = verify_draw(&[&app.url(""), &id.to_string()]).await;
    assert!(ok, "{said}");
    assert_eq!(draws_recorded(&app, id).await, 1);
    println!(
        "a draw over 30 entrants lost before its record; drawn again over the 20 kept: {said}"
    );
}
