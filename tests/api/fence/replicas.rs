//! Replicas that do not acknowledge: a stalled replica costs availability, never units;
//! order-id claims whose acknowledgement fails do not leak node numbers; a WAIT
//! refused after the admission ran is an unknown outcome, not "nothing reserved".

use std::collections::HashMap;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::Value;
use sqlx::PgPool;

use super::*;
use crate::common::{open_sale_at, press_all, uid, vid, TestApp};

fn signal_pid(pid: u32, signal: &str) {
    let status = std::process::Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

/// Answers by kind: 202, 503 with nothing reserved, 503 unknown, and anything else.
fn tally(answers: &[(i64, Option<(StatusCode, Value)>)]) -> HashMap<&'static str, usize> {
    let mut out = HashMap::new();
    for (_, answer) in answers {
        let kind = match answer {
            Some((StatusCode::ACCEPTED, _)) => "admitted",
            Some((StatusCode::SERVICE_UNAVAILABLE, body))
                if body["error"]["outcome"] == "unknown" =>
            {
                "unknown"
            }
            Some((StatusCode::SERVICE_UNAVAILABLE, _)) => "unavailable",
            _ => "other",
        };
        *out.entry(kind).or_default() += 1;
    }
    out
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_replica_silent_longer_than_the_lag_bound_costs_availability_and_no_unit(db: PgPool) {
    let trio = Trio::start().await;
    let app = TestApp::spawn_with(db, trio.url(0).to_string(), true).await;
    let (_api, base) = app
        .spawn_server("api", &on(trio.url(0), waiting_for_one()))
        .await;
    let sale = open_sale_at(&app.client, &base, 200).await;
    let stream = app.keys.stream(app.keys.shard_of(vid(sale))).to_string();

    // Both replicas stall (SIGSTOP): connected, silent. Within a probe's period and
    // timeout (250 + 300 ms here), the instance refuses every grab unsent; Redis's own
    // guard (min-replicas-max-lag 1, in whole seconds) follows within 2-3 s.
    for replica in [1, 2] {
        signal_pid(trio.nodes[replica].pid(), "-STOP");
    }
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let storm = press_all(&app, &base, sale, 1..=600, 64).await;
    let kinds = tally(&storm);
    let entries: usize = trio.cmd(0, redis::cmd("XLEN").arg(&stream));
    let stock = app.redis_stock(sale).await;
    println!(
        "with the replicas silent for 1 s: {kinds:?}; entries {entries}, redis stock {stock:?}"
    );
    for replica in [1, 2] {
        signal_pid(trio.nodes[replica].pid(), "-CONT");
    }
    assert_eq!(
        kinds.get("unavailable"),
        Some(&600),
        "every grab refused: {kinds:?}"
    );
    assert_eq!(entries, 0, "no entry appended");
    assert_eq!(stock, Some(200), "no unit taken");

    // The replicas back: the sale sells again.
    let after = crate::recovery::rollback::press_through_503s(&app, &base, sale, 601..=610).await;
    assert_eq!(crate::recovery::rollback::won(&after).len(), 10);
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn order_id_claims_whose_acknowledgement_keeps_failing_hold_one_node_number(db: PgPool) {
    let trio = Trio::start().await;
    let app = TestApp::spawn_with(db, trio.url(0).to_string(), true).await;
    let leases = |trio: &Trio| -> Vec<String> {
        trio.cmd(
            0,
            redis::cmd("KEYS").arg(format!("{}seckill:node:*", app.keys.prefix())),
        )
    };
    // This process's own lease.
    let before = leases(&trio).len();
    // Both replicas gone silent, and an API instance starting: its claims run (the
    // primary's write guard kept off, as on a server whose CONFIG the service cannot
    // set) and their WAIT fails, again and again.
    for replica in [1, 2] {
        signal_pid(trio.nodes[replica].pid(), "-STOP");
    }
    trio.guard_off(0);
    // (Never ready: it holds no order-id node while no claim is acknowledged.)
    let (_api, _base) = app
        .spawn_server_unready("api", &on(trio.url(0), waiting_for_one()))
        .await;
    let began = Instant::now();
    while began.elapsed() < Duration::from_secs(16) {
        trio.guard_off(0);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let held = leases(&trio);
    for replica in [1, 2] {
        signal_pid(trio.nodes[replica].pid(), "-CONT");
    }
    println!(
        "node leases: {before} before, {} after 16 s of unacknowledged claims: {held:?}",
        held.len()
    );
    assert_eq!(
        held.len(),
        before + 1,
        "the instance's claims hold one number, claimed again and again"
    );
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_wait_refused_after_the_admission_ran_is_an_unknown_outcome_and_the_order_is_written(
    db: PgPool,
) {
    let trio = Trio::start().await;
    let app = TestApp::spawn_with(db, trio.url(0).to_string(), true).await;
    let sale = app.open_sale(10).await;
    // A Redis user that may run everything but WAIT (an ACL a provider ships, say).
    let () = trio.cmd(
        0,
        redis::cmd("ACL")
            .arg("SETUSER")
            .arg("nowait")
            .arg("on")
            .arg(">secret")
            .arg("~*")
            .arg("&*")
            .arg("+@all")
            .arg("-wait"),
    );
    let addr = trio.nodes[0].addr();
    let url = format!("redis://nowait:secret@{}:{}", addr.ip(), addr.port());
    let mut limited = redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let minted = app.state.admission.ids.next().expect("an order id");
    let grab = seckill::admission::Grab {
        voucher_id: vid(sale),
        user_id: uid(7),
        order_id: minted,
        segment: 0,
        segments: 1,
    };
    let one = seckill::scripts::Replicas {
        n: 1,
        timeout: Duration::from_millis(500),
        max_lag: Duration::from_secs(1),
    };
    let shard = app.keys.shard_of(vid(sale));
    let outcome = seckill::admission::admit_many(
        &mut limited,
        &app.keys,
        shard,
        &[grab],
        one,
        &Default::default(),
    )
    .await;
    let err = outcome.expect_err("WAIT is refused");
    assert!(
        err.to_string().contains("permissions to run the 'wait'"),
        "{err}"
    );
    let outcome = seckill::admission::Outcome::of(Err(err), minted);
    assert_eq!(
        outcome,
        seckill::admission::Outcome::Unknown { order_id: minted }
    );
    let answer = seckill::http::seckill::answer(outcome, vid(sale)).unwrap_err();
    let response = axum::response::IntoResponse::into_response(answer);
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body: Value = serde_json::from_slice(
        &axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .unwrap(),
    )
    .unwrap();
    assert_eq!(body["error"]["outcome"], "unknown", "{body}");
    assert_eq!(body["error"]["order_id"], minted.to_string(), "{body}");
    // It ran: the unit is taken and the order is written.
    assert_eq!(app.redis_stock(sale).await, Some(9));
    app.drain().await;
    assert_eq!(app.pg_orders(sale).await, vec![(minted.get(), 7)]);
}
