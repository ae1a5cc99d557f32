//! An identity provider's public signing keys, from its JWKS (`JWT_JWKS_URL`).
//!
//! Fetched at start (the process starts even if the provider does not answer), kept in
//! memory, refreshed every [`REFRESH_EVERY`] (retried from 1 s, doubling to 10 s, while a
//! fetch fails), and fetched again when a token names a `kid` the cache lacks, at most
//! once per [`REFETCH_GAP`] for that reason: a flood of made-up `kid`s costs the provider
//! one request per 10 s. One fetch at a time; a request that needs one waits for it (at
//! most [`MISS_WAIT`]). A failed or malformed fetch keeps the cached keys; a good one
//! replaces them (a key the provider dropped is dropped here too).
//!
//! Usable keys: a `kid`, `use` absent or `sig`, `key_ops` absent or holding `verify`;
//! RSA (2048 bits or more) for RS256, EC P-256 for ES256; the JWK's `alg`, when present,
//! must be that algorithm. Anything else in the set (encryption keys, symmetric `oct`
//! keys, other curves or algorithms) is skipped, never used.

use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, Instant};

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use jsonwebtoken::jwk::{
    AlgorithmParameters, EllipticCurve, Jwk, KeyAlgorithm, KeyOperations, PublicKeyUse,
};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use tokio_util::sync::CancellationToken;

use super::{
    decode_checked, AuthUser, Expected, Refused, Unauthorized, ALG_MISMATCH, NO_KID, UNKNOWN_KID,
};

/// An unknown `kid` fetches the set again only if the last fetch it caused began at least
/// this long ago.
pub const REFETCH_GAP: Duration = Duration::from_secs(10);
/// The longest a request waits for a fetch (its own or one in flight).
pub const MISS_WAIT: Duration = Duration::from_secs(5);
/// One fetch, connection to last byte.
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(5);
/// Keys are fetched again this often, so rotated keys arrive before a token needs them.
pub const REFRESH_EVERY: Duration = Duration::from_secs(300);
/// After a failed fetch the next is tried this soon, the delay doubling up to
/// [`RETRY_MAX`].
pub const RETRY_FIRST: Duration = Duration::from_secs(1);
pub const RETRY_MAX: Duration = Duration::from_secs(10);
/// A larger document is refused (real ones are a few KiB).
pub const MAX_BODY: usize = 1 << 20;

/// A usable key: the one algorithm it verifies, and the key.
struct Key {
    alg: Algorithm,
    decoding: DecodingKey,
}

type KeySet = HashMap<String, Arc<Key>>;

/// The identity provider's keys. Cloning shares them.
#[derive(Clone)]
pub struct Jwks(Arc<Inner>);

struct Inner {
    url: reqwest::Url,
    /// The URL as logged: without a password, should it hold one.
    shown: String,
    client: reqwest::Client,
    /// `None` until a fetch has succeeded.
    keys: RwLock<Option<KeySet>>,
    /// Held for the whole of a fetch: one at a time.
    fetches: tokio::sync::Mutex<Fetches>,
    rs256: Validation,
    es256: Validation,
}

#[derive(Default)]
struct Fetches {
    /// When the last fetch caused by an unknown `kid` began.
    last_on_miss: Option<Instant>,
}

impl Fetches {
    fn due_on_miss(&self) -> bool {
        self.last_on_miss
            .is_none_or(|began| began.elapsed() >= REFETCH_GAP)
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Trigger {
    /// At start, on schedule, or retrying.
    Schedule,
    /// A token named a `kid` the cache lacks.
    UnknownKid,
}

enum Lookup {
    Found(Arc<Key>),
    Unknown,
    NotLoaded,
}

impl Jwks {
    /// Keys from `url` (nothing fetched yet), for tokens that must also meet `expected`.
    pub fn new(url: &str, expected: &Expected) -> anyhow::Result<Self> {
        let parsed = reqwest::Url::parse(url)
            .map_err(|e| anyhow::anyhow!("JWT_JWKS_URL {url:?} is not a URL: {e}"))?;
        anyhow::ensure!(
            matches!(parsed.scheme(), "https" | "http"),
            "JWT_JWKS_URL must be an https:// URL (http:// only on a trusted network), not {url:?}"
        );
        let mut shown = parsed.clone();
        if shown.password().is_some() {
            let _ = shown.set_password(Some("***"));
        }
        if parsed.scheme() == "http" {
            let loopback = match parsed.host_str() {
                Some("localhost") => true,
                Some(host) => host
                    .trim_matches(['[', ']'])
                    .parse::<std::net::IpAddr>()
                    .is_ok_and(|ip| ip.is_loopback()),
                None => false,
            };
            if !loopback {
                tracing::warn!(
                    url = %shown,
                    "JWT_JWKS_URL is plain http: whoever can alter that traffic can sign tokens"
                );
            }
        }
        let client = reqwest::Client::builder()
            .timeout(FETCH_TIMEOUT)
            .connect_timeout(FETCH_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("seckill/", env!("CARGO_PKG_VERSION")))
            .build()?;
        // Installed before the first fetch, so that it is counted.
        crate::metrics::handle();
        Ok(Self(Arc::new(Inner {
            url: parsed,
            shown: shown.to_string(),
            client,
            keys: RwLock::new(None),
            fetches: tokio::sync::Mutex::default(),
            rs256: expected.validation(Algorithm::RS256),
            es256: expected.validation(Algorithm::ES256),
        })))
    }

    /// Whether a fetch has succeeded yet.
    pub fn loaded(&self) -> bool {
        self.0.read_keys().is_some()
    }

    /// Fetches the set now (after a fetch in flight, if any); true if this fetch
    /// succeeded. At most [`FETCH_TIMEOUT`].
    pub async fn refresh(&self) -> bool {
        self.0.refresh(Trigger::Schedule).await
    }

    /// Fetches every [`REFRESH_EVERY`], and after a failure from [`RETRY_FIRST`] doubling
    /// to [`RETRY_MAX`], until `cancel` fires. The first fetch is [`Jwks::refresh`]'s, at
    /// start-up: this waits before its own.
    pub async fn keep_fresh(self, cancel: CancellationToken) {
        let mut delay = if self.loaded() {
            REFRESH_EVERY
        } else {
            RETRY_FIRST
        };
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(delay) => {}
            }
            let fetched = tokio::select! {
                _ = cancel.cancelled() => return,
                fetched = self.0.refresh(Trigger::Schedule) => fetched,
            };
            delay = match fetched {
                true => REFRESH_EVERY,
                false if delay >= REFRESH_EVERY => RETRY_FIRST,
                false => (delay * 2).min(RETRY_MAX),
            };
        }
    }

    /// Verifies a token whose header says `alg` (RS256 or ES256) and names `kid`.
    pub(super) async fn verify(
        &self,
        token: &str,
        alg: Algorithm,
        kid: Option<&str>,
    ) -> Result<AuthUser, Refused> {
        let kid = kid.ok_or(Unauthorized(NO_KID))?;
        let key = match self.lookup(kid) {
            Lookup::Found(key) => key,
            Lookup::Unknown | Lookup::NotLoaded => {
                self.fetch_on_miss().await;
                match self.lookup(kid) {
                    Lookup::Found(key) => key,
                    Lookup::Unknown => return Err(Unauthorized(UNKNOWN_KID).into()),
                    Lookup::NotLoaded => return Err(Refused::KeysNotLoaded),
                }
            }
        };
        // The key's own algorithm, never the token's word alone.
        if key.alg != alg {
            return Err(Unauthorized(ALG_MISMATCH).into());
        }
        let validation = match key.alg {
            Algorithm::RS256 => &self.0.rs256,
            _ => &self.0.es256,
        };
        Ok(decode_checked(token, &key.decoding, validation)?)
    }

    fn lookup(&self, kid: &str) -> Lookup {
        match &*self.0.read_keys() {
            None => Lookup::NotLoaded,
            Some(keys) => keys
                .get(kid)
                .cloned()
                .map_or(Lookup::Unknown, Lookup::Found),
        }
    }

    /// After a miss: waits for a fetch in flight, then fetches if the last fetch caused
    /// by a miss began [`REFETCH_GAP`] ago or more. At most [`MISS_WAIT`] in all.
    async fn fetch_on_miss(&self) {
        let wait = async {
            if self.0.fetches.lock().await.due_on_miss() {
                // Spawned: a caller that goes away does not cancel the fetch others
                // wait for (and that counts against the gap).
                let inner = self.0.clone();
                let _ = tokio::spawn(async move { inner.refresh(Trigger::UnknownKid).await }).await;
            }
        };
        let _ = tokio::time::timeout(MISS_WAIT, wait).await;
    }
}

impl Inner {
    fn read_keys(&self) -> std::sync::RwLockReadGuard<'_, Option<KeySet>> {
        self.keys.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// One fetch (unless `trigger` is a miss and another miss fetched less than
    /// [`REFETCH_GAP`] ago); true if it succeeded.
    async fn refresh(&self, trigger: Trigger) -> bool {
        let mut fetches = self.fetches.lock().await;
        if trigger == Trigger::UnknownKid {
            if !fetches.due_on_miss() {
                return false;
            }
            fetches.last_on_miss = Some(Instant::now());
        }
        let (outcome, ok) = match self.fetch().await {
            Ok((keys, skipped)) => {
                let mut cached = self.keys.write().unwrap_or_else(PoisonError::into_inner);
                let changed = cached.as_ref().is_none_or(|old| {
                    old.len() != keys.len() || keys.keys().any(|k| !old.contains_key(k))
                });
                if changed {
                    let mut kids: Vec<&str> = keys.keys().map(String::as_str).collect();
                    kids.sort_unstable();
                    tracing::info!(url = %self.shown, ?kids, skipped, "identity provider keys loaded");
                } else {
                    tracing::debug!(url = %self.shown, "identity provider keys unchanged");
                }
                *cached = Some(keys);
                ("ok", true)
            }
            Err(Failed { outcome, why }) => {
                tracing::warn!(
                    url = %self.shown,
                    error = %why,
                    keeping = self.read_keys().as_ref().map_or(0, HashMap::len),
                    "fetching the identity provider's keys (JWKS) failed; the cached keys stay"
                );
                (outcome, false)
            }
        };
        metrics::counter!(crate::metrics::JWKS_FETCHES, "outcome" => outcome).increment(1);
        ok
    }

    async fn fetch(&self) -> Result<(KeySet, usize), Failed> {
        let unreachable = |e: reqwest::Error| Failed::new("error", error_chain(&e));
        let mut response = self
            .client
            .get(self.url.clone())
            .header(reqwest::header::ACCEPT, "application/json")
            .send()
            .await
            .map_err(unreachable)?;
        let status = response.status();
        if !status.is_success() {
            return Err(Failed::new("error", format!("answered {status}")));
        }
        let too_large = || Failed::new("invalid", format!("larger than {MAX_BODY} bytes"));
        if response
            .content_length()
            .is_some_and(|n| n > MAX_BODY as u64)
        {
            return Err(too_large());
        }
        let mut body = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(unreachable)? {
            if body.len() + chunk.len() > MAX_BODY {
                return Err(too_large());
            }
            body.extend_from_slice(&chunk);
        }
        let (keys, skipped) = parse_key_set(&body).map_err(|why| Failed::new("invalid", why))?;
        if keys.is_empty() {
            return Err(Failed::new(
                "invalid",
                format!("no usable signing key ({skipped} skipped)"),
            ));
        }
        Ok((keys, skipped))
    }
}

/// Why a fetch failed, and its `outcome` label.
struct Failed {
    outcome: &'static str,
    why: String,
}

impl Failed {
    fn new(outcome: &'static str, why: String) -> Self {
        Self { outcome, why }
    }
}

/// An error and its causes, `: `-separated (reqwest's own message names none).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// The usable keys of a JWKS document by `kid` (the first of a duplicated `kid`), and
/// how many keys were skipped. Not `{"keys": [...]}`: an error.
fn parse_key_set(body: &[u8]) -> Result<(KeySet, usize), String> {
    #[derive(serde::Deserialize)]
    struct Document {
        keys: Vec<serde_json::Value>,
    }
    let document: Document = serde_json::from_slice(body)
        .map_err(|e| format!("not a JWKS document ({{\"keys\": [...]}}): {e}"))?;
    let mut keys = KeySet::new();
    let mut skipped = 0;
    for value in document.keys {
        match usable_key(value) {
            Some((kid, key)) if !keys.contains_key(&kid) => {
                keys.insert(kid, Arc::new(key));
            }
            _ => skipped += 1,
        }
    }
    Ok((keys, skipped))
}

/// The key a JWK describes, if it is a signing key of a supported kind with a `kid`.
fn usable_key(value: serde_json::Value) -> Option<(String, Key)> {
    // One by one: a key of a kind jsonwebtoken cannot read does not spoil the set.
    let jwk: Jwk = serde_json::from_value(value).ok()?;
    let common = &jwk.common;
    let kid = common.key_id.clone().filter(|kid| !kid.is_empty())?;
    if common
        .public_key_use
        .as_ref()
        .is_some_and(|u| *u != PublicKeyUse::Signature)
    {
        return None;
    }
    if common
        .key_operations
        .as_ref()
        .is_some_and(|ops| !ops.contains(&KeyOperations::Verify))
    {
        return None;
    }
    let alg = match (&jwk.algorithm, common.key_algorithm) {
        (AlgorithmParameters::RSA(rsa), None | Some(KeyAlgorithm::RS256)) => {
            let modulus = URL_SAFE_NO_PAD.decode(&rsa.n).ok()?;
            let bytes = modulus.iter().skip_while(|b| **b == 0).count();
            (bytes >= 256).then_some(Algorithm::RS256)?
        }
        (AlgorithmParameters::EllipticCurve(ec), None | Some(KeyAlgorithm::ES256)) => {
            let coordinate = |c: &str| URL_SAFE_NO_PAD.decode(c).is_ok_and(|c| c.len() == 32);
            (ec.curve == EllipticCurve::P256 && coordinate(&ec.x) && coordinate(&ec.y))
                .then_some(Algorithm::ES256)?
        }
        _ => return None,
    };
    let decoding = DecodingKey::from_jwk(&jwk).ok()?;
    Some((kid, Key { alg, decoding }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ring::signature::{EcdsaKeyPair, KeyPair, ECDSA_P256_SHA256_FIXED_SIGNING};
    use serde_json::json;

    fn ec_jwk(kid: &str) -> serde_json::Value {
        let rng = ring::rand::SystemRandom::new();
        let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &rng).unwrap();
        let pair = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, pkcs8.as_ref(), &rng)
            .unwrap();
        let point = pair.public_key().as_ref();
        json!({"kty": "EC", "crv": "P-256", "kid": kid,
               "x": URL_SAFE_NO_PAD.encode(&point[1..33]), "y": URL_SAFE_NO_PAD.encode(&point[33..])})
    }

    /// An RSA public key of `bits` (the modulus need not be a real one to be read).
    fn rsa_jwk(kid: &str, bits: usize) -> serde_json::Value {
        let mut n = vec![0xC5u8; bits / 8];
        n[bits / 8 - 1] |= 1;
        json!({"kty": "RSA", "kid": kid, "n": URL_SAFE_NO_PAD.encode(&n), "e": "AQAB"})
    }

    fn with(
        mut jwk: serde_json::Value,
        field: &str,
        value: serde_json::Value,
    ) -> serde_json::Value {
        jwk[field] = value;
        jwk
    }

    fn algs(keys: Vec<serde_json::Value>) -> (Vec<(String, Algorithm)>, usize) {
        let body = serde_json::to_vec(&json!({ "keys": keys })).unwrap();
        let (set, skipped) = parse_key_set(&body).unwrap();
        let mut algs: Vec<_> = set.iter().map(|(k, v)| (k.clone(), v.alg)).collect();
        algs.sort_by(|a, b| a.0.cmp(&b.0));
        (algs, skipped)
    }

    #[test]
    fn rsa_keys_verify_rs256_and_p256_keys_es256() {
        let (found, skipped) = algs(vec![
            rsa_jwk("r", 2048),
            ec_jwk("e"),
            with(rsa_jwk("r-alg", 4096), "alg", json!("RS256")),
            with(
                with(ec_jwk("e-alg"), "alg", json!("ES256")),
                "use",
                json!("sig"),
            ),
            with(ec_jwk("e-ops"), "key_ops", json!(["verify"])),
        ]);
        assert_eq!(
            found,
            vec![
                ("e".to_string(), Algorithm::ES256),
                ("e-alg".to_string(), Algorithm::ES256),
                ("e-ops".to_string(), Algorithm::ES256),
                ("r".to_string(), Algorithm::RS256),
                ("r-alg".to_string(), Algorithm::RS256),
            ]
        );
        assert_eq!(skipped, 0);
    }

    #[test]
    fn keys_that_are_not_for_rs256_or_es256_signatures_are_skipped() {
        let p384 = json!({"kty": "EC", "crv": "P-384", "kid": "p384",
            "x": URL_SAFE_NO_PAD.encode([7u8; 48]), "y": URL_SAFE_NO_PAD.encode([9u8; 48])});
        let (found, skipped) = algs(vec![
            rsa_jwk("good", 2048),
            with(rsa_jwk("enc", 2048), "use", json!("enc")),
            with(rsa_jwk("sign-only", 2048), "key_ops", json!(["sign"])),
            with(rsa_jwk("ps256", 2048), "alg", json!("PS256")),
            with(rsa_jwk("rs512", 2048), "alg", json!("RS512")),
            with(rsa_jwk("says-es256", 2048), "alg", json!("ES256")),
            with(ec_jwk("says-rs256"), "alg", json!("RS256")),
            with(ec_jwk("says-hs256"), "alg", json!("HS256")),
            rsa_jwk("short", 1024),
            p384,
            json!({"kty": "oct", "kid": "secret", "k": "c2VjcmV0"}),
            json!({"kty": "OKP", "crv": "Ed25519", "kid": "ed", "x": URL_SAFE_NO_PAD.encode([1u8; 32])}),
            json!({"kty": "RSA", "kid": "broken", "n": "***", "e": "AQAB"}),
            json!({"kty": "EC", "crv": "P-256", "kid": "short-x", "x": "AQ", "y": "AQ"}),
            json!({"kty": "XYZ", "kid": "unknown"}),
            with(rsa_jwk("", 2048), "kid", json!("")),
            {
                let mut no_kid = rsa_jwk("x", 2048);
                no_kid.as_object_mut().unwrap().remove("kid");
                no_kid
            },
            // A second key under a known kid: the first stays.
            ec_jwk("good"),
            json!("not an object"),
        ]);
        assert_eq!(found, vec![("good".to_string(), Algorithm::RS256)]);
        assert_eq!(skipped, 18);
    }

    #[test]
    fn a_document_that_is_not_a_key_set_is_an_error() {
        for bad in [&b"[]"[..], b"{}", b"{\"keys\": {}}", b"<html>", b""] {
            assert!(
                parse_key_set(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        let (keys, skipped) = parse_key_set(br#"{"keys": []}"#).unwrap();
        assert!(keys.is_empty());
        assert_eq!(skipped, 0);
    }
}
