//! Unit tests: the replies of the load step and of the check step.

use super::check::Compared;
use super::fenced::StepReply;
use super::*;

fn reply(numbers: &[i64]) -> Vec<redis::Value> {
    numbers.iter().map(|&n| redis::Value::Int(n)).collect()
}

#[test]
fn the_load_steps_replies_are_read_by_their_meaning() {
    let code = |n: i64| StepReply::parse(reply(&[n])).unwrap();
    assert_eq!(code(-1), StepReply::LeftAlone);
    assert_eq!(code(-2), StepReply::TailTooLong);
    assert_eq!(code(-3), StepReply::TooLate);
    assert_eq!(code(-4), StepReply::LivesElsewhere);
    assert!(StepReply::parse(reply(&[7])).is_err(), "no such code");
    let StepReply::Done(figures) = StepReply::parse(reply(&[5, 10, 2, -1, 0, 0, 0, 0])).unwrap()
    else {
        panic!("not done");
    };
    let c = Compared::parse(&figures).unwrap();
    assert_eq!(c.expected.stock, 5);
    assert_eq!(c.actual_stock, None, "-1: the state was missing");
    assert_eq!(c.actual_epoch, None, "0: no epoch");
    let c = Compared::parse(&reply(&[3, 7, 2, 4, 5, 1, 1, 12])).unwrap();
    assert_eq!(c.actual_stock, Some(4));
    assert_eq!(
        (c.actual_buyers, c.mismatched_buyers, c.owed_held),
        (5, 1, 1)
    );
    assert_eq!(c.actual_epoch, Epoch::new(12));
    assert!(Compared::parse(&reply(&[1, 2])).is_err());
    assert!(Built::parse(&reply(&[1, 2])).is_err());
}

#[test]
fn a_builds_reply_names_its_term_and_the_orders_it_carries_into_its_epoch() {
    let text = |t: &str| redis::Value::BulkString(t.as_bytes().to_vec());
    let mut r = reply(&[3, 7, 2]);
    r.push(text("1795734190.251474.7f14e9429c90"));
    let b = Built::parse(&r).unwrap();
    assert_eq!(
        b.expected,
        Loaded {
            stock: 3,
            buyers: 7,
            in_flight: 2
        }
    );
    assert!(b.carried.is_empty());
    // Order and user ids come back as the stream spelled them (bulk strings).
    r.extend([text("117514385399746560"), text("41")]);
    r.extend([text("117514385399746561"), text("42")]);
    // An entry the worker will dead-letter carries nothing.
    r.extend([text("not an id"), text("43")]);
    let b = Built::parse(&r).unwrap();
    assert_eq!(b.term, "1795734190.251474.7f14e9429c90");
    let carried = |o: i64, u: i64| (OrderId::new(o).unwrap(), UserId::new(u).unwrap());
    assert_eq!(
        b.carried,
        [
            carried(117514385399746560, 41),
            carried(117514385399746561, 42)
        ]
    );
    assert!(
        Built::parse(&reply(&[3, 7, 2])).is_err(),
        "a reply it cannot read"
    );
}
