//! An identity provider's public signing keys, from its JWKS (`JWT_JWKS_URL`).
//!
//! Fetched at start (the process starts even if the provider does not answer), kept in
//! memory, refreshed every [`REFRESH_EVERY`] (retried from 1 s, doubling to 10 s, while a
//! fetch fails), and fetched again when a token names a `kid` the cache lacks, at most
//! once per [`REFETCH_GAP`] for that reason: a flood of made-up `kid`s costs the provider
//! one request per 10 s. One fetch at a time. A request with an unknown `kid` waits for
//! the fetch it caused, or for one another miss caused that is still running, at most
//! [`MISS_WAIT`], and then answers 503 if that fetch is still running (the key may be on
//! its way). Otherwise it answers at once: 401 for an unknown `kid`, 503 before the keys
//! were ever loaded. It never waits for a scheduled fetch, so a provider that hangs costs
//! a request at most [`MISS_WAIT`]. A failed or malformed fetch keeps the cached keys; a
//! good one replaces them (a key the provider dropped is dropped here too).
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
/// The longest a request waits for a fetch caused by an unknown `kid` (its own or
/// another's still running). Providers answer in milliseconds; one that does not gets
/// its shoppers a 503 after this, not after [`FETCH_TIMEOUT`].
pub const MISS_WAIT: Duration = Duration::from_secs(1);
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
    fetches: tokio::sync::Mutex<()>,
    /// Fetches caused by unknown `kid`s. A plain mutex, never held across an await: a
    /// request checks it without queueing behind a fetch.
    misses: std::sync::Mutex<Misses>,
    rs256: Validation,
    es256: Validation,
}

#[derive(Default)]
struct Misses {
    /// When the last fetch caused by an unknown `kid` began.
    last: Option<Instant>,
    /// That fetch: `true` once it has ended.
    running: Option<tokio::sync::watch::Receiver<bool>>,
}

impl Misses {
    fn due(&self) -> bool {
        self.last.is_none_or(|began| began.elapsed() >= REFETCH_GAP)
    }
}

enum Lookup {
    Found(Arc<Key>),
    Unknown,
    NotLoaded,
}

impl Jwks {
    /// Keys from `url` (nothing fetched yet), for tokens that must also meet `expected`.
    pub fn new(url: &str, expected: &Expected) -> anyhow::Result<Self> {
        // Errors and logs show the URL without a password, should it hold one.
        let parsed = reqwest::Url::parse(url).map_err(|e| {
            anyhow::anyhow!("JWT_JWKS_URL {:?} is not a URL: {e}", redact_userinfo(url))
        })?;
        let mut shown = parsed.clone();
        if shown.password().is_some() {
            let _ = shown.set_password(Some("***"));
        }
        anyhow::ensure!(
            matches!(parsed.scheme(), "https" | "http"),
            "JWT_JWKS_URL must be an https:// URL (http:// only on a trusted network), not {:?}",
            shown.as_str()
        );
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
            misses: std::sync::Mutex::default(),
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
        self.0.refresh().await
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
                fetched = self.0.refresh() => fetched,
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
                let still_fetching = self.fetch_on_miss().await;
                match self.lookup(kid) {
                    Lookup::Found(key) => key,
                    // The fetch may yet bring it: "try again", not "bad token".
                    Lookup::Unknown if still_fetching => return Err(Refused::KeysNotLoaded),
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

    /// After a miss: starts a fetch if the last one a miss caused began [`REFETCH_GAP`]
    /// ago or more, and waits (at most [`MISS_WAIT`]) for the miss-caused fetch still
    /// running, if any. True if that fetch is still running when the wait ends.
    async fn fetch_on_miss(&self) -> bool {
        let running = {
            let mut misses = self.0.misses.lock().unwrap_or_else(PoisonError::into_inner);
            // (A closed channel is a fetch that ended without saying so.)
            let running = misses.running.clone();
            match running.filter(|r| !*r.borrow() && r.has_changed().is_ok()) {
                Some(running) => Some(running),
                None if misses.due() => {
                    let (ended, running) = tokio::sync::watch::channel(false);
                    misses.last = Some(Instant::now());
                    misses.running = Some(running.clone());
                    // Spawned: a caller that goes away does not cancel the fetch others
                    // wait for (and that counts against the gap).
                    let inner = self.0.clone();
                    tokio::spawn(async move {
                        inner.refresh().await;
                        let _ = ended.send(true);
                    });
                    Some(running)
                }
                None => None,
            }
        };
        let Some(mut running) = running else {
            return false;
        };
        let ended = tokio::time::timeout(MISS_WAIT, running.wait_for(|ended| *ended)).await;
        !matches!(ended, Ok(Ok(_)))
    }
}

impl Inner {
    fn read_keys(&self) -> std::sync::RwLockReadGuard<'_, Option<KeySet>> {
        self.keys.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// One fetch, after the one in flight if any; true if it succeeded.
    async fn refresh(&self) -> bool {
        let _one_at_a_time = self.fetches.lock().await;
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

/// `url` with whatever sits between `scheme://` and the last `@` of its authority
/// replaced by `***`: for a text that did not parse as a URL, so nothing is assumed
/// about where a password ends.
fn redact_userinfo(url: &str) -> String {
    let Some(start) = url.find("://").map(|i| i + 3) else {
        return url.to_string();
    };
    let authority_end = url[start..]
        .find(['/', '?', '#'])
        .map_or(url.len(), |i| start + i);
    match url[start..authority_end].rfind('@') {
        Some(at) => format!("{}***{}", &url[..start], &url[start + at..]),
        None => url.to_string(),
    }
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
    fn a_password_in_jwt_jwks_url_never_reaches_an_error() {
        let expected = Expected::new(None, None);
        for url in [
            "ftp://user:hunter2@idp.example/jwks.json",
            "https://user:hunter2@idp example/jwks.json",
            "https://user:hunter2@[::1/jwks.json",
            "https://us@er:hunter2@idp.example:99999/jwks.json",
        ] {
            let err = Jwks::new(url, &expected).err().expect(url).to_string();
            assert!(err.starts_with("JWT_JWKS_URL"), "{err}");
            assert!(!err.contains("hunter2"), "{err}");
        }
        assert_eq!(
            redact_userinfo("https://a:b@c@host/p@q"),
            "https://***@host/p@q"
        );
        assert_eq!(redact_userinfo("https://host/p@q"), "https://host/p@q");
        assert_eq!(redact_userinfo("not a url"), "not a url");
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
