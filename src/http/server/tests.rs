//! Unit tests: the server's sockets, connection limits and judging of request heads.

use super::*;

use super::head::Heads;
use crate::http::{MAX_HEADERS, MAX_HEADER_BYTES, MAX_URL_BYTES};

/// What the scanner makes of `bytes`, fed at once and byte by byte (the same either way).
fn judge(bytes: &[u8]) -> Result<(), (usize, Refusal)> {
    let whole = Heads::new().feed(bytes);
    let mut heads = Heads::new();
    let bytewise = (0..bytes.len()).try_for_each(|i| {
        heads
            .feed(&bytes[i..=i])
            .map_err(|(_, refusal)| (i, refusal))
    });
    assert_eq!(whole, bytewise, "{}", String::from_utf8_lossy(bytes));
    whole
}

/// A request with `headers` of `value`, for a head that counts `target` plus, per header,
/// its name and value and 4 (as the middleware counts).
fn request(target: &str, headers: &[(&str, &str)]) -> Vec<u8> {
    let mut head = format!("GET {target} HTTP/1.1\r\n");
    for (name, value) in headers {
        head += &format!("{name}: {value}\r\n");
    }
    head += "\r\n";
    head.into_bytes()
}

#[test]
fn heads_within_our_limits_pass_one_byte_over_them_is_refused_where_it_comes() {
    let target = format!("/{}", "a".repeat(MAX_URL_BYTES - 1));
    assert_eq!(judge(&request(&target, &[])), Ok(()));
    let over = request(&format!("{target}b"), &[]);
    assert_eq!(judge(&over), Err((4 + MAX_URL_BYTES, Refusal::UrlTooLong)));

    let names: Vec<String> = (0..MAX_HEADERS).map(|i| format!("x-{i:03}")).collect();
    let many: Vec<(&str, &str)> = names.iter().map(|n| (n.as_str(), "1")).collect();
    let ok = request("/", &many);
    assert_eq!(judge(&ok), Ok(()));
    let mut one_more = ok[..ok.len() - 2].to_vec();
    let at = one_more.len();
    one_more.extend_from_slice(b"x-more: 1\r\n\r\n");
    assert_eq!(judge(&one_more), Err((at, Refusal::HeadTooLarge)));

    // Target, then name + value + 4 per header; whitespace around a value is not counted.
    let value = "v".repeat(MAX_HEADER_BYTES - 1 - ("x-big".len() + 4));
    let full = request("/", &[("x-big", &format!(" {value} \t"))]);
    assert_eq!(judge(&full), Ok(()));
    let over = request("/", &[("x-big", &format!("{value}w"))]);
    let at = over.len() - 5; // the `w`
    assert_eq!(judge(&over), Err((at, Refusal::HeadTooLarge)));
}

#[test]
fn the_next_head_is_found_after_each_kind_of_body_and_judged_too() {
    let bad = b"G@T / HTTP/1.1\r\n\r\n";
    let bodies: [&[u8]; 5] = [
        b"GET / HTTP/1.1\r\nHost: a\r\n\r\n",
        b"GET / HTTP/1.1\r\nContent-Lengths: 5\r\nTransfer-Encoding-X: gzip\r\n\r\n",
        b"\r\nPOST /v\xc3\xa4 HTTP/1.1\nContent-Length:  5 \ncontent-length: 5\n\nG@T /",
        b"POST /v HTTP/1.1\r\nTransfer-Encoding: gzip, Chunked\r\n\r\n\
          5;x=\"G@T\"\r\nG@T /\r\n0\r\nX-Trailer: G@T\r\n\r\n",
        b"POST /v HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n\
          A\r\n0123456789\r\n0\r\n\r\n",
    ];
    for body in bodies {
        let what = String::from_utf8_lossy(body);
        assert_eq!(judge(body), Ok(()), "{what}");
        let twice = [body, body, &bad[..]].concat();
        assert_eq!(
            judge(&twice),
            Err((2 * body.len() + 1, Refusal::NotHttp)),
            "{what}"
        );
    }
}

/// hyper ends a trailer line only at CRLF: a bare LF is a byte of the line, so what
/// follows it up to the next CRLF is a trailer, not a request.
#[test]
fn a_bare_lf_in_the_trailers_ends_no_line_as_in_hyper() {
    let chunked = b"POST /v HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\
        \nG@T / HTTP/1.1\r\nContent-Length: 10\r\n\r\n";
    let next = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n";
    assert_eq!(judge(&[&chunked[..], &next[..]].concat()), Ok(()));
    let bad = b"G@T / HTTP/1.1\r\n\r\n";
    assert_eq!(
        judge(&[&chunked[..], &bad[..]].concat()),
        Err((chunked.len() + 1, Refusal::NotHttp))
    );
    // A CR not followed by LF there is refused by hyper: the connection is not followed.
    let broken = b"POST /v HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\rX";
    assert_eq!(judge(&[&broken[..], &bad[..]].concat()), Ok(()));
}

#[test]
fn bytes_that_are_no_http_1_request_head_are_refused() {
    for (bytes, at) in [
        (&b"G@T / HTTP/1.1\r\n\r\n"[..], 1),
        (b" GET / HTTP/1.1\r\n\r\n", 0),
        (b"\x16\x03\x01\x02\x00\x01", 0),
        (b"\r\r\n", 1),
        (b"GET  / HTTP/1.1\r\n\r\n", 4),
        (b"GET /\r\n", 5),
        (b"GET / HTTP/2.0\r\n\r\n", 11),
        (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 11),
        (b"GET / http/1.1\r\n", 6),
        (b"GET / HTTP/1.1 \r\n", 14),
        (b"GET / HTTP/1.1\r\nX-A : 1\r\n\r\n", 19),
        (b"GET / HTTP/1.1\r\n folded: 1\r\n\r\n", 16),
        (b"GET / HTTP/1.1\r\nX-A: \x01\r\n\r\n", 21),
        (b"GET / HTTP/1.1\r\nX-A\r\n\r\n", 19),
        (b"GET /a\x80b HTTP/1.1\r\n\r\n", 6),
        (b"GET /a\xe0\x80\x80 HTTP/1.1\r\n\r\n", 7),
        (b"GET /a\xc3 HTTP/1.1\r\n\r\n", 7),
        (b"GET / HTTP/1.1\r\nContent-Length: +5\r\n\r\n", 37),
        (
            b"GET / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
            55,
        ),
        (
            b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked, gzip\r\n\r\n",
            52,
        ),
        (b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n", 46),
    ] {
        let what = String::from_utf8_lossy(bytes);
        assert_eq!(judge(bytes), Err((at, Refusal::NotHttp)), "{what}");
    }
}

#[test]
fn a_connection_whose_bodies_cannot_be_followed_is_left_to_hyper() {
    for head in [
        &b"GET / HTTP/1.1\r\nUpgrade: websocket\r\n\r\n"[..],
        b"CONNECT a:443 HTTP/1.1\r\n\r\n",
        b"CONNECT a:443 HTTP/1.1\r\nContent-Length: 5\r\n\r\n",
    ] {
        let then = [head, b"G@T / HTTP/1.1\r\n\r\n"].concat();
        assert_eq!(judge(&then), Ok(()), "{}", String::from_utf8_lossy(head));
    }
}

#[tokio::test]
async fn a_refusal_is_answered_in_the_json_error_format_and_closes() {
    for (refusal, status, says) in [
        (Refusal::UrlTooLong, "414 URI Too Long", "URL too long"),
        (
            Refusal::HeadTooLarge,
            "431 Request Header Fields Too Large",
            "headers too large",
        ),
        (Refusal::NotHttp, "400 Bad Request", "not valid HTTP"),
    ] {
        let bytes = closing_answer(refusal.error()).await;
        let text = String::from_utf8(bytes).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(
            head.starts_with(&format!("HTTP/1.1 {status}\r\n")),
            "{head}"
        );
        for line in [
            "content-type: application/json".to_string(),
            "connection: close".into(),
            format!("content-length: {}", body.len()),
        ] {
            assert!(head.contains(&format!("\r\n{line}")), "{head}");
        }
        let date = head.split("\r\ndate: ").nth(1).unwrap();
        assert!(chrono::DateTime::parse_from_rfc2822(date).is_ok(), "{date}");
        let body: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(body["error"]["code"], "validation");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{message}");
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
