//! Unit tests: the load step's replies.

use super::*;

#[test]
fn the_load_steps_replies_are_read_by_their_meaning() {
    assert_eq!(StepReply::parse(&[-1]).unwrap(), StepReply::LeftAlone);
    assert_eq!(StepReply::parse(&[-2]).unwrap(), StepReply::TailTooLong);
    assert_eq!(StepReply::parse(&[-3]).unwrap(), StepReply::TooLate);
    let StepReply::Done(f) = StepReply::parse(&[5, 10, 2, -1, 0, 0, 0]).unwrap() else {
        panic!("not done");
    };
    assert_eq!(f.expected.stock, 5);
    assert_eq!(f.actual_stock, None, "-1: the state was missing");
    assert!(StepReply::parse(&[1, 2]).is_err());
}
