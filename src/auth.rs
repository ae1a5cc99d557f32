//! Bearer tokens: HS256 JWTs signed with `JWT_SECRET`.
//!
//! `sub` is the user id (a positive 64-bit integer, as a JSON string or number), `exp`
//! is required, `role: "admin"` marks administrators. Anything else is a 401.

use std::time::{SystemTime, UNIX_EPOCH};

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde::{Deserialize, Deserializer, Serialize};

pub(crate) const ADMIN_ROLE: &str = "admin";

#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Claims {
    #[serde(deserialize_with = "positive_id", serialize_with = "as_string")]
    pub sub: i64,
    pub exp: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
}

/// `sub` as a JSON number or a string of digits; a positive 64-bit integer either way.
fn positive_id<'de, D: Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
    struct Id;
    impl serde::de::Visitor<'_> for Id {
        type Value = i64;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a positive integer")
        }
        fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<i64, E> {
            (v > 0)
                .then_some(v)
                .ok_or_else(|| E::custom("sub is not positive"))
        }
        fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<i64, E> {
            i64::try_from(v)
                .ok()
                .filter(|v| *v > 0)
                .ok_or_else(|| E::custom("sub out of range"))
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<i64, E> {
            parse_id(v).ok_or_else(|| E::custom("sub is not a positive integer"))
        }
    }
    d.deserialize_any(Id)
}

fn as_string<S: serde::Serializer>(id: &i64, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&id.to_string())
}

#[derive(Deserialize)]
struct JoseHeader<'a> {
    #[serde(borrow)]
    alg: std::borrow::Cow<'a, str>,
}

/// Leeway on `exp`, in seconds (clock skew between token issuer and us).
const LEEWAY_SECS: u64 = 5;

/// Signing and verifying keys, built once from the secret.
pub struct JwtKeys {
    encoding: EncodingKey,
    /// HMAC-SHA256 key for verification: the hot path verifies with it directly.
    /// `jsonwebtoken::decode` under the same rules cost the seckill route more than 5 %
    /// of its throughput (README, "Benchmarks"); a test checks that both agree.
    hmac: ring::hmac::Key,
    /// Encoded headers of HS256 tokens as common libraries write them; any other header
    /// is decoded and checked.
    known_headers: [String; 3],
}

impl JwtKeys {
    pub fn new(secret: &str) -> anyhow::Result<Self> {
        anyhow::ensure!(!secret.is_empty(), "JWT_SECRET must not be empty");
        let b64 = |json: &str| URL_SAFE_NO_PAD.encode(json);
        Ok(Self {
            encoding: EncodingKey::from_secret(secret.as_bytes()),
            hmac: ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret.as_bytes()),
            known_headers: [
                b64(r#"{"typ":"JWT","alg":"HS256"}"#),
                b64(r#"{"alg":"HS256","typ":"JWT"}"#),
                b64(r#"{"alg":"HS256"}"#),
            ],
        })
    }

    pub fn mint(&self, user_id: i64, admin: bool, ttl_secs: u64) -> anyhow::Result<String> {
        anyhow::ensure!(user_id > 0, "user id must be positive");
        let claims = Claims {
            sub: user_id,
            exp: now_secs() + ttl_secs,
            role: admin.then(|| ADMIN_ROLE.to_string()),
        };
        Ok(jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &claims,
            &self.encoding,
        )?)
    }

    /// Verifies an HS256 token: algorithm pinned (a header naming any other, or `none`,
    /// is refused), signature checked in constant time, `exp` required (5 s leeway),
    /// `sub` a positive integer, `role` absent or `"admin"`.
    pub(crate) fn verify(&self, token: &str) -> Result<AuthUser, Unauthorized> {
        let invalid = || Unauthorized("invalid or expired token");
        let mut parts = token.split('.');
        let (Some(header), Some(payload), Some(signature), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(invalid());
        };
        if !self.known_headers.iter().any(|h| h == header) {
            let raw = URL_SAFE_NO_PAD.decode(header).map_err(|_| invalid())?;
            let parsed: JoseHeader = serde_json::from_slice(&raw).map_err(|_| invalid())?;
            if parsed.alg != "HS256" {
                return Err(invalid());
            }
        }
        let mut mac = [0u8; 32];
        match URL_SAFE_NO_PAD.decode_slice(signature, &mut mac) {
            Ok(32) => {}
            _ => return Err(invalid()),
        }
        let signed = &token[..header.len() + 1 + payload.len()];
        ring::hmac::verify(&self.hmac, signed.as_bytes(), &mac).map_err(|_| invalid())?;

        let raw = URL_SAFE_NO_PAD.decode(payload).map_err(|_| invalid())?;
        let claims: Claims = serde_json::from_slice(&raw).map_err(|_| invalid())?;
        if claims.exp.saturating_add(LEEWAY_SECS) < now_secs() {
            return Err(invalid());
        }
        let admin = match claims.role.as_deref() {
            None => false,
            Some(ADMIN_ROLE) => true,
            Some(_) => return Err(Unauthorized("unknown role in token")),
        };
        Ok(AuthUser {
            user_id: claims.sub,
            admin,
        })
    }
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The authenticated caller (extracted from the request in `http::extract`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct AuthUser {
    pub user_id: i64,
    pub admin: bool,
}

/// An authenticated administrator; shoppers get 403.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Admin;

/// Why a token was refused (the HTTP layer answers 401 with it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub(crate) struct Unauthorized(pub &'static str);

/// Parses an id strictly: ASCII digits only, no sign, no leading zero, a positive i64.
pub(crate) fn parse_id(s: &str) -> Option<i64> {
    let canonical = !s.is_empty()
        && s.len() <= 19
        && s.bytes().all(|b| b.is_ascii_digit())
        && !s.starts_with('0');
    if !canonical {
        return None;
    }
    s.parse::<i64>().ok().filter(|&id| id > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys() -> JwtKeys {
        JwtKeys::new("test-secret").unwrap()
    }

    fn sign(claims: serde_json::Value, secret: &str) -> String {
        jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &claims,
            &EncodingKey::from_secret(secret.as_bytes()),
        )
        .unwrap()
    }

    fn in_an_hour() -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs()
            + 3600
    }

    #[test]
    fn a_minted_token_verifies_with_its_user_and_role() {
        let k = keys();
        let user = k.verify(&k.mint(42, false, 60).unwrap()).unwrap();
        assert_eq!((user.user_id, user.admin), (42, false));
        let admin = k.verify(&k.mint(7, true, 60).unwrap()).unwrap();
        assert_eq!((admin.user_id, admin.admin), (7, true));
    }

    #[test]
    fn sub_may_be_a_number_or_a_string_but_must_be_positive() {
        let k = keys();
        let exp = in_an_hour();
        assert_eq!(
            k.verify(&sign(
                serde_json::json!({"sub": 5, "exp": exp}),
                "test-secret"
            ))
            .unwrap()
            .user_id,
            5
        );
        assert_eq!(
            k.verify(&sign(
                serde_json::json!({"sub": "6", "exp": exp}),
                "test-secret"
            ))
            .unwrap()
            .user_id,
            6
        );
        for bad in [
            serde_json::json!({"sub": 0, "exp": exp}),
            serde_json::json!({"sub": -3, "exp": exp}),
            serde_json::json!({"sub": "abc", "exp": exp}),
            serde_json::json!({"sub": "1.5", "exp": exp}),
            serde_json::json!({"exp": exp}),
            serde_json::json!({"sub": 1}),
            serde_json::json!({"sub": 1, "exp": exp, "role": "root"}),
        ] {
            assert!(
                k.verify(&sign(bad.clone(), "test-secret")).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn a_header_written_differently_is_still_accepted_when_it_says_hs256() {
        let k = keys();
        let mut header = Header::new(Algorithm::HS256);
        header.kid = Some("key-1".into());
        let token = jsonwebtoken::encode(
            &header,
            &serde_json::json!({"sub": 8, "exp": in_an_hour()}),
            &EncodingKey::from_secret(b"test-secret"),
        )
        .unwrap();
        assert_eq!(k.verify(&token).unwrap().user_id, 8);
    }

    #[test]
    fn expired_foreign_and_unsigned_tokens_are_refused() {
        let k = keys();
        let past = in_an_hour() - 7200;
        assert!(k
            .verify(&sign(
                serde_json::json!({"sub": 1, "exp": past}),
                "test-secret"
            ))
            .is_err());
        assert!(k
            .verify(&sign(
                serde_json::json!({"sub": 1, "exp": in_an_hour()}),
                "other"
            ))
            .is_err());
        // Signed with the right secret but another algorithm.
        let hs384 = jsonwebtoken::encode(
            &Header::new(Algorithm::HS384),
            &serde_json::json!({"sub": 1, "exp": in_an_hour()}),
            &EncodingKey::from_secret(b"test-secret"),
        )
        .unwrap();
        assert!(k.verify(&hs384).is_err());
        // A tampered payload keeps the old signature.
        let good = k.mint(1, false, 60).unwrap();
        let mut parts: Vec<&str> = good.split('.').collect();
        let admin_payload = URL_SAFE_NO_PAD.encode(format!(
            r#"{{"sub":"1","exp":{},"role":"admin"}}"#,
            in_an_hour()
        ));
        parts[1] = &admin_payload;
        assert!(k.verify(&parts.join(".")).is_err());
        assert!(k.verify(&format!("{good}.x")).is_err());
        assert!(k.verify("").is_err());
        // alg "none": header {"alg":"none","typ":"JWT"}, no signature.
        let none = "eyJhbGciOiJub25lIiwidHlwIjoiSldUIn0.eyJzdWIiOjEsImV4cCI6OTk5OTk5OTk5OX0.";
        assert!(k.verify(none).is_err());
    }

    /// The fast path accepts exactly what `jsonwebtoken::decode` accepts under the same
    /// rules (HS256 pinned, `exp` required, 5 s leeway, `aud` not checked), with the
    /// same `sub` and role rules.
    #[test]
    fn the_fast_path_agrees_with_jsonwebtoken() {
        use jsonwebtoken::{DecodingKey, Validation};
        let k = keys();
        let mut validation = Validation::new(Algorithm::HS256);
        validation.leeway = LEEWAY_SECS;
        validation.validate_aud = false;
        let decoding = DecodingKey::from_secret(b"test-secret");
        let reference = |t: &str| {
            jsonwebtoken::decode::<Claims>(t, &decoding, &validation)
                .ok()
                .filter(|d| matches!(d.claims.role.as_deref(), None | Some(ADMIN_ROLE)))
                .map(|d| (d.claims.sub, d.claims.role.is_some()))
        };
        let (exp, now) = (in_an_hour(), now_secs());
        let mut tokens: Vec<String> = [
            serde_json::json!({"sub": 5, "exp": exp}),
            serde_json::json!({"sub": "6", "exp": exp, "role": "admin"}),
            serde_json::json!({"sub": 7, "exp": exp, "aud": "elsewhere", "nbf": exp}),
            serde_json::json!({"sub": 8, "exp": now - 2}),
            serde_json::json!({"sub": 9, "exp": now - 60}),
            serde_json::json!({"sub": 1, "exp": -1}),
            serde_json::json!({"sub": 1, "exp": "soon"}),
            serde_json::json!({"sub": 0, "exp": exp}),
            serde_json::json!({"sub": "01", "exp": exp}),
            serde_json::json!({"sub": 1.5, "exp": exp}),
            serde_json::json!({"exp": exp}),
            serde_json::json!({"sub": 1}),
            serde_json::json!({"sub": 1, "exp": exp, "role": "root"}),
        ]
        .into_iter()
        .map(|claims| sign(claims, "test-secret"))
        .collect();
        let good = k.mint(3, false, 60).unwrap();
        let mut header = Header::new(Algorithm::HS256);
        header.kid = Some("key-1".into());
        let claims = serde_json::json!({"sub": 4, "exp": exp});
        let secret = EncodingKey::from_secret(b"test-secret");
        tokens.extend([
            jsonwebtoken::encode(&header, &claims, &secret).unwrap(),
            jsonwebtoken::encode(&Header::new(Algorithm::HS384), &claims, &secret).unwrap(),
            sign(claims.clone(), "other"),
            format!("{good}.x"),
            good[..good.len() - 1].to_string(),
            good.clone(),
            String::new(),
            "a.b".into(),
            "eyJhbGciOiJub25lIiwidHlwIjoiSldUIn0.eyJzdWIiOjEsImV4cCI6OTk5OTk5OTk5OX0.".into(),
        ]);
        for token in &tokens {
            let ours = k.verify(token).ok().map(|u| (u.user_id, u.admin));
            assert_eq!(ours, reference(token), "{token}");
        }
    }
}
