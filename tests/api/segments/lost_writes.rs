//! A segmented sale when Redis hands back an older state of one segment (a restart from a
//! snapshot, a failover to a lagging replica), or moves race: never a unit twice, and
//! never `sold_out` while some segment may still have one.

use super::*;
use crate::common::uid;
use seckill::keys::home_segment;

/// `n` users whose home is `segment` of a sale in `segments` segments, from id `from` on.
fn users_of(segment: u8, segments: u8, from: i64, n: usize) -> Vec<i64> {
    (from..)
        .filter(|u| home_segment(uid(*u), segments) == segment)
        .take(n)
        .collect()
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_move_a_repair_voided_is_not_recorded_when_an_older_donor_brings_it_back(db: PgPool) {
    let app = app_without_finisher(db).await;
    let voucher = segmented_sale(&app, 30, 3).await;
    let p1 = SaleSegment::new(vid(voucher), 1, 3);
    let (state, moves_out) = (app.keys.segment(p1), app.keys.moves_out(p1));
    assert_eq!(take(&app, p1, 0, 5151, 5).await, 5);
    // What an older copy of segment 1's server will hold: the units taken, the record.
    let old_state: Vec<u8> = app.redis_cmd(redis::cmd("DUMP").arg(&state)).await;
    let old_moves: Vec<u8> = app.redis_cmd(redis::cmd("DUMP").arg(&moves_out)).await;
    // A repair voids the move; segment 1's shoppers buy its ten units.
    let (code, out) = app.cli(&["reconcile", "--repair", "--voucher", &voucher.to_string()]);
    assert_eq!(code, 0, "{out}");
    for user in users_of(1, 3, 1, 10) {
        let (status, body) = app.grab(voucher, user).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    }
    app.drain().await;
    // Segment 1's server comes back older, in a new term (its state stale until healed).
    for (key, dump) in [(&state, old_state), (&moves_out, old_moves)] {
        let _: () = app
            .redis_cmd(
                redis::cmd("RESTORE")
                    .arg(key)
                    .arg(0)
                    .arg(dump)
                    .arg("REPLACE"),
            )
            .await;
    }
    let _: () = app
        .redis_cmd(
            redis::cmd("HSET")
                .arg(&state)
                .arg("term")
                .arg("an older life"),
        )
        .await;
    // A finisher runs before the heal: the record in a stale state is not recorded.
    let done = app
        .state
        .admission
        .segments
        .finish(vid(voucher), 3)
        .await
        .unwrap();
    assert_eq!(done.credited, 0);
    let moved: i64 = sqlx::query_scalar("SELECT count(*) FROM seckill_segment_moves")
        .fetch_one(&app.db)
        .await
        .unwrap();
    assert_eq!(moved, 0, "the voided move stays void");
    let (code, out) = app.cli(&["reconcile", "--repair", "--voucher", &voucher.to_string()]);
    assert_eq!(code, 0, "{out}");
    let answers = press_all(&app, &app.base, voucher, 1000..1100, 16).await;
    assert_eq!(winners(&answers).len(), 20, "exactly the units left");
    app.drain().await;
    let dead: i64 = sqlx::query_scalar("SELECT count(*) FROM dead_orders")
        .fetch_one(&app.db)
        .await
        .unwrap();
    assert_eq!(dead, 0, "no 202 refused by Postgres");
    let (code, books) = app.cli(&["reconcile", "--voucher", &voucher.to_string()]);
    assert_eq!(code, 0, "{books}");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_segment_built_in_an_older_term_is_not_read_as_sold_out(db: PgPool) {
    let app = app_without_finisher(db).await;
    let voucher = segmented_sale(&app, 3, 3).await;
    let (zero, two) = (users_of(0, 3, 1, 3), users_of(2, 3, 1, 1));
    assert_eq!(app.grab(voucher, zero[0]).await.0, StatusCode::ACCEPTED);
    assert_eq!(app.grab(voucher, two[0]).await.0, StatusCode::ACCEPTED);
    // Segment 1 as an older copy of its server had it: none left, another term.
    let p1 = app.keys.segment(SaleSegment::new(vid(voucher), 1, 3));
    let _: () = app
        .redis_cmd(
            redis::cmd("HSET")
                .arg(&p1)
                .arg("stock")
                .arg(0)
                .arg("term")
                .arg("old"),
        )
        .await;
    let (status, body) = app.grab(voucher, zero[1]).await;
    assert_eq!(
        status,
        StatusCode::SERVICE_UNAVAILABLE,
        "not sold out: {body}"
    );
    // Rebuilt from Postgres, its unit is there.
    let (code, out) = app.cli(&["reconcile", "--repair", "--voucher", &voucher.to_string()]);
    assert_eq!(code, 0, "{out}");
    let (status, body) = app.grab(voucher, zero[2]).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_drained_segment_waits_for_a_move_another_instance_is_finishing(db: PgPool) {
    let app = app_without_finisher(db).await;
    let voucher = segmented_sale(&app, 3, 3).await;
    let (zero, two) = (users_of(0, 3, 1, 2), users_of(2, 3, 1, 1));
    assert_eq!(app.grab(voucher, zero[0]).await.0, StatusCode::ACCEPTED);
    // Another instance takes segment 1's unit for segment 2, whose own unit then sells.
    let (from, to) = (
        SaleSegment::new(vid(voucher), 1, 3),
        SaleSegment::new(vid(voucher), 2, 3),
    );
    assert_eq!(take(&app, from, 2, 4242, 1).await, 1);
    assert_eq!(app.grab(voucher, two[0]).await.0, StatusCode::ACCEPTED);
    // It holds the sale's lock to record the move, then credits it, slowly.
    let mut tx = lock_sale(&app, voucher).await;
    let mover = async {
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        record_by_hand(&mut tx, voucher, (4242, 1, 2, 1)).await;
        let credited: i64 = app
            .redis_cmd(
                redis::cmd("FCALL")
                    .arg("seckill_credit")
                    .arg(3)
                    .arg(app.keys.segment(to))
                    .arg(app.keys.moves_in(to))
                    .arg(app.keys.segment_marker(to))
                    .arg(4242)
                    .arg(1)
                    .arg(""),
            )
            .await;
        assert_eq!(credited, 1);
        sqlx::query("UPDATE seckill_segment_moves SET credited_at = now() WHERE id = 4242")
            .execute(&mut *tx)
            .await
            .unwrap();
        tx.commit().await.unwrap();
    };
    // Meanwhile a shopper of segment 0 (drained) presses: the unit on its way is theirs.
    let ((status, body), ()) = tokio::join!(app.grab(voucher, zero[1]), mover);
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    app.drain().await;
    let (code, books) = app.cli(&["reconcile", "--voucher", &voucher.to_string()]);
    assert_eq!(code, 0, "{books}");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_grab_routed_as_if_the_sale_had_one_segment_is_not_decided_in_segment_zero(db: PgPool) {
    use seckill::admission::{admit_many, Grab, Outcome};
    let app = app_without_finisher(db).await;
    let voucher = segmented_sale(&app, 30, 3).await;
    // An instance that read the sale's segments before it was loaded routes a user of segment
    // 2 to segment 0, as for a sale in one segment: refused, nothing taken.
    let user = users_of(2, 3, 1, 1)[0];
    let grab = |segment, segments| Grab {
        voucher_id: vid(voucher),
        user_id: uid(user),
        order_id: crate::common::oid(77),
        segment,
        segments,
    };
    let shard = app.keys.shard_of(vid(voucher));
    let outcomes = admit_many(
        &mut app.redis.clone(),
        &app.keys,
        shard,
        &[grab(0, 1)],
        seckill::scripts::Replicas::NONE,
        &Default::default(),
    )
    .await
    .unwrap();
    assert_eq!(outcomes, [Outcome::NotLoaded]);
    assert_eq!(app.redis_stock(voucher).await, Some(30));
    // Routed by its segments, the same grab is admitted in its home segment.
    let home = SaleSegment::new(vid(voucher), 2, 3);
    let outcomes = admit_many(
        &mut app.redis.clone(),
        &app.keys,
        app.keys.shard_of_segment(home),
        &[grab(2, 3)],
        seckill::scripts::Replicas::NONE,
        &Default::default(),
    )
    .await
    .unwrap();
    assert!(
        matches!(outcomes[..], [Outcome::Admitted { .. }]),
        "{outcomes:?}"
    );
}
