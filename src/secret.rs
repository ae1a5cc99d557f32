//! Values that must never reach a log line or a panic message: settings are `Debug`
//! (clap prints them, `tracing` may record them), so their secrets print as `***`.

use std::fmt;

/// A secret (the HS256 key): `Debug` prints `***` and there is no `Display`; the value
/// is read only through [`Secret::expose`], where it is used.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl From<String> for Secret {
    fn from(value: String) -> Self {
        Self(value)
    }
}

impl From<&str> for Secret {
    fn from(value: &str) -> Self {
        Self(value.to_owned())
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// A server's URL (`postgres://`, `redis://`, ...) that may carry a password: `Debug`
/// and `Display` show it with the password as `***`, so it can be logged;
/// [`ServerUrl::expose`] gives the whole URL to the client that connects.
#[derive(Clone, PartialEq, Eq)]
pub struct ServerUrl(String);

impl ServerUrl {
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The URL with its password, if any, replaced; not a URL at all: nothing of it
    /// (a mistyped URL may still hold a password).
    fn redacted(&self) -> String {
        match url::Url::parse(&self.0) {
            Ok(mut url) => {
                if url.password().is_some() {
                    let _ = url.set_password(Some("***"));
                }
                url.to_string()
            }
            Err(_) => "(not a URL)".into(),
        }
    }
}

impl From<String> for ServerUrl {
    fn from(value: String) -> Self {
        Self(value)
    }
}

impl From<&str> for ServerUrl {
    fn from(value: &str) -> Self {
        Self(value.to_owned())
    }
}

impl fmt::Debug for ServerUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.redacted())
    }
}

impl fmt::Display for ServerUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_prints_as_stars() {
        let secret = Secret::from("hunter2");
        assert_eq!(format!("{secret:?}"), "Secret(***)");
        assert_eq!(secret.expose(), "hunter2");
    }

    #[test]
    fn a_urls_password_prints_as_stars_and_the_rest_stays() {
        let cases = [
            (
                "postgres://app:pa:ss@db:5432/shop",
                "postgres://app:***@db:5432/shop",
            ),
            ("redis://:p@ss@cache:6379/0", "redis://:***@cache:6379/0"),
            ("rediss://default:x@h", "rediss://default:***@h"),
            ("postgres://app@db/shop", "postgres://app@db/shop"),
            ("redis://127.0.0.1:6379", "redis://127.0.0.1:6379"),
            ("redis://h/0?user=a@b", "redis://h/0?user=a@b"),
            ("not a url", "(not a URL)"),
        ];
        for (url, shown) in cases {
            let url = ServerUrl::from(url);
            assert_eq!(url.to_string(), shown);
            assert_eq!(format!("{url:?}"), format!("{shown:?}"));
        }
        assert_eq!(
            ServerUrl::from("redis://:p@ss@cache:6379/0").expose(),
            "redis://:p@ss@cache:6379/0"
        );
    }
}
