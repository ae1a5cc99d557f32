//! Unknown grabs and orders nobody was told of: which orders a grab whose answer did
//! not say could have made, and whether every order in Postgres is one some answer
//! accounts for.

use std::collections::HashSet;

use super::{minted_ms, Evidence, Record, Verdict};

/// The span in which an unknown grab's order, if any, was minted: from its sending to
/// its answer, or (no answer) to the user's next request, at most 15 s.
fn unknown_window(e: &Evidence, r: &Record) -> (f64, f64) {
    // Ids carry whole milliseconds: a few of slack at the ends an answer bounds. The
    // user's next request bounds it strictly (its own order is minted after it is sent,
    // and the shopper waits at least 50 ms between two requests).
    let hi = match r.recv_ms {
        Some(recv) => recv + 5.0,
        None => {
            let next = e
                .history
                .iter()
                .filter(|n| n.user == r.user && n.sent_ms > r.sent_ms)
                .map(|n| n.sent_ms - 2.0)
                .fold(f64::INFINITY, f64::min);
            next.min(r.sent_ms + 15_000.0)
        }
    };
    (r.sent_ms - 5.0, hi)
}

/// Orders and burials of `user` and `voucher` minted within `window`.
fn minted_within(e: &Evidence, user: i64, voucher: i64, (lo, hi): (f64, f64)) -> Vec<i64> {
    let within = |id: i64| (lo..=hi).contains(&minted_ms(id, e.start_unix_ms));
    let mut ids: Vec<i64> = e
        .orders
        .iter()
        .filter(|o| o.user == user && o.voucher == voucher && within(o.id))
        .map(|o| o.id)
        .chain(
            e.dead
                .iter()
                .filter(|d| d.user == user && d.voucher == voucher && within(d.id))
                .map(|d| d.id),
        )
        .collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// Every unknown grab turned out as exactly one order, or none: by the id its answer
/// carried, else by the orders of that user and voucher minted while it was in flight.
pub(super) fn check_unknowns(e: &Evidence, v: &mut Verdict) {
    let orders: HashSet<i64> = e.orders.iter().map(|o| o.id).collect();
    let dead: HashSet<i64> = e.dead.iter().map(|d| d.id).collect();
    for r in e.history.iter().filter(|r| r.is_unknown_grab()) {
        v.unknowns.total += 1;
        let ids = match r.order_id {
            Some(id) => {
                v.unknowns.by_id += 1;
                vec![id]
            }
            None => minted_within(e, r.user, r.voucher, unknown_window(e, r)),
        };
        match ids.as_slice() {
            [id] if orders.contains(id) => v.unknowns.order += 1,
            [id] if dead.contains(id) => v.unknowns.dead += 1,
            [] | [_] => v.unknowns.none += 1,
            many => {
                v.unknowns.ambiguous += 1;
                v.violate(
                    "unknown unresolved",
                    Some(r.sent_ms),
                    format!(
                        "grab of user {} on voucher {} sent at {:.1} s ({}) matches {} orders: {many:?}",
                        r.user,
                        r.voucher,
                        r.sent_ms / 1000.0,
                        r.answer_label(),
                        many.len()
                    ),
                );
            }
        }
    }
}

/// Every order in Postgres is one some answer told of: a 202 or `already_ordered` named
/// it, or an unknown grab of its user and voucher was in flight when it was minted. An
/// order behind a refusal (`sold_out`, `503` without `"outcome": "unknown"`) is one the
/// shopper was told they do not have.
pub(super) fn check_phantoms(e: &Evidence, v: &mut Verdict) {
    let mut told: HashSet<i64> = e
        .history
        .iter()
        .filter_map(Record::promised_order)
        .collect();
    told.extend(
        e.history
            .iter()
            .filter(|r| r.is_unknown_grab())
            .filter_map(|r| r.order_id),
    );
    let unknowns: Vec<(&Record, (f64, f64))> = e
        .history
        .iter()
        .filter(|r| r.is_unknown_grab() && r.order_id.is_none())
        .map(|r| (r, unknown_window(e, r)))
        .collect();
    for o in e.orders.iter().filter(|o| !told.contains(&o.id)) {
        let minted = minted_ms(o.id, e.start_unix_ms);
        let explained = unknowns.iter().any(|(r, (lo, hi))| {
            r.user == o.user && r.voucher == o.voucher && (*lo..=*hi).contains(&minted)
        });
        if !explained {
            v.phantoms += 1;
            v.violate(
                "order nobody was promised",
                Some(minted),
                format!(
                    "order {} (user {}, voucher {}, minted at {:.1} s, {}) answers no 202, already_ordered or unknown grab",
                    o.id,
                    o.user,
                    o.voucher,
                    minted / 1000.0,
                    o.status
                ),
            );
        }
    }
}
