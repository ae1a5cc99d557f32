//! Units moved between segments: a move left half done (its mover killed after taking the
//! units) is finished exactly once by whoever finds it, or voided by a rebuild of the
//! donor, never both.

use super::*;

/// Segment `p` of a test's sale in three segments.
fn segment(voucher: i64, p: u8) -> SaleSegment {
    SaleSegment::new(vid(voucher), p, 3)
}

/// Each segment's stock in Redis.
async fn segment_stocks(app: &TestApp, voucher: i64, segments: u8) -> Vec<i64> {
    let mut out = Vec::new();
    for segment in SaleSegment::all(vid(voucher), segments) {
        let stock: Option<i64> = app
            .redis_cmd(
                redis::cmd("HGET")
                    .arg(app.keys.segment(segment))
                    .arg("stock"),
            )
            .await;
        out.push(stock.expect("every segment loaded"));
    }
    out
}

/// Each segment's allotment, as Postgres holds it.
pub(crate) async fn allotments(app: &TestApp, voucher: i64) -> Vec<i32> {
    sqlx::query_scalar(
        "SELECT allotted FROM seckill_segments WHERE voucher_id = $1 ORDER BY segment",
    )
    .bind(voucher)
    .fetch_all(&app.db)
    .await
    .unwrap()
}

/// The segments hold `stocks`, and finishing moves credits nothing and leaves them so.
async fn finishing_changes_nothing(app: &TestApp, voucher: i64, stocks: [i64; 3]) {
    assert_eq!(segment_stocks(app, voucher, 3).await, stocks);
    let done = app
        .state
        .admission
        .segments
        .finish(vid(voucher), 3)
        .await
        .unwrap();
    assert_eq!(done.credited, 0);
    assert_eq!(segment_stocks(app, voucher, 3).await, stocks);
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
    assert_eq!(take(&app, segment(voucher, 1), 0, 777, 4).await, 4);
    assert_eq!(segment_stocks(&app, voucher, 3).await, [10, 6, 10]);
    // On their way: the books still balance (the units are counted as in transit).
    let (code, books) = app.cli(&["reconcile", "--voucher", &voucher.to_string()]);
    assert_eq!(code, 0, "{books}");

    // Three finishers at once (every instance looks every second): one credit.
    let segments = &app.state.admission.segments;
    let (a, b, c) = tokio::join!(
        segments.finish(vid(voucher), 3),
        segments.finish(vid(voucher), 3),
        segments.finish(vid(voucher), 3)
    );
    let credited = [a, b, c].map(|f| f.unwrap().credited);
    assert_eq!(
        credited.iter().sum::<usize>(),
        1,
        "credited once: {credited:?}"
    );
    assert_eq!(segment_stocks(&app, voucher, 3).await, [14, 6, 10]);
    assert_eq!(allotments(&app, voucher).await, [14, 6, 10]);
    assert_eq!(segments.finish(vid(voucher), 3).await.unwrap().found, 0);
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
    assert_eq!(take(&app, segment(voucher, 2), 1, 888, 5).await, 5);
    let (code, out) = app.cli(&["reconcile", "--repair", "--voucher", &voucher.to_string()]);
    assert_eq!(code, 0, "{out}");
    // The donor has its units back from its allotment; the move's record is gone, so
    // nobody can record or credit it any more.
    finishing_changes_nothing(&app, voucher, [10, 10, 10]).await;
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
    assert_eq!(take(&app, segment(voucher, 0), 2, 999, 3).await, 3);
    // Recorded (a mover killed between its two transactions): the allotments moved.
    let mut tx = lock_sale(&app, voucher).await;
    record_by_hand(&mut tx, voucher, (999, 0, 2, 3)).await;
    tx.commit().await.unwrap();
    let (code, books) = app.cli(&["reconcile", "--voucher", &voucher.to_string()]);
    assert_eq!(code, 0, "in transit, balanced: {books}");
    // A repair rebuilds every segment from Postgres: the recipient gets the units from its
    // allotment, and the move is marked as credited there, so finishing it adds nothing.
    let (code, out) = app.cli(&["reconcile", "--repair", "--voucher", &voucher.to_string()]);
    assert_eq!(code, 0, "{out}");
    finishing_changes_nothing(&app, voucher, [7, 10, 13]).await;
    let uncredited: i64 =
        sqlx::query_scalar("SELECT count(*) FROM seckill_segment_moves WHERE credited_at IS NULL")
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
