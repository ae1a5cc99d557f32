//! Unit tests: the demo's pieces that need no server.

use super::*;
use serde_json::json;

#[test]
fn answers_are_sorted_into_the_table_outcomes() {
    let admitted = json!({"order_id": "12", "status": "pending"});
    let err = |code: &str| json!({"error": {"code": code, "message": "m"}});
    let cases = [
        (202, admitted, Reply::Admitted("12".into())),
        (409, err("sold_out"), Reply::SoldOut),
        (409, err("already_ordered"), Reply::AlreadyOrdered),
        (429, err("rate_limited"), Reply::RateLimited),
        (409, err("ended"), Reply::Error("409 ended".into())),
        (503, Value::Null, Reply::Error("503".into())),
        (
            202,
            json!({}),
            Reply::Error("202 without an order_id".into()),
        ),
    ];
    for (status, body, want) in cases {
        assert_eq!(classify(StatusCode::from_u16(status).unwrap(), &body), want);
    }
}

#[test]
fn the_table_adds_up_and_names_the_errors() {
    let mut t = Replies::default();
    t.add(Reply::Admitted("1".into()));
    t.add(Reply::SoldOut);
    t.add(Reply::SoldOut);
    t.add(Reply::Error("409 ended".into()));
    let table = t.table();
    assert!(table.contains("admitted                 1\n"), "{table}");
    assert!(table.contains("sold_out                 2\n"), "{table}");
    assert!(table.contains("errors                   1\n"), "{table}");
    assert!(table.contains("total                    4\n"), "{table}");
    assert!(table.contains("error 409 ended: 1"), "{table}");
}

#[test]
fn the_url_comes_from_the_flag_then_bind_then_the_default() {
    assert_eq!(
        base_url(Some("http://h:1/"), Some("0.0.0.0:2")).unwrap(),
        "http://h:1"
    );
    assert_eq!(
        base_url(None, Some("0.0.0.0:9000")).unwrap(),
        "http://127.0.0.1:9000"
    );
    assert_eq!(
        base_url(None, Some("[::]:9000")).unwrap(),
        "http://127.0.0.1:9000"
    );
    assert_eq!(
        base_url(None, Some("[::1]:9000")).unwrap(),
        "http://[::1]:9000"
    );
    assert_eq!(base_url(None, None).unwrap(), DEFAULT_URL);
    for bad in ["localhost:8080", "ftp://h", "http://h/?x=1", "not a url"] {
        assert!(base_url(Some(bad), None).is_err(), "{bad}");
    }
    assert!(base_url(None, Some("nonsense")).is_err());
}
