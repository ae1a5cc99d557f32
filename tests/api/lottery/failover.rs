//! A lottery across a failover. Two primaries around the draw: an API instance and a
//! worker still reach the old primary, which holds the window and its entrants, while the
//! new one holds a copy from before the failover; one draw stands, the one of the Redis
//! the sale was last built into. And Sentinel promoting a replica that lagged, mid-window,
//! with acknowledgements: every entry a held press stands on is in the draw. Either way
//! nobody is told of an order but the draw's.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::Value;
use sqlx::PgPool;

use super::*;
use crate::common::sentinel::{PrivateSentinel, MASTER};
use crate::fence::{on, stored, wait_drained, waiting_for_one, worker_on, Trio};

/// When the new primary gets an API instance (whose first look builds the sale into it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NewPrimary {
    /// After the window: the old primary has drawn, and the draw is recorded.
    AfterTheDraw,
    /// In the window, before the draw: the sale is built into the new primary first.
    InTheWindow,
}

/// A lottery of 3 units on node 0 (API 1, worker 1), its window 3 s, or 8 s when the new
/// primary is to start in it. Users 1..=10 enter there; node 1 is promoted with every entry
/// copied and node 2 follows it, while API 1 stays on node 0, whose min-replicas guard is
/// off, and users 11..=15 enter there only. API 2 and worker 2 come to node 1 as `when`
/// says. Whichever Redis draws, the sale's one recorded draw is the one whose answers were
/// given: its winners hold their orders in Postgres, and every answer that names an order
/// names one of them.
async fn a_lottery_across_a_failover(db: PgPool, when: NewPrimary) {
    let trio = Trio::start().await;
    let app = TestApp::spawn_with(db, trio.url(0).to_string(), true).await;
    let no_wait = vec![("REDIS_WAIT_REPLICAS", "0".to_string())];
    let (_api1, base1) = app.spawn_server("api", &on(trio.url(0), no_wait)).await;
    let _worker1 = worker_on(&app, trio.url(0));
    // (Long enough, in the window, for the new primary's instance to start.)
    let window_ms = match when {
        NewPrimary::AfterTheDraw => 3_000,
        NewPrimary::InTheWindow => 8_000,
    };
    let stock = 3;
    let voucher = lottery_sale(&app, stock, 1_500, window_ms).await;
    let id = voucher["id"].as_i64().unwrap();
    let (copied, old_only) = (1..=10, 11..=15);
    let (first_term, _) = build_of(&app, id).await;
    until_after_begin(&voucher, 100).await;

    let bases1 = [base1.clone()];
    let failover = async {
        entered_on(&trio, 0, &app, id, copied.clone()).await;
        for replica in [1, 2] {
            trio.wait_in_sync(replica, 0).await;
        }
        trio.fail_over_leaving_node_0().await;
        let api2 = async {
            match when {
                NewPrimary::InTheWindow => Some(
                    app.spawn_server("api", &on(trio.url(1), waiting_for_one()))
                        .await,
                ),
                NewPrimary::AfterTheDraw => None,
            }
        };
        tokio::join!(press_together(&app, &bases1, id, old_only.clone()), api2)
    };
    let (first, (second, api2)) =
        tokio::join!(press_together(&app, &bases1, id, copied.clone()), failover);
    let held: Vec<Pressed> = first.into_iter().chain(second).collect();
    if when == NewPrimary::AfterTheDraw {
        // Recorded (by a held press, or else within a second by an instance's look)
        // before the new primary has an instance to build the sale into it.
        let deadline = Instant::now() + Duration::from_secs(30);
        while draws_recorded(&app, id).await == 0 {
            assert!(
                Instant::now() < deadline,
                "the old primary's draw never recorded"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let (_api2, base2) = match api2 {
        Some(api2) => api2,
        None => {
            app.spawn_server("api", &on(trio.url(1), waiting_for_one()))
                .await
        }
    };
    let _worker2 = worker_on(&app, trio.url(1));
    let built_at = built_anew(&app, id, &first_term).await;
    let window_end =
        time_at(&voucher["seckill"]["begin_time"]) + chrono::Duration::milliseconds(window_ms);
    assert_eq!(
        built_at < window_end,
        when == NewPrimary::InTheWindow,
        "the new primary built {} ms before the window's end",
        (window_end - built_at).num_milliseconds()
    );

    // Everyone presses again through the new primary, once it admits.
    let everyone: Vec<i64> = copied.clone().chain(old_only.clone()).collect();
    let again = press_through_503s(&app, &base2, id, everyone.clone()).await;
    wait_drained(trio.url(1), &app, id).await;

    // The draw, recorded and published, that anyone can verify.
    assert_eq!(draws_recorded(&app, id).await, 1, "the draw is recorded");
    let (_, draw) = app.get(&format!("/vouchers/{id}/draw"), None).await;
    let entrants: BTreeSet<i64> = serde_json::from_value(draw["entrants"].clone()).unwrap();
    let winners: BTreeSet<i64> = serde_json::from_value(draw["winners"].clone()).unwrap();
    let (ok, said) = verify_draw(&[&app.url(""), &id.to_string()]).await;
    assert!(ok, "{said}");
    let expected_entrants: BTreeSet<i64> = match when {
        // The old primary was the sale's until the draw: every entry it took counts.
        NewPrimary::AfterTheDraw => everyone.iter().copied().collect(),
        // The new primary was built in the window from its copy: the old primary's
        // later entries never reached it.
        NewPrimary::InTheWindow => copied.clone().collect(),
    };
    assert_eq!(entrants, expected_entrants, "{draw}");
    assert_eq!(winners.len(), stock as usize, "{draw}");

    // The winners' orders are the sale's only orders, whichever worker came first.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let orders = stored(&app, id).await;
    let buyers: BTreeSet<i64> = orders.values().copied().collect();
    assert_eq!(buyers, winners, "only the draw's winners hold orders");
    assert_eq!(orders.len(), stock as usize);

    // Every answer naming an order names the draw's order of that shopper.
    let told_at_the_draw = told_only_the_draw(&orders, &winners, &held, &again);
    match when {
        // (Each winner's held press told, unless the record came after its bound.)
        NewPrimary::AfterTheDraw => assert!(told_at_the_draw <= stock as usize),
        // The old primary's state is older than the sale's build from then on: it
        // draws nothing, and its instance's held presses hear `unknown`. (The new
        // primary draws only once its term opens: API 1 and the harness's app stay on
        // the old primary and never vouch for it, so it is held 10 s, past the window.)
        NewPrimary::InTheWindow => assert_eq!(told_at_the_draw, 0),
    }
    println!(
        "{when:?}: {} entrants, winners {winners:?}, {told_at_the_draw} told of their order \
         at the draw; {said}",
        entrants.len()
    );
}

/// Checks every answer against the sale's orders in Postgres (the draw's winners'): one
/// that names an order (a 202, `already_ordered`) names that shopper's; a `held` press
/// not told of one heard `503`, or `sold_out` if its shopper did not win; pressed `again` once the draw stood, a
/// winner hears `already_ordered`, anyone else `sold_out`. How many held presses were
/// told of their order.
fn told_only_the_draw(
    orders: &HashMap<i64, i64>,
    winners: &BTreeSet<i64>,
    held: &[Pressed],
    again: &HashMap<i64, (StatusCode, Value)>,
) -> usize {
    let order_of: HashMap<i64, i64> = orders.iter().map(|(o, u)| (*u, *o)).collect();
    let named = |user: i64, status: StatusCode, body: &Value| -> bool {
        let id = match status {
            StatusCode::ACCEPTED => body["order_id"].as_str(),
            _ => body["error"]["order_id"]
                .as_str()
                .filter(|_| body["error"]["code"] == "already_ordered"),
        };
        let Some(id) = id else { return false };
        let id: i64 = id.parse().unwrap();
        assert_eq!(order_of.get(&user), Some(&id), "user {user}: {body}");
        true
    };
    let mut told = 0;
    for (user, answer, _) in held {
        let (status, body) = answer
            .as_ref()
            .unwrap_or_else(|| panic!("user {user} unanswered"));
        if named(*user, *status, body) {
            told += 1;
            continue;
        }
        assert!(
            (body["error"]["code"] == "sold_out" && !winners.contains(user))
                || *status == StatusCode::SERVICE_UNAVAILABLE,
            "user {user}: {status} {body}"
        );
    }
    for (user, (status, body)) in again {
        let code = &body["error"]["code"];
        match winners.contains(user) {
            true => assert!(
                named(*user, *status, body) && code == "already_ordered",
                "user {user}: {status} {body}"
            ),
            false => assert_eq!(code, "sold_out", "user {user}: {status} {body}"),
        }
    }
    told
}

/// The Redis term the sale was last built into, and when.
async fn build_of(app: &TestApp, voucher: i64) -> (String, chrono::DateTime<Utc>) {
    sqlx::query_as("SELECT term, built_at FROM sale_epochs WHERE voucher_id = $1")
        .bind(voucher)
        .fetch_one(&app.db)
        .await
        .unwrap()
}

/// When the sale was first built into a term other than `term` (waits, bounded).
async fn built_anew(app: &TestApp, voucher: i64, term: &str) -> chrono::DateTime<Utc> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (now, at) = build_of(app, voucher).await;
        if now != term {
            return at;
        }
        assert!(
            Instant::now() < deadline,
            "never built into the new primary"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits (bounded) until node `node` holds an entry of each of `users` in the sale.
async fn entered_on(
    trio: &Trio,
    node: usize,
    app: &TestApp,
    voucher: i64,
    users: impl Iterator<Item = i64> + Clone,
) {
    let key = app
        .keys
        .segment(seckill::keys::SaleSegment::new(vid(voucher), 0, 1));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let marks: Vec<Option<String>> = trio.cmd(
            node,
            redis::cmd("HMGET")
                .arg(&key)
                .arg(users.clone().map(|u| format!("u:{u}")).collect::<Vec<_>>()),
        );
        if marks.iter().all(Option::is_some) {
            return;
        }
        assert!(Instant::now() < deadline, "not entered on node {node}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[sqlx::test(migrations = "./migrations")]
async fn an_old_primary_that_draws_before_the_new_one_is_built_makes_the_one_draw_and_the_new_primary_carries_it(
    db: PgPool,
) {
    a_lottery_across_a_failover(db, NewPrimary::AfterTheDraw).await;
}

#[sqlx::test(migrations = "./migrations")]
async fn a_new_primary_built_in_the_window_makes_the_one_draw_and_the_old_primary_draws_nothing(
    db: PgPool,
) {
    a_lottery_across_a_failover(db, NewPrimary::InTheWindow).await;
}

/// A Sentinel deployment (three sentinels, a primary, a replica behind a cuttable link)
/// and a real `seckill serve` finding Redis through the sentinels, each admission call
/// waiting for one replica's acknowledgement. In a lottery's window users 1..=20 enter and
/// the replica copies them; users 21..=30 press as its link is cut (each held only if the
/// replica acknowledged its entry, else answered 503); users 31..=35 press after the cut
/// (503, never held); the primary is killed -9, the sentinels promote the replica that
/// lagged, and it gets a replica of its own; users 36..=40 press. One draw, on the new
/// master, counts every entry a held press stood on and none the old primary alone held;
/// its winners are the sale's orders, and every answer naming an order names one of them.
#[sqlx::test(migrations = "./migrations")]
async fn a_sentinel_failover_mid_window_loses_no_entry_a_held_press_stood_on(db: PgPool) {
    let mut redis = PrivateSentinel::start().await;
    let spare = PrivateRedis::start();
    // The harness's app, on the primary, creates the sale, then stops (it would hold the
    // new master's term back until its lease ran out).
    let app = TestApp::spawn_with(db, redis.url(redis.primary_port), true).await;
    let env = vec![
        ("REDIS_SENTINEL_URLS", redis.sentinel_urls()),
        ("REDIS_SENTINEL_MASTER", MASTER.to_string()),
        ("REDIS_WAIT_REPLICAS", "1".to_string()),
    ];
    let (_server, base) = app.spawn_server("serve", &env).await;
    let (stock, window_ms) = (5, 10_000);
    let voucher = lottery_sale(&app, stock, 2_000, window_ms).await;
    let id = voucher["id"].as_i64().unwrap();
    app.stop_serving();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let keepers: i64 = sqlx::query_scalar("SELECT count(*) FROM promise_keepers")
            .fetch_one(&app.db)
            .await
            .unwrap();
        if keepers <= 1 {
            break;
        }
        assert!(Instant::now() < deadline, "the harness's app never left");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (copied, racing, lagged, promoted) = (1..=20, 21..=30, 31..=35, 36..=40);
    until_after_begin(&voucher, 100).await;

    let bases = [base.clone()];
    let fault = async {
        // Once the replica holds every early entry, the next presses race the cut of its
        // link: an entry held from then on is one the replica acknowledged.
        let key = app
            .keys
            .segment(seckill::keys::SaleSegment::new(vid(id), 0, 1));
        let marks = copied.clone().map(|u| format!("u:{u}")).collect::<Vec<_>>();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let held: Vec<Option<String>> = redis
                .query(
                    redis.replica_port,
                    redis::cmd("HMGET").arg(&key).arg(&marks),
                )
                .await
                .unwrap();
            if held.iter().all(Option::is_some) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the replica never held every entry"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let then = async {
            tokio::time::sleep(Duration::from_millis(2)).await;
            redis.cut_replica_link();
            let refused = press_together(&app, &bases, id, lagged.clone()).await;
            redis.kill_primary();
            redis.wait_replica_promoted().await;
            // A replica of its own: without one nothing is acknowledged.
            redis.give_promoted_a_replica(&spare).await;
            let promoted_at = Utc::now();
            let after = futures::stream::iter(promoted.clone())
                .map(|user| press_until_decided(&app, &base, id, user))
                .buffer_unordered(8)
                .collect::<Vec<_>>()
                .await;
            (refused, promoted_at, after)
        };
        tokio::join!(press_together(&app, &bases, id, racing.clone()), then)
    };
    let (first, (raced, (refused, promoted_at, after))) =
        tokio::join!(press_together(&app, &bases, id, copied.clone()), fault);
    for (user, answer, _) in &refused {
        let (status, body) = answer.as_ref().expect("answered");
        assert_eq!(
            *status,
            StatusCode::SERVICE_UNAVAILABLE,
            "user {user}: no replica acknowledged: {body}"
        );
    }
    let held: Vec<Pressed> = first
        .into_iter()
        .chain(raced.iter().cloned())
        .chain(
            after
                .iter()
                .map(|(user, _, answer)| (*user, Some(answer.clone()), Duration::ZERO)),
        )
        .collect();
    let everyone: Vec<i64> = (1..=40).collect();
    let again = press_through_503s(&app, &base, id, everyone).await;

    let (_, draw) = app
        .send(app.client.get(format!("{base}/vouchers/{id}/draw")))
        .await;
    let entrants: BTreeSet<i64> = serde_json::from_value(draw["entrants"].clone()).unwrap();
    let winners: BTreeSet<i64> = serde_json::from_value(draw["winners"].clone()).unwrap();
    let (ok, said) = verify_draw(&[&base, &id.to_string()]).await;
    assert!(ok, "{said}");
    assert!(
        copied.clone().all(|u| entrants.contains(&u)),
        "an entry the new master's copy held was lost: {draw}"
    );
    // A press that raced the cut and was held (answered from the draw, not 503) stood on
    // an acknowledged entry: it is in the draw.
    let mut held_racing = 0;
    for (user, answer, _) in &raced {
        let (status, body) = answer.as_ref().expect("answered");
        if *status != StatusCode::SERVICE_UNAVAILABLE {
            held_racing += 1;
            assert!(
                entrants.contains(user),
                "user {user} was held, and its entry lost: {status} {body}; {draw}"
            );
        }
    }
    assert!(
        !lagged.clone().any(|u| entrants.contains(&u)),
        "an entry no replica held: {draw}"
    );
    let window_end =
        time_at(&voucher["seckill"]["begin_time"]) + chrono::Duration::milliseconds(window_ms);
    // A press the new master decided, sent a second or more before the window's end, was
    // an entry (when the promotion left that much of the window, some press was).
    let mut on_the_new_master = 0;
    for (user, sent, (status, body)) in &after {
        if *sent + chrono::Duration::seconds(1) < window_end {
            on_the_new_master += 1;
            assert!(
                entrants.contains(user),
                "user {user} pressed on the new master in the window: {status} {body}; {draw}"
            );
        }
    }
    if promoted_at + chrono::Duration::seconds(4) < window_end {
        assert!(
            on_the_new_master > 0,
            "promoted {} ms before the window's end, and no press entered there",
            (window_end - promoted_at).num_milliseconds()
        );
    }
    assert_eq!(winners.len(), stock as usize, "{draw}");

    let deadline = Instant::now() + Duration::from_secs(60);
    let orders = loop {
        let orders = stored(&app, id).await;
        if orders.len() >= stock as usize {
            break orders;
        }
        assert!(Instant::now() < deadline, "the winners' orders: {orders:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let buyers: BTreeSet<i64> = orders.values().copied().collect();
    assert_eq!(buyers, winners, "only the draw's winners hold orders");
    let told = told_only_the_draw(&orders, &winners, &held, &again);
    println!(
        "{} entrants ({held_racing} of {} presses racing the cut held, {on_the_new_master} on \
         the new master, promoted {} ms before the window's end), {told} of {} presses told \
         of their order at the draw; {said}",
        entrants.len(),
        raced.len(),
        (window_end - promoted_at).num_milliseconds(),
        held.len()
    );
}

/// `user` presses through `base` until the answer is not a 503: when the press that
/// answered was sent, and its answer.
async fn press_until_decided(
    app: &TestApp,
    base: &str,
    voucher: i64,
    user: i64,
) -> (i64, chrono::DateTime<Utc>, (StatusCode, Value)) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let sent = Utc::now();
        let press = app
            .client
            .post(format!("{base}/vouchers/{voucher}/seckill"))
            .bearer_auth(app.token(user));
        let (status, body) = app.send(press).await;
        if status != StatusCode::SERVICE_UNAVAILABLE {
            return (user, sent, (status, body));
        }
        assert!(
            Instant::now() < deadline,
            "user {user}: 503 for a minute: {body}"
        );
        // (Under the default limit of 5 grabs a second per user.)
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
