//! TLS to Postgres and Redis, against real servers that accept nothing else: a private
//! Postgres with `ssl=on` and only `hostssl` lines in pg_hba, a `redis-server` with only a
//! `--tls-port`, a TLS-only Redis Cluster; certificates made by `openssl` in the test.

use std::time::Duration;

use futures::StreamExt;
use reqwest::StatusCode;
use serde_json::Value;
use sqlx::PgPool;

use crate::common::cluster::PrivateCluster;
use crate::common::faults::{self, Process, BIN};
use crate::common::tls::{Certs, TlsPostgres, TlsRedis};
use seckill::auth::JwtKeys;

/// Runs `seckill <args>` to its end (at most 60 s): exit code and standard error.
pub(crate) async fn cli(args: &[&str], env: &[(&str, String)]) -> (Option<i32>, String) {
    let mut cmd = tokio::process::Command::new(BIN);
    cmd.args(args)
        .env("JWT_SECRET", crate::common::SECRET)
        .env("RUST_LOG", "warn")
        .kill_on_drop(true);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .expect("the command ended within 60 s")
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Opens a sale of `stock` through the API at `base`, lets `shoppers` different users
/// grab it at once, and waits until Postgres (`db`) holds exactly the admitted orders.
async fn sell(base: &str, db: &PgPool, stock: i64, shoppers: i64) -> i64 {
    let jwt = JwtKeys::new(crate::common::SECRET).unwrap();
    let http = reqwest::Client::new();
    let voucher = crate::common::open_sale_at(&http, base, stock).await;

    let results: Vec<(StatusCode, Value)> = futures::stream::iter(1..=shoppers)
        .map(|user| {
            let req = http
                .post(format!("{base}/vouchers/{voucher}/seckill"))
                .bearer_auth(jwt.mint(100 + user, false, 600).unwrap());
            async move {
                let resp = req.send().await.unwrap();
                (resp.status(), resp.json().await.unwrap())
            }
        })
        .buffer_unordered(32)
        .collect()
        .await;
    let mut admitted: Vec<i64> = Vec::new();
    for (status, body) in &results {
        if *status == StatusCode::ACCEPTED {
            admitted.push(body["order_id"].as_str().unwrap().parse().unwrap());
        } else {
            assert_eq!(
                (*status, body["error"]["code"].as_str()),
                (StatusCode::CONFLICT, Some("sold_out")),
                "{body}"
            );
        }
    }
    assert_eq!(admitted.len() as i64, stock, "admitted = stock");
    admitted.sort_unstable();

    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let stored: Vec<i64> = sqlx::query_scalar(
            "SELECT id FROM voucher_orders WHERE voucher_id = $1 AND status = 'created' ORDER BY id",
        )
        .bind(voucher)
        .fetch_all(db)
        .await
        .unwrap();
        if stored == admitted {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "orders never persisted: {stored:?} vs {admitted:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let left: i32 = sqlx::query_scalar("SELECT stock FROM seckill_vouchers WHERE voucher_id = $1")
        .bind(voucher)
        .fetch_one(db)
        .await
        .unwrap();
    assert_eq!(left, 0);
    voucher
}

#[tokio::test]
async fn a_sale_is_sold_and_persisted_through_tls_only_postgres_and_redis() {
    let certs = Certs::make();
    let pg = TlsPostgres::start(&certs);
    let redis = TlsRedis::start(&certs);
    let ca = certs.ca.display().to_string();
    let db_url = pg.url(
        "localhost",
        &format!("sslmode=verify-full&sslrootcert={ca}"),
    );
    let redis_url = redis.url("localhost");

    // Both servers refuse plaintext, so every connection that works below is TLS.
    let plain = sqlx::PgPool::connect(&pg.url("localhost", "sslmode=disable")).await;
    assert!(plain.is_err(), "postgres accepted a plaintext connection");
    let plain_redis = redis::Client::open(format!("redis://localhost:{}", redis.port))
        .unwrap()
        .get_connection_with_timeout(Duration::from_secs(2))
        .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c));
    assert!(plain_redis.is_err(), "redis answered in plaintext");
    let db = sqlx::PgPool::connect(&db_url).await.unwrap();

    let env = vec![
        ("DATABASE_URL", db_url.clone()),
        ("REDIS_URL", redis_url.clone()),
        ("REDIS_TLS_CA_FILE", ca.clone()),
    ];
    let (code, err) = cli(&["migrate"], &env).await;
    assert_eq!(code, Some(0), "migrate over TLS: {err}");

    // The API and a worker as separate processes, each over TLS to both stores.
    let port = faults::free_port();
    let base = format!("http://127.0.0.1:{port}");
    let mut api_env = vec![
        ("REDIS_TLS_CA_FILE", ca.clone()),
        ("BIND", format!("127.0.0.1:{port}")),
        ("SKIP_MIGRATIONS", "true".to_string()),
    ];
    let _api = Process::spawn("api", &redis_url, "", &db_url, &api_env);
    api_env.truncate(1);
    api_env.push(("WORKER_BLOCK_MS", "200".to_string()));
    let _worker = Process::spawn("worker", &redis_url, "", &db_url, &api_env);
    faults::wait_ready(&base).await;

    let voucher = sell(&base, &db, 5, 12).await;
    let sessions: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_ssl JOIN pg_stat_activity USING (pid) \
         WHERE ssl AND datname = 'postgres'",
    )
    .fetch_one(&db)
    .await
    .unwrap();
    println!("voucher {voucher}: 5 of 12 shoppers admitted over rediss://, 5 orders persisted over verify-full; {sessions} TLS sessions on postgres");

    // The operators' commands reach both stores the same way.
    let voucher = voucher.to_string();
    let (code, err) = cli(&["reconcile", "--voucher", &voucher], &env).await;
    assert_eq!(
        code,
        Some(0),
        "reconcile over TLS finds the stores balanced: {err}"
    );
    let (code, err) = cli(&["dead-letters"], &env).await;
    assert_eq!(code, Some(0), "dead-letters over TLS: {err}");
}

/// A server that answers Postgres's TLS request as one without TLS does ("N"), then
/// hangs up: which server a test finds at `DATABASE_URL` may have TLS on or off.
async fn refuses_tls() -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut request = [0u8; 8]; // length 8, code 80877103: SSLRequest
                if socket.read_exact(&mut request).await.is_ok() {
                    let _ = socket.write_all(b"N").await;
                }
            });
        }
    });
    addr
}

#[tokio::test]
async fn a_tls_mistake_stops_every_command_at_once_with_an_error_naming_the_setting() {
    let certs = Certs::make();
    let pg = TlsPostgres::start(&certs);
    let redis = TlsRedis::start(&certs);
    let ca = certs.ca.display().to_string();
    let other = certs.other_ca.display().to_string();
    let good_db = pg.url(
        "localhost",
        &format!("sslmode=verify-full&sslrootcert={ca}"),
    );
    let good_redis = [
        ("REDIS_URL", redis.url("localhost")),
        ("REDIS_TLS_CA_FILE", ca.clone()),
    ];

    every_postgres_mistake_stops_every_command(&certs, &pg, &ca, &other, &good_redis).await;
    verify_ca_connects_and_the_environments_settings_count(&pg, &ca, &other).await;

    every_redis_mistake_stops_every_command(&redis, &ca, &other, &good_db).await;

    // A scheme that does not match the port: a plain port never finishes a TLS
    // handshake, a TLS port drops plain RESP. Neither is certain (a slow or restarting
    // node looks alike), so the start goes on, but the warning says what to check.
    let plain = crate::common::redis_url().replacen("redis://", "rediss://", 1);
    let tls_as_plain = format!("redis://127.0.0.1:{}", redis.port);
    for (url, needle) in [
        (
            plain,
            "if this is a plain (non-TLS) port, the URL must be redis://",
        ),
        (
            tls_as_plain,
            "if this port speaks only TLS, the URL must be rediss://",
        ),
    ] {
        let env = [
            ("DATABASE_URL", good_db.clone()),
            ("REDIS_URL", url.clone()),
        ];
        let (_, err) = cli(&["dead-letters"], &env).await;
        assert!(
            err.contains(needle) && err.contains("check REDIS_URL"),
            "{url}: {err}"
        );
    }
}

async fn every_postgres_mistake_stops_every_command(
    certs: &Certs,
    pg: &TlsPostgres,
    ca: &str,
    other: &str,
    good_redis: &[(&'static str, String)],
) {
    // Postgres: the wrong CA, a host the certificate does not name (verify-ca does not
    // check names: it connects), TLS demanded of a server without it, a missing CA file.
    let no_tls = refuses_tls().await;
    let cases = [
        (
            pg.url(
                "localhost",
                &format!("sslmode=verify-full&sslrootcert={other}"),
            ),
            vec!["TLS with Postgres failed", "sslrootcert", "UnknownIssuer"],
        ),
        (
            pg.url(
                "127.0.0.2",
                &format!("sslmode=verify-full&sslrootcert={ca}"),
            ),
            vec![
                "TLS with Postgres failed",
                "verify-full",
                "not valid for name",
            ],
        ),
        (
            format!("postgres://postgres@{no_tls}/postgres?sslmode=require"),
            vec![
                "TLS with Postgres failed",
                "server does not support TLS",
                "sslmode=require",
            ],
        ),
        (
            pg.url(
                "localhost",
                "sslmode=verify-full&sslrootcert=/nonexistent/ca.pem",
            ),
            vec!["DATABASE_URL", "sslrootcert=/nonexistent/ca.pem"],
        ),
        // require with a root certificate verifies the chain, as libpq does (sqlx alone
        // would not), under sqlx's alias too.
        (
            pg.url("localhost", &format!("sslmode=require&sslrootcert={other}")),
            vec![
                "TLS with Postgres failed",
                "UnknownIssuer",
                "sslmode=require",
            ],
        ),
        (
            pg.url("localhost", &format!("sslmode=require&ssl-ca={other}")),
            vec!["TLS with Postgres failed", "UnknownIssuer", "ssl-ca="],
        ),
        // A directory, or a file that holds no certificate, is refused at once.
        (
            pg.url("localhost", "sslmode=verify-full&ssl-root-cert=/tmp"),
            vec!["DATABASE_URL: ssl-root-cert=/tmp"],
        ),
        (
            pg.url(
                "localhost",
                &format!(
                    "sslmode=verify-full&sslrootcert={}",
                    certs.server_key.display()
                ),
            ),
            vec!["DATABASE_URL: sslrootcert=", "no PEM certificate"],
        ),
    ];
    for (url, expected) in cases {
        for command in [&["migrate"][..], &["worker"], &["api"], &["reconcile"]] {
            let mut env = vec![("DATABASE_URL", url.clone())];
            env.extend(good_redis.iter().cloned());
            env.push(("BIND", format!("127.0.0.1:{}", faults::free_port())));
            let (code, err) = cli(command, &env).await;
            assert_eq!(code, Some(2), "{command:?} with {url} must fail: {err}");
            for needle in &expected {
                assert!(
                    err.contains(needle),
                    "{command:?} {url}: {needle:?} not in {err}"
                );
            }
        }
    }
}

async fn verify_ca_connects_and_the_environments_settings_count(
    pg: &TlsPostgres,
    ca: &str,
    other: &str,
) {
    // verify-ca checks the chain. (It should skip the host name as libpq does, but sqlx
    // 0.8.6 with rustls >= 0.23.24 checks it too, a known sqlx limitation; see
    // docs/operations.md, "TLS".)
    let (code, err) = cli(
        &["migrate"],
        &[(
            "DATABASE_URL",
            pg.url("localhost", &format!("sslmode=verify-ca&sslrootcert={ca}")),
        )],
    )
    .await;
    assert_eq!(code, Some(0), "verify-ca with the right CA connects: {err}");
    // The environment's PGSSLMODE/PGSSLROOTCERT count as sqlx reads them, and are named.
    let (code, err) = cli(
        &["migrate"],
        &[
            ("DATABASE_URL", pg.url("localhost", "")),
            ("PGSSLMODE", "require".into()),
            ("PGSSLROOTCERT", other.to_string()),
        ],
    )
    .await;
    assert_eq!(code, Some(2), "PGSSLROOTCERT of another CA: {err}");
    for needle in ["UnknownIssuer", "PGSSLMODE=require", "PGSSLROOTCERT="] {
        assert!(err.contains(needle), "{needle:?} not in {err}");
    }
}

async fn every_redis_mistake_stops_every_command(
    redis: &TlsRedis,
    ca: &str,
    other: &str,
    good_db: &str,
) {
    // Redis: no CA file (the system's roots do not know the test's CA), the wrong CA,
    // a CA file with a plaintext URL, an unreadable CA file.
    let rediss = redis.url("localhost");
    type Env = Vec<(&'static str, String)>;
    let cases: Vec<(Env, Vec<&str>)> = vec![
        (
            vec![("REDIS_URL", rediss.clone())],
            vec![
                "TLS with Redis failed",
                "REDIS_URL",
                "set REDIS_TLS_CA_FILE",
            ],
        ),
        (
            vec![
                ("REDIS_URL", rediss.clone()),
                ("REDIS_TLS_CA_FILE", other.to_string()),
            ],
            vec![
                "TLS with Redis failed",
                "UnknownIssuer",
                "REDIS_TLS_CA_FILE",
            ],
        ),
        (
            vec![
                ("REDIS_URL", format!("redis://127.0.0.1:{}", redis.port)),
                ("REDIS_TLS_CA_FILE", ca.to_string()),
            ],
            vec!["REDIS_TLS_CA_FILE is set but REDIS_URL is not a rediss:// URL"],
        ),
        (
            vec![
                ("REDIS_URL", rediss.clone()),
                ("REDIS_TLS_CA_FILE", "/nonexistent/ca.pem".into()),
            ],
            vec!["REDIS_TLS_CA_FILE /nonexistent/ca.pem"],
        ),
    ];
    for (redis_env, expected) in cases {
        for command in [&["dead-letters"][..], &["worker"], &["serve"]] {
            let mut env = vec![("DATABASE_URL", good_db.to_string())];
            env.extend(redis_env.iter().cloned());
            env.push(("BIND", format!("127.0.0.1:{}", faults::free_port())));
            let (code, err) = cli(command, &env).await;
            assert_eq!(
                code,
                Some(2),
                "{command:?} with {redis_env:?} must fail: {err}"
            );
            for needle in &expected {
                assert!(
                    err.contains(needle),
                    "{command:?} {redis_env:?}: {needle:?} not in {err}"
                );
            }
        }
    }
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_sale_is_sold_through_a_redis_cluster_that_speaks_only_tls(db: PgPool) {
    let certs = Certs::make();
    let cluster = PrivateCluster::start_tls(3, &certs);
    let url = faults::database_url(&db, None);
    let port = faults::free_port();
    let env = vec![
        ("REDIS_CLUSTER_URLS", cluster.urls()),
        ("REDIS_TLS_CA_FILE", certs.ca.display().to_string()),
        ("WORKER_BLOCK_MS", "200".to_string()),
        ("BIND", format!("127.0.0.1:{port}")),
    ];
    // The cluster's certificate checked against the system's roots, or another CA:
    // every command stops at once, naming the settings.
    let other = certs.other_ca.display().to_string();
    for (ca, expected) in [
        (None, vec!["REDIS_CLUSTER_URLS", "set REDIS_TLS_CA_FILE"]),
        (
            Some(other),
            vec!["REDIS_CLUSTER_URLS", "UnknownIssuer", "REDIS_TLS_CA_FILE"],
        ),
    ] {
        for command in [&["dead-letters"][..], &["worker"], &["serve"]] {
            let mut env = vec![
                ("DATABASE_URL", url.clone()),
                ("REDIS_CLUSTER_URLS", cluster.urls()),
                ("BIND", format!("127.0.0.1:{}", faults::free_port())),
            ];
            env.extend(ca.clone().map(|ca| ("REDIS_TLS_CA_FILE", ca)));
            let (code, err) = cli(command, &env).await;
            assert_eq!(code, Some(2), "{command:?} {ca:?}: {err}");
            assert!(
                err.contains("TLS with Redis failed"),
                "{command:?} {ca:?}: {err}"
            );
            for needle in &expected {
                assert!(
                    err.contains(needle),
                    "{command:?} {ca:?}: {needle:?} not in {err}"
                );
            }
        }
    }
    let _server = Process::spawn("serve", "redis://127.0.0.1:1", "", &url, &env);
    let base = format!("http://127.0.0.1:{port}");
    faults::wait_ready(&base).await;
    let voucher = sell(&base, &db, 4, 10).await;
    println!(
        "voucher {voucher}: 4 of 10 shoppers admitted through a 3-node TLS-only cluster ({}), 4 orders persisted",
        cluster.urls()
    );
}
