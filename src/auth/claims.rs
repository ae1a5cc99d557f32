//! The rules a verified token's claims must meet, the same on every path (`exp`, `sub`,
//! `role` and `shop_id`; `iss` and `aud` when configured), each broken one named by its
//! message. Apart from the keys, which decide only whether a signature holds.

use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::{Deserialize, Deserializer};

use super::{
    now_secs, AuthUser, Parts, Role, Unauthorized, ADMIN_ROLE, BAD_EXP, BAD_SHOP, BAD_SIGNATURE,
    BAD_SUB, EXPIRED, INVALID, MALFORMED, NO_EXP, NO_SUB, SHOP_ROLE, UNKNOWN_ROLE, WRONG_AUDIENCE,
    WRONG_ISSUER,
};
use crate::domain::{ShopId, UserId};

#[derive(Debug, Deserialize)]
pub(crate) struct Claims {
    #[serde(deserialize_with = "positive_id")]
    pub sub: UserId,
    pub exp: u64,
    #[serde(default)]
    pub role: Option<String>,
    /// With `role: "shop"`: the shop the staff member works for.
    #[serde(default)]
    pub shop_id: Option<serde_json::Value>,
}

/// `sub` as a JSON number or a string of digits; a positive 64-bit integer either way.
fn positive_id<'de, D: Deserializer<'de>>(d: D) -> Result<UserId, D::Error> {
    struct Id;
    impl serde::de::Visitor<'_> for Id {
        type Value = UserId;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a positive integer")
        }
        fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<UserId, E> {
            UserId::new(v).ok_or_else(|| E::custom("sub is not positive"))
        }
        fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<UserId, E> {
            i64::try_from(v)
                .ok()
                .and_then(UserId::new)
                .ok_or_else(|| E::custom("sub out of range"))
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<UserId, E> {
            v.parse()
                .map_err(|_| E::custom("sub is not a positive integer"))
        }
    }
    d.deserialize_any(Id)
}

/// Whether `exp` has passed, with [`LEEWAY_SECS`].
fn expired(exp: u64) -> bool {
    exp.saturating_add(LEEWAY_SECS) < now_secs()
}

/// The caller a verified token's claims name, by the rules of every path: `exp`
/// present, a number and not past; `sub` a positive 64-bit integer; `role` absent or
/// `"admin"`. Each broken rule has its message, checked in that order.
pub(super) fn claims_user(raw: &[u8]) -> Result<AuthUser, Unauthorized> {
    match serde_json::from_slice::<Claims>(raw) {
        Ok(claims) => unexpired_user(claims),
        Err(_) => Err(Unauthorized(match serde_json::from_slice(raw) {
            Ok(claims) => broken_claim(&claims),
            Err(_) => MALFORMED,
        })),
    }
}

fn unexpired_user(claims: Claims) -> Result<AuthUser, Unauthorized> {
    if expired(claims.exp) {
        return Err(Unauthorized(EXPIRED));
    }
    user(claims)
}

/// Which rule claims that do not read as [`Claims`] break (the slow path of a refusal).
fn broken_claim(claims: &serde_json::Value) -> &'static str {
    let serde_json::Value::Object(claims) = claims else {
        return MALFORMED;
    };
    match claims.get("exp").map(serde_json::Value::as_u64) {
        None => return NO_EXP,
        Some(None) => return BAD_EXP,
        Some(Some(exp)) if expired(exp) => return EXPIRED,
        Some(Some(_)) => {}
    }
    match claims.get("sub") {
        None => return NO_SUB,
        Some(sub) if positive_id(sub).is_err() => return BAD_SUB,
        Some(_) => {}
    }
    match claims.get("role") {
        None | Some(serde_json::Value::Null | serde_json::Value::String(_)) => MALFORMED,
        Some(_) => UNKNOWN_ROLE,
    }
}

/// Leeway on `exp`, in seconds (clock skew between token issuer and us).
pub(super) const LEEWAY_SECS: u64 = 5;

/// What every token must also carry, whatever signed it: `iss` and `aud`, when
/// configured (`JWT_ISSUER`, `JWT_AUDIENCE`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Expected {
    pub issuer: Option<String>,
    /// Accepted when the token's `aud` is this string, or an array holding it.
    pub audience: Option<String>,
}

impl Expected {
    /// Unset when empty (`JWT_ISSUER=` means no check, as unset does).
    pub fn new(issuer: Option<&str>, audience: Option<&str>) -> Self {
        let set = |v: Option<&str>| v.filter(|v| !v.is_empty()).map(str::to_string);
        Self {
            issuer: set(issuer),
            audience: set(audience),
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.issuer.is_none() && self.audience.is_none()
    }

    /// jsonwebtoken's rules for `alg`: those of the HS256 fast path (`exp` required,
    /// 5 s leeway, `nbf` and an unexpected `aud` not checked) plus `iss`/`aud`, which
    /// must then be present. `exp` is judged after it, by [`expired`].
    pub(super) fn validation(&self, alg: Algorithm) -> Validation {
        let mut validation = Validation::new(alg);
        validation.leeway = LEEWAY_SECS;
        // (`exp` is still required; whether it passed is judged by the one clock,
        // `expired`, not by jsonwebtoken's reading of this machine's.)
        validation.validate_exp = false;
        validation.validate_aud = false;
        if let Some(issuer) = &self.issuer {
            validation.set_issuer(&[issuer]);
            validation.required_spec_claims.insert("iss".into());
        }
        if let Some(audience) = &self.audience {
            validation.set_audience(&[audience]);
            validation.validate_aud = true;
            validation.required_spec_claims.insert("aud".into());
        }
        validation
    }
}

/// Verifies a token with jsonwebtoken under `validation` (which pins the algorithm),
/// then the claims rules.
///
/// jsonwebtoken checks the signature, then `exp`, `iss` and `aud`; the claims are read
/// as JSON first, so that our own rules (`sub`, `role`) name what they refuse too.
pub(super) fn decode_checked(
    token: &str,
    key: &DecodingKey,
    validation: &Validation,
) -> Result<AuthUser, Unauthorized> {
    match jsonwebtoken::decode::<serde_json::Value>(token, key, validation) {
        Ok(data) => match Claims::deserialize(&data.claims) {
            Ok(claims) => unexpired_user(claims),
            Err(_) => Err(Unauthorized(broken_claim(&data.claims))),
        },
        Err(e) => Err(Unauthorized(match e.kind() {
            ErrorKind::InvalidToken
            | ErrorKind::Base64(_)
            | ErrorKind::Json(_)
            | ErrorKind::Utf8(_) => MALFORMED,
            ErrorKind::InvalidSignature => BAD_SIGNATURE,
            ErrorKind::ExpiredSignature => EXPIRED,
            // jsonwebtoken says "missing" of an `exp` that is not a number, too.
            ErrorKind::MissingRequiredClaim(c) if c == "exp" => {
                let payload = Parts::of(token).and_then(|p| p.payload_json().ok());
                match payload.and_then(|raw| serde_json::from_slice(&raw).ok()) {
                    Some(claims) => match broken_claim(&claims) {
                        MALFORMED => NO_EXP,
                        why => why,
                    },
                    None => MALFORMED,
                }
            }
            ErrorKind::InvalidIssuer => WRONG_ISSUER,
            ErrorKind::MissingRequiredClaim(c) if c == "iss" => WRONG_ISSUER,
            ErrorKind::InvalidAudience => WRONG_AUDIENCE,
            ErrorKind::MissingRequiredClaim(c) if c == "aud" => WRONG_AUDIENCE,
            _ => INVALID,
        })),
    }
}

/// The caller the (verified, unexpired) claims name.
fn user(claims: Claims) -> Result<AuthUser, Unauthorized> {
    let role = match claims.role.as_deref() {
        None => Role::Shopper,
        Some(ADMIN_ROLE) => Role::Admin,
        Some(SHOP_ROLE) => {
            Role::Shop(shop_id(claims.shop_id.as_ref()).ok_or(Unauthorized(BAD_SHOP))?)
        }
        Some(_) => return Err(Unauthorized(UNKNOWN_ROLE)),
    };
    Ok(AuthUser {
        user_id: claims.sub,
        admin: role == Role::Admin,
        shop: match role {
            Role::Shop(shop) => Some(shop),
            _ => None,
        },
    })
}

/// A `shop_id` claim: a JSON number or a string of digits, positive.
fn shop_id(claim: Option<&serde_json::Value>) -> Option<ShopId> {
    match claim? {
        serde_json::Value::Number(n) => n.as_i64().and_then(ShopId::new),
        serde_json::Value::String(s) => s.parse().ok(),
        _ => None,
    }
}
