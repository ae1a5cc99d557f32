//! Tokens of an identity provider: RS256/ES256 JWTs verified against its JWKS, served
//! here on loopback by a small axum router whose key set the test changes and whose
//! fetches it counts. Keys are generated per test (RSA by the `openssl` CLI, P-256 by
//! ring), tokens signed with jsonwebtoken.

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use reqwest::StatusCode;
use serde_json::{json, Value};
use sqlx::PgPool;

use crate::common::{TestApp, SECRET};
use seckill::auth::{Expected, JwtKeys};
use seckill::config::JwtArgs;

const ISSUER: &str = "https://idp.test/realms/shop";
const AUDIENCE: &str = "seckill-api";

/// The identity provider: `GET /jwks.json` answers the current key set (or 500 while
/// `failing`, or nothing at all while `hanging`), counting every request.
struct Idp {
    url: String,
    keys: Arc<Mutex<Vec<Value>>>,
    fetches: Arc<AtomicUsize>,
    failing: Arc<AtomicBool>,
    hanging: Arc<AtomicBool>,
    server: tokio::task::JoinHandle<()>,
}

impl Idp {
    async fn start(keys: Vec<Value>) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        Self::serve(listener, keys)
    }

    /// On a given address (one the app was told about before anything listened there).
    async fn start_at(addr: std::net::SocketAddr, keys: Vec<Value>) -> Self {
        let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
        Self::serve(listener, keys)
    }

    fn serve(listener: tokio::net::TcpListener, keys: Vec<Value>) -> Self {
        use axum::http::StatusCode as Status;
        let url = format!("http://{}/jwks.json", listener.local_addr().unwrap());
        let keys = Arc::new(Mutex::new(keys));
        let fetches = Arc::new(AtomicUsize::new(0));
        let failing = Arc::new(AtomicBool::new(false));
        let hanging = Arc::new(AtomicBool::new(false));
        let (k, f, down, hang) = (
            keys.clone(),
            fetches.clone(),
            failing.clone(),
            hanging.clone(),
        );
        let app = axum::Router::new().route(
            "/jwks.json",
            axum::routing::get(move || {
                let (k, f, down, hang) = (k.clone(), f.clone(), down.clone(), hang.clone());
                async move {
                    f.fetch_add(1, Ordering::SeqCst);
                    if hang.load(Ordering::SeqCst) {
                        std::future::pending::<()>().await;
                    }
                    if down.load(Ordering::SeqCst) {
                        return Err(Status::INTERNAL_SERVER_ERROR);
                    }
                    let keys = k.lock().unwrap().clone();
                    Ok(axum::Json(json!({ "keys": keys })))
                }
            }),
        );
        let server = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self {
            url,
            keys,
            fetches,
            failing,
            hanging,
            server,
        }
    }

    fn fetches(&self) -> usize {
        self.fetches.load(Ordering::SeqCst)
    }

    fn set_keys(&self, keys: Vec<Value>) {
        *self.keys.lock().unwrap() = keys;
    }

    fn set_failing(&self, failing: bool) {
        self.failing.store(failing, Ordering::SeqCst);
    }

    /// Requests arriving while set are accepted and never answered.
    fn set_hanging(&self, hanging: bool) {
        self.hanging.store(hanging, Ordering::SeqCst);
    }
}

impl Drop for Idp {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// A signing key of the provider: its private half for signing, its JWK for the set.
struct SigningKey {
    kid: String,
    alg: Algorithm,
    encoding: EncodingKey,
    jwk: Value,
    /// RSA only: the public key as PEM and DER, SubjectPublicKeyInfo and PKCS#1, as
    /// an attacker would find them.
    public_forms: Vec<(&'static str, Vec<u8>)>,
}

fn openssl(args: &[&str], input: Option<&[u8]>) -> Vec<u8> {
    use std::io::Write;
    let mut child = Command::new("openssl")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("the openssl CLI is needed to generate RSA keys");
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(input.unwrap_or_default()).unwrap();
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "openssl {args:?} failed");
    out.stdout
}

/// A fresh 2048-bit RSA key (RS256).
fn rsa_key(kid: &str) -> SigningKey {
    let pem = openssl(
        &[
            "genpkey",
            "-algorithm",
            "RSA",
            "-pkeyopt",
            "rsa_keygen_bits:2048",
        ],
        None,
    );
    // (OpenSSL 3 writes an RSA key's DER as PKCS#1.)
    let der = openssl(&["pkey", "-outform", "DER"], Some(&pem));
    let key = ring::signature::RsaKeyPair::from_der(&der).unwrap();
    let public = ring::rsa::PublicKeyComponents::<Vec<u8>>::from(key.public());
    let jwk = json!({"kty": "RSA", "kid": kid, "use": "sig", "alg": "RS256",
                     "n": URL_SAFE_NO_PAD.encode(&public.n), "e": URL_SAFE_NO_PAD.encode(&public.e)});
    let public_forms = vec![
        ("SPKI PEM", openssl(&["pkey", "-pubout"], Some(&pem))),
        (
            "SPKI DER",
            openssl(&["pkey", "-pubout", "-outform", "DER"], Some(&pem)),
        ),
        (
            "PKCS#1 PEM",
            openssl(&["rsa", "-RSAPublicKey_out"], Some(&pem)),
        ),
        ("PKCS#1 DER", key.public().as_ref().to_vec()),
    ];
    SigningKey {
        kid: kid.into(),
        alg: Algorithm::RS256,
        encoding: EncodingKey::from_rsa_pem(&pem).unwrap(),
        jwk,
        public_forms,
    }
}

/// A fresh P-256 key (ES256); its JWK names no `alg` (ES256 is inferred from the curve).
fn ec_key(kid: &str) -> SigningKey {
    use ring::signature::{EcdsaKeyPair, KeyPair, ECDSA_P256_SHA256_FIXED_SIGNING};
    let rng = ring::rand::SystemRandom::new();
    let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &rng).unwrap();
    let pair =
        EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, pkcs8.as_ref(), &rng).unwrap();
    let point = pair.public_key().as_ref();
    SigningKey {
        kid: kid.into(),
        alg: Algorithm::ES256,
        encoding: EncodingKey::from_ec_der(pkcs8.as_ref()),
        jwk: json!({"kty": "EC", "crv": "P-256", "kid": kid,
                    "x": URL_SAFE_NO_PAD.encode(&point[1..33]), "y": URL_SAFE_NO_PAD.encode(&point[33..])}),
        public_forms: Vec::new(),
    }
}

impl SigningKey {
    /// A token signed by this key, naming its `kid`.
    fn sign(&self, claims: &Value) -> String {
        self.sign_as(self.alg, Some(&self.kid), claims)
    }

    /// A token signed by this key, whatever its header says.
    fn sign_as(&self, alg: Algorithm, kid: Option<&str>, claims: &Value) -> String {
        let mut header = Header::new(alg);
        header.kid = kid.map(str::to_string);
        jsonwebtoken::encode(&header, claims, &self.encoding).unwrap()
    }
}

fn exp() -> i64 {
    chrono::Utc::now().timestamp() + 600
}

/// Claims the app configured by [`app_with_idp`] accepts: `sub` as a string, as most
/// providers write it.
fn claims(user: i64) -> Value {
    json!({"sub": user.to_string(), "exp": exp(), "iss": ISSUER, "aud": AUDIENCE})
}

fn admin_claims(user: i64) -> Value {
    let mut c = claims(user);
    c["role"] = json!("admin");
    c
}

/// The app verifying tokens of `idp` (issuer and audience checked) and HS256 tokens
/// signed with [`SECRET`].
async fn app_with_idp(db: PgPool, idp: &Idp) -> TestApp {
    TestApp::spawn_with_jwt(db, jwt_args(Some(SECRET), &idp.url)).await
}

fn jwt_args(secret: Option<&str>, jwks_url: &str) -> JwtArgs {
    JwtArgs {
        jwt_secret: secret.map(Into::into),
        jwt_jwks_url: Some(jwks_url.to_string()),
        jwt_issuer: Some(ISSUER.into()),
        jwt_audience: Some(AUDIENCE.into()),
    }
}

/// `GET /orders` with `token`: 200 exactly when the token is accepted.
async fn my_orders(app: &TestApp, token: &str) -> (StatusCode, Value) {
    app.get("/orders", Some(token)).await
}

/// The messages of refused tokens (each rule has its own).
const BAD_SIGNATURE: &str = "token signature does not verify (signed with another key, or altered)";
const EXPIRED: &str = "token expired: its exp is in the past";
const NO_EXP: &str = "token has no exp (expiry) claim, which is required";
const SUB_REFUSED: &str =
    "token sub must be the user id: a positive 64-bit integer (a JSON number or a string of digits)";

/// Asserts a 401 `unauthorized` whose message is `why`.
async fn assert_refused(app: &TestApp, token: &str, why: &str, what: &str) {
    let (status, body) = my_orders(app, token).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{what}: {body}");
    assert_eq!(body["error"]["code"], "unauthorized", "{what}");
    assert_eq!(body["error"]["message"], why, "{what}");
}

async fn assert_accepted(app: &TestApp, token: &str, what: &str) {
    let (status, body) = my_orders(app, token).await;
    assert_eq!(status, StatusCode::OK, "{what}: {body}");
}

fn voucher_body() -> Value {
    let now = chrono::Utc::now();
    json!({"shop_id": 1, "title": "50 off 100", "pay_value": 5000, "actual_value": 10000,
           "seckill": {"stock": 5, "begin_time": now - chrono::Duration::minutes(1),
                       "end_time": now + chrono::Duration::hours(1)}})
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn an_rs256_token_naming_a_jwks_key_is_accepted_with_its_user_and_role(db: PgPool) {
    let key = rsa_key("rsa-1");
    let idp = Idp::start(vec![key.jwk.clone()]).await;
    let app = app_with_idp(db, &idp).await;

    let (status, voucher) = app
        .post_json(
            "/vouchers",
            Some(&key.sign(&admin_claims(1))),
            &voucher_body(),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "an admin's token: {voucher}");
    let (status, body) = app
        .post_json("/vouchers", Some(&key.sign(&claims(2))), &voucher_body())
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "a shopper's token: {body}");

    let voucher = voucher["id"].as_i64().unwrap();
    let shopper = key.sign(&claims(7001));
    let (status, grabbed) = app
        .send(
            app.client
                .post(app.url(&format!("/vouchers/{voucher}/seckill")))
                .bearer_auth(&shopper),
        )
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{grabbed}");
    let (status, orders) = my_orders(&app, &shopper).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(orders[0]["order_id"], grabbed["order_id"], "{orders}");
    assert_eq!(orders[0]["user_id"], 7001, "{orders}");
    assert_eq!(
        idp.fetches(),
        1,
        "fetched once at start, then from the cache"
    );
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn an_es256_token_naming_a_jwks_key_is_accepted_with_its_user(db: PgPool) {
    let rsa = rsa_key("rsa-1");
    let ec = ec_key("ec-1");
    let idp = Idp::start(vec![rsa.jwk.clone(), ec.jwk.clone()]).await;
    let app = app_with_idp(db, &idp).await;

    let voucher = {
        let (status, v) = app
            .post_json(
                "/vouchers",
                Some(&ec.sign(&admin_claims(1))),
                &voucher_body(),
            )
            .await;
        assert_eq!(status, StatusCode::CREATED, "{v}");
        v["id"].as_i64().unwrap()
    };
    // `sub` as a JSON number this time.
    let mut numeric = claims(7002);
    numeric["sub"] = json!(7002);
    let shopper = ec.sign(&numeric);
    let (status, grabbed) = app
        .send(
            app.client
                .post(app.url(&format!("/vouchers/{voucher}/seckill")))
                .bearer_auth(&shopper),
        )
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{grabbed}");
    let (_, orders) = my_orders(&app, &shopper).await;
    assert_eq!(orders[0]["user_id"], 7002, "{orders}");

    // The claims rules are the HS256 ones.
    let mut bad_sub = claims(1);
    bad_sub["sub"] = json!("auth0|123");
    let mut root = claims(1);
    root["role"] = json!("root");
    let mut expired = claims(1);
    expired["exp"] = json!(chrono::Utc::now().timestamp() - 60);
    let mut no_exp = claims(1);
    no_exp.as_object_mut().unwrap().remove("exp");
    assert_refused(&app, &ec.sign(&bad_sub), SUB_REFUSED, "sub").await;
    assert_refused(&app, &ec.sign(&root), "unknown role in token", "role").await;
    assert_refused(&app, &ec.sign(&expired), EXPIRED, "exp").await;
    assert_refused(&app, &ec.sign(&no_exp), NO_EXP, "no exp").await;
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_token_from_another_issuer_is_refused(db: PgPool) {
    let key = rsa_key("rsa-1");
    let idp = Idp::start(vec![key.jwk.clone()]).await;
    let app = app_with_idp(db, &idp).await;

    assert_accepted(&app, &key.sign(&claims(5)), "the configured issuer").await;
    let mut other = claims(5);
    other["iss"] = json!("https://idp.test/realms/other");
    let mut none = claims(5);
    none.as_object_mut().unwrap().remove("iss");
    for (what, c) in [("another issuer", other), ("no issuer", none)] {
        assert_refused(&app, &key.sign(&c), "token issuer not accepted", what).await;
    }
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_token_for_another_audience_is_refused(db: PgPool) {
    let key = ec_key("ec-1");
    let idp = Idp::start(vec![key.jwk.clone()]).await;
    let app = app_with_idp(db, &idp).await;

    let mut several = claims(5);
    several["aud"] = json!(["account", AUDIENCE]);
    assert_accepted(&app, &key.sign(&several), "an array holding ours").await;
    let mut other = claims(5);
    other["aud"] = json!("account");
    let mut others = claims(5);
    others["aud"] = json!(["account", "billing"]);
    let mut none = claims(5);
    none.as_object_mut().unwrap().remove("aud");
    for (what, c) in [
        ("another audience", other),
        ("other audiences", others),
        ("no audience", none),
    ] {
        assert_refused(&app, &key.sign(&c), "token audience not accepted", what).await;
    }
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_token_naming_an_unknown_kid_or_none_is_refused(db: PgPool) {
    let known = rsa_key("rsa-1");
    let stranger = rsa_key("rsa-2");
    let idp = Idp::start(vec![known.jwk.clone()]).await;
    let app = app_with_idp(db, &idp).await;

    let c = claims(5);
    assert_refused(
        &app,
        &stranger.sign(&c),
        "unknown key id (kid)",
        "unknown kid",
    )
    .await;
    // A key of the set named, but signed by another: the signature fails.
    let forged = stranger.sign_as(Algorithm::RS256, Some("rsa-1"), &c);
    assert_refused(&app, &forged, BAD_SIGNATURE, "forged").await;
    let anonymous = known.sign_as(Algorithm::RS256, None, &c);
    assert_refused(&app, &anonymous, "token has no key id (kid)", "no kid").await;
    assert_accepted(&app, &known.sign(&c), "the known key").await;
}

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
async fn an_hs256_token_signed_with_the_providers_public_key_is_refused(db: PgPool) {
    let key = rsa_key("rsa-1");
    let idp = Idp::start(vec![key.jwk.clone()]).await;
    // With a secret (HS256 checked against it, never against a JWKS key) and without
    // (HS256 not accepted at all).
    let both = app_with_idp(db.clone(), &idp).await;
    let jwks_only = TestApp::spawn_with_jwt(db, jwt_args(None, &idp.url)).await;

    let mut forms = key.public_forms.clone();
    let jwk_text = key.jwk.to_string().into_bytes();
    forms.push(("JWK text", jwk_text));
    forms.push((
        "modulus",
        URL_SAFE_NO_PAD
            .decode(key.jwk["n"].as_str().unwrap())
            .unwrap(),
    ));
    for (what, public) in &forms {
        let mut header = Header::new(Algorithm::HS256);
        header.kid = Some(key.kid.clone());
        let token =
            jsonwebtoken::encode(&header, &admin_claims(1), &EncodingKey::from_secret(public))
                .unwrap();
        assert_refused(&both, &token, BAD_SIGNATURE, what).await;
        assert_refused(&jwks_only, &token, "token algorithm not accepted", what).await;
    }
    // The same key as RS256 is good: only the algorithm is wrong above.
    assert_accepted(&both, &key.sign(&claims(1)), "RS256").await;
    assert_accepted(&jwks_only, &key.sign(&claims(1)), "RS256").await;
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_token_whose_alg_is_not_its_keys_is_refused(db: PgPool) {
    let rsa = rsa_key("rsa-1");
    let ec = ec_key("ec-1");
    let idp = Idp::start(vec![rsa.jwk.clone(), ec.jwk.clone()]).await;
    let app = app_with_idp(db, &idp).await;

    let c = claims(5);
    // RS256 (signed by the RSA key) naming the EC key, and ES256 naming the RSA key.
    let rs_on_ec = rsa.sign_as(Algorithm::RS256, Some("ec-1"), &c);
    let es_on_rsa = ec.sign_as(Algorithm::ES256, Some("rsa-1"), &c);
    for (what, token) in [("RS256 on EC", rs_on_ec), ("ES256 on RSA", es_on_rsa)] {
        assert_refused(&app, &token, "token algorithm does not match its key", what).await;
    }
    assert_accepted(&app, &rsa.sign(&c), "RS256 on RSA").await;
    assert_accepted(&app, &ec.sign(&c), "ES256 on EC").await;
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn an_unsigned_alg_none_token_or_another_algorithm_is_refused(db: PgPool) {
    let rsa = rsa_key("rsa-1");
    let idp = Idp::start(vec![rsa.jwk.clone()]).await;
    let app = app_with_idp(db, &idp).await;

    let payload = URL_SAFE_NO_PAD.encode(admin_claims(1).to_string());
    for header in [
        json!({"alg": "none", "kid": "rsa-1"}),
        json!({"alg": "none", "typ": "JWT"}),
        json!({"alg": "NONE", "kid": "rsa-1"}),
        json!({"kid": "rsa-1"}),
    ] {
        let head = URL_SAFE_NO_PAD.encode(header.to_string());
        for token in [format!("{head}.{payload}."), format!("{head}.{payload}")] {
            let (status, body) = my_orders(&app, &token).await;
            assert_eq!(status, StatusCode::UNAUTHORIZED, "{header}: {body}");
        }
        let token = format!("{head}.{payload}.");
        if header.get("alg").is_some() {
            assert_refused(&app, &token, "token algorithm not accepted", "none").await;
        }
    }
    // Signed by the JWKS key, with algorithms it could compute but we do not accept.
    for alg in [Algorithm::RS384, Algorithm::RS512, Algorithm::PS256] {
        let token = rsa.sign_as(alg, Some("rsa-1"), &claims(1));
        assert_refused(
            &app,
            &token,
            "token algorithm not accepted",
            &format!("{alg:?}"),
        )
        .await;
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
