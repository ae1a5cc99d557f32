//! The payment provider's signature on a notification:
//! `Seckill-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<raw body>")>`,
//! several `v1=` allowed (a provider rotating its secret signs with both). The body is
//! checked as received, byte for byte, before it is parsed; the timestamp bounds a
//! replay of a captured request to [`TOLERANCE_SECS`], and the event id makes any
//! replay within it change nothing.

use crate::secret::Secret;

/// The header the signature travels in.
pub const HEADER: &str = "seckill-signature";

/// How far the signature's timestamp may be from the server's clock, either way.
pub const TOLERANCE_SECS: i64 = 300;

/// Why a notification's signature does not hold (answered 401 `bad_signature`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BadSignature {
    #[error("no secret is configured to check payment notifications (PAYMENT_WEBHOOK_SECRETS)")]
    NotConfigured,
    #[error("no Seckill-Signature header")]
    Missing,
    #[error("Seckill-Signature must read t=<unix seconds>,v1=<hex HMAC-SHA256> (v1 may repeat)")]
    Malformed,
    #[error("the signature's timestamp is more than 300 s away from the server's clock")]
    OutOfTolerance,
    #[error("no v1 signature matches the body under a configured secret")]
    Mismatch,
}

/// The secrets notifications may be signed with (`PAYMENT_WEBHOOK_SECRETS`: two during
/// a rotation).
#[derive(Clone)]
pub struct Secrets(Vec<ring::hmac::Key>);

impl std::fmt::Debug for Secrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secrets({} × ***)", self.0.len())
    }
}

impl Secrets {
    pub fn new(secrets: &[Secret]) -> Self {
        Self(secrets.iter().map(|s| key(s.expose().as_bytes())).collect())
    }

    /// Checks `header` against the raw `body` at `now` (unix seconds): the timestamp
    /// within tolerance, and some `v1` the HMAC of one secret (compared in constant
    /// time by `ring`).
    pub fn verify(&self, header: Option<&str>, body: &[u8], now: i64) -> Result<(), BadSignature> {
        if self.0.is_empty() {
            return Err(BadSignature::NotConfigured);
        }
        let header = header.ok_or(BadSignature::Missing)?;
        let (t, signatures) = parse(header).ok_or(BadSignature::Malformed)?;
        if (now - t).abs() > TOLERANCE_SECS {
            return Err(BadSignature::OutOfTolerance);
        }
        let signed = signed_bytes(t, body);
        let holds = signatures.iter().any(|sig| {
            self.0
                .iter()
                .any(|k| ring::hmac::verify(k, &signed, sig).is_ok())
        });
        if holds {
            Ok(())
        } else {
            Err(BadSignature::Mismatch)
        }
    }
}

/// The header value the provider sends for `body` at `t`, signed with `secret`.
pub fn sign(secret: &Secret, t: i64, body: &[u8]) -> String {
    let tag = ring::hmac::sign(&key(secret.expose().as_bytes()), &signed_bytes(t, body));
    format!("t={t},v1={}", hex::encode(tag.as_ref()))
}

fn key(secret: &[u8]) -> ring::hmac::Key {
    ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret)
}

fn signed_bytes(t: i64, body: &[u8]) -> Vec<u8> {
    let mut signed = format!("{t}.").into_bytes();
    signed.extend_from_slice(body);
    signed
}

/// `t` and the `v1` signatures (decoded) of a header; `None` unless it has exactly one
/// `t` (digits) and at least one `v1` (64 hex digits). Other schemes are ignored, as
/// a provider may add them.
fn parse(header: &str) -> Option<(i64, Vec<Vec<u8>>)> {
    let mut t = None;
    let mut signatures = Vec::new();
    for part in header.split(',') {
        let (name, value) = part.trim().split_once('=')?;
        match name {
            "t" => {
                let digits = !value.is_empty()
                    && value.len() <= 12
                    && value.bytes().all(|b| b.is_ascii_digit());
                if t.is_some() || !digits {
                    return None;
                }
                t = Some(value.parse().ok()?);
            }
            "v1" => {
                if value.len() != 64 {
                    return None;
                }
                signatures.push(hex::decode(value).ok()?);
            }
            _ => {}
        }
    }
    (!signatures.is_empty()).then_some((t?, signatures))
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: i64 = 1_800_000_000;

    fn secrets(list: &[&str]) -> Secrets {
        Secrets::new(&list.iter().map(|s| Secret::from(*s)).collect::<Vec<_>>())
    }

    #[test]
    fn a_body_signed_with_a_configured_secret_holds() {
        let body = br#"{"id":"evt_1"}"#;
        let header = sign(&"s1".into(), NOW, body);
        assert_eq!(
            secrets(&["s1"]).verify(Some(&header), body, NOW + 299),
            Ok(())
        );
    }

    #[test]
    fn either_secret_of_a_rotation_holds() {
        let body = b"{}";
        let both = secrets(&["old", "new"]);
        for s in ["old", "new"] {
            let header = sign(&s.into(), NOW, body);
            assert_eq!(both.verify(Some(&header), body, NOW), Ok(()));
        }
    }

    #[test]
    fn a_header_with_several_v1_holds_if_one_matches() {
        let body = b"{}";
        let good = sign(&"s1".into(), NOW, body);
        let header = format!(
            "t={NOW},v1={},{}",
            "0".repeat(64),
            good.split_once(',').unwrap().1
        );
        assert_eq!(secrets(&["s1"]).verify(Some(&header), body, NOW), Ok(()));
    }

    #[test]
    fn a_changed_body_another_secret_or_a_stale_timestamp_is_refused() {
        let body = br#"{"amount":100}"#;
        let header = sign(&"s1".into(), NOW, body);
        let s = secrets(&["s1"]);
        assert_eq!(
            s.verify(Some(&header), br#"{"amount":1}"#, NOW),
            Err(BadSignature::Mismatch)
        );
        assert_eq!(
            secrets(&["s2"]).verify(Some(&header), body, NOW),
            Err(BadSignature::Mismatch)
        );
        assert_eq!(
            s.verify(Some(&header), body, NOW + 301),
            Err(BadSignature::OutOfTolerance)
        );
        assert_eq!(
            s.verify(Some(&header), body, NOW - 301),
            Err(BadSignature::OutOfTolerance)
        );
        // Re-signed under another timestamp without the secret: the tag no longer matches.
        let moved = header.replacen(&format!("t={NOW}"), &format!("t={}", NOW + 10), 1);
        assert_eq!(
            s.verify(Some(&moved), body, NOW),
            Err(BadSignature::Mismatch)
        );
    }

    #[test]
    fn malformed_headers_and_no_secret_are_refused() {
        let s = secrets(&["s1"]);
        for bad in [
            "",
            "t=1",
            "v1=00",
            "t=x,v1=00",
            &format!("t=1,t=2,v1={}", "0".repeat(64)),
            "t=1,v1=zz",
        ] {
            assert_eq!(
                s.verify(Some(bad), b"", NOW),
                Err(BadSignature::Malformed),
                "{bad}"
            );
        }
        assert_eq!(s.verify(None, b"", NOW), Err(BadSignature::Missing));
        assert_eq!(
            secrets(&[]).verify(Some("t=1"), b"", NOW),
            Err(BadSignature::NotConfigured)
        );
    }
}
