//! Extractors whose rejections speak the contract's JSON error format.

use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRef, FromRequest, FromRequestParts, Path, Request};
use axum::http::{header, request::Parts, StatusCode};
use serde::de::DeserializeOwned;

use crate::auth::parse_id;
use crate::auth::{Admin, AuthUser, Verifier};
use crate::http::error::AppError;

/// `axum::Json`, but a malformed body is a `validation` error: 400 when it cannot be
/// read as JSON, 422 when it is JSON of the wrong shape (anything but an object, too).
pub(crate) struct AppJson<T>(pub T);

impl<T, S> FromRequest<S> for AppJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = AppError;

    async fn from_request(req: Request, state: &S) -> Result<Self, AppError> {
        match object_body(req, state).await? {
            Some(value) => Ok(Self(value)),
            None => Err(AppError::bad_request(
                "a JSON body is required (`Content-Type: application/json`)",
            )),
        }
    }
}

/// An optional JSON body: `None` when the request carries none (or only whitespace);
/// otherwise as [`AppJson`].
pub(crate) struct MaybeJson<T>(pub Option<T>);

impl<T, S> FromRequest<S> for MaybeJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = AppError;

    async fn from_request(req: Request, state: &S) -> Result<Self, AppError> {
        Ok(Self(object_body(req, state).await?))
    }
}

/// Reads a body that must be a JSON object sent as `application/json`; `None` when
/// there is no body. serde would also read a struct from a JSON array (its fields in
/// order), so anything but an object is refused first.
async fn object_body<T: DeserializeOwned, S: Send + Sync>(
    req: Request,
    state: &S,
) -> Result<Option<T>, AppError> {
    let json_type = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| {
            let mime = v
                .split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase();
            mime == "application/json"
                || (mime.starts_with("application/") && mime.ends_with("+json"))
        })
        .unwrap_or(false);
    let body = axum::body::Bytes::from_request(req, state)
        .await
        .map_err(|e| AppError::Validation {
            status: e.status(),
            message: e.body_text(),
        })?;
    let Some(&first) = body.iter().find(|b| !b.is_ascii_whitespace()) else {
        return Ok(None);
    };
    if !json_type {
        return Err(AppError::bad_request(
            "a request body must be JSON, sent with `Content-Type: application/json`",
        ));
    }
    if first != b'{' {
        return Err(
            match serde_json::from_slice::<serde::de::IgnoredAny>(&body) {
                Ok(_) => AppError::invalid("the body must be a JSON object"),
                Err(e) => AppError::bad_request(format!("the body is not valid JSON: {e}")),
            },
        );
    }
    match axum::Json::<T>::from_bytes(&body) {
        Ok(axum::Json(value)) => Ok(Some(value)),
        Err(rejection) => Err(json_rejection(rejection)),
    }
}

/// For a field holding an object: refuses the JSON array serde would read the struct
/// from (`#[serde(deserialize_with = "...")]`, `null` allowed for an `Option`).
pub(crate) fn object_or_null<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: DeserializeOwned,
{
    use serde::de::Error;
    use serde::Deserialize;
    match Option::<serde_json::Map<String, serde_json::Value>>::deserialize(d)? {
        None => Ok(None),
        Some(map) => T::deserialize(serde_json::Value::Object(map))
            .map(Some)
            .map_err(D::Error::custom),
    }
}

fn json_rejection(rejection: JsonRejection) -> AppError {
    let status = match &rejection {
        JsonRejection::JsonDataError(_) => StatusCode::UNPROCESSABLE_ENTITY,
        JsonRejection::JsonSyntaxError(_) | JsonRejection::MissingJsonContentType(_) => {
            StatusCode::BAD_REQUEST
        }
        // Body too large (413) and unreadable bodies keep their own status.
        other => other.status(),
    };
    AppError::Validation {
        status,
        message: rejection.body_text(),
    }
}

/// The single id in a route's path (`/vouchers/{id}`, `/orders/{order_id}`, ...).
#[derive(Debug, Clone, Copy)]
pub(crate) struct PathId(pub i64);

impl<S: Send + Sync> FromRequestParts<S> for PathId {
    type Rejection = AppError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, AppError> {
        let Path(raw) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|e| AppError::bad_request(e.body_text()))?;
        parse_id(&raw).map(PathId).ok_or_else(|| {
            AppError::bad_request(format!(
                "`{raw}` is not a valid id: expected a positive 64-bit integer"
            ))
        })
    }
}

/// The caller of a `Authorization: Bearer <token>` request; 401 without a valid token.
/// 503 for an identity provider's token while its keys have never been fetched. Works
/// with any state the verifier can be taken from.
impl<S> FromRequestParts<S> for AuthUser
where
    Arc<Verifier>: FromRef<S>,
    S: Send + Sync,
{
    type Rejection = AppError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, AppError> {
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
        Ok(Arc::<Verifier>::from_ref(state).verify(token).await?)
    }
}

impl<S> FromRequestParts<S> for Admin
where
    Arc<Verifier>: FromRef<S>,
    S: Send + Sync,
{
    type Rejection = AppError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, AppError> {
        let user = AuthUser::from_request_parts(parts, state).await?;
        if !user.admin {
            return Err(AppError::Forbidden);
        }
        Ok(Admin)
    }
}

#[cfg(test)]
mod tests {
    use super::parse_id;
    use proptest::prelude::*;

    proptest! {
        /// Every positive i64 written canonically parses back to itself.
        #[test]
        fn canonical_ids_round_trip(id in 1i64..=i64::MAX) {
            prop_assert_eq!(parse_id(&id.to_string()), Some(id));
        }

        /// Whatever the input, the answer is either None or a positive id that prints back
        /// as exactly the input: no lenient parse slips through.
        #[test]
        fn anything_parsed_is_canonical(s in "\\PC{0,24}") {
            if let Some(id) = parse_id(&s) {
                prop_assert!(id > 0);
                prop_assert_eq!(id.to_string(), s);
            }
        }
    }

    #[test]
    fn ids_are_parsed_strictly() {
        assert_eq!(parse_id("1"), Some(1));
        assert_eq!(parse_id("9223372036854775807"), Some(i64::MAX));
        for bad in [
            "",
            "0",
            "-1",
            "+1",
            "01",
            " 1",
            "1 ",
            "1.0",
            "1e3",
            "abc",
            "9223372036854775808",
            "99999999999999999999",
            "１",
        ] {
            assert_eq!(parse_id(bad), None, "{bad:?}");
        }
    }
}
