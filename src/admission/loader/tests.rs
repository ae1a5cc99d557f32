//! Unit tests: the load step's replies.

use super::*;

fn reply(numbers: &[i64]) -> Vec<redis::Value> {
    numbers.iter().map(|&n| redis::Value::Int(n)).collect()
}

#[test]
fn the_load_steps_replies_are_read_by_their_meaning() {
    assert_eq!(
        StepReply::parse(&reply(&[-1])).unwrap(),
        StepReply::LeftAlone
    );
    assert_eq!(
        StepReply::parse(&reply(&[-2])).unwrap(),
        StepReply::TailTooLong
    );
    assert_eq!(StepReply::parse(&reply(&[-3])).unwrap(), StepReply::TooLate);
    let mut done = reply(&[5, 10, 2, -1, 0, 0, 0, 0]);
    done.push(redis::Value::BulkString(b"1.2.a".to_vec()));
    let StepReply::Done(f) = StepReply::parse(&done).unwrap() else {
        panic!("not done");
    };
    assert_eq!(f.expected.stock, 5);
    assert_eq!(f.actual_stock, None, "-1: the state was missing");
    assert_eq!(f.actual_epoch, None, "0: no epoch");
    assert!(f.carried.is_empty());
    assert!(StepReply::parse(&reply(&[1, 2])).is_err());
}

#[test]
fn a_builds_reply_names_its_term_and_the_orders_it_carries_into_its_epoch() {
    let text = |t: &str| redis::Value::BulkString(t.as_bytes().to_vec());
    // Order and user ids come back as the stream spelled them (bulk strings).
    let mut r = reply(&[3, 7, 2, 4, 5, 0, 0, 12]);
    r.push(text("1795734190.251474.7f14e9429c90"));
    r.extend([text("117514385399746560"), text("41")]);
    r.extend([text("117514385399746561"), text("42")]);
    // An entry the worker will dead-letter carries nothing.
    r.extend([text("not an id"), text("43")]);
    let StepReply::Done(f) = StepReply::parse(&r).unwrap() else {
        panic!("not done");
    };
    assert_eq!(f.actual_epoch, Epoch::new(12));
    assert_eq!(f.term, "1795734190.251474.7f14e9429c90");
    let carried = |o: i64, u: i64| (OrderId::new(o).unwrap(), UserId::new(u).unwrap());
    assert_eq!(
        f.carried,
        [
            carried(117514385399746560, 41),
            carried(117514385399746561, 42)
        ]
    );
    assert_eq!(
        StepReply::parse(&reply(&[-4])).unwrap(),
        StepReply::LivesElsewhere
    );
    assert!(
        StepReply::parse(&reply(&[3, 7, 2])).is_err(),
        "a reply it cannot read"
    );
}

#[test]
fn a_term_is_drawn_before_another_by_the_clock_it_begins_with() {
    use crate::scripts::term_drawn_before as drawn_before;
    assert!(drawn_before("1795734190.251474.aa", "1795734190.251475.bb"));
    assert!(drawn_before("1795734189.999999.aa", "1795734190.000000.aa"));
    assert!(!drawn_before(
        "1795734190.251474.aa",
        "1795734190.251474.bb"
    ));
    assert!(!drawn_before("1795734191.0.aa", "1795734190.999999.aa"));
    assert!(!drawn_before("garbage", "1795734190.0.aa"));
}
