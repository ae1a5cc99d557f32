//! The HTTP server's own limits (slow and idle connections, a connection cap,
//! oversized headers), honest answers when the admission store fails mid-call, read
//! paths that fall back to Postgres while Redis is down, and input nits.

use std::time::Duration;

use crate::common::{oid, uid, vid, TestApp};
use reqwest::StatusCode;
use serde_json::json;
use sqlx::PgPool;

mod connections;
mod json_errors;
mod slow_redis;

/// Blocks a Redis server for `millis` with a busy script (no DEBUG command needed):
/// commands sent meanwhile wait in its socket buffers and run afterwards.
pub(crate) async fn block_redis(url: &str, millis: u64) -> tokio::task::JoinHandle<()> {
    let client = redis::Client::open(url).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let task = tokio::spawn(async move {
        let busy = "local t = redis.call('TIME') local start = t[1] * 1000 + t[2] / 1000 \
                    while true do t = redis.call('TIME') \
                    if t[1] * 1000 + t[2] / 1000 - start > tonumber(ARGV[1]) then return 1 end end";
        let _: redis::RedisResult<i64> = redis::cmd("EVAL")
            .arg(busy)
            .arg(0)
            .arg(millis)
            .query_async(&mut conn)
            .await;
    });
    // Let the script start before anything else is sent.
    tokio::time::sleep(Duration::from_millis(200)).await;
    task
}

// --- The server's own limits, against the real binary. ---

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn addr_of(base: &str) -> String {
    base.trim_start_matches("http://").to_string()
}

/// Reads from `stream` until the server closes it (EOF or reset); `Err` if it is still
/// open after `limit`. Whatever it sent before is returned.
async fn until_closed(stream: &mut TcpStream, limit: Duration) -> Result<Vec<u8>, Vec<u8>> {
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + limit;
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) => return Err(got),
            Ok(Ok(0)) | Ok(Err(_)) => return Ok(got),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

/// Sends `GET /healthz` on `stream` and reads its whole (small) answer within `limit`.
async fn healthz_within(stream: &mut TcpStream, limit: Duration) -> String {
    let deadline = tokio::time::Instant::now() + limit;
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n")
        .await
        .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains("\"ok\"}") {
        let n = tokio::time::timeout_at(deadline, stream.read(&mut buf))
            .await
            .unwrap_or_else(|_| panic!("no answer within {limit:?}"))
            .unwrap();
        assert!(
            n > 0,
            "closed before answering: {}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&got).into_owned()
}

async fn healthz_on(stream: &mut TcpStream) -> String {
    healthz_within(stream, Duration::from_secs(5)).await
}

/// Opens a connection that starts a request and then sends one more header byte every
/// `every`, as a slowloris client does, until the server closes it.
async fn trickle(addr: &str, every: Duration) -> tokio::task::JoinHandle<Option<Duration>> {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    tokio::spawn(async move {
        let started = std::time::Instant::now();
        if stream
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: test\r\nX-Slow: ")
            .await
            .is_err()
        {
            return Some(started.elapsed());
        }
        let mut buf = [0u8; 64];
        while started.elapsed() < Duration::from_secs(60) {
            tokio::select! {
                read = stream.read(&mut buf) => match read {
                    Ok(0) | Err(_) => return Some(started.elapsed()),
                    Ok(_) => {}
                },
                _ = tokio::time::sleep(every) => {
                    if stream.write_all(b"a").await.is_err() {
                        return Some(started.elapsed());
                    }
                }
            }
        }
        None
    })
}

/// Opens a connection with a small receive buffer, asks for the Swagger UI bundle
/// (about 1.5 MB) `times` over in one go, and never reads: the server's writes stall.
async fn stop_reading(addr: &str, times: usize) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stream = socket.connect(addr.parse().unwrap()).await.unwrap();
    let request = b"GET /docs/swagger-ui-bundle.js HTTP/1.1\r\nHost: test\r\n\r\n";
    stream.write_all(&request.repeat(times)).await.unwrap();
    stream
}

async fn bundle_len(base: &str) -> usize {
    let resp = reqwest::get(format!("{base}/docs/swagger-ui-bundle.js"))
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    resp.bytes().await.unwrap().len()
}
