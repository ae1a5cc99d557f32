//! Bearer tokens: HS256 JWTs signed with `JWT_SECRET`, and RS256/ES256 JWTs signed by an
//! identity provider whose public keys are published as a JWKS (`JWT_JWKS_URL`, see
//! [`jwks`]). Either may be configured alone, or both.
//!
//! `sub` is the user id (a positive 64-bit integer, as a JSON string or number), `exp`
//! is required (5 s leeway), `role: "admin"` marks administrators, `role: "shop"` with
//! a `shop_id` claim (a positive 64-bit integer) a shop's staff; `iss` / `aud` must
//! match `JWT_ISSUER` / `JWT_AUDIENCE` when those are set. Anything else is a 401.
//!
//! The header's `alg` picks the path, and no path ever looks at another's keys: HS256 is
//! checked against the secret only (refused without one), RS256/ES256 against the JWKS
//! key its `kid` names, whose own algorithm must be the token's; any other `alg`
//! (`none` included) is refused.

mod claims;
pub mod jwks;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};

pub use claims::Expected;
use claims::{claims_user, decode_checked};
pub use jwks::Jwks;

use crate::domain::{ShopId, UserId};

pub(crate) const ADMIN_ROLE: &str = "admin";
pub(crate) const SHOP_ROLE: &str = "shop";

/// Why tokens are refused (the `message` of the 401): one message per rule, so a
/// client's developer knows what to fix; none holds anything of a key or secret.
pub(crate) const MALFORMED: &str =
    "malformed token: expected a JWT, three base64url parts of JSON (header.payload.signature)";
pub(crate) const BAD_SIGNATURE: &str =
    "token signature does not verify (signed with another key, or altered)";
pub(crate) const EXPIRED: &str = "token expired: its exp is in the past";
pub(crate) const NO_EXP: &str = "token has no exp (expiry) claim, which is required";
pub(crate) const BAD_EXP: &str = "token exp must be a whole number of seconds since 1970";
pub(crate) const NO_SUB: &str = "token has no sub claim: the user id is required";
pub(crate) const BAD_SUB: &str =
    "token sub must be the user id: a positive 64-bit integer (a JSON number or a string of digits)";
/// Anything else a verifying library refuses (a key it cannot use, say).
pub(crate) const INVALID: &str = "token could not be verified";
pub(crate) const ALG_NOT_ACCEPTED: &str = "token algorithm not accepted";
pub(crate) const ALG_MISMATCH: &str = "token algorithm does not match its key";
pub(crate) const NO_KID: &str = "token has no key id (kid)";
pub(crate) const UNKNOWN_KID: &str = "unknown key id (kid)";
pub(crate) const WRONG_ISSUER: &str = "token issuer not accepted";
pub(crate) const WRONG_AUDIENCE: &str = "token audience not accepted";
pub(crate) const UNKNOWN_ROLE: &str = "unknown role in token";
pub(crate) const BAD_SHOP: &str =
    "a shop token (role \"shop\") needs shop_id: the shop's id, a positive 64-bit integer";

/// The claims `mint` writes.
#[derive(Serialize)]
struct Minted<'a> {
    sub: String,
    exp: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    shop_id: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    iss: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    aud: Option<&'a str>,
}

#[derive(Deserialize)]
struct JoseHeader<'a> {
    #[serde(borrow)]
    alg: std::borrow::Cow<'a, str>,
    #[serde(borrow, default)]
    kid: Option<std::borrow::Cow<'a, str>>,
}

/// A token cut at its dots: exactly three parts, or `None`.
struct Parts<'a> {
    token: &'a str,
    header: &'a str,
    payload: &'a str,
    signature: &'a str,
}

impl<'a> Parts<'a> {
    fn of(token: &'a str) -> Option<Self> {
        let mut parts = token.split('.');
        match (parts.next(), parts.next(), parts.next(), parts.next()) {
            (Some(header), Some(payload), Some(signature), None) => Some(Self {
                token,
                header,
                payload,
                signature,
            }),
            _ => None,
        }
    }

    /// The header, decoded from base64url (parse it as a [`JoseHeader`]).
    fn header_json(&self) -> Result<Vec<u8>, Unauthorized> {
        URL_SAFE_NO_PAD
            .decode(self.header)
            .map_err(|_| Unauthorized(MALFORMED))
    }

    /// The payload, decoded from base64url.
    fn payload_json(&self) -> Result<Vec<u8>, Unauthorized> {
        URL_SAFE_NO_PAD
            .decode(self.payload)
            .map_err(|_| Unauthorized(MALFORMED))
    }
}

fn parse_header(raw: &[u8]) -> Result<JoseHeader<'_>, Unauthorized> {
    serde_json::from_slice(raw).map_err(|_| Unauthorized(MALFORMED))
}

/// What a token lets its bearer do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Shopper,
    Admin,
    /// Staff of this shop: they redeem its coupons and list its orders.
    Shop(ShopId),
}

/// HS256 signing and verifying keys, built once from the secret.
pub struct JwtKeys {
    encoding: EncodingKey,
    /// HMAC-SHA256 key for verification: the hot path verifies with it directly.
    /// `jsonwebtoken::decode` under the same rules cost the seckill route more than 5 %
    /// of its throughput (load/results/2026-11-23-crates-vs-hand-rolled.md); a test checks
    /// that both agree.
    hmac: ring::hmac::Key,
    /// Encoded headers of HS256 tokens as common libraries write them; any other header
    /// is decoded and checked.
    known_headers: [String; 3],
    expected: Expected,
    /// Only with `iss`/`aud` to check: then tokens go through `jsonwebtoken::decode`
    /// (the fast path checks neither, and stays free of allocations for the claims).
    checked: Option<Box<(DecodingKey, Validation)>>,
}

impl JwtKeys {
    pub fn new(secret: &str) -> anyhow::Result<Self> {
        Self::with_expected(secret, Expected::default())
    }

    /// Keys whose tokens must carry `expected`'s `iss`/`aud` (and that mints them).
    pub fn with_expected(secret: &str, expected: Expected) -> anyhow::Result<Self> {
        anyhow::ensure!(!secret.is_empty(), "JWT_SECRET must not be empty");
        let b64 = |json: &str| URL_SAFE_NO_PAD.encode(json);
        let checked = (!expected.is_empty()).then(|| {
            Box::new((
                DecodingKey::from_secret(secret.as_bytes()),
                expected.validation(Algorithm::HS256),
            ))
        });
        Ok(Self {
            encoding: EncodingKey::from_secret(secret.as_bytes()),
            hmac: ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret.as_bytes()),
            known_headers: [
                b64(r#"{"typ":"JWT","alg":"HS256"}"#),
                b64(r#"{"alg":"HS256","typ":"JWT"}"#),
                b64(r#"{"alg":"HS256"}"#),
            ],
            expected,
            checked,
        })
    }

    /// An HS256 token for `user_id`, carrying the configured `iss`/`aud` if any.
    pub fn mint(&self, user_id: i64, admin: bool, ttl_secs: u64) -> anyhow::Result<String> {
        let role = if admin { Role::Admin } else { Role::Shopper };
        self.mint_as(user_id, role, ttl_secs)
    }

    /// An HS256 token for `user_id` in `role`.
    pub fn mint_as(&self, user_id: i64, role: Role, ttl_secs: u64) -> anyhow::Result<String> {
        anyhow::ensure!(user_id > 0, "user id must be positive");
        let claims = Minted {
            sub: user_id.to_string(),
            exp: now_secs() + ttl_secs,
            role: match role {
                Role::Shopper => None,
                Role::Admin => Some(ADMIN_ROLE),
                Role::Shop(_) => Some(SHOP_ROLE),
            },
            shop_id: match role {
                Role::Shop(shop) => Some(shop.get()),
                _ => None,
            },
            iss: self.expected.issuer.as_deref(),
            aud: self.expected.audience.as_deref(),
        };
        Ok(jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &claims,
            &self.encoding,
        )?)
    }

    /// Verifies an HS256 token: algorithm pinned (a header naming any other, or `none`,
    /// is refused), signature checked in constant time, `exp` required (5 s leeway),
    /// `sub` a positive integer, `role` absent or `"admin"`, `iss`/`aud` as expected.
    /// (Requests go through [`Verifier::verify`], which takes the same path.)
    #[cfg(test)]
    pub(crate) fn verify(&self, token: &str) -> Result<AuthUser, Unauthorized> {
        let parts = Parts::of(token).ok_or(Unauthorized(MALFORMED))?;
        if !self.is_known_header(parts.header)
            && parse_header(&parts.header_json()?)?.alg != "HS256"
        {
            return Err(Unauthorized(ALG_NOT_ACCEPTED));
        }
        self.verify_hs256(&parts)
    }

    fn is_known_header(&self, header: &str) -> bool {
        self.known_headers.iter().any(|h| h == header)
    }

    /// Verifies a token whose header says HS256.
    fn verify_hs256(&self, parts: &Parts) -> Result<AuthUser, Unauthorized> {
        if let Some(checked) = &self.checked {
            return decode_checked(parts.token, &checked.0, &checked.1);
        }
        let bad_signature = || Unauthorized(BAD_SIGNATURE);
        let mut mac = [0u8; 32];
        match URL_SAFE_NO_PAD.decode_slice(parts.signature, &mut mac) {
            Ok(32) => {}
            Err(base64::DecodeSliceError::DecodeError(_)) => return Err(Unauthorized(MALFORMED)),
            _ => return Err(bad_signature()),
        }
        let signed = &parts.token[..parts.header.len() + 1 + parts.payload.len()];
        ring::hmac::verify(&self.hmac, signed.as_bytes(), &mac).map_err(|_| bad_signature())?;
        claims_user(&parts.payload_json()?)
    }
}

/// Every way a token may be verified here: the HS256 secret, an identity provider's
/// JWKS, or both.
pub struct Verifier {
    hs256: Option<JwtKeys>,
    jwks: Option<Jwks>,
}

impl Verifier {
    /// At least one of the two is required.
    pub fn new(hs256: Option<JwtKeys>, jwks: Option<Jwks>) -> anyhow::Result<Self> {
        anyhow::ensure!(
            hs256.is_some() || jwks.is_some(),
            "no way to verify bearer tokens: set JWT_SECRET (HS256 tokens), JWT_JWKS_URL \
             (RS256/ES256 tokens of an identity provider), or both"
        );
        Ok(Self { hs256, jwks })
    }

    /// From the configuration (`JWT_SECRET`, `JWT_JWKS_URL`, `JWT_ISSUER`, `JWT_AUDIENCE`).
    /// Fetches nothing yet: see [`Jwks::refresh`] and [`Jwks::keep_fresh`].
    pub fn from_args(args: &crate::config::JwtArgs) -> anyhow::Result<Self> {
        let expected = Expected::new(args.jwt_issuer.as_deref(), args.jwt_audience.as_deref());
        let hs256 = args
            .jwt_secret
            .as_ref()
            .map(|secret| JwtKeys::with_expected(secret.expose(), expected.clone()))
            .transpose()?;
        let jwks = args
            .jwt_jwks_url
            .as_ref()
            .map(crate::secret::ServerUrl::expose)
            .filter(|url| !url.is_empty())
            .map(|url| Jwks::new(url, &expected))
            .transpose()?;
        Self::new(hs256, jwks)
    }

    /// The identity provider's keys, when configured.
    pub fn jwks(&self) -> Option<&Jwks> {
        self.jwks.as_ref()
    }

    /// Verifies a bearer token. HS256 tokens as common libraries write them take the
    /// fast path at once (no allocation, no lock); otherwise the header is decoded and
    /// its `alg` picks the keys.
    pub(crate) async fn verify(&self, token: &str) -> Result<AuthUser, Refused> {
        let parts = Parts::of(token).ok_or(Unauthorized(MALFORMED))?;
        if let Some(hs256) = &self.hs256 {
            if hs256.is_known_header(parts.header) {
                return Ok(hs256.verify_hs256(&parts)?);
            }
        }
        let raw = parts.header_json()?;
        let header = parse_header(&raw)?;
        let kid = header.kid.as_deref();
        match (header.alg.as_ref(), &self.hs256, &self.jwks) {
            ("HS256", Some(hs256), _) => Ok(hs256.verify_hs256(&parts)?),
            // Boxed: the HS256 path's future stays small.
            ("RS256", _, Some(jwks)) => Box::pin(jwks.verify(token, Algorithm::RS256, kid)).await,
            ("ES256", _, Some(jwks)) => Box::pin(jwks.verify(token, Algorithm::ES256, kid)).await,
            _ => Err(Unauthorized(ALG_NOT_ACCEPTED).into()),
        }
    }
}

/// Redis's clock as this process knows it ([`crate::clock`]): a token expires at the
/// same instant on every instance, whatever their own clocks say.
fn now_secs() -> u64 {
    crate::clock::now_us().max(0) as u64 / 1_000_000
}

/// The authenticated caller (extracted from the request in `http::extract`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct AuthUser {
    pub user_id: UserId,
    pub admin: bool,
    /// Staff of this shop (`role: "shop"`).
    pub shop: Option<ShopId>,
}

/// An authenticated administrator; shoppers get 403.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Admin;

/// Why a token was refused (the HTTP layer answers 401 with it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub(crate) struct Unauthorized(pub &'static str);

/// Why a request's token was not accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Refused {
    /// A bad token: 401.
    #[error("{0}")]
    Unauthorized(&'static str),
    /// An RS256/ES256 token, and the identity provider's keys were never fetched (it has
    /// not answered since the start): 503, retry.
    #[error("identity provider keys not loaded yet")]
    KeysNotLoaded,
}

impl From<Unauthorized> for Refused {
    fn from(e: Unauthorized) -> Self {
        Refused::Unauthorized(e.0)
    }
}

#[cfg(test)]
mod tests;
