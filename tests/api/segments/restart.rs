//! A real restart of the Redis under a segmented sale, from a snapshot taken before some
//! of its segments drained and took units from the others: the term watcher alone sees the
//! older server, every segment is rebuilt from Postgres (allotments with their recorded
//! moves), and the sale sells exactly the units left, in any segment.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::Value;
use sqlx::PgPool;

use super::segmented_sale_at;
use crate::common::faults::PrivateRedis;
use crate::common::{uid, vid, TestApp};
use crate::recovery::rollback::{press_through_503s, the_books_after_the_restart, won};
use seckill::keys::{home_segment, SaleSegment};

const STOCK: i64 = 300;
const SEGMENTS: u8 = 3;

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_restart_from_an_older_snapshot_under_a_segmented_sale_heals_itself_and_sells_exactly_the_units_left(
    db: PgPool,
) {
    let mut redis = PrivateRedis::start();
    let app = TestApp::spawn_with(db, redis.url.clone(), true).await;
    let (_server, base) = app.spawn_server("serve", &[]).await;
    let sale = segmented_sale_at(
        &app.client,
        &base,
        &app.admin_token(),
        STOCK,
        SEGMENTS as i64,
    )
    .await;
    // A second sale nobody presses after the restart: only the term watcher can
    // rebuild it.
    let idle = segmented_sale_at(&app.client, &base, &app.admin_token(), 30, SEGMENTS as i64).await;
    let idle_early = won(&press_through_503s(&app, &base, idle, 1..=10).await);
    assert_eq!(idle_early.len(), 10);

    // 120 winners spread over the segments, in Postgres; then the snapshot.
    let first = won(&press_through_503s(&app, &base, sale, 1..=120).await);
    assert_eq!(first.len(), 120);
    assert_eq!(
        app.wait_for_orders(sale, 120, Duration::from_secs(30))
            .await,
        120
    );
    assert_eq!(
        app.wait_for_orders(idle, 10, Duration::from_secs(30)).await,
        10
    );
    redis.save();

    // After it: 120 shoppers of segment 0 alone, which drains and takes units from the
    // others (moves recorded in Postgres), and 5 cancels, their units given back.
    let crowd_of_segment_0: Vec<i64> = (2_000..)
        .filter(|u| home_segment(uid(*u), SEGMENTS) == 0)
        .take(120)
        .collect();
    let second = won(&press_through_503s(&app, &base, sale, crowd_of_segment_0.clone()).await);
    assert_eq!(
        second.len(),
        120,
        "segment 0 drained and took units from the others"
    );
    assert_eq!(
        app.wait_for_orders(sale, 240, Duration::from_secs(30))
            .await,
        240
    );
    let moved: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(units), 0)::bigint FROM seckill_segment_moves WHERE voucher_id = $1 AND to_segment = 0",
    )
    .bind(sale)
    .fetch_one(&app.db)
    .await
    .unwrap();
    assert!(moved > 0, "no unit moved to segment 0");
    let idle_late = won(&press_through_503s(&app, &base, idle, 11..=20).await);
    assert_eq!(idle_late.len(), 10);
    assert_eq!(
        app.wait_for_orders(idle, 20, Duration::from_secs(30)).await,
        20
    );
    for user in 1..=5 {
        let (status, body) = app.cancel(&first[&user].to_string(), user).await;
        assert_eq!(status, StatusCode::OK, "{body}");
    }
    assert_eq!(app.owed_releases().await, 0, "releases made in Redis");

    // The bad night: Redis killed and started again from the snapshot, which knows
    // neither the moves, nor the second crowd, nor the cancels. Nobody runs anything.
    redis.crash_and_restart();
    let restarted = Instant::now();
    let idle_rebuilt = tokio::spawn(until_rebuilt(
        redis.url.clone(),
        app.keys.clone(),
        idle,
        idle_late,
    ));
    let again: Vec<i64> = (1..=120)
        .chain(crowd_of_segment_0.iter().copied())
        .collect();
    let again = press_through_503s(&app, &base, sale, again).await;
    let healed_in = restarted.elapsed();
    let fresh = press_through_503s(&app, &base, sale, 5_001..=5_200).await;

    let held: HashMap<i64, i64> = first
        .iter()
        .chain(second.iter())
        .map(|(u, o)| (*u, *o))
        .collect();
    let won_again = check_the_winners_again(&again, &held);
    let fresh_won = won(&fresh);
    // 300 - (240 - 5 cancelled) active - 5 won again by the cancelled.
    assert_eq!(
        fresh_won.len(),
        60,
        "the units left, in whatever segment, no more"
    );
    for (status, body) in fresh.values() {
        if *status != StatusCode::ACCEPTED {
            assert_eq!(body["error"]["code"], "sold_out", "{body}");
        }
    }

    let idle_rebuilt_in = idle_rebuilt.await.unwrap();
    assert!(
        idle_rebuilt_in < Duration::from_secs(30),
        "the sale nobody pressed was not rebuilt with the winners after the snapshot"
    );
    let all: Vec<i64> = [&first, &second, &won_again, &fresh_won]
        .iter()
        .flat_map(|m| m.values().copied())
        .collect();
    let cancelled: HashSet<i64> = (1..=5).map(|u| first[&u]).collect();
    let reconciled_in =
        the_books_after_the_restart(&app, &base, sale, STOCK, &all, &cancelled).await;
    println!(
        "segmented sale restarted from an older snapshot: {} units moved to segment 0 before it; \
         202s {} ({} of them cancelled) for {STOCK} units, oversold 0; first answers again \
         after {:.1} s, the sale nobody pressed rebuilt after {:.1} s, reconcile clean \
         {:.1} s later",
        moved,
        all.len(),
        cancelled.len(),
        healed_in.as_secs_f64(),
        idle_rebuilt_in.as_secs_f64(),
        reconciled_in.as_secs_f64(),
    );
}

/// Earlier winners still hold their own orders; the five who cancelled win again. Their
/// new orders.
fn check_the_winners_again(
    again: &HashMap<i64, (StatusCode, Value)>,
    held: &HashMap<i64, i64>,
) -> HashMap<i64, i64> {
    let mut won_again = HashMap::new();
    for (user, (status, body)) in again {
        if *user <= 5 {
            assert_eq!(
                *status,
                StatusCode::ACCEPTED,
                "cancelled buyer {user}: {body}"
            );
            won_again.insert(*user, body["order_id"].as_str().unwrap().parse().unwrap());
        } else {
            assert_eq!(*status, StatusCode::CONFLICT, "user {user}: {body}");
            assert_eq!(body["error"]["code"], "already_ordered", "{body}");
            assert_eq!(
                body["error"]["order_id"],
                held[user].to_string(),
                "user {user}"
            );
        }
    }
    won_again
}

/// How long until Redis holds the buyer record of each of `winners` (user → order) of
/// `voucher` again, in their home segments: only a rebuild from Postgres brings back the
/// winners a snapshot did not know. Gives up after 30 s (and returns 30 s).
async fn until_rebuilt(
    url: String,
    keys: seckill::keys::Keys,
    voucher: i64,
    winners: HashMap<i64, i64>,
) -> Duration {
    let started = Instant::now();
    let limit = Duration::from_secs(30);
    let client = redis::Client::open(url).unwrap();
    while started.elapsed() < limit {
        if let Ok(mut conn) = client.get_multiplexed_async_connection().await {
            let mut all_there = true;
            for (user, order) in &winners {
                let segment = SaleSegment::home_of(vid(voucher), uid(*user), SEGMENTS);
                // The buyer field the admission script writes (`u:<user_id>`).
                let held: Option<String> = redis::cmd("HGET")
                    .arg(keys.segment(segment))
                    .arg(format!("u:{user}"))
                    .query_async(&mut conn)
                    .await
                    .unwrap_or(None);
                all_there &= held == Some(order.to_string());
            }
            if all_there {
                return started.elapsed();
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    limit
}
