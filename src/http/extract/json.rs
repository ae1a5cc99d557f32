//! JSON request bodies, read so that every error is worded here from serde's structured
//! information, never from serde_json's English: the bytes are parsed into a [`Json`]
//! tree first (a syntax error has only its category, line and column from serde_json),
//! then the body's type is read from the tree by a deserializer of our own, whose error
//! ([`Misfit`]) words what was expected from the type asked for (`deserialize_i64`: an
//! integer) or from the visitor's own description, and what came from the value itself.
//! `serde_path_to_error` names the field.

use std::fmt;

use serde::de::{self, DeserializeOwned, Unexpected, Visitor};
use serde_json::error::Category;

use crate::http::error::AppError;

/// Reads `T` from a body that must be a JSON object: 400 when the bytes are not JSON,
/// 422 when the JSON does not fit `T` (its path, then what was expected and what came).
pub(crate) fn read_object<T: DeserializeOwned>(body: &[u8]) -> Result<T, AppError> {
    let json: Json = serde_json::from_slice(body).map_err(|e| unreadable(body, &e))?;
    // serde would also read a struct from a JSON array (its fields in order).
    if !matches!(json, Json::Object(_)) {
        return Err(AppError::invalid("the body must be a JSON object"));
    }
    serde_path_to_error::deserialize(json).map_err(|e| {
        let path = e.path().to_string();
        let Misfit(what) = e.into_inner();
        AppError::invalid(match path.as_str() {
            "." => what,
            path => format!("{path}: {what}"),
        })
    })
}

/// The 400 for bytes that are not JSON, at the line and column serde_json stopped at.
fn unreadable(body: &[u8], e: &serde_json::Error) -> AppError {
    let (line, column) = (e.line(), e.column());
    let message = match e.classify() {
        Category::Eof => format!("EOF while parsing a value at line {line} column {column}"),
        _ => match char_at(body, line, column) {
            Some(c) if c.is_control() => format!(
                "syntax error at line {line} column {column}, at `{}`",
                c.escape_debug()
            ),
            Some(c) => format!("syntax error at line {line} column {column}, at `{c}`"),
            None => format!("syntax error at line {line} column {column}"),
        },
    };
    AppError::bad_request(format!("the body is not valid JSON: {message}"))
}

/// The character at serde_json's `line` and `column` (both from 1, the column in bytes).
fn char_at(body: &[u8], line: usize, column: usize) -> Option<char> {
    let text = body.split(|&b| b == b'\n').nth(line.checked_sub(1)?)?;
    let rest = text.get(column.checked_sub(1)?..)?;
    let end = rest.len().min(4);
    (1..=end).find_map(|n| std::str::from_utf8(&rest[..n]).ok()?.chars().next())
}

/// A JSON document as sent: an object's members in order, a repeated name kept (so a
/// struct still refuses a duplicate field).
#[derive(Debug)]
pub(crate) enum Json {
    Null,
    Bool(bool),
    Unsigned(u64),
    Signed(i64),
    /// serde_json reads an integer too large for 64 bits as a float (`1e23`).
    Float(f64),
    String(String),
    Array(Vec<Json>),
    Object(Vec<(String, Json)>),
}

impl<'de> de::Deserialize<'de> for Json {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(JsonVisitor)
    }
}

struct JsonVisitor;

impl<'de> Visitor<'de> for JsonVisitor {
    type Value = Json;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_unit<E>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }
    fn visit_none<E>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }
    fn visit_bool<E>(self, b: bool) -> Result<Json, E> {
        Ok(Json::Bool(b))
    }
    fn visit_u64<E>(self, n: u64) -> Result<Json, E> {
        Ok(Json::Unsigned(n))
    }
    fn visit_i64<E>(self, n: i64) -> Result<Json, E> {
        Ok(Json::Signed(n))
    }
    fn visit_f64<E>(self, n: f64) -> Result<Json, E> {
        Ok(Json::Float(n))
    }
    fn visit_str<E>(self, s: &str) -> Result<Json, E> {
        Ok(Json::String(s.to_owned()))
    }
    fn visit_string<E>(self, s: String) -> Result<Json, E> {
        Ok(Json::String(s))
    }
    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Json::Array(items))
    }
    fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
        let mut members = Vec::new();
        while let Some(member) = map.next_entry()? {
            members.push(member);
        }
        Ok(Json::Object(members))
    }
}

/// Why a JSON value does not fit where it is read, in JSON's words (an object, an
/// integer), not Rust's (`map`, `i64`).
#[derive(Debug)]
pub(crate) struct Misfit(String);

impl fmt::Display for Misfit {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Misfit {}

impl de::Error for Misfit {
    /// A type's own message (a time without its zone offset, say), as it is.
    fn custom<T: fmt::Display>(message: T) -> Self {
        Misfit(message.to_string())
    }
    fn invalid_type(found: Unexpected, expected: &dyn de::Expected) -> Self {
        Misfit(format!("expected {expected}, not {}", words(found)))
    }
    fn invalid_value(found: Unexpected, expected: &dyn de::Expected) -> Self {
        Self::invalid_type(found, expected)
    }
    fn invalid_length(len: usize, expected: &dyn de::Expected) -> Self {
        Misfit(format!("expected {expected}, not {len} elements"))
    }
    fn unknown_variant(variant: &str, expected: &'static [&'static str]) -> Self {
        Misfit(format!("unknown variant `{variant}`, {}", one_of(expected)))
    }
    fn unknown_field(field: &str, expected: &'static [&'static str]) -> Self {
        Misfit(format!("unknown field `{field}`, {}", one_of(expected)))
    }
    fn missing_field(field: &'static str) -> Self {
        Misfit(format!("missing field `{field}`"))
    }
    fn duplicate_field(field: &'static str) -> Self {
        Misfit(format!("duplicate field `{field}`"))
    }
}

/// The names a field or variant could have had.
fn one_of(names: &[&str]) -> String {
    let quoted: Vec<String> = names.iter().map(|n| format!("`{n}`")).collect();
    match quoted.as_slice() {
        [] => "there are none".into(),
        [one] => format!("expected {one}"),
        [a, b] => format!("expected {a} or {b}"),
        all => format!("expected one of {}", all.join(", ")),
    }
}

/// What came, as JSON calls it (a long string is cut short).
fn words(found: Unexpected) -> String {
    match found {
        Unexpected::Bool(b) => b.to_string(),
        Unexpected::Unsigned(n) => format!("the number {n}"),
        Unexpected::Signed(n) => format!("the number {n}"),
        Unexpected::Float(n) => format!("the number {}", float_text(n)),
        Unexpected::Char(c) => string_words(&c.to_string()),
        Unexpected::Str(s) => string_words(s),
        Unexpected::Unit | Unexpected::Option => "null".into(),
        Unexpected::Seq => "an array".into(),
        Unexpected::Map => "an object".into(),
        Unexpected::Other(other) => other.into(),
        // Rust's kinds of value, which no JSON value is read as.
        _ => "a value of another kind".into(),
    }
}

/// A float as JSON writes it (`5.0`, `1e+30`), as serde_json would.
fn float_text(n: f64) -> String {
    serde_json::to_string(&n).unwrap_or_else(|_| n.to_string())
}

/// A string, escaped as Rust escapes it, and cut after 40 characters.
fn string_words(s: &str) -> String {
    let escaped = format!("{s:?}");
    let inner = &escaped[1..escaped.len() - 1];
    let mut short: String = inner.chars().take(40).collect();
    if inner.chars().count() > 40 {
        short.push('…');
    }
    format!("the string \"{short}\"")
}

impl Json {
    fn unexpected(&self) -> Unexpected<'_> {
        match self {
            Json::Null => Unexpected::Unit,
            Json::Bool(b) => Unexpected::Bool(*b),
            Json::Unsigned(n) => Unexpected::Unsigned(*n),
            Json::Signed(n) => Unexpected::Signed(*n),
            Json::Float(n) => Unexpected::Float(*n),
            Json::String(s) => Unexpected::Str(s),
            Json::Array(_) => Unexpected::Seq,
            Json::Object(_) => Unexpected::Map,
        }
    }

    /// This value, where `expected` was.
    fn misfit(&self, expected: &str) -> Misfit {
        Misfit(format!(
            "expected {expected}, not {}",
            words(self.unexpected())
        ))
    }

    /// An integer from `low` to `high`; a whole number outside them is out of range.
    fn integer<'de, V: Visitor<'de>>(
        self,
        v: V,
        low: i128,
        high: i128,
    ) -> Result<V::Value, Misfit> {
        let range = low..=high;
        let out_of_range = || Misfit(format!("out of range: expected {}", whole(low, high)));
        match self {
            Json::Unsigned(n) if range.contains(&n.into()) => v.visit_u64(n),
            Json::Signed(n) if range.contains(&n.into()) => v.visit_i64(n),
            Json::Unsigned(_) | Json::Signed(_) => Err(out_of_range()),
            // `as` saturates: a huge float stays out of range.
            Json::Float(n) if n.fract() == 0.0 && !range.contains(&(n as i128)) => {
                Err(out_of_range())
            }
            other if (low, high) == (i64::MIN.into(), i64::MAX.into()) => {
                Err(other.misfit("an integer"))
            }
            other => Err(other.misfit(&whole(low, high))),
        }
    }
}

fn whole(low: i128, high: i128) -> String {
    format!("a whole number from {low} to {high}")
}

mod deserializer;
