//! Minting and verifying HS256 tokens, against jsonwebtoken as the reference; the
//! verifier's other promises in the submodules.

use super::claims::{Claims, LEEWAY_SECS};
use super::*;
use std::time::{SystemTime, UNIX_EPOCH};

mod algorithms;
mod claims;
mod refusals;

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

fn sign_as(alg: Algorithm, claims: &serde_json::Value, secret: &str) -> String {
    jsonwebtoken::encode(
        &Header::new(alg),
        claims,
        &EncodingKey::from_secret(secret.as_bytes()),
    )
    .unwrap()
}

fn verifier(hs256: Option<JwtKeys>, jwks: Option<Jwks>) -> Verifier {
    Verifier::new(hs256, jwks).unwrap()
}

/// A JWKS nothing answers at (connections to port 1 are refused at once).
fn unreachable_jwks() -> Jwks {
    Jwks::new("http://127.0.0.1:1/jwks.json", &Expected::default()).unwrap()
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
    assert_eq!((user.user_id.get(), user.admin), (42, false));
    let admin = k.verify(&k.mint(7, true, 60).unwrap()).unwrap();
    assert_eq!((admin.user_id.get(), admin.admin), (7, true));
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
        .user_id
        .get(),
        5
    );
    assert_eq!(
        k.verify(&sign(
            serde_json::json!({"sub": "6", "exp": exp}),
            "test-secret"
        ))
        .unwrap()
        .user_id
        .get(),
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

/// Each rule a token can break has a message of its own, the same whether the token
/// takes the fast path or jsonwebtoken's (`iss`/`aud` configured, and the JWKS path).
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
    assert_eq!(k.verify(&token).unwrap().user_id.get(), 8);
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
    // The JWKS path and HS256 with iss/aud configured verify under these rules too,
    // `exp` judged after jsonwebtoken by the one clock (here unheard: this machine's).
    let mut ours = validation.clone();
    ours.validate_exp = false;
    assert_eq!(Expected::default().validation(Algorithm::HS256), ours);
    let decoding = DecodingKey::from_secret(b"test-secret");
    let reference = |t: &str| {
        jsonwebtoken::decode::<Claims>(t, &decoding, &validation)
            .ok()
            .filter(|d| matches!(d.claims.role.as_deref(), None | Some(ADMIN_ROLE)))
            .map(|d| (d.claims.sub.get(), d.claims.role.is_some()))
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
        let ours = k.verify(token).ok().map(|u| (u.user_id.get(), u.admin));
        assert_eq!(ours, reference(token), "{token}");
    }
}
