//! Bearer tokens: HS256 JWTs signed with `JWT_SECRET`.
//!
//! `sub` is the user id (a positive 64-bit integer, as a JSON string or number), `exp`
//! is required, `role: "admin"` marks administrators. Anything else is a 401.

use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::FromRequestParts;
use axum::http::{header, request::Parts};
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Deserializer, Serialize};

use crate::error::AppError;
use crate::state::AppState;

pub const ADMIN_ROLE: &str = "admin";

#[derive(Debug, Serialize, Deserialize)]
pub struct Claims {
    #[serde(deserialize_with = "positive_id", serialize_with = "as_string")]
    pub sub: i64,
    pub exp: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
}

fn positive_id<'de, D: Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Num(i64),
        Str(String),
    }
    let id = match Raw::deserialize(d)? {
        Raw::Num(n) => n,
        Raw::Str(s) => crate::http::extract::parse_id(&s)
            .ok_or_else(|| serde::de::Error::custom("sub is not a positive integer"))?,
    };
    if id <= 0 {
        return Err(serde::de::Error::custom("sub is not a positive integer"));
    }
    Ok(id)
}

fn as_string<S: serde::Serializer>(id: &i64, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&id.to_string())
}

/// Signing and verifying keys, built once from the secret.
pub struct JwtKeys {
    encoding: EncodingKey,
    decoding: DecodingKey,
    validation: Validation,
}

impl JwtKeys {
    pub fn new(secret: &str) -> anyhow::Result<Self> {
        anyhow::ensure!(!secret.is_empty(), "JWT_SECRET must not be empty");
        // Pinned to HS256: tokens naming any other algorithm (or `none`) are refused.
        let mut validation = Validation::new(Algorithm::HS256);
        validation.leeway = 5;
        // `sub` is required by `Claims` itself (jsonwebtoken would only accept it as a string).
        validation.set_required_spec_claims(&["exp"]);
        Ok(Self {
            encoding: EncodingKey::from_secret(secret.as_bytes()),
            decoding: DecodingKey::from_secret(secret.as_bytes()),
            validation,
        })
    }

    pub fn mint(&self, user_id: i64, admin: bool, ttl_secs: u64) -> anyhow::Result<String> {
        anyhow::ensure!(user_id > 0, "user id must be positive");
        let now = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs();
        let claims = Claims {
            sub: user_id,
            exp: now + ttl_secs,
            role: admin.then(|| ADMIN_ROLE.to_string()),
        };
        Ok(jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &claims,
            &self.encoding,
        )?)
    }

    pub fn verify(&self, token: &str) -> Result<AuthUser, AppError> {
        let data = jsonwebtoken::decode::<Claims>(token, &self.decoding, &self.validation)
            .map_err(|_| AppError::Unauthorized("invalid or expired token"))?;
        let admin = match data.claims.role.as_deref() {
            None => false,
            Some(ADMIN_ROLE) => true,
            Some(_) => return Err(AppError::Unauthorized("unknown role in token")),
        };
        Ok(AuthUser {
            user_id: data.claims.sub,
            admin,
        })
    }
}

/// The authenticated caller.
#[derive(Debug, Clone, Copy)]
pub struct AuthUser {
    pub user_id: i64,
    pub admin: bool,
}

impl FromRequestParts<AppState> for AuthUser {
    type Rejection = AppError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, AppError> {
        let value = parts
            .headers
            .get(header::AUTHORIZATION)
            .ok_or(AppError::Unauthorized("missing bearer token"))?;
        let token = value
            .to_str()
            .ok()
            .and_then(|v| {
                v.strip_prefix("Bearer ")
                    .or_else(|| v.strip_prefix("bearer "))
            })
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or(AppError::Unauthorized("malformed authorization header"))?;
        state.jwt.verify(token)
    }
}

/// An authenticated administrator; shoppers get 403.
#[derive(Debug, Clone, Copy)]
pub struct Admin(pub AuthUser);

impl FromRequestParts<AppState> for Admin {
    type Rejection = AppError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, AppError> {
        let user = AuthUser::from_request_parts(parts, state).await?;
        if !user.admin {
            return Err(AppError::Forbidden);
        }
        Ok(Admin(user))
    }
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
        // alg "none": header {"alg":"none","typ":"JWT"}, no signature.
        let none = "eyJhbGciOiJub25lIiwidHlwIjoiSldUIn0.eyJzdWIiOjEsImV4cCI6OTk5OTk5OTk5OX0.";
        assert!(k.verify(none).is_err());
    }
}
