//! Units moved between parts: a move left half done (its mover killed after taking the
//! units) is finished exactly once by whoever finds it, or voided by a rebuild of the
//! donor, never both.

use super::*;
use crate::common::vid;
use seckill::keys::SalePart;

/// An instance that does not finish moves by itself: each test finishes (or voids) its
/// half-done move when it means to.
async fn app_without_finisher(db: PgPool) -> TestApp {
    let settings = seckill::config::Settings {
        finish_moves_every: None,
        ..Default::default()
    };
    TestApp::spawn_with_settings(db, settings).await
}

/// Takes `units` out of `from` for `to` as move `id`, as a mover does before it records
/// the move in Postgres (and as it leaves the sale when killed right after).
async fn take(app: &TestApp, voucher: i64, from: u8, to: u8, id: i64, units: i64) -> i64 {
    let part = SalePart::new(vid(voucher), from, 3);
    app.redis_cmd(
        redis::cmd("FCALL")
            .arg("seckill_take")
            .arg(2)
            .arg(app.keys.part(part))
            .arg(app.keys.moves_out(part))
            .arg(id)
            .arg(units)
            .arg(to),
    )
    .await
}

/// Each part's stock in Redis.
async fn part_stocks(app: &TestApp, voucher: i64, parts: u8) -> Vec<i64> {
    let mut out = Vec::new();
    for part in SalePart::all(vid(voucher), parts) {
        let stock: Option<i64> = app
            .redis_cmd(redis::cmd("HGET").arg(app.keys.part(part)).arg("stock"))
            .await;
        out.push(stock.expect("every part loaded"));
    }
    out
}

async fn allotments(app: &TestApp, voucher: i64) -> Vec<i32> {
    sqlx::query_scalar("SELECT allotted FROM seckill_parts WHERE voucher_id = $1 ORDER BY part")
        .bind(voucher)
        .fetch_all(&app.db)
        .await
        .unwrap()
}

/// Sells out the rest with fresh shoppers: how many were admitted.
async fn sell_out(app: &TestApp, voucher: i64, from_user: i64, shoppers: i64) -> usize {
    let answers = press_all(app, &app.base, voucher, from_user..from_user + shoppers, 16).await;
    winners(&answers).len()
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_move_a_dead_mover_left_taken_is_credited_once_by_finishers_racing(db: PgPool) {
    let app = app_without_finisher(db).await;
    let voucher = segmented_sale(&app, 30, 3).await;
    assert_eq!(take(&app, voucher, 1, 0, 777, 4).await, 4);
    assert_eq!(part_stocks(&app, voucher, 3).await, [10, 6, 10]);
    // On their way: the books still balance (the units are counted as in transit).
    let (code, books) = app.cli(&["reconcile", "--voucher", &voucher.to_string()]);
    assert_eq!(code, 0, "{books}");

    // Three finishers at once (every instance looks every second): one credit.
    let parts = &app.state.parts;
    let (a, b, c) = tokio::join!(
        parts.finish(vid(voucher), 3),
        parts.finish(vid(voucher), 3),
        parts.finish(vid(voucher), 3)
    );
    let credited = [a, b, c].map(|f| f.unwrap().credited);
    assert_eq!(
        credited.iter().sum::<usize>(),
        1,
        "credited once: {credited:?}"
    );
    assert_eq!(part_stocks(&app, voucher, 3).await, [14, 6, 10]);
    assert_eq!(allotments(&app, voucher).await, [14, 6, 10]);
    assert_eq!(parts.finish(vid(voucher), 3).await.unwrap().found, 0);
    let (code, books) = app.cli(&["reconcile", "--voucher", &voucher.to_string()]);
    assert_eq!(code, 0, "{books}");

    assert_eq!(
        sell_out(&app, voucher, 1, 45).await,
        30,
        "no unit lost or doubled"
    );
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_move_taken_but_not_recorded_is_void_once_a_repair_rebuilt_the_donor(db: PgPool) {
    let app = app_without_finisher(db).await;
    let voucher = segmented_sale(&app, 30, 3).await;
    assert_eq!(take(&app, voucher, 2, 1, 888, 5).await, 5);
    let (code, out) = app.cli(&["reconcile", "--repair", "--voucher", &voucher.to_string()]);
    assert_eq!(code, 0, "{out}");
    // The donor has its units back from its allotment; the move's record is gone, so
    // nobody can record or credit it any more.
    assert_eq!(part_stocks(&app, voucher, 3).await, [10, 10, 10]);
    assert_eq!(
        app.state
            .parts
            .finish(vid(voucher), 3)
            .await
            .unwrap()
            .credited,
        0
    );
    assert_eq!(part_stocks(&app, voucher, 3).await, [10, 10, 10]);
    assert_eq!(allotments(&app, voucher).await, [10, 10, 10]);
    assert_eq!(
        sell_out(&app, voucher, 1, 45).await,
        30,
        "no unit lost or doubled"
    );
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_move_recorded_but_not_credited_is_counted_by_a_rebuild_of_the_recipient_once(
    db: PgPool,
) {
    let app = app_without_finisher(db).await;
    let voucher = segmented_sale(&app, 30, 3).await;
    assert_eq!(take(&app, voucher, 0, 2, 999, 3).await, 3);
    // Recorded (a mover killed between its two transactions): the allotments moved.
    let mut tx = app.db.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM seckill_vouchers WHERE voucher_id = $1 FOR UPDATE")
        .bind(voucher)
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO seckill_part_moves (id, voucher_id, from_part, to_part, units) \
         VALUES (999, $1, 0, 2, 3)",
    )
    .bind(voucher)
    .execute(&mut *tx)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE seckill_parts SET allotted = allotted + CASE part WHEN 0 THEN -3 ELSE 3 END \
         WHERE voucher_id = $1 AND part IN (0, 2)",
    )
    .bind(voucher)
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let (code, books) = app.cli(&["reconcile", "--voucher", &voucher.to_string()]);
    assert_eq!(code, 0, "in transit, balanced: {books}");
    // A repair rebuilds every part from Postgres: the recipient gets the units from its
    // allotment, and the move is marked as credited there, so finishing it adds nothing.
    let (code, out) = app.cli(&["reconcile", "--repair", "--voucher", &voucher.to_string()]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(part_stocks(&app, voucher, 3).await, [7, 10, 13]);
    assert_eq!(
        app.state
            .parts
            .finish(vid(voucher), 3)
            .await
            .unwrap()
            .credited,
        0
    );
    assert_eq!(part_stocks(&app, voucher, 3).await, [7, 10, 13]);
    let uncredited: i64 =
        sqlx::query_scalar("SELECT count(*) FROM seckill_part_moves WHERE credited_at IS NULL")
            .fetch_one(&app.db)
            .await
            .unwrap();
    assert_eq!(uncredited, 0);
    assert_eq!(
        sell_out(&app, voucher, 1, 45).await,
        30,
        "no unit lost or doubled"
    );
}
