//! An admission call's orders travel as one stream entry: written whole, a refused one
//! buried on its own, the entry acknowledged once, and never counted in flight again by
//! a rebuild once Postgres buried it.

use super::*;
use seckill::admission::{admit_many, Grab, Outcome};
use seckill::domain::{OrderId, UserId};

/// Three grabs of `voucher` decided by ONE call of the admission function.
async fn admit_in_one_call(app: &TestApp, voucher: i64, users: [i64; 3]) -> Vec<Outcome> {
    let grabs: Vec<Grab> = users
        .iter()
        .map(|&u| Grab {
            voucher_id: vid(voucher),
            user_id: UserId::new(u).unwrap(),
            order_id: OrderId::new(900_000 + u).unwrap(),
            segment: 0,
            segments: 1,
        })
        .collect();
    let mut conn = app.redis.clone();
    let shard = app.keys.shard_of(vid(voucher));
    admit_many(
        &mut conn,
        &app.keys,
        shard,
        &grabs,
        seckill::scripts::Replicas::NONE,
        &Default::default(),
    )
    .await
    .unwrap()
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn one_calls_orders_are_one_entry_written_whole_and_a_buried_one_is_not_counted_again(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(10).await;
    let stream = app.keys.stream(app.keys.shard_of(vid(voucher)));
    let outcomes = admit_in_one_call(&app, voucher, [1, 2, 3]).await;
    assert!(
        outcomes
            .iter()
            .all(|o| matches!(o, Outcome::Admitted { .. })),
        "{outcomes:?}"
    );
    let len: usize = app.redis_cmd(redis::cmd("XLEN").arg(stream)).await;
    assert_eq!(len, 1, "three orders, one entry");
    let raw: Vec<(String, Vec<(String, String)>)> = app
        .redis_cmd(redis::cmd("XRANGE").arg(stream).arg("-").arg("+"))
        .await;
    let fields = raw[0].1.clone();
    assert_eq!(fields[0], ("orders".to_string(), "3".to_string()));

    // Postgres has only two units left (sold through another channel): one order of
    // the entry is refused, the two others are written.
    sqlx::query("UPDATE seckill_vouchers SET stock = 2 WHERE voucher_id = $1")
        .bind(voucher)
        .execute(&app.db)
        .await
        .unwrap();
    let report = app.drain().await;
    assert_eq!((report.inserted, report.dead_lettered), (2, 1));
    assert_eq!(app.pending_count().await, 0, "the entry is acknowledged");
    let buried: i64 = sqlx::query_scalar("SELECT user_id FROM dead_orders WHERE voucher_id = $1")
        .bind(voucher)
        .fetch_one(&app.db)
        .await
        .unwrap();
    // Its record is dropped; its unit is not returned (Postgres had none for it).
    assert_eq!(redis_sale(&app, voucher, buried).await, (Some(7), None));

    // The same entry pending again (held by a worker that died before acknowledging
    // it): a rebuild must not count the buried order in flight, nor give its record
    // back. The shop restocks to 5 meanwhile.
    sqlx::query("UPDATE seckill_vouchers SET stock = 5 WHERE voucher_id = $1")
        .bind(voucher)
        .execute(&app.db)
        .await
        .unwrap();
    let mut xadd = redis::cmd("XADD");
    xadd.arg(stream).arg("*");
    for (k, v) in &fields {
        xadd.arg(k).arg(v);
    }
    let _: String = app.redis_cmd(&xadd).await;
    assert_eq!(deliver_and_die(&app, "died-holding-it").await, 3);
    // (The restock is a drift the repair reports and mends.)
    let (_, out) = app.cli(&["reconcile", "--repair", "--voucher", &voucher.to_string()]);
    assert!(
        out.contains("redis stock 5, buyers 2 (0 in flight)"),
        "{out}"
    );
    assert_eq!(
        redis_sale(&app, voucher, buried).await,
        (Some(5), None),
        "the two written orders are Postgres's, the buried one is nobody's"
    );
    // The check compares again: nothing of the entry is in flight (the restock itself
    // stays a difference of Postgres's own figures, which is not this test's).
    let (_, out) = app.cli(&["reconcile", "--voucher", &voucher.to_string()]);
    let mut lines = out.lines();
    let header: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    let row: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    let column = |name: &str| row[header.iter().position(|h| *h == name).unwrap()];
    assert_eq!(
        (
            column("in_flight"),
            column("stock_drift"),
            column("buyers_drift")
        ),
        ("0", "0", "0"),
        "{out}"
    );
}
