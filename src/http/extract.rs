//! Extractors whose rejections speak the contract's JSON error format.

use std::str::FromStr;
use std::sync::Arc;

use axum::extract::{FromRef, FromRequest, FromRequestParts, Path, Request};
use axum::http::{header, request::Parts, StatusCode};
use serde::de::DeserializeOwned;

use crate::auth::{Admin, AuthUser, Verifier};
use crate::http::error::AppError;

mod json;

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
/// there is no body.
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
            // axum's text ("Failed to buffer the request body: ...") names no limit.
            message: if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                format!(
                    "request body too large: at most {} KiB",
                    crate::http::BODY_LIMIT / 1024
                )
            } else {
                "the request body could not be read".into()
            },
        })?;
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    if !json_type {
        return Err(AppError::bad_request(
            "a request body must be JSON, sent with `Content-Type: application/json`",
        ));
    }
    json::read_object(&body).map(Some)
}

/// For a field holding an object: refuses the JSON array serde would read the struct
/// from (`#[serde(deserialize_with = "...")]`, `null` allowed for an `Option`). Request
/// bodies are refused that already ([`json`]); this keeps the rule under any
/// deserializer (serde_json's own, in tests). The
/// object is read in place, so an error inside it keeps its path
/// (`seckill.begin_time: ...`, not just `seckill: ...`).
pub(crate) fn object_or_null<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: serde::Deserialize<'de>,
{
    struct OrNull<T>(std::marker::PhantomData<T>);
    impl<'de, T: serde::Deserialize<'de>> serde::de::Visitor<'de> for OrNull<T> {
        type Value = Option<T>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a JSON object or null")
        }
        fn visit_none<E: serde::de::Error>(self) -> Result<Option<T>, E> {
            Ok(None)
        }
        fn visit_unit<E: serde::de::Error>(self) -> Result<Option<T>, E> {
            Ok(None)
        }
        fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Option<T>, D::Error> {
            T::deserialize(ObjectOnly(d)).map(Some)
        }
    }
    d.deserialize_option(OrNull(std::marker::PhantomData))
}

/// A deserializer that reads a struct from a map only: serde_json reads one from an
/// array of its fields too (`deserialize_struct`), `deserialize_map` refuses that.
struct ObjectOnly<D>(D);

impl<'de, D: serde::Deserializer<'de>> serde::Deserializer<'de> for ObjectOnly<D> {
    type Error = D::Error;

    fn deserialize_any<V: serde::de::Visitor<'de>>(self, v: V) -> Result<V::Value, D::Error> {
        self.0.deserialize_any(v)
    }

    fn deserialize_struct<V: serde::de::Visitor<'de>>(
        self,
        _name: &'static str,
        _fields: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, D::Error> {
        self.0.deserialize_map(v)
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
        ignored_any
    }
}

/// A sale time: RFC 3339 as chrono reads it (`2026-12-01T10:00:00Z`,
/// `2026-12-01T10:00:00+08:00`), read into UTC. A time without a zone offset cannot be
/// placed in time; the answer says so, rather than chrono's "premature end of input".
pub(crate) fn rfc3339<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<chrono::DateTime<chrono::Utc>, D::Error> {
    struct Time;
    impl serde::de::Visitor<'_> for Time {
        type Value = chrono::DateTime<chrono::Utc>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str(
                "an RFC 3339 date and time with a zone offset, such as \"2026-12-01T10:00:00Z\"",
            )
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
            match v.parse::<chrono::DateTime<chrono::FixedOffset>>() {
                Ok(at) => Ok(at.with_timezone(&chrono::Utc)),
                Err(_) if v.parse::<chrono::NaiveDateTime>().is_ok() => Err(E::custom(format!(
                    "`{v}` has no zone offset, so it names no instant: RFC 3339 needs one, \
                     such as `{v}Z` (UTC) or `{v}+08:00`"
                ))),
                Err(e) => Err(E::custom(format!(
                    "`{v}` is not an RFC 3339 date and time with a zone offset, such as \
                     `2026-12-01T10:00:00Z` ({e})"
                ))),
            }
        }
    }
    d.deserialize_str(Time)
}

/// The single id in a route's path (`/vouchers/{id}`, `/orders/{order_id}`, ...), of
/// the route's id type (`PathId<VoucherId>`, `PathId<OrderId>`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct PathId<T>(pub T);

impl<S: Send + Sync, T: FromStr> FromRequestParts<S> for PathId<T> {
    type Rejection = AppError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, AppError> {
        let Path(raw) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|e| AppError::bad_request(e.body_text()))?;
        raw.parse().map(PathId).map_err(|_| {
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
            .ok_or(AppError::Unauthorized(
                "malformed authorization header: expected `Bearer <token>`",
            ))?;
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

/// The client's address, when the server was started with connect info.
pub(crate) struct PeerIp(pub Option<std::net::IpAddr>);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for PeerIp {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _: &S,
    ) -> Result<Self, Self::Rejection> {
        Ok(PeerIp(
            parts
                .extensions
                .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
                .map(|c| c.0.ip()),
        ))
    }
}

#[cfg(test)]
mod tests {
    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Inner {
        #[serde(deserialize_with = "super::rfc3339")]
        at: chrono::DateTime<chrono::Utc>,
    }

    #[derive(Debug, serde::Deserialize)]
    struct Outer {
        #[serde(default, deserialize_with = "super::object_or_null")]
        inner: Option<Inner>,
    }

    fn outer(json: &str) -> Result<Outer, String> {
        let de = &mut serde_json::Deserializer::from_str(json);
        serde_path_to_error::deserialize(de).map_err(|e| e.to_string())
    }

    #[test]
    fn a_nested_object_is_read_in_place_keeping_the_path_of_its_errors() {
        let ok = outer(r#"{"inner": {"at": "2026-12-01T10:00:00+08:00"}}"#).unwrap();
        assert_eq!(
            ok.inner.unwrap().at.to_rfc3339(),
            "2026-12-01T02:00:00+00:00"
        );
        assert!(outer(r#"{"inner": null}"#).unwrap().inner.is_none());
        assert!(outer(r#"{}"#).unwrap().inner.is_none());
        let array = outer(r#"{"inner": ["2026-12-01T10:00:00Z"]}"#).unwrap_err();
        assert!(
            array.starts_with("inner: invalid type: sequence"),
            "{array}"
        );
        let unknown = outer(r#"{"inner": {"at": "2026-12-01T10:00:00Z", "x": 1}}"#).unwrap_err();
        assert!(
            unknown.starts_with("inner.x: unknown field `x`"),
            "{unknown}"
        );
        let zoneless = outer(r#"{"inner": {"at": "2026-12-01T10:00:00"}}"#).unwrap_err();
        assert!(
            zoneless.starts_with("inner.at: `2026-12-01T10:00:00` has no zone offset"),
            "{zoneless}"
        );
        assert!(zoneless.contains("RFC 3339"), "{zoneless}");
        let garbage = outer(r#"{"inner": {"at": "tomorrow"}}"#).unwrap_err();
        assert!(
            garbage.starts_with("inner.at: `tomorrow` is not an RFC 3339"),
            "{garbage}"
        );
        let number = outer(r#"{"inner": {"at": 5}}"#).unwrap_err();
        assert!(
            number.starts_with("inner.at: invalid type: integer"),
            "{number}"
        );
    }

    /// Every kind of field a body may have, for the words of its errors.
    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Fields {
        #[serde(default)]
        i: i64,
        #[serde(default)]
        small: u8,
        #[serde(default)]
        half: i32,
        #[serde(default)]
        s: String,
        #[serde(default)]
        flag: bool,
        inner: Option<Inner>,
        title: String,
    }

    fn misfit(json: &str) -> String {
        let body = format!(r#"{{"title": "t", {json}}}"#);
        match super::json::read_object::<Fields>(body.as_bytes()) {
            Err(crate::http::error::AppError::Validation { message, .. }) => message,
            other => panic!("{json}: {other:?}"),
        }
    }

    #[test]
    fn numbers_of_the_wrong_kind_name_the_field_and_one_too_large_is_out_of_range() {
        let long = "x".repeat(100);
        for (json, ours) in [
            (
                r#""i": "1""#.to_string(),
                r#"i: expected an integer, not the string "1""#.to_string(),
            ),
            (
                format!(r#""small": "{long}""#),
                format!(
                    "small: expected a whole number from 0 to 255, not the string \"{}…\"",
                    &long[..40]
                ),
            ),
            (
                r#""small": 300"#.into(),
                "small: out of range: expected a whole number from 0 to 255".into(),
            ),
            (
                r#""small": -1"#.into(),
                "small: out of range: expected a whole number from 0 to 255".into(),
            ),
            (
                r#""i": 1e23"#.into(),
                "i: out of range: expected a whole number from -9223372036854775808 to \
                 9223372036854775807"
                    .into(),
            ),
            (
                r#""i": 5.0"#.into(),
                "i: expected an integer, not the number 5.0".into(),
            ),
            (
                r#""half": 2.5"#.into(),
                "half: expected a whole number from -2147483648 to 2147483647, not the number 2.5"
                    .into(),
            ),
        ] {
            assert_eq!(misfit(&json), ours, "{json}");
        }
    }

    #[test]
    fn errors_of_other_shapes_name_the_field_in_jsons_words_or_the_types_own() {
        for (json, ours) in [
            (
                r#""s": {}"#.to_string(),
                "s: expected a string, not an object".to_string(),
            ),
            (
                r#""i": "a\"b\n""#.into(),
                r#"i: expected an integer, not the string "a\"b\n""#.into(),
            ),
            (
                r#""flag": null"#.into(),
                "flag: expected a boolean, not null".into(),
            ),
            (
                r#""inner": ["2026-12-01T10:00:00Z"]"#.into(),
                "inner: expected an object, not an array".into(),
            ),
            (
                r#""inner": {"at": 5}"#.into(),
                "inner.at: expected an RFC 3339 date and time with a zone offset, such as \
                 \"2026-12-01T10:00:00Z\", not the number 5"
                    .into(),
            ),
            (
                r#""inner": {"at": "2026-12-01T10:00:00"}"#.into(),
                "inner.at: `2026-12-01T10:00:00` has no zone offset, so it names no instant: \
                 RFC 3339 needs one, such as `2026-12-01T10:00:00Z` (UTC) or \
                 `2026-12-01T10:00:00+08:00`"
                    .into(),
            ),
            (
                r#""x": 1"#.into(),
                "x: unknown field `x`, expected one of `i`, `small`, `half`, `s`, `flag`, \
                 `inner`, `title`"
                    .into(),
            ),
            (r#""title": "u""#.into(), "duplicate field `title`".into()),
        ] {
            assert_eq!(misfit(&json), ours, "{json}");
        }
        let missing = super::json::read_object::<Fields>(b"{}").unwrap_err();
        assert!(
            format!("{missing:?}").contains("missing field `title`"),
            "{missing:?}"
        );
    }

    #[test]
    fn bytes_that_are_not_a_json_object_are_refused_saying_where() {
        for (body, status, message) in [
            (
                "{\"title\": \"t\",",
                400,
                "the body is not valid JSON: EOF while parsing a value at line 1 column 14",
            ),
            (
                "{\"title\": \"t\",}",
                400,
                "the body is not valid JSON: syntax error at line 1 column 15, at `}`",
            ),
            (
                "{\"title\":\n \"t\" \"u\"}",
                400,
                "the body is not valid JSON: syntax error at line 2 column 6, at `\"`",
            ),
            ("[1, 2]", 422, "the body must be a JSON object"),
            ("\"t\"", 422, "the body must be a JSON object"),
        ] {
            match super::json::read_object::<Fields>(body.as_bytes()) {
                Err(crate::http::error::AppError::Validation {
                    status: s,
                    message: m,
                }) => {
                    assert_eq!((s.as_u16(), m.as_str()), (status, message), "{body}");
                }
                other => panic!("{body}: {other:?}"),
            }
        }
    }
}
