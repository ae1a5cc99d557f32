//! A lottery sale spread over several segments (several hash slots: on a cluster,
//! several masters) draws once over all of them: one seed, one list of entrants, one set
//! of winners, each admitted in its home segment; then it goes on first come.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{json, Value};
use sqlx::PgPool;

use super::{
    draws_recorded, press_together, press_with_a_snapshot_late_in_the_window, sale_in_segments,
    time_at, two_instances_and_a_worker, until_after_begin, verify_draw, written_buyers, Pressed,
};
use crate::common::faults::PrivateRedis;
use crate::common::{uid, vid, TestApp};
use crate::recovery::rollback::press_through_503s;
use crate::segments::moves::allotments;
use seckill::keys::SaleSegment;

const SEGMENTS: u8 = 3;

/// Whether some segment's Redis state still holds its window or an entrant's mark.
async fn some_segment_holds_its_window(app: &TestApp, voucher: i64) -> bool {
    for segment in SaleSegment::all(vid(voucher), SEGMENTS) {
        let state: Vec<(String, String)> = redis::cmd("HGETALL")
            .arg(app.keys.segment(segment))
            .query_async(&mut app.redis.clone())
            .await
            .unwrap();
        if state
            .iter()
            .any(|(f, v)| f == "lottery_end" || (f.starts_with("u:") && v.starts_with('e')))
        {
            return true;
        }
    }
    false
}

/// The users answered 202 among `answers`; every answer came within `within`, and any
/// but a 202 or `sold_out` fails the test.
fn won_among(answers: &[Pressed], within: Duration) -> BTreeSet<i64> {
    let mut won = BTreeSet::new();
    for (user, answer, took) in answers {
        let (status, body) = answer.as_ref().expect("every press is answered");
        assert!(
            *took <= within,
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
    won
}

#[sqlx::test(migrations = "./migrations")]
async fn a_lottery_over_three_segments_draws_once_over_all_of_them_and_anyone_can_verify_it(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let (_processes, bases) = two_instances_and_a_worker(&app).await;
    let (stock, entrants, window_ms) = (40, 600, 2_500);
    let opening = json!({"mode": "lottery", "window_ms": window_ms});
    let voucher = sale_in_segments(&app, stock, 2_000, opening, SEGMENTS).await;
    let id = voucher["id"].as_i64().unwrap();
    assert_eq!(voucher["seckill"]["segments"], SEGMENTS, "{voucher}");
    until_after_begin(&voucher, 100).await;

    let answers = press_together(&app, &bases, id, 1..=entrants).await;
    let won = won_among(&answers, Duration::from_millis(window_ms as u64 + 500));
    assert_eq!(won.len(), stock as usize, "exactly the stock is drawn");
    let homes: BTreeSet<u8> = won
        .iter()
        .map(|&u| seckill::keys::home_segment(uid(u), SEGMENTS))
        .collect();
    assert!(homes.len() > 1, "winners in several segments: {homes:?}");
    assert_eq!(
        written_buyers(&app, id).await,
        won,
        "every winner's order is a row"
    );

    // One draw over every segment's entrants, as published and recomputed.
    let (status, draw) = app.get(&format!("/vouchers/{id}/draw"), None).await;
    assert_eq!(status, StatusCode::OK, "{draw}");
    let listed: Vec<i64> = serde_json::from_value(draw["entrants"].clone()).unwrap();
    let entered: BTreeSet<u8> = listed
        .iter()
        .map(|&u| seckill::keys::home_segment(uid(u), SEGMENTS))
        .collect();
    assert_eq!(
        entered.len(),
        SEGMENTS as usize,
        "entrants from every segment"
    );
    assert!(listed.len() > stock as usize, "{} entrants", listed.len());
    let drawn: BTreeSet<i64> = serde_json::from_value(draw["winners"].clone()).unwrap();
    assert_eq!(drawn, won);
    let (ok, said) = verify_draw(&[&app.url(""), &id.to_string()]).await;
    assert!(ok, "{said}");
    println!("{said}");

    // Each segment holds its winners' units, the allotments still the stock; every
    // segment rebuilt: no window, no entrant's mark left.
    let allotted = allotments(&app, id).await;
    assert_eq!(allotted.iter().sum::<i32>(), stock as i32, "{allotted:?}");
    for (segment, &units) in allotted.iter().enumerate() {
        let winners_here = won
            .iter()
            .filter(|&&u| seckill::keys::home_segment(uid(u), SEGMENTS) as usize == segment)
            .count();
        assert_eq!(
            units as usize, winners_here,
            "segment {segment}: {allotted:?}"
        );
    }
    assert!(!some_segment_holds_its_window(&app, id).await);

    // After the draw: a winner holds their order, a loser hears sold out.
    let winner = *won.iter().next().unwrap();
    let (_, body) = app.grab(id, winner).await;
    assert_eq!(body["error"]["code"], "already_ordered", "{body}");
    let loser = (1..=entrants).find(|u| !won.contains(u)).unwrap();
    let (_, body) = app.grab(id, loser).await;
    assert_eq!(body["error"]["code"], "sold_out", "{body}");

    // A winner's unit given back sells again, first come, to a loser of another
    // segment (units move between segments as in any segmented sale).
    let order = answers
        .iter()
        .find(|(user, _, _)| *user == winner)
        .and_then(|(_, a, _)| a.as_ref()?.1["order_id"].as_str().map(str::to_owned))
        .unwrap();
    let (status, body) = app.cancel(&order, winner).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let home = seckill::keys::home_segment(uid(winner), SEGMENTS);
    let elsewhere = (1..=entrants)
        .find(|&u| !won.contains(&u) && seckill::keys::home_segment(uid(u), SEGMENTS) != home)
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let (status, body) = app.grab(id, elsewhere).await;
        if status == StatusCode::ACCEPTED {
            break;
        }
        assert_eq!(body["error"]["code"], "sold_out", "{body}");
        assert!(
            std::time::Instant::now() < deadline,
            "the unit given back never sold again"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[sqlx::test(migrations = "./migrations")]
async fn a_segmented_lottery_with_units_left_after_its_draw_sells_them_first_come_and_never_more(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let (_processes, bases) = two_instances_and_a_worker(&app).await;
    let (stock, entrants, window_ms) = (30, 12, 1_500);
    let opening = json!({"mode": "lottery", "window_ms": window_ms});
    let voucher = sale_in_segments(&app, stock, 2_000, opening, SEGMENTS).await;
    let id = voucher["id"].as_i64().unwrap();
    until_after_begin(&voucher, 100).await;

    // The entrants press in the window; the others just as it closes, while the draw
    // is being made (their segments may not be rebuilt yet: they wait for it).
    let late = async {
        until_after_begin(&voucher, window_ms as u64 + 50).await;
        press_together(&app, &bases, id, 1_001..=1_040).await
    };
    let (held, late) = futures::join!(press_together(&app, &bases, id, 1..=entrants), late);
    let bound = Duration::from_millis(window_ms as u64 + 500);
    let drawn = won_among(&held, bound);
    assert_eq!(
        drawn.len(),
        entrants as usize,
        "every entrant wins: {drawn:?}"
    );
    let first_come = won_among(&late, bound);
    assert_eq!(
        first_come.len(),
        (stock - entrants) as usize,
        "the units left go first come, no more"
    );

    let buyers = written_buyers(&app, id).await;
    assert_eq!(buyers, drawn.union(&first_come).copied().collect());
    let left: i32 = sqlx::query_scalar("SELECT stock FROM seckill_vouchers WHERE voucher_id = $1")
        .bind(id)
        .fetch_one(&app.db)
        .await
        .unwrap();
    assert_eq!(left, 0, "never oversold");
    let (_, draw) = app.get(&format!("/vouchers/{id}/draw"), None).await;
    let listed: BTreeSet<i64> = serde_json::from_value(draw["entrants"].clone()).unwrap();
    assert_eq!(listed, drawn, "only window presses are entrants");
    assert!(!some_segment_holds_its_window(&app, id).await);
}

#[sqlx::test(migrations = "./migrations")]
async fn a_segmented_draw_happens_once_when_the_only_instance_holding_presses_is_killed_as_it_draws(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let (mut one, base_one) = app.spawn_server("api", &[]).await;
    let (_two, base_two) = app.spawn_server("api", &[]).await;
    let (stock, entrants, window_ms) = (20, 200, 1_500);
    let opening = json!({"mode": "lottery", "window_ms": window_ms});
    let voucher = sale_in_segments(&app, stock, 2_000, opening, SEGMENTS).await;
    let id = voucher["id"].as_i64().unwrap();
    until_after_begin(&voucher, 100).await;

    // Every held press is instance one's, so it draws; it is killed just after the
    // window's end: before, during or after its record, or amid its segments' rebuilds.
    let kill = async {
        until_after_begin(&voucher, window_ms as u64 + 15).await;
        one.kill9();
    };
    let bases = [base_one];
    let (answers, ()) = tokio::join!(press_together(&app, &bases, id, 1..=entrants), kill);
    let answered = answers.iter().filter(|(_, a, _)| a.is_some()).count();

    // Another instance (every instance looks each second) finishes the draw with
    // nobody pressing: recorded once, every segment rebuilt.
    let deadline = Instant::now() + Duration::from_secs(15);
    while draws_recorded(&app, id).await == 0 || some_segment_holds_its_window(&app, id).await {
        assert!(Instant::now() < deadline, "the draw was never finished");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Everyone presses again elsewhere: exactly the stock holds an order.
    let again = press_through_503s(&app, &base_two, id, 1..=entrants).await;
    let mut won = BTreeSet::new();
    for (user, (status, body)) in &again {
        match body["error"]["code"].as_str() {
            Some("already_ordered") => {
                won.insert(*user);
            }
            Some("sold_out") => {}
            _ => panic!("user {user}: {status} {body}"),
        }
    }
    assert_eq!(won.len(), stock as usize, "one draw, exactly the stock");
    for (user, answer, _) in &answers {
        if let Some((StatusCode::ACCEPTED, _)) = answer {
            assert!(won.contains(user), "a 202 before the kill stands: {user}");
        }
    }
    assert_eq!(written_buyers(&app, id).await, won);
    assert_eq!(draws_recorded(&app, id).await, 1);
    let (_, draw) = app.get(&format!("/vouchers/{id}/draw"), None).await;
    let drawn: BTreeSet<i64> = serde_json::from_value(draw["winners"].clone()).unwrap();
    assert_eq!(drawn, won, "the winners are the draw's");
    let (ok, said) = verify_draw(&[&app.url(""), &id.to_string()]).await;
    assert!(ok, "{said}");
    assert_eq!(allotments(&app, id).await.iter().sum::<i32>(), stock as i32);
    println!("{answered} of {entrants} presses answered before the kill; {said}");
}

#[sqlx::test(migrations = "./migrations")]
async fn a_segmented_draw_redis_loses_after_answering_is_not_drawn_again_and_its_winners_stand(
    db: PgPool,
) {
    let mut redis = PrivateRedis::start();
    let app = TestApp::spawn_with(db, redis.url.clone(), true).await;
    let (_api, base) = app.spawn_server("api", &[]).await;
    let (stock, entrants, window_ms) = (10, 60, 1_500);
    let opening = json!({"mode": "lottery", "window_ms": window_ms});
    let voucher = sale_in_segments(&app, stock, 1_500, opening, SEGMENTS).await;
    let id = voucher["id"].as_i64().unwrap();
    until_after_begin(&voucher, 100).await;

    let won =
        press_with_a_snapshot_late_in_the_window(&app, &redis, &base, &voucher, entrants).await;
    assert_eq!(won.len(), stock as usize, "exactly the stock is drawn");

    // Redis back from the snapshot: every segment holds its window again.
    redis.crash_and_restart();
    assert!(some_segment_holds_its_window(&app, id).await);

    // Everyone presses again: the winners hold their orders, nobody else wins anything.
    let again = press_through_503s(&app, &base, id, 1..=entrants + 20).await;
    for (user, (status, body)) in &again {
        match won.get(user) {
            Some(order) => {
                assert_eq!(
                    body["error"]["code"], "already_ordered",
                    "winner {user}: {status} {body}"
                );
                assert_eq!(body["error"]["order_id"].as_str(), Some(order.as_str()));
            }
            None => assert_eq!(
                body["error"]["code"], "sold_out",
                "user {user}: {status} {body}"
            ),
        }
    }
    let buyers = written_buyers(&app, id).await;
    assert_eq!(buyers, won.keys().copied().collect::<BTreeSet<_>>());
    assert_eq!(app.pg_stock(id).await, 0);
    assert_eq!(draws_recorded(&app, id).await, 1);
    assert!(!some_segment_holds_its_window(&app, id).await);
    let (ok, said) = verify_draw(&[&app.url(""), &id.to_string()]).await;
    assert!(ok, "{said}");
}

#[sqlx::test(migrations = "./migrations")]
async fn a_winner_whose_order_closed_is_never_told_of_it_by_a_segment_the_draw_has_not_rebuilt(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let (stock, entrants, window_ms) = (4, 12, 600);
    let opening = json!({"mode": "lottery", "window_ms": window_ms});
    let voucher = sale_in_segments(&app, stock, 1_000, opening, SEGMENTS).await;
    let id = voucher["id"].as_i64().unwrap();
    until_after_begin(&voucher, 100).await;
    let bases = [app.url("")];
    let answers = press_together(&app, &bases, id, 1..=entrants).await;
    let (user, order) = answers
        .iter()
        .find_map(|(user, answer, _)| match answer {
            Some((StatusCode::ACCEPTED, body)) => {
                Some((*user, body["order_id"].as_str().unwrap().to_owned()))
            }
            _ => None,
        })
        .expect("a winner");
    // (The held presses are answered before the segments' rebuilds: those done first.)
    let deadline = Instant::now() + Duration::from_secs(15);
    while some_segment_holds_its_window(&app, id).await {
        assert!(Instant::now() < deadline, "the segments were never rebuilt");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, body) = app.cancel(&order, user).await;
    assert_eq!(status, StatusCode::OK, "{body}");

    // The winner's segment as it was between the draw's record and its rebuild: still
    // holding its window, the winner marked an entrant under the order the draw gave.
    // (Its epoch one past the one Postgres names, for now: admitted from, and left alone
    // by every rebuild, each instance's look each second included.)
    let segment = SaleSegment::home_of(vid(id), uid(user), SEGMENTS);
    let end = time_at(&voucher["seckill"]["begin_time"]).timestamp_millis() + window_ms;
    let epoch: i64 =
        sqlx::query_scalar("SELECT epoch FROM sale_epochs WHERE voucher_id = $1 AND segment = $2")
            .bind(id)
            .bind(segment.segment as i16)
            .fetch_one(&app.db)
            .await
            .unwrap();
    let set = |fields: Vec<String>| {
        let mut redis = app.redis.clone();
        let key = app.keys.segment(segment);
        async move {
            let _: () = redis::cmd("HSET")
                .arg(key)
                .arg(fields)
                .query_async(&mut redis)
                .await
                .unwrap();
        }
    };
    set(vec![
        "lottery_end".into(),
        end.to_string(),
        format!("u:{user}"),
        format!("e{order}"),
        "epoch".into(),
        (epoch + 1).to_string(),
    ])
    .await;
    let (status, body) = app.grab(id, user).await;
    assert_eq!(
        status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{body}: told of a cancelled order?"
    );
    assert!(
        body["error"]["message"].as_str().unwrap().contains("drawn"),
        "{body}"
    );
    assert_eq!(body["error"]["order_id"], Value::Null, "{body}");

    // Once the segment is rebuilt from Postgres, the unit given back sells again: to
    // this shopper, under a new order.
    set(vec!["epoch".into(), epoch.to_string()]).await;
    let again = press_through_503s(&app, &bases[0], id, [user]).await;
    let (status, body) = &again[&user];
    assert_eq!(*status, StatusCode::ACCEPTED, "{body}");
    assert_ne!(body["order_id"].as_str(), Some(order.as_str()));
    assert!(!some_segment_holds_its_window(&app, id).await);
    assert_eq!(allotments(&app, id).await.iter().sum::<i32>(), stock as i32);
}

#[sqlx::test(migrations = "./migrations")]
async fn a_draw_takes_no_entries_from_a_segment_copy_postgres_no_longer_names(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let (stock, window_ms) = (3, 600);
    let opening = json!({"mode": "lottery", "window_ms": window_ms});
    let voucher = sale_in_segments(&app, stock, 1_000, opening, SEGMENTS).await;
    let id = voucher["id"].as_i64().unwrap();
    // Nobody enters in segment 0: its copy gives the draw no winner, only its word that
    // it holds every entrant it was given.
    let entrants: Vec<i64> = (1..=60)
        .filter(|&u| seckill::keys::home_segment(uid(u), SEGMENTS) != 0)
        .collect();
    // Postgres names another build of segment 0 than the one Redis holds (as when an
    // old primary still answers after a failover, the sale rebuilt on the new one).
    let moved = |by: i64| {
        sqlx::query(
            "UPDATE sale_epochs SET epoch = epoch + $2 WHERE voucher_id = $1 AND segment = 0",
        )
        .bind(id)
        .bind(by)
        .execute(&app.db)
    };
    until_after_begin(&voucher, 100).await;
    let bases = [app.url("")];
    let (answers, _) = tokio::join!(press_together(&app, &bases, id, entrants.clone()), async {
        until_after_begin(&voucher, window_ms as u64 / 2).await;
        moved(1_000).await.unwrap()
    });
    for (user, answer, _) in &answers {
        let (status, body) = answer.as_ref().expect("answered");
        assert_eq!(
            body["error"]["outcome"], "unknown",
            "user {user}: {status} {body}: answered from a draw that read an unnamed copy"
        );
    }
    until_after_begin(&voucher, window_ms as u64 + 1_500).await;
    assert_eq!(
        draws_recorded(&app, id).await,
        0,
        "a draw over an unnamed copy"
    );

    // Postgres names the copy again: the draw is made (each instance looks each second).
    moved(-1_000).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    while draws_recorded(&app, id).await == 0 || some_segment_holds_its_window(&app, id).await {
        assert!(Instant::now() < deadline, "the draw was never made");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let again = press_through_503s(&app, &bases[0], id, entrants.clone()).await;
    let won: BTreeSet<i64> = again
        .iter()
        .filter(|(_, (_, body))| body["error"]["code"] == "already_ordered")
        .map(|(user, _)| *user)
        .collect();
    assert_eq!(won.len(), stock as usize, "{again:?}");
    let (ok, said) = verify_draw(&[&app.url(""), &id.to_string()]).await;
    assert!(ok, "{said}");
}
