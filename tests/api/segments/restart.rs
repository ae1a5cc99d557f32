//! A real restart of the Redis under a segmented sale, from a snapshot taken before some
//! of its parts drained and took units from the others: the term watcher alone sees the
//! older server, every part is rebuilt from Postgres (allotments with their recorded
//! moves), and the sale sells exactly the units left, in any part.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::Value;
use sqlx::PgPool;

use super::segmented_sale_at;
use crate::common::faults::PrivateRedis;
use crate::common::{metric_value, metrics_at, uid, TestApp};
use crate::rollback::{press_through_503s, until_reconcile_is_clean, won};
use seckill::keys::home_part;

const STOCK: i64 = 300;
const PARTS: u8 = 3;

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_restart_from_an_older_snapshot_under_a_segmented_sale_heals_itself_and_sells_exactly_the_units_left(
    db: PgPool,
) {
    let mut redis = PrivateRedis::start();
    let app = TestApp::spawn_with(db, redis.url.clone(), true).await;
    let (_server, base) = app.spawn_server("serve", &[]).await;
    let sale = segmented_sale_at(&app.client, &base, &app.admin_token(), STOCK, PARTS as i64).await;

    // 120 winners spread over the parts, in Postgres; then the snapshot.
    let first = won(&press_through_503s(&app, &base, sale, 1..=120).await);
    assert_eq!(first.len(), 120);
    assert_eq!(
        app.wait_for_orders(sale, 120, Duration::from_secs(30))
            .await,
        120
    );
    redis.save();

    // After it: 120 shoppers of part 0 alone, which drains and takes units from the
    // others (moves recorded in Postgres), and 5 cancels, their units given back.
    let crowd_of_part_0: Vec<i64> = (2_000..)
        .filter(|u| home_part(uid(*u), PARTS) == 0)
        .take(120)
        .collect();
    let second = won(&press_through_503s(&app, &base, sale, crowd_of_part_0.clone()).await);
    assert_eq!(
        second.len(),
        120,
        "part 0 drained and took units from the others"
    );
    assert_eq!(
        app.wait_for_orders(sale, 240, Duration::from_secs(30))
            .await,
        240
    );
    let moved: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(units), 0)::bigint FROM seckill_part_moves WHERE voucher_id = $1 AND to_part = 0",
    )
    .bind(sale)
    .fetch_one(&app.db)
    .await
    .unwrap();
    assert!(moved > 0, "no unit moved to part 0");
    for user in 1..=5 {
        let (status, body) = app.cancel(&first[&user].to_string(), user).await;
        assert_eq!(status, StatusCode::OK, "{body}");
    }
    assert_eq!(app.owed_releases().await, 0, "releases made in Redis");

    // The bad night: Redis killed and started again from the snapshot, which knows
    // neither the moves, nor the second crowd, nor the cancels. Nobody runs anything.
    redis.crash_and_restart();
    let restarted = Instant::now();
    let again: Vec<i64> = (1..=120).chain(crowd_of_part_0.iter().copied()).collect();
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
        "the units left, in whatever part, no more"
    );
    for (status, body) in fresh.values() {
        if *status != StatusCode::ACCEPTED {
            assert_eq!(body["error"]["code"], "sold_out", "{body}");
        }
    }

    let all: Vec<i64> = [&first, &second, &won_again, &fresh_won]
        .iter()
        .flat_map(|m| m.values().copied())
        .collect();
    assert_eq!(
        all.iter().collect::<HashSet<_>>().len(),
        all.len(),
        "an order id twice"
    );
    assert_eq!(
        app.wait_for_orders(sale, 300, Duration::from_secs(30))
            .await,
        300
    );
    let stored = app.assert_consistent(sale, STOCK).await;
    let cancelled: HashSet<i64> = (1..=5).map(|u| first[&u]).collect();
    let active: HashSet<i64> = all
        .into_iter()
        .filter(|id| !cancelled.contains(id))
        .collect();
    assert_eq!(
        stored, active,
        "the active orders are exactly the 202s not cancelled"
    );
    let reconciled_in = until_reconcile_is_clean(&app, Duration::from_secs(30)).await;

    let metrics = metrics_at(&app.client, &base).await;
    let healed = metric_value(&metrics, "seckill_redis_rollbacks_healed_total").unwrap();
    let no_stock = metric_value(&metrics, "seckill_dead_lettered_total{kind=\"no_stock\"}");
    assert!(healed >= 1.0, "the rollback was counted: {healed}");
    assert_eq!(no_stock, Some(0.0), "no 202 beyond the stock");
    println!(
        "segmented sale restarted from an older snapshot: {} units moved to part 0 before it; \
         202s {} ({} of them cancelled) for {STOCK} units, oversold 0; first answers again \
         after {:.1} s, reconcile clean {:.1} s later",
        moved,
        active.len() + cancelled.len(),
        cancelled.len(),
        healed_in.as_secs_f64(),
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
