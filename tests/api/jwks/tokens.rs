//! Which tokens a JWKS provider's keys accept: RS256 and ES256 with their user and
//! role, and refusals for issuer, audience, kid, algorithm and unsigned tokens.

use super::*;

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn an_rs256_token_naming_a_jwks_key_is_accepted_with_its_user_and_role(db: PgPool) {
    let key = rsa_key("rsa-1");
    let idp = Idp::start(vec![key.jwk.clone()]).await;
    let app = app_with_idp(db, &idp).await;

    let (status, voucher) = app
        .post_json(
            "/vouchers",
            Some(&key.sign(&admin_claims(1))),
            &voucher_body(),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "an admin's token: {voucher}");
    let (status, body) = app
        .post_json("/vouchers", Some(&key.sign(&claims(2))), &voucher_body())
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "a shopper's token: {body}");

    let voucher = voucher["id"].as_i64().unwrap();
    let shopper = key.sign(&claims(7001));
    let (status, grabbed) = app.grab_as(voucher, &shopper).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{grabbed}");
    let (status, orders) = my_orders(&app, &shopper).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(orders[0]["order_id"], grabbed["order_id"], "{orders}");
    assert_eq!(orders[0]["user_id"], 7001, "{orders}");
    assert_eq!(
        idp.fetches(),
        1,
        "fetched once at start, then from the cache"
    );
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn an_es256_token_naming_a_jwks_key_is_accepted_with_its_user(db: PgPool) {
    let rsa = rsa_key("rsa-1");
    let ec = ec_key("ec-1");
    let idp = Idp::start(vec![rsa.jwk.clone(), ec.jwk.clone()]).await;
    let app = app_with_idp(db, &idp).await;

    let voucher = {
        let (status, v) = app
            .post_json(
                "/vouchers",
                Some(&ec.sign(&admin_claims(1))),
                &voucher_body(),
            )
            .await;
        assert_eq!(status, StatusCode::CREATED, "{v}");
        v["id"].as_i64().unwrap()
    };
    // `sub` as a JSON number this time.
    let mut numeric = claims(7002);
    numeric["sub"] = json!(7002);
    let shopper = ec.sign(&numeric);
    let (status, grabbed) = app.grab_as(voucher, &shopper).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{grabbed}");
    let (_, orders) = my_orders(&app, &shopper).await;
    assert_eq!(orders[0]["user_id"], 7002, "{orders}");

    // The claims rules are the HS256 ones.
    let mut bad_sub = claims(1);
    bad_sub["sub"] = json!("auth0|123");
    let mut root = claims(1);
    root["role"] = json!("root");
    let mut expired = claims(1);
    expired["exp"] = json!(chrono::Utc::now().timestamp() - 60);
    let mut no_exp = claims(1);
    no_exp.as_object_mut().unwrap().remove("exp");
    assert_refused(&app, &ec.sign(&bad_sub), SUB_REFUSED, "sub").await;
    assert_refused(&app, &ec.sign(&root), "unknown role in token", "role").await;
    assert_refused(&app, &ec.sign(&expired), EXPIRED, "exp").await;
    assert_refused(&app, &ec.sign(&no_exp), NO_EXP, "no exp").await;
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_token_from_another_issuer_is_refused(db: PgPool) {
    let key = rsa_key("rsa-1");
    let idp = Idp::start(vec![key.jwk.clone()]).await;
    let app = app_with_idp(db, &idp).await;

    assert_accepted(&app, &key.sign(&claims(5)), "the configured issuer").await;
    let mut other = claims(5);
    other["iss"] = json!("https://idp.test/realms/other");
    let mut none = claims(5);
    none.as_object_mut().unwrap().remove("iss");
    for (what, c) in [("another issuer", other), ("no issuer", none)] {
        assert_refused(&app, &key.sign(&c), "token issuer not accepted", what).await;
    }
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_token_for_another_audience_is_refused(db: PgPool) {
    let key = ec_key("ec-1");
    let idp = Idp::start(vec![key.jwk.clone()]).await;
    let app = app_with_idp(db, &idp).await;

    let mut several = claims(5);
    several["aud"] = json!(["account", AUDIENCE]);
    assert_accepted(&app, &key.sign(&several), "an array holding ours").await;
    let mut other = claims(5);
    other["aud"] = json!("account");
    let mut others = claims(5);
    others["aud"] = json!(["account", "billing"]);
    let mut none = claims(5);
    none.as_object_mut().unwrap().remove("aud");
    for (what, c) in [
        ("another audience", other),
        ("other audiences", others),
        ("no audience", none),
    ] {
        assert_refused(&app, &key.sign(&c), "token audience not accepted", what).await;
    }
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_token_naming_an_unknown_kid_or_none_is_refused(db: PgPool) {
    let known = rsa_key("rsa-1");
    let stranger = rsa_key("rsa-2");
    let idp = Idp::start(vec![known.jwk.clone()]).await;
    let app = app_with_idp(db, &idp).await;

    let c = claims(5);
    assert_refused(
        &app,
        &stranger.sign(&c),
        "unknown key id (kid)",
        "unknown kid",
    )
    .await;
    // A key of the set named, but signed by another: the signature fails.
    let forged = stranger.sign_as(Algorithm::RS256, Some("rsa-1"), &c);
    assert_refused(&app, &forged, BAD_SIGNATURE, "forged").await;
    let anonymous = known.sign_as(Algorithm::RS256, None, &c);
    assert_refused(&app, &anonymous, "token has no key id (kid)", "no kid").await;
    assert_accepted(&app, &known.sign(&c), "the known key").await;
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn an_hs256_token_signed_with_the_providers_public_key_is_refused(db: PgPool) {
    let key = rsa_key("rsa-1");
    let idp = Idp::start(vec![key.jwk.clone()]).await;
    // With a secret (HS256 checked against it, never against a JWKS key) and without
    // (HS256 not accepted at all).
    let both = app_with_idp(db.clone(), &idp).await;
    let jwks_only = TestApp::spawn_with_jwt(db, jwt_args(None, &idp.url)).await;

    let mut forms = key.public_forms.clone();
    let jwk_text = key.jwk.to_string().into_bytes();
    forms.push(("JWK text", jwk_text));
    forms.push((
        "modulus",
        URL_SAFE_NO_PAD
            .decode(key.jwk["n"].as_str().unwrap())
            .unwrap(),
    ));
    for (what, public) in &forms {
        let mut header = Header::new(Algorithm::HS256);
        header.kid = Some(key.kid.clone());
        let token =
            jsonwebtoken::encode(&header, &admin_claims(1), &EncodingKey::from_secret(public))
                .unwrap();
        assert_refused(&both, &token, BAD_SIGNATURE, what).await;
        assert_refused(&jwks_only, &token, "token algorithm not accepted", what).await;
    }
    // The same key as RS256 is good: only the algorithm is wrong above.
    assert_accepted(&both, &key.sign(&claims(1)), "RS256").await;
    assert_accepted(&jwks_only, &key.sign(&claims(1)), "RS256").await;
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_token_whose_alg_is_not_its_keys_is_refused(db: PgPool) {
    let rsa = rsa_key("rsa-1");
    let ec = ec_key("ec-1");
    let idp = Idp::start(vec![rsa.jwk.clone(), ec.jwk.clone()]).await;
    let app = app_with_idp(db, &idp).await;

    let c = claims(5);
    // RS256 (signed by the RSA key) naming the EC key, and ES256 naming the RSA key.
    let rs_on_ec = rsa.sign_as(Algorithm::RS256, Some("ec-1"), &c);
    let es_on_rsa = ec.sign_as(Algorithm::ES256, Some("rsa-1"), &c);
    for (what, token) in [("RS256 on EC", rs_on_ec), ("ES256 on RSA", es_on_rsa)] {
        assert_refused(&app, &token, "token algorithm does not match its key", what).await;
    }
    assert_accepted(&app, &rsa.sign(&c), "RS256 on RSA").await;
    assert_accepted(&app, &ec.sign(&c), "ES256 on EC").await;
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn an_unsigned_alg_none_token_or_another_algorithm_is_refused(db: PgPool) {
    let rsa = rsa_key("rsa-1");
    let idp = Idp::start(vec![rsa.jwk.clone()]).await;
    let app = app_with_idp(db, &idp).await;

    let payload = URL_SAFE_NO_PAD.encode(admin_claims(1).to_string());
    for header in [
        json!({"alg": "none", "kid": "rsa-1"}),
        json!({"alg": "none", "typ": "JWT"}),
        json!({"alg": "NONE", "kid": "rsa-1"}),
        json!({"kid": "rsa-1"}),
    ] {
        let head = URL_SAFE_NO_PAD.encode(header.to_string());
        for token in [format!("{head}.{payload}."), format!("{head}.{payload}")] {
            let (status, body) = my_orders(&app, &token).await;
            assert_eq!(status, StatusCode::UNAUTHORIZED, "{header}: {body}");
        }
        let token = format!("{head}.{payload}.");
        if header.get("alg").is_some() {
            assert_refused(&app, &token, "token algorithm not accepted", "none").await;
        }
    }
    // Signed by the JWKS key, with algorithms it could compute but we do not accept.
    for alg in [Algorithm::RS384, Algorithm::RS512, Algorithm::PS256] {
        let token = rsa.sign_as(alg, Some("rsa-1"), &claims(1));
        assert_refused(
            &app,
            &token,
            "token algorithm not accepted",
            &format!("{alg:?}"),
        )
        .await;
    }
}
