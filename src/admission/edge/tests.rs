//! Unit tests: the edge's memory: what it believes, for how long, and how much it holds.

use super::*;

fn v(id: i64) -> VoucherId {
    VoucherId::new(id).unwrap()
}

fn u(id: i64) -> UserId {
    UserId::new(id).unwrap()
}

fn edge(ttl: Duration) -> Arc<Edge> {
    Arc::new(Edge::new(ttl))
}

fn sold_out(edge: &Arc<Edge>, voucher_id: i64, buyers: &[i64]) {
    let learning = edge.begin(v(voucher_id), Purpose::Verdict).unwrap();
    let buyers = Arc::new(KnownBuyers {
        users: buyers.iter().map(|&b| u(b)).collect(),
        signature: Signature {
            gen: "1".into(),
            term: "t".into(),
        },
    });
    learning.record(Instant::now(), Some(Verdict::SoldOut { buyers }));
}

#[test]
fn a_sold_out_sale_is_answered_at_the_edge_except_to_its_buyers() {
    let edge = edge(Duration::from_secs(5));
    sold_out(&edge, 7, &[1, 2]);
    let now = Instant::now();
    assert_eq!(edge.answer(v(7), u(3), now), Some(Outcome::SoldOut));
    assert_eq!(edge.answer(v(7), u(1), now), None, "a buyer hears Redis");
    assert_eq!(
        edge.answer(v(8), u(3), now),
        None,
        "another sale is not known"
    );
}

#[test]
fn a_memory_is_believed_only_for_its_time_to_live() {
    let edge = edge(Duration::from_millis(500));
    sold_out(&edge, 7, &[]);
    let now = Instant::now();
    assert_eq!(edge.answer(v(7), u(3), now), Some(Outcome::SoldOut));
    assert_eq!(
        edge.answer(v(7), u(3), now + Duration::from_millis(500)),
        None
    );
}

#[test]
fn an_announcement_during_a_learning_stops_its_recording() {
    let edge = edge(Duration::from_secs(5));
    let learning = edge.begin(v(7), Purpose::Verdict).unwrap();
    assert!(
        edge.begin(v(7), Purpose::Verdict).is_none(),
        "one learning per sale at a time"
    );
    edge.forget(v(7));
    learning.record(Instant::now(), Some(Verdict::Ended));
    assert_eq!(edge.answer(v(7), u(1), Instant::now()), None);
    // The next learning may record.
    let learning = edge.begin(v(7), Purpose::Verdict).unwrap();
    learning.record(Instant::now(), Some(Verdict::Ended));
    assert_eq!(
        edge.answer(v(7), u(1), Instant::now()),
        Some(Outcome::Ended)
    );
    edge.forget_all();
    assert_eq!(edge.answer(v(7), u(1), Instant::now()), None);
}

#[test]
fn a_learning_dropped_midway_lets_the_sale_be_learned_again() {
    let edge = edge(Duration::from_secs(5));
    let lookup = edge.lookup(v(7)).unwrap();
    drop(lookup);
    let lookup = edge.lookup(v(7)).expect("learnable again");
    lookup.not_found(Instant::now());
    assert_eq!(
        edge.answer(v(7), u(1), Instant::now()),
        Some(Outcome::NotFound)
    );
}

#[test]
fn a_missing_voucher_is_remembered_apart_from_a_voucher_without_a_sale() {
    let edge = edge(Duration::from_secs(5));
    edge.lookup(v(7)).unwrap().no_voucher(Instant::now());
    edge.lookup(v(8)).unwrap().not_found(Instant::now());
    let now = Instant::now();
    assert_eq!(edge.answer(v(7), u(1), now), Some(Outcome::NoVoucher));
    assert_eq!(edge.answer(v(8), u(1), now), Some(Outcome::NotFound));
    assert_eq!(Outcome::NoVoucher.index(), Outcome::NotFound.index());
}

#[test]
fn a_sale_not_yet_open_is_answered_until_its_opening_only() {
    let edge = edge(Duration::from_secs(5));
    let now = Instant::now();
    let learning = edge.begin(v(7), Purpose::Verdict).unwrap();
    let opens = now + Duration::from_millis(200);
    learning.record(now, Some(Verdict::NotStarted { opens }));
    assert_eq!(edge.answer(v(7), u(1), now), Some(Outcome::NotStarted));
    assert_eq!(edge.answer(v(7), u(1), opens), None);
}

#[test]
fn made_up_sales_fill_at_most_half_the_memory_and_real_ones_keep_room() {
    let edge = edge(Duration::from_secs(1));
    for voucher_id in 1..=MAX_SALES as i64 {
        match edge.lookup(v(voucher_id)) {
            Some(lookup) => lookup.not_found(Instant::now()),
            None => {
                assert_eq!(voucher_id as usize - 1, MAX_SALES / 2, "half");
                break;
            }
        }
    }
    assert!(edge.lookup(v(i64::MAX)).is_none(), "lookups full");
    assert!(
        edge.begin(v(i64::MAX - 1), Purpose::Verdict).is_some(),
        "a sale Redis answered for still has room"
    );
}

#[test]
fn an_edge_with_no_time_to_live_remembers_nothing() {
    let edge = edge(Duration::ZERO);
    assert!(edge.begin(v(7), Purpose::Verdict).is_none());
    assert!(edge.lookup(v(7)).is_none());
    assert_eq!(edge.answer(v(7), u(1), Instant::now()), None);
}
