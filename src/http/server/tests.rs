//! Unit tests: the server's sockets and connection limits.

use super::*;

#[test]
fn hypers_bare_refusals_are_replaced_by_the_json_error_format_and_nothing_else_is() {
    let date = "date: Wed, 25 Nov 2026 19:26:56 GMT";
    for (status, says) in [
        ("414 URI Too Long", "URL too long"),
        ("431 Request Header Fields Too Large", "headers too large"),
        ("400 Bad Request", "not valid HTTP"),
    ] {
        let hyper = format!(
            "HTTP/1.1 {status}\r\nconnection: close\r\ncontent-length: 0\r\n{date}\r\n\r\n"
        );
        let r = Replacement::of(hyper.as_bytes()).unwrap_or_else(|| panic!("{status}"));
        assert_eq!(r.stands_for, hyper.len());
        let text = String::from_utf8(r.bytes).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(
            head.starts_with(&format!("HTTP/1.1 {status}\r\n")),
            "{head}"
        );
        assert!(
            head.contains("\r\ncontent-type: application/json\r\n"),
            "{head}"
        );
        assert!(head.contains("\r\nconnection: close\r\n"), "{head}");
        assert!(
            head.contains(&format!("\r\ncontent-length: {}\r\n", body.len())),
            "{head}"
        );
        assert!(head.ends_with(date), "{head}");
        let body: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(body["error"]["code"], "validation");
        assert!(
            body["error"]["message"].as_str().unwrap().contains(says),
            "{body}"
        );
    }
    // The router's own answers, and anything that is not a whole head, stay.
    for other in [
        "HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\ncontent-length: 0\r\n\r\n",
        "HTTP/1.1 414 URI Too Long\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}",
        "HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
        "HTTP/1.1 405 Method Not Allowed\r\ncontent-length: 0\r\n\r\n",
        "HTTP/1.1 414 URI Too Long\r\ncontent-length: 0\r\n",
        "HTTP/1.1 414 URI Too Long\r\ncontent-length: 10\r\n\r\n0123456789",
        "{\"error\": \"HTTP/1.1 414 \"}",
        "",
    ] {
        assert!(Replacement::of(other.as_bytes()).is_none(), "{other:?}");
    }
}

#[cfg(target_os = "linux")]
#[tokio::test]
async fn accepted_sockets_give_up_on_a_silent_peer_within_the_dead_peer_limit() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let _client = TcpStream::connect(listener.local_addr().unwrap())
        .await
        .unwrap();
    let (tcp, _) = listener.accept().await.unwrap();
    detect_dead_peers(&tcp);
    let sock = socket2::SockRef::from(&tcp);
    assert!(sock.keepalive().unwrap());
    assert_eq!(sock.tcp_user_timeout().unwrap(), Some(DEAD_PEER));
    let (idle, every, probes) = (
        sock.tcp_keepalive_time().unwrap(),
        sock.tcp_keepalive_interval().unwrap(),
        sock.tcp_keepalive_retries().unwrap(),
    );
    assert!(
        idle + every * probes <= DEAD_PEER,
        "{idle:?} {every:?} {probes}"
    );
}
