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

mod fetching;
mod tokens;

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
        jwt_jwks_url: Some(jwks_url.into()),
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
