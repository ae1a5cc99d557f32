//! A token is verified only with the keys its header's algorithm names (HS256: the
//! secret, on the same path as `JwtKeys::verify`; RS256/ES256: the JWKS), and a verifier
//! needs one of the two.

use super::*;

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
