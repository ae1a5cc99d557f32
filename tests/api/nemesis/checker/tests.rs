//! Each check shown failing on a small fabricated history, and a clean one passing.

use super::*;
use crate::nemesis::history::Phase;

const START: f64 = 1_780_000_000_000.0;

/// An order id minted `ms` after the campaign's start.
fn id_at(ms: f64, seq: i64) -> i64 {
    (((START + ms - seckill::admission::order_id::EPOCH_MS as f64) as i64) << 22) | seq
}

fn grab(user: i64, voucher: i64, sent: f64, status: Option<u16>, code: Option<&str>) -> Record {
    Record {
        kind: Kind::Grab,
        phase: Phase::Campaign,
        api: 0,
        user,
        voucher,
        order: None,
        sent_ms: sent,
        recv_ms: status.map(|_| sent + 20.0),
        status,
        code: code.map(str::to_string),
        order_id: None,
        outcome: None,
        failure: status.is_none().then(|| "timeout".to_string()),
    }
}

fn admitted(user: i64, voucher: i64, sent: f64, id: i64) -> Record {
    Record {
        order_id: Some(id),
        ..grab(user, voucher, sent, Some(202), None)
    }
}

fn unknown(user: i64, voucher: i64, sent: f64) -> Record {
    Record {
        outcome: Some("unknown".into()),
        ..grab(user, voucher, sent, Some(503), Some("unavailable"))
    }
}

fn order(id: i64, user: i64, voucher: i64, status: &str, created: f64) -> PgOrder {
    PgOrder {
        id,
        user,
        voucher,
        status: status.into(),
        created_ms: created,
        pay_before_ms: created + 900_000.0,
        closed_ms: None,
        refund_reason: None,
        first_paid_ms: None,
    }
}

/// Two users, one 202 each, a sale of 2: every promise kept.
fn clean() -> Evidence {
    let (a, b) = (id_at(100.0, 1), id_at(300.0, 2));
    Evidence {
        history: vec![admitted(1, 7, 95.0, a), admitted(2, 7, 295.0, b)],
        orders: vec![
            order(a, 1, 7, "paid", 101.0),
            order(b, 2, 7, "created", 301.0),
        ],
        dead: vec![],
        sales: vec![SaleBooks {
            voucher: 7,
            segments: 1,
            initial: 2,
            pg_stock: 0,
            redis_stock: Some(0),
            open: true,
        }],
        lotteries: vec![],
        start_unix_ms: START,
        settled: true,
        reconcile_exit: Some(0),
        admit_again: vec![(7, Some(1.5))],
        admit_bound_secs: 30.0,
        evicting: vec![],
        api_stopped: vec![],
    }
}

fn checks(v: &Verdict) -> Vec<&'static str> {
    v.violations.iter().map(|v| v.check).collect()
}

#[test]
fn a_history_that_keeps_every_promise_has_no_violation() {
    let v = check(&clean());
    assert!(v.violations.is_empty(), "{:?}", v.violations);
    assert_eq!((v.admitted, v.promised, v.lost), (2, 2, 0));
}

#[test]
fn a_202_whose_order_is_not_in_postgres_is_lost() {
    let mut e = clean();
    let gone = e.orders.remove(1);
    e.sales[0].pg_stock = 1;
    e.sales[0].redis_stock = Some(1);
    e.dead.push(DeadOrder {
        id: gone.id,
        user: 2,
        voucher: 7,
        reason: "stale_epoch".into(),
        returns_unit: false,
    });
    let v = check(&e);
    assert_eq!(v.lost, 1);
    assert_eq!(checks(&v), ["lost"], "{:?}", v.violations);
    assert!(v.violations[0]
        .detail
        .contains("dead-lettered (stale_epoch)"));
}

#[test]
fn more_live_orders_than_units_is_an_oversold_sale() {
    let mut e = clean();
    let c = id_at(500.0, 3);
    e.history.push(admitted(3, 7, 495.0, c));
    e.orders.push(order(c, 3, 7, "created", 501.0));
    let v = check(&e);
    assert_eq!(v.oversold_units, 2, "{:?}", v.violations);
    assert!(checks(&v).contains(&"oversold"));
    assert!(checks(&v).contains(&"admitted beyond stock"));
    assert!(checks(&v).contains(&"more 202s than stock"));
    assert!(checks(&v).contains(&"stock arithmetic (postgres)"));
}

#[test]
fn a_unit_returned_twice_breaks_the_stock_arithmetic_of_either_store() {
    let mut e = clean();
    e.orders[1].status = "cancelled".into();
    e.orders[1].closed_ms = Some(900.0);
    e.sales[0].pg_stock = 2; // returned twice: 1 expected
    e.sales[0].redis_stock = Some(1);
    let v = check(&e);
    assert_eq!(
        checks(&v),
        ["stock arithmetic (postgres)", "stock arithmetic (redis)"],
        "{:?}",
        v.violations
    );
}

#[test]
fn an_order_admitted_while_the_same_user_held_a_live_one_is_two_live_orders() {
    let mut e = clean();
    let again = id_at(400.0, 9);
    e.history.push(admitted(1, 7, 395.0, again));
    // The first was cancelled only after the second was admitted (and before the
    // second was written).
    e.orders[0].status = "cancelled".into();
    e.orders[0].closed_ms = Some(450.0);
    e.orders.push(order(again, 1, 7, "created", 500.0));
    let v = check(&e);
    assert_eq!(v.two_live, 1);
    assert_eq!(checks(&v), ["two live orders"], "{:?}", v.violations);
}

#[test]
fn an_unknown_grab_that_matches_two_orders_is_unresolved() {
    let mut e = clean();
    e.sales[0].initial = 4;
    let (x, y) = (id_at(610.0, 4), id_at(615.0, 5));
    e.history.push(unknown(3, 7, 600.0));
    e.orders.push(order(x, 3, 7, "cancelled", 611.0));
    e.orders.last_mut().unwrap().closed_ms = Some(612.0);
    e.orders.push(order(y, 3, 7, "created", 616.0));
    e.sales[0].pg_stock = 1;
    e.sales[0].redis_stock = Some(1);
    let v = check(&e);
    assert_eq!(v.unknowns.ambiguous, 1);
    assert_eq!(checks(&v), ["unknown unresolved"], "{:?}", v.violations);
}

#[test]
fn unknown_grabs_resolve_as_an_order_or_none_by_window_or_by_the_id_they_carry() {
    let mut e = clean();
    e.sales[0].initial = 4;
    e.sales[0].pg_stock = 2;
    e.sales[0].redis_stock = Some(2);
    let x = id_at(710.0, 6);
    e.history.push(unknown(3, 7, 700.0)); // became x
    e.history.push(unknown(4, 7, 700.0)); // became nothing
    e.history.push(grab(5, 7, 800.0, None, None)); // no answer, nothing
    e.history.push(Record {
        order_id: Some(id_at(900.0, 7)), // named, never written: none
        ..unknown(6, 7, 899.0)
    });
    e.orders.push(order(x, 3, 7, "expired", 711.0));
    e.orders.last_mut().unwrap().closed_ms = Some(5_711.0);
    let v = check(&e);
    assert!(v.violations.is_empty(), "{:?}", v.violations);
    let u = &v.unknowns;
    assert_eq!((u.total, u.order, u.none, u.by_id), (4, 1, 3, 1));
}

#[test]
fn an_order_behind_a_refusal_is_one_nobody_was_promised() {
    let mut e = clean();
    e.sales[0].initial = 3;
    let x = id_at(1_010.0, 8);
    e.history
        .push(grab(3, 7, 1_000.0, Some(503), Some("unavailable")));
    e.orders.push(order(x, 3, 7, "created", 1_011.0));
    let v = check(&e);
    assert_eq!(v.phantoms, 1);
    assert_eq!(
        checks(&v),
        ["order nobody was promised"],
        "{:?}",
        v.violations
    );
}

#[test]
fn one_id_answered_to_two_shoppers_is_an_order_id_twice() {
    let mut e = clean();
    let a = e.orders[0].id;
    e.history.push(Record {
        code: Some("already_ordered".into()),
        ..admitted(2, 7, 500.0, a)
    });
    e.history.last_mut().unwrap().status = Some(409);
    let v = check(&e);
    assert_eq!(v.duplicates, 1);
    assert!(checks(&v).contains(&"order id twice"), "{:?}", v.violations);
}

#[test]
fn a_202_for_a_grab_sent_after_the_close_was_answered_is_caught() {
    let mut e = clean();
    e.history.insert(
        0,
        Record {
            kind: Kind::CloseSale,
            ..grab(1, 7, 10.0, Some(200), None)
        },
    );
    let v = check(&e);
    assert_eq!(
        checks(&v),
        ["202 after close", "202 after close"],
        "{:?}",
        v.violations
    );
}

#[test]
fn drift_a_sale_that_stays_shut_and_an_unsettled_stream_are_caught() {
    let mut e = clean();
    e.reconcile_exit = Some(1);
    e.admit_again = vec![(7, Some(45.0)), (8, None)];
    e.settled = false;
    e.sales[0].redis_stock = None;
    let v = check(&e);
    assert_eq!(
        checks(&v),
        [
            "stock arithmetic (redis)",
            "not settled",
            "reconcile",
            "admitting again",
            "admitting again"
        ],
        "{:?}",
        v.violations
    );
}

#[test]
fn an_answer_500_is_caught() {
    let mut e = clean();
    e.history.push(Record {
        kind: Kind::Cancel,
        ..grab(1, 7, 900.0, Some(500), Some("internal"))
    });
    let v = check(&e);
    assert_eq!(checks(&v), ["500 internal"], "{:?}", v.violations);
}

#[test]
fn a_second_202_while_the_first_order_is_live_is_two_live_orders_even_if_never_written() {
    let mut e = clean();
    let again = id_at(400.0, 9);
    e.history.push(admitted(1, 7, 395.0, again));
    e.dead.push(DeadOrder {
        id: again,
        user: 1,
        voucher: 7,
        reason: "user already holds another order for this voucher".into(),
        returns_unit: true,
    });
    let v = check(&e);
    assert_eq!(v.two_live, 1);
    assert_eq!(
        checks(&v),
        ["lost", "two live orders"],
        "{:?}",
        v.violations
    );
}

#[test]
fn a_unit_sold_twice_by_redis_is_more_202s_than_stock_even_when_postgres_refused_one() {
    let mut e = clean();
    let c = id_at(500.0, 3);
    e.history.push(admitted(3, 7, 495.0, c));
    e.dead.push(DeadOrder {
        id: c,
        user: 3,
        voucher: 7,
        reason: "no stock left in postgres".into(),
        returns_unit: false,
    });
    let v = check(&e);
    assert_eq!(
        checks(&v),
        ["lost", "more 202s than stock", "admitted beyond stock"],
        "{:?}",
        v.violations
    );
}

#[test]
fn an_unanswered_grab_is_not_blamed_for_the_order_of_the_next_press() {
    let mut e = clean();
    e.sales[0].initial = 3;
    let (x, y) = (id_at(1_010.0, 4), id_at(3_001.0, 5));
    e.history.push(grab(3, 7, 1_000.0, None, None)); // no answer: became x
    e.history.push(admitted(3, 7, 3_000.0, y)); // the next press, 2 s later
    e.orders.push(order(x, 3, 7, "cancelled", 1_011.0));
    e.orders.last_mut().unwrap().closed_ms = Some(2_000.0);
    e.orders.push(order(y, 3, 7, "created", 3_002.0));
    let v = check(&e);
    assert!(v.violations.is_empty(), "{:?}", v.violations);
    assert_eq!((v.unknowns.total, v.unknowns.order), (1, 1));
}

/// A lottery of 1 unit (voucher 8, its window ending at 1 s) drawn for user 3, whose held
/// press was answered 202 at 1.1 s.
fn drawn() -> Evidence {
    let mut e = clean();
    let id = id_at(500.0, 3);
    e.history.push(Record {
        recv_ms: Some(1_100.0),
        ..admitted(3, 8, 495.0, id)
    });
    e.orders.push(order(id, 3, 8, "created", 1_050.0));
    e.sales.push(SaleBooks {
        voucher: 8,
        segments: 1,
        initial: 1,
        pg_stock: 0,
        redis_stock: Some(0),
        open: true,
    });
    e.lotteries.push(Lottery {
        voucher: 8,
        window_ms: (0.0, 1_000.0),
        winners: Some(vec![3]),
        entrants: 2,
        unverified: None,
    });
    e
}

#[test]
fn a_lottery_drawn_after_its_window_with_its_winners_orders_has_no_violation() {
    let v = check(&drawn());
    assert!(v.violations.is_empty(), "{:?}", v.violations);
    assert_eq!(
        v.draws,
        [Drawn {
            voucher: 8,
            window_ms: (0.0, 1_000.0),
            winners: 1,
            entrants: 2
        }]
    );
}

#[test]
fn a_lottery_that_admits_in_its_window_draws_unverifiably_or_wrongs_a_winner_is_caught() {
    let mut e = drawn();
    e.history.last_mut().unwrap().recv_ms = Some(900.0);
    assert_eq!(checks(&check(&e)), ["admitted in a lottery's window"]);

    let mut e = drawn();
    e.lotteries[0].unverified = Some("winners differ".into());
    assert_eq!(checks(&check(&e)), ["a draw that does not verify"]);

    let mut e = drawn();
    e.lotteries[0].winners = Some(vec![3, 4]);
    assert_eq!(checks(&check(&e)), ["a winner without its order"]);

    // An order admitted (first come, its answer lost) before the window's end.
    let mut e = drawn();
    e.orders.last_mut().unwrap().created_ms = 950.0;
    assert_eq!(checks(&check(&e)), ["admitted in a lottery's window"]);

    // A winner whose earlier press in the window heard sold out.
    let mut e = drawn();
    e.history
        .push(grab(3, 8, 200.0, Some(409), Some("sold_out")));
    assert_eq!(checks(&check(&e)), ["a winner told sold out"]);

    // No draw recorded, yet a press after the window was decided.
    let mut e = drawn();
    e.lotteries[0].winners = None;
    e.history
        .push(grab(5, 8, 1_500.0, Some(409), Some("sold_out")));
    assert!(checks(&check(&e)).contains(&"a lottery never drawn"));
}

#[test]
fn a_202_for_a_grab_sent_while_the_primary_could_evict_is_caught_and_one_before_it_is_not() {
    let mut e = clean();
    // The first 202 (sent at 95 ms) came before the switch at 90 ms had been looked
    // at; the second (sent at 295 ms) well after it, answered before the switch back.
    e.evicting = vec![(90.0, 400.0)];
    let v = check(&e);
    assert_eq!(
        checks(&v),
        ["202 while redis may evict"],
        "{:?}",
        v.violations
    );
    assert!(
        v.violations[0].detail.contains("user 2"),
        "{:?}",
        v.violations
    );
    // Switched back before it was answered: no violation.
    e.evicting = vec![(90.0, 250.0)];
    assert!(check(&e).violations.is_empty());
}

#[test]
fn a_deadline_past_at_creation_and_an_in_time_payment_refunded_as_late_are_caught() {
    let mut e = clean();
    e.orders[1].pay_before_ms = e.orders[1].created_ms;
    assert_eq!(checks(&check(&e)), ["a deadline past at creation"]);

    // Paid in time, then closed (expired) as though it had not been.
    let mut e = clean();
    let o = &mut e.orders[0];
    (o.status, o.refund_reason) = ("refunding".into(), Some("late_payment".into()));
    o.first_paid_ms = Some(o.pay_before_ms - 1.0);
    o.closed_ms = Some(o.pay_before_ms);
    // (Its unit went back on sale.)
    (e.sales[0].pg_stock, e.sales[0].redis_stock) = (1, Some(1));
    assert_eq!(checks(&check(&e)), ["an in-time payment refunded"]);
    // Paid after its deadline, or after its owner cancelled it: given back rightly.
    e.orders[0].first_paid_ms = Some(e.orders[0].pay_before_ms + 1.0);
    assert!(check(&e).violations.is_empty());
    e.orders[0].first_paid_ms = Some(e.orders[0].pay_before_ms - 1.0);
    e.orders[0].closed_ms = Some(e.orders[0].pay_before_ms - 2.0);
    assert!(check(&e).violations.is_empty());
}

#[test]
fn a_held_press_answered_past_the_window_and_500_ms_is_caught_unless_its_instance_was_stopped() {
    let mut e = drawn();
    e.history.push(Record {
        recv_ms: Some(2_600.0),
        ..grab(4, 8, 600.0, Some(503), Some("unavailable"))
    });
    let v = check(&e);
    assert!(
        checks(&v).contains(&"a held press answered late"),
        "{:?}",
        v.violations
    );
    // Its instance was paused meanwhile: not the service's doing.
    let api = e.history.last().unwrap().api;
    e.api_stopped.push((api, 900.0, 2_400.0));
    let v = check(&e);
    assert!(
        !checks(&v).contains(&"a held press answered late"),
        "{:?}",
        v.violations
    );
}
