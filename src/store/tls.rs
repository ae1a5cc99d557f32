//! The TLS settings of a Postgres connection, as sqlx reads them: `sslmode`,
//! `sslrootcert`, `sslcert`, `sslkey` in `DATABASE_URL` (and their aliases `ssl-mode`,
//! `ssl-root-cert`/`ssl-ca`, `ssl-cert`, `ssl-key`), else `PGSSLMODE`, `PGSSLROOTCERT`,
//! `PGSSLCERT`, `PGSSLKEY`. Checked at start so that a mistake names its setting
//! instead of surfacing as a failed connection a minute later.

use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use sqlx::postgres::{PgConnectOptions, PgSslMode};

/// One setting's value and where it came from ("DATABASE_URL: sslrootcert" or
/// "PGSSLROOTCERT"), for messages.
#[derive(Debug, Clone)]
pub(super) struct Setting {
    pub from: String,
    pub value: String,
}

impl std::fmt::Display for Setting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}={}", self.from, self.value)
    }
}

#[derive(Debug, Default)]
pub(super) struct TlsSettings {
    pub mode: Option<Setting>,
    pub root: Option<Setting>,
    cert: Option<Setting>,
    key: Option<Setting>,
}

impl TlsSettings {
    /// The settings `url` and the environment give (the URL's last occurrence wins, as
    /// in sqlx).
    pub fn of(url: &str) -> Self {
        let env = |name: &str| {
            std::env::var(name).ok().map(|value| Setting {
                from: name.to_string(),
                value,
            })
        };
        let mut found = Self {
            mode: env("PGSSLMODE"),
            root: env("PGSSLROOTCERT"),
            cert: env("PGSSLCERT"),
            key: env("PGSSLKEY"),
        };
        let query = url.split_once('?').map_or("", |(_, q)| q);
        for (key, value) in form_urlencoded::parse(query.as_bytes()) {
            let slot = match &*key {
                "sslmode" | "ssl-mode" => &mut found.mode,
                "sslrootcert" | "ssl-root-cert" | "ssl-ca" => &mut found.root,
                "sslcert" | "ssl-cert" => &mut found.cert,
                "sslkey" | "ssl-key" => &mut found.key,
                _ => continue,
            };
            *slot = Some(Setting {
                from: format!("DATABASE_URL: {key}"),
                value: value.into_owned(),
            });
        }
        found
    }

    /// Every certificate and key named can be read and holds what it should.
    pub fn check(&self) -> anyhow::Result<()> {
        for (setting, what) in [
            (&self.root, Pem::Certificates),
            (&self.cert, Pem::Certificates),
            (&self.key, Pem::PrivateKey),
        ] {
            if let Some(setting) = setting {
                what.check(setting)?;
            }
        }
        anyhow::ensure!(
            self.cert.is_some() == self.key.is_some(),
            "{}: a client certificate needs its key and a key its certificate (sslcert and sslkey)",
            self.cert.as_ref().or(self.key.as_ref()).unwrap().from
        );
        Ok(())
    }

    /// libpq verifies the chain under `sslmode=require` when a root certificate is
    /// given (as verify-ca); sqlx would not verify at all. Do as libpq does.
    pub fn apply(&self, options: PgConnectOptions) -> PgConnectOptions {
        if matches!(options.get_ssl_mode(), PgSslMode::Require) && self.root.is_some() {
            tracing::info!(
                "sslmode=require with a root certificate: the server's certificate is verified (as verify-ca)"
            );
            return options.ssl_mode(PgSslMode::VerifyCa);
        }
        options
    }

    /// What to check after a failed handshake, naming where each setting came from.
    pub fn hint(&self) -> String {
        let mode = match &self.mode {
            Some(mode) => mode.to_string(),
            None => "sslmode (unset: prefer)".into(),
        };
        let root = match &self.root {
            Some(root) => format!("{root} must hold the CA that signed the server's certificate"),
            None => "sslrootcert names the CA file (the system's roots otherwise)".into(),
        };
        format!(
            "check {mode} (verify-full and verify-ca also need the URL's host named in the \
             certificate), {root}"
        )
    }
}

#[derive(Clone, Copy)]
enum Pem {
    Certificates,
    PrivateKey,
}

impl Pem {
    fn check(self, setting: &Setting) -> anyhow::Result<()> {
        let value = setting.value.trim();
        // sqlx takes a value that looks like PEM as the PEM itself, else as a path.
        let pem = if value.starts_with("-----BEGIN") && value.ends_with("-----") {
            value.as_bytes().to_vec()
        } else {
            std::fs::read(value).map_err(|e| anyhow::anyhow!("{setting}: {e}"))?
        };
        let fail = |why: String| anyhow::anyhow!("{}={}: {why}", setting.from, shown(setting));
        match self {
            Pem::Certificates => {
                let certs = CertificateDer::pem_slice_iter(&pem)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| fail(e.to_string()))?;
                if certs.is_empty() {
                    return Err(fail("no PEM certificate in it".into()));
                }
            }
            Pem::PrivateKey => {
                PrivateKeyDer::from_pem_slice(&pem)
                    .map_err(|e| fail(format!("no PEM private key in it ({e})")))?;
            }
        }
        Ok(())
    }
}

/// A path as given; inline PEM is not echoed.
fn shown(setting: &Setting) -> &str {
    if setting.value.trim_start().starts_with("-----BEGIN") {
        "(inline PEM)"
    } else {
        &setting.value
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_urls_aliases_are_read_and_the_last_occurrence_wins() {
        let s = TlsSettings::of(
            "postgres://u:p@h/db?ssl-mode=verify-ca&ssl-ca=/a.pem&sslrootcert=/b.pem&ssl-cert=/c&sslkey=/k",
        );
        assert_eq!(s.mode.unwrap().value, "verify-ca");
        let root = s.root.unwrap();
        assert_eq!(
            (root.from.as_str(), root.value.as_str()),
            ("DATABASE_URL: sslrootcert", "/b.pem")
        );
        assert_eq!(s.cert.unwrap().from, "DATABASE_URL: ssl-cert");
        assert_eq!(s.key.unwrap().value, "/k");
    }

    #[test]
    fn a_directory_a_missing_file_or_a_file_without_pem_is_refused_naming_the_setting() {
        let dir = std::env::temp_dir();
        let not_pem = dir.join(format!("seckill-not-pem-{}", std::process::id()));
        std::fs::write(&not_pem, "hello").unwrap();
        for (path, needle) in [
            (dir.display().to_string(), "DATABASE_URL: ssl-ca="),
            ("/nonexistent/ca.pem".to_string(), "No such file"),
            (not_pem.display().to_string(), "no PEM certificate"),
        ] {
            let s = TlsSettings::of(&format!(
                "postgres://h/db?sslmode=verify-full&ssl-ca={path}"
            ));
            let err = s.check().unwrap_err().to_string();
            assert!(
                err.contains(needle) && err.contains("ssl-ca"),
                "{path}: {err}"
            );
        }
        let s = TlsSettings::of(&format!(
            "postgres://h/db?sslcert={}&sslkey={}",
            not_pem.display(),
            not_pem.display()
        ));
        let err = s.check().unwrap_err().to_string();
        assert!(err.contains("sslcert"), "{err}");
        std::fs::remove_file(not_pem).unwrap();
    }

    #[test]
    fn require_with_a_root_certificate_verifies_the_chain_as_libpq_does() {
        let url = "postgres://h/db?sslmode=require&sslrootcert=/ca.pem";
        let options: PgConnectOptions = url.parse().unwrap();
        let applied = TlsSettings::of(url).apply(options);
        assert!(matches!(applied.get_ssl_mode(), PgSslMode::VerifyCa));
        let url = "postgres://h/db?sslmode=require";
        let options: PgConnectOptions = url.parse().unwrap();
        let applied = TlsSettings::of(url).apply(options);
        assert!(matches!(applied.get_ssl_mode(), PgSslMode::Require));
    }
}
