//! Fetching the JWKS: keys added later, failed fetches, floods of unknown kids, a
//! hanging or down provider, HS256 alongside, and `seckill token`.

use super::*;

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_key_added_to_the_jwks_later_is_accepted_without_a_restart(db: PgPool) {
    let old = rsa_key("2026-01");
    let new = ec_key("2026-02");
    let idp = Idp::start(vec![old.jwk.clone()]).await;
    let app = app_with_idp(db, &idp).await;
    assert_eq!(idp.fetches(), 1);

    // Rotation: the provider publishes the new key, then signs with it.
    idp.set_keys(vec![old.jwk.clone(), new.jwk.clone()]);
    assert_accepted(&app, &new.sign(&claims(5)), "the new key").await;
    assert_eq!(idp.fetches(), 2, "its unknown kid fetched the set once");
    assert_accepted(&app, &old.sign(&claims(5)), "the old key, still listed").await;
    assert_accepted(&app, &new.sign(&claims(6)), "the new key, cached").await;
    assert_eq!(idp.fetches(), 2);
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_failed_fetch_keeps_the_cached_keys(db: PgPool) {
    let key = rsa_key("rsa-1");
    let idp = Idp::start(vec![key.jwk.clone()]).await;
    let app = app_with_idp(db, &idp).await;

    idp.set_failing(true);
    let unknown = ec_key("ec-9").sign(&claims(5));
    assert_refused(&app, &unknown, "unknown key id (kid)", "unknown kid").await;
    assert_eq!(
        idp.fetches(),
        2,
        "the unknown kid caused a fetch, which failed"
    );
    assert_accepted(&app, &key.sign(&claims(5)), "the cached key").await;
    let metrics = app.metrics_text().await;
    for outcome in ["ok", "error"] {
        let series = format!("seckill_jwks_fetches_total{{outcome=\"{outcome}\"}}");
        let value = crate::common::metric_value(&metrics, &series);
        assert!(value >= Some(1.0), "{series} is {value:?}");
    }
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_flood_of_unknown_kids_fetches_the_jwks_at_most_once_per_10_s(db: PgPool) {
    let key = ec_key("ec-1");
    let idp = Idp::start(vec![key.jwk.clone()]).await;
    let app = app_with_idp(db, &idp).await;
    assert_eq!(idp.fetches(), 1, "at start");

    let stranger = ec_key("unused");
    let flood_began = Instant::now();
    for round in 0..6 {
        let presses = (0..50).map(|i| {
            let token = stranger.sign_as(
                Algorithm::ES256,
                Some(&format!("made-up-{round}-{i}")),
                &claims(5),
            );
            let app = &app;
            async move { my_orders(app, &token).await }
        });
        for (status, body) in futures::future::join_all(presses).await {
            assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
            assert_eq!(body["error"]["message"], "unknown key id (kid)");
        }
    }
    assert!(
        flood_began.elapsed() < Duration::from_secs(9),
        "the flood took too long"
    );
    assert_eq!(
        idp.fetches(),
        2,
        "300 unknown kids within 10 s: one fetch (the first), not one each"
    );
    assert_accepted(&app, &key.sign(&claims(5)), "a known kid meanwhile").await;

    // 10 s after the first (which began a moment after the flood), an unknown kid
    // fetches again (once).
    tokio::time::sleep(Duration::from_millis(10_500).saturating_sub(flood_began.elapsed())).await;
    let late = (0..20).map(|i| {
        let token = stranger.sign_as(Algorithm::ES256, Some(&format!("late-{i}")), &claims(5));
        let app = &app;
        async move { my_orders(app, &token).await.0 }
    });
    for status in futures::future::join_all(late).await {
        assert_eq!(status, StatusCode::UNAUTHORIZED);
    }
    assert_eq!(idp.fetches(), 3, "one more fetch after 10 s");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_provider_that_hangs_costs_an_unknown_kid_one_second_and_a_known_kid_nothing(db: PgPool) {
    use seckill::auth::jwks::{FETCH_TIMEOUT, MISS_WAIT, REFETCH_GAP};
    let key = ec_key("ec-1");
    let idp = Idp::start(vec![key.jwk.clone()]).await;
    let app = app_with_idp(db, &idp).await;
    assert_eq!(idp.fetches(), 1, "at start");
    idp.set_hanging(true);

    // 50 unknown kids at once: one fetch, which hangs; each waits for it MISS_WAIT,
    // not FETCH_TIMEOUT, and gets "try again" (the key may be on its way).
    let stranger = ec_key("rotated");
    let began = Instant::now();
    let presses = (0..50).map(|i| {
        let token = stranger.sign_as(Algorithm::ES256, Some(&format!("new-{i}")), &claims(5));
        let app = &app;
        async move {
            let sent = Instant::now();
            let answer = my_orders(app, &token).await;
            (answer, sent.elapsed())
        }
    });
    for ((status, body), took) in futures::future::join_all(presses).await {
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        assert_eq!(body["error"]["code"], "unavailable", "{body}");
        assert!(
            took >= MISS_WAIT.mul_f32(0.9) && took < FETCH_TIMEOUT.mul_f32(0.8),
            "waited {took:?}: the fetch's own wait, not the provider's timeout"
        );
    }
    assert_eq!(idp.fetches(), 2, "one fetch for the 50");
    // A known kid never waits for the fetch.
    let sent = Instant::now();
    assert_accepted(&app, &key.sign(&claims(5)), "a known kid while it hangs").await;
    assert!(sent.elapsed() < MISS_WAIT, "{:?}", sent.elapsed());

    // The hung fetch ends (timed out) a little after FETCH_TIMEOUT; until REFETCH_GAP
    // since it began, an unknown kid is a plain 401 at once, with no fetch.
    idp.set_hanging(false);
    tokio::time::sleep(
        (FETCH_TIMEOUT + Duration::from_millis(500)).saturating_sub(began.elapsed()),
    )
    .await;
    let sent = Instant::now();
    assert_refused(
        &app,
        &stranger.sign_as(Algorithm::ES256, Some("new-0"), &claims(5)),
        "unknown key id (kid)",
        "within the gap, after the hung fetch",
    )
    .await;
    assert!(sent.elapsed() < MISS_WAIT, "{:?}", sent.elapsed());
    assert_eq!(idp.fetches(), 2);

    // After the gap, the provider answers again and the new key is fetched and used.
    idp.set_keys(vec![key.jwk.clone(), stranger.jwk.clone()]);
    tokio::time::sleep((REFETCH_GAP + Duration::from_millis(200)).saturating_sub(began.elapsed()))
        .await;
    assert_accepted(
        &app,
        &stranger.sign(&claims(5)),
        "the new key, after the gap",
    )
    .await;
    assert_eq!(idp.fetches(), 3);
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn with_the_jwks_down_at_start_its_tokens_get_503_until_it_answers(db: PgPool) {
    let key = rsa_key("rsa-1");
    // Nothing listens there yet: connections are refused.
    let addr: std::net::SocketAddr = format!("127.0.0.1:{}", crate::common::faults::free_port())
        .parse()
        .unwrap();
    let url = format!("http://{addr}/jwks.json");
    let app = TestApp::spawn_with_jwt(db, jwt_args(Some(SECRET), &url)).await;

    let token = key.sign(&claims(5));
    for _ in 0..3 {
        let resp = app
            .client
            .get(app.url("/orders"))
            .bearer_auth(&token)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(resp.headers()["retry-after"], "1");
        let body: Value = resp.json().await.unwrap();
        assert_eq!(body["error"]["code"], "unavailable", "{body}");
    }
    // HS256 works meanwhile (with the configured issuer and audience).
    let expected = Expected::new(Some(ISSUER), Some(AUDIENCE));
    let hs256 = JwtKeys::with_expected(SECRET, expected).unwrap();
    assert_accepted(&app, &hs256.mint(5, false, 60).unwrap(), "HS256").await;

    let idp = Idp::start_at(addr, vec![key.jwk.clone()]).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, body) = my_orders(&app, &token).await;
        if status == StatusCode::OK {
            break;
        }
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        assert!(Instant::now() < deadline, "the keys never arrived");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(idp.fetches() >= 1);
    // And a token the keys do not verify is now a 401, not a 503.
    assert_refused(
        &app,
        &rsa_key("rsa-1").sign(&claims(5)),
        BAD_SIGNATURE,
        "another key under the same kid",
    )
    .await;
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn hs256_tokens_still_work_alongside_the_jwks_under_the_same_issuer_and_audience(db: PgPool) {
    let key = ec_key("ec-1");
    let idp = Idp::start(vec![key.jwk.clone()]).await;
    let app = app_with_idp(db, &idp).await;

    // As `seckill token` mints them with JWT_ISSUER/JWT_AUDIENCE set.
    let hs256 =
        JwtKeys::with_expected(SECRET, Expected::new(Some(ISSUER), Some(AUDIENCE))).unwrap();
    let (status, body) = app
        .post_json(
            "/vouchers",
            Some(&hs256.mint(1, true, 60).unwrap()),
            &voucher_body(),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_accepted(&app, &hs256.mint(9, false, 60).unwrap(), "HS256").await;
    assert_accepted(&app, &key.sign(&claims(9)), "ES256").await;
    // The issuer and audience checks apply to HS256 tokens too.
    // (One claim wrong at a time: with both missing, jsonwebtoken reports either.)
    let hs256_with = |change: &dyn Fn(&mut Value)| {
        let mut c = claims(9);
        change(&mut c);
        jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &c,
            &EncodingKey::from_secret(SECRET.as_bytes()),
        )
        .unwrap()
    };
    for (token, why, what) in [
        (
            hs256_with(&|c| drop(c.as_object_mut().unwrap().remove("iss"))),
            "token issuer not accepted",
            "no iss",
        ),
        (
            hs256_with(&|c| c["iss"] = json!("https://elsewhere.test")),
            "token issuer not accepted",
            "iss",
        ),
        (
            hs256_with(&|c| drop(c.as_object_mut().unwrap().remove("aud"))),
            "token audience not accepted",
            "no aud",
        ),
        (
            hs256_with(&|c| c["aud"] = json!("elsewhere")),
            "token audience not accepted",
            "aud",
        ),
    ] {
        assert_refused(&app, &token, why, what).await;
    }
    let (status, body) = my_orders(&app, &app.token(9)).await;
    assert_eq!(
        status,
        StatusCode::UNAUTHORIZED,
        "neither iss nor aud: {body}"
    );
    let why = body["error"]["message"].as_str().unwrap();
    assert!(
        why == "token issuer not accepted" || why == "token audience not accepted",
        "{why}"
    );
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn the_seckill_token_command_writes_the_configured_issuer_and_audience(db: PgPool) {
    let idp = Idp::start(vec![ec_key("ec-1").jwk]).await;
    let app = app_with_idp(db, &idp).await;
    let out = Command::new(crate::common::faults::BIN)
        .args(["token", "--user", "31"])
        .env("JWT_SECRET", SECRET)
        .env("JWT_ISSUER", ISSUER)
        .env("JWT_AUDIENCE", AUDIENCE)
        .output()
        .unwrap();
    assert!(out.status.success());
    let token = String::from_utf8(out.stdout).unwrap().trim().to_string();
    assert_accepted(&app, &token, "seckill token").await;
    let out = Command::new(crate::common::faults::BIN)
        .args(["token", "--user", "31"])
        .env_remove("JWT_SECRET")
        .env_remove("JWT_ISSUER")
        .env_remove("JWT_AUDIENCE")
        .output()
        .unwrap();
    assert!(!out.status.success(), "no secret, no token");
    assert!(String::from_utf8_lossy(&out.stderr).contains("JWT_SECRET"));
}
