//! The verifier and the minting of tokens, against jsonwebtoken as the reference.

use super::claims::{Claims, LEEWAY_SECS};
use super::*;

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
    // The JWKS path and HS256 with iss/aud configured verify under these rules too.
    assert_eq!(Expected::default().validation(Algorithm::HS256), validation);
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

/// Requests take the same HS256 path as `JwtKeys::verify`, common header or not.
#[tokio::test]
async fn the_verifier_accepts_exactly_the_hs256_tokens_the_keys_accept() {
    let k = keys();
    let v = verifier(Some(keys()), None);
    let exp = in_an_hour();
    let mut with_kid = Header::new(Algorithm::HS256);
    with_kid.kid = Some("key-1".into());
    let good = k.mint(3, true, 60).unwrap();
    let tokens = [
        good.clone(),
        jsonwebtoken::encode(
            &with_kid,
            &serde_json::json!({"sub": 4, "exp": exp}),
            &EncodingKey::from_secret(b"test-secret"),
        )
        .unwrap(),
        sign(
            serde_json::json!({"sub": 5, "exp": exp - 7200}),
            "test-secret",
        ),
        sign(serde_json::json!({"sub": 5, "exp": exp}), "other"),
        sign(
            serde_json::json!({"sub": 5, "exp": exp, "role": "root"}),
            "test-secret",
        ),
        sign_as(
            Algorithm::HS384,
            &serde_json::json!({"sub": 5, "exp": exp}),
            "test-secret",
        ),
        format!("{good}.x"),
        "a.b".into(),
        "eyJhbGciOiJub25lIiwidHlwIjoiSldUIn0.eyJzdWIiOjEsImV4cCI6OTk5OTk5OTk5OX0.".into(),
    ];
    for token in &tokens {
        let ours = v
            .verify(token)
            .await
            .ok()
            .map(|u| (u.user_id.get(), u.admin));
        let reference = k.verify(token).ok().map(|u| (u.user_id.get(), u.admin));
        assert_eq!(ours, reference, "{token}");
    }
    assert_eq!(v.verify(&good).await.unwrap().user_id.get(), 3);
}

#[tokio::test]
async fn issuer_and_audience_apply_to_hs256_tokens_when_configured() {
    let expected = Expected::new(Some("https://idp.example"), Some("seckill"));
    let k = JwtKeys::with_expected("test-secret", expected).unwrap();
    let v = verifier(
        Some(JwtKeys::with_expected("test-secret", k.expected.clone()).unwrap()),
        None,
    );
    let minted = k.mint(42, false, 60).unwrap();
    let payload: serde_json::Value = serde_json::from_slice(
        &URL_SAFE_NO_PAD
            .decode(minted.split('.').nth(1).unwrap())
            .unwrap(),
    )
    .unwrap();
    assert_eq!(payload["iss"], "https://idp.example");
    assert_eq!(payload["aud"], "seckill");
    assert_eq!(v.verify(&minted).await.unwrap().user_id.get(), 42);

    let exp = in_an_hour();
    let check = |claims: serde_json::Value| sign(claims, "test-secret");
    let cases = [
        (
            serde_json::json!({"sub": 1, "exp": exp, "iss": "https://idp.example", "aud": ["x", "seckill"]}),
            Ok(1),
        ),
        (
            serde_json::json!({"sub": 1, "exp": exp, "aud": "seckill"}),
            Err(WRONG_ISSUER),
        ),
        (
            serde_json::json!({"sub": 1, "exp": exp, "iss": "https://evil.example", "aud": "seckill"}),
            Err(WRONG_ISSUER),
        ),
        (
            serde_json::json!({"sub": 1, "exp": exp, "iss": "https://idp.example"}),
            Err(WRONG_AUDIENCE),
        ),
        (
            serde_json::json!({"sub": 1, "exp": exp, "iss": "https://idp.example", "aud": "other"}),
            Err(WRONG_AUDIENCE),
        ),
        (
            serde_json::json!({"sub": 1, "exp": exp, "iss": "https://idp.example", "aud": ["other"]}),
            Err(WRONG_AUDIENCE),
        ),
        (
            serde_json::json!({"sub": 1, "exp": exp - 7200, "iss": "https://idp.example", "aud": "seckill"}),
            Err(EXPIRED),
        ),
        (
            serde_json::json!({"sub": 0, "exp": exp, "iss": "https://idp.example", "aud": "seckill"}),
            Err(BAD_SUB),
        ),
        (
            serde_json::json!({"sub": 1, "exp": exp, "iss": "https://idp.example", "aud": "seckill", "role": "root"}),
            Err(UNKNOWN_ROLE),
        ),
    ];
    for (claims, want) in cases {
        let token = check(claims.clone());
        let got = v.verify(&token).await.map(|u| u.user_id.get());
        assert_eq!(got, want.map_err(Refused::Unauthorized), "{claims}");
        assert_eq!(
            k.verify(&token).map(|u| u.user_id.get()).map_err(|e| e.0),
            want,
            "{claims}"
        );
    }
    // Unconfigured, neither is checked (the rules of the fast path).
    let plain = keys();
    let token =
        check(serde_json::json!({"sub": 1, "exp": exp, "iss": "anyone", "aud": "anything"}));
    assert_eq!(plain.verify(&token).unwrap().user_id.get(), 1);
}

#[tokio::test]
async fn the_header_alg_picks_the_keys_and_no_other_algorithm_is_accepted() {
    let exp = in_an_hour();
    let claims = serde_json::json!({"sub": 1, "exp": exp});
    let hs256 = sign(claims.clone(), "test-secret");
    // Without a secret, HS256 is refused outright (never tried against JWKS keys).
    let jwks_only = verifier(None, Some(unreachable_jwks()));
    assert_eq!(
        jwks_only.verify(&hs256).await.unwrap_err(),
        Refused::Unauthorized(ALG_NOT_ACCEPTED)
    );
    // Without a JWKS, RS256/ES256 are refused.
    let hs_only = verifier(Some(keys()), None);
    let header = |json: &str| URL_SAFE_NO_PAD.encode(json);
    let body = URL_SAFE_NO_PAD.encode(claims.to_string());
    let rs256 = format!("{}.{body}.c2ln", header(r#"{"alg":"RS256","kid":"k"}"#));
    let es256 = format!("{}.{body}.c2ln", header(r#"{"alg":"ES256","kid":"k"}"#));
    for token in [&rs256, &es256] {
        assert_eq!(
            hs_only.verify(token).await.unwrap_err(),
            Refused::Unauthorized(ALG_NOT_ACCEPTED)
        );
    }
    // Anything else, either way.
    let both = verifier(Some(keys()), Some(unreachable_jwks()));
    for alg in [
        "none", "None", "HS384", "HS512", "RS384", "PS256", "ES384", "EdDSA", "",
    ] {
        let token = format!(
            "{}.{body}.",
            header(&format!(r#"{{"alg":"{alg}","kid":"k"}}"#))
        );
        for v in [&both, &jwks_only, &hs_only] {
            assert_eq!(
                v.verify(&token).await.unwrap_err(),
                Refused::Unauthorized(ALG_NOT_ACCEPTED),
                "{alg}"
            );
        }
    }
    // An RS256 token must name its key.
    let no_kid = format!("{}.{body}.c2ln", header(r#"{"alg":"RS256"}"#));
    assert_eq!(
        both.verify(&no_kid).await.unwrap_err(),
        Refused::Unauthorized(NO_KID)
    );
    // Keys never fetched: 503, not 401 (the token may be good); HS256 still works.
    assert_eq!(
        both.verify(&rs256).await.unwrap_err(),
        Refused::KeysNotLoaded
    );
    assert_eq!(both.verify(&hs256).await.unwrap().user_id.get(), 1);
}

#[test]
fn a_secret_or_a_jwks_is_required_and_the_jwks_url_must_be_http() {
    let err = Verifier::new(None, None).err().unwrap().to_string();
    assert!(
        err.contains("JWT_SECRET") && err.contains("JWT_JWKS_URL"),
        "{err}"
    );
    let args = crate::config::JwtArgs {
        jwt_jwks_url: Some("".into()),
        jwt_issuer: Some("https://idp.example".into()),
        ..Default::default()
    };
    assert!(Verifier::from_args(&args).is_err());
    assert!(Verifier::from_args(&crate::config::JwtArgs {
        jwt_secret: Some("".into()),
        ..Default::default()
    })
    .is_err());
    for bad in [
        "not a url",
        "ftp://idp.example/jwks.json",
        "file:///etc/jwks.json",
    ] {
        assert!(Jwks::new(bad, &Expected::default()).is_err(), "{bad}");
    }
    let jwks_only = Verifier::from_args(&crate::config::JwtArgs {
        jwt_jwks_url: Some("https://idp.example/.well-known/jwks.json".into()),
        ..Default::default()
    })
    .unwrap();
    assert!(jwks_only.hs256.is_none() && jwks_only.jwks().is_some());
}

/// A shop's staff: `role: "shop"` with a positive `shop_id` (a number or digits); a shop
/// token without one, or with a bad one, is refused with the rule that failed.
#[test]
fn a_shop_token_carries_its_shop_and_one_without_a_valid_shop_id_is_refused() {
    let k = keys();
    let exp = now_secs() + 600;
    for (claims, want) in [
        (
            serde_json::json!({"sub": 9, "exp": exp, "role": "shop", "shop_id": 7}),
            Ok(Some(7)),
        ),
        (
            serde_json::json!({"sub": 9, "exp": exp, "role": "shop", "shop_id": "7"}),
            Ok(Some(7)),
        ),
        (serde_json::json!({"sub": 9, "exp": exp}), Ok(None)),
        (
            serde_json::json!({"sub": 9, "exp": exp, "role": "shop"}),
            Err(BAD_SHOP),
        ),
        (
            serde_json::json!({"sub": 9, "exp": exp, "role": "shop", "shop_id": 0}),
            Err(BAD_SHOP),
        ),
        (
            serde_json::json!({"sub": 9, "exp": exp, "role": "shop", "shop_id": -3}),
            Err(BAD_SHOP),
        ),
        (
            serde_json::json!({"sub": 9, "exp": exp, "role": "shop", "shop_id": "07"}),
            Err(BAD_SHOP),
        ),
        (
            serde_json::json!({"sub": 9, "exp": exp, "role": "shop", "shop_id": [7]}),
            Err(BAD_SHOP),
        ),
    ] {
        let token = sign(claims.clone(), "test-secret");
        let got = k
            .verify(&token)
            .map(|u| u.shop.map(ShopId::get))
            .map_err(|e| e.0);
        assert_eq!(got, want, "{claims}");
    }
    // A shop_id without the role is no staff member, and staff are no administrators.
    let stray = sign(
        serde_json::json!({"sub": 9, "exp": exp, "shop_id": 7}),
        "test-secret",
    );
    let user = k.verify(&stray).unwrap();
    assert_eq!((user.shop, user.admin), (None, false));
    let minted = k
        .mint_as(9, Role::Shop(ShopId::new(7).unwrap()), 60)
        .unwrap();
    let staff = k.verify(&minted).unwrap();
    assert_eq!((staff.shop.map(ShopId::get), staff.admin), (Some(7), false));
}
