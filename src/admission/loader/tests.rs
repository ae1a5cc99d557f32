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
    let StepReply::Done(f) = StepReply::parse(&reply(&[5, 10, 2, -1, 0, 0, 0, 0])).unwrap() else {
        panic!("not done");
    };
    assert_eq!(f.expected.stock, 5);
    assert_eq!(f.actual_stock, None, "-1: the state was missing");
    assert_eq!(f.actual_epoch, None, "0: no epoch");
    assert!(f.carried.is_empty());
    assert!(StepReply::parse(&reply(&[1, 2])).is_err());
}

#[test]
fn a_builds_reply_names_the_orders_it_carries_into_its_epoch() {
    // Order ids come back as the stream spelled them (bulk strings).
    let mut r = reply(&[3, 7, 2, 4, 5, 0, 0, 12]);
    r.push(redis::Value::BulkString(b"117514385399746560".to_vec()));
    r.push(redis::Value::BulkString(b"117514385399746561".to_vec()));
    let StepReply::Done(f) = StepReply::parse(&r).unwrap() else {
        panic!("not done");
    };
    assert_eq!(f.actual_epoch, Epoch::new(12));
    assert_eq!(
        f.carried,
        [117514385399746560, 117514385399746561].map(|o| OrderId::new(o).unwrap())
    );
    r.push(redis::Value::BulkString(b"not an id".to_vec()));
    assert!(StepReply::parse(&r).is_err(), "a reply it cannot read");
}
