//! Requests refused before the router sees them (oversized headers, URLs too long,
//! bytes that are not HTTP) still answered in the JSON error format: judged by the
//! server as they come in, before hyper, whose own limits are higher, would refuse them.

use super::*;

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn oversized_headers_get_a_431_in_the_json_error_format(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let (_server, base) = app.spawn_server("api", &[]).await;
    let client = reqwest::Client::new();
    let big = client
        .get(format!("{base}/healthz"))
        .header("x-big", "a".repeat(40 * 1024));
    let mut many = client.get(format!("{base}/healthz"));
    for i in 0..150 {
        many = many.header(format!("x-h{i}"), "1");
    }
    for (what, req) in [("40 KiB header", big), ("150 headers", many)] {
        let resp = req.send().await.unwrap();
        assert_eq!(
            resp.status(),
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "{what}"
        );
        let body: serde_json::Value = resp.json().await.expect("a JSON body");
        assert_eq!(body["error"]["code"], "validation", "{what}: {body}");
    }
    // Ordinary requests pass.
    let ok = client.get(format!("{base}/healthz")).send().await.unwrap();
    assert_eq!(ok.status(), StatusCode::OK);
}

/// Sends `request` on a new connection and reads the answer until the server closes
/// it: its head (lower-cased) and body.
async fn raw_answer(addr: &str, request: &[u8], what: &str) -> (String, String) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(request).await.unwrap();
    let answer = until_closed(&mut stream, Duration::from_secs(5))
        .await
        .unwrap_or_else(|got| panic!("{what}: still open after {got:?}"));
    let answer = String::from_utf8(answer).unwrap();
    let (head, body) = answer
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("{what}: {answer}"));
    (head.to_ascii_lowercase(), body.to_string())
}

/// Asserts an answer of `status` in the JSON error format, code `validation`, whose
/// message holds `says`.
fn assert_json_error(what: &str, (head, body): &(String, String), status: u16, says: &str) {
    assert!(
        head.starts_with(&format!("http/1.1 {status} ")),
        "{what}: {head}"
    );
    assert!(
        head.contains("\r\ncontent-type: application/json\r\n"),
        "{what}: {head}"
    );
    assert!(
        head.contains(&format!("\r\ncontent-length: {}\r\n", body.len())),
        "{what}: {head}"
    );
    let body: serde_json::Value = serde_json::from_str(body).expect("a JSON body");
    assert_eq!(body["error"]["code"], "validation", "{what}: {body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains(says), "{what}: {message}");
}

/// A URL over 32 KiB is a 414 in the JSON error format, below hyper's own limit (64 KiB)
/// and above it: the server refuses it before hyper has read it.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_url_too_long_gets_a_414_in_the_json_error_format(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let (_server, base) = app.spawn_server("api", &[]).await;
    let addr = addr_of(&base);
    for kib in [40, 70, 200] {
        let request = format!(
            "GET /vouchers/1?q={} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n",
            "a".repeat(kib * 1024)
        );
        let what = format!("{kib} KiB");
        let answer = raw_answer(&addr, request.as_bytes(), &what).await;
        assert_json_error(&what, &answer, 414, "URL");
    }
    // A long URL below the limit is served.
    let url = format!("{base}/healthz?q={}", "a".repeat(30 * 1024));
    let resp = reqwest::get(url).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
}

/// What hyper would refuse before the router sees it (more headers than its parser
/// takes, a request line that is not HTTP) is answered in the JSON error format too, and
/// the connection is closed.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn requests_hyper_refuses_itself_get_the_json_error_format_too(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let (_server, base) = app.spawn_server("api", &[]).await;
    let addr = addr_of(&base);
    let many: String = (0..450).map(|i| format!("x-h{i}: 1\r\n")).collect();
    for (what, request, status, says) in [
        (
            "450 headers",
            format!("GET /healthz HTTP/1.1\r\nHost: test\r\n{many}\r\n"),
            431,
            "headers",
        ),
        (
            "not HTTP",
            "G@T /healthz HTTP/1.1\r\nHost: test\r\n\r\n".to_string(),
            400,
            "HTTP",
        ),
    ] {
        let answer = raw_answer(&addr, request.as_bytes(), what).await;
        assert_json_error(what, &answer, status, says);
    }
}

/// hyper's own limits are above ours, and our judging of heads follows a keep-alive
/// connection's bodies: a head just over our limits, after requests with bodies sent in
/// the same write, gets our JSON once the answers before it are sent, then the close.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_head_over_our_limits_after_other_requests_gets_our_json_after_their_answers(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let (_server, base) = app.spawn_server("api", &[]).await;
    let addr = addr_of(&base);
    let ahead = concat!(
        "GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n",
        "GET /healthz HTTP/1.1\r\nHost: test\r\nContent-Length: 5\r\n\r\nG@T /",
        "GET /healthz HTTP/1.1\r\nHost: test\r\nTransfer-Encoding: chunked\r\n\r\n",
        "5\r\nG@T /\r\n0\r\n\r\n",
    );
    let headers: String = (0..101).map(|i| format!("x-h{i}: 1\r\n")).collect();
    let long_url = format!("/healthz?q={}", "a".repeat(33 * 1024));
    for (what, last, status, says) in [
        (
            "101 headers",
            format!("GET /healthz HTTP/1.1\r\n{headers}\r\n"),
            431,
            "headers",
        ),
        (
            "a 33 KiB URL",
            format!("GET {long_url} HTTP/1.1\r\nHost: test\r\n\r\n"),
            414,
            "URL",
        ),
    ] {
        let mut stream = TcpStream::connect(&addr).await.unwrap();
        stream
            .write_all(format!("{ahead}{last}").as_bytes())
            .await
            .unwrap();
        let got = until_closed(&mut stream, Duration::from_secs(5))
            .await
            .unwrap_or_else(|got| panic!("{what}: still open after {got:?}"));
        let got = String::from_utf8(got).unwrap();
        // The three answers before it, whole, then ours.
        let answers: Vec<&str> = got.split("HTTP/1.1 ").skip(1).collect();
        assert_eq!(answers.len(), 4, "{what}: {got}");
        for answer in &answers[..3] {
            assert!(answer.starts_with("200 OK\r\n"), "{what}: {answer}");
            assert!(
                answer.ends_with("\r\n\r\n{\"status\":\"ok\"}"),
                "{what}: {answer}"
            );
        }
        let (head, body) = answers[3].split_once("\r\n\r\n").unwrap();
        let head = format!("http/1.1 {}", head.to_ascii_lowercase());
        assert!(head.contains("\r\nconnection: close\r\n"), "{what}: {head}");
        assert_json_error(what, &(head, body.to_string()), status, says);
    }
}
