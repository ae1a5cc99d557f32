//! What a token's claims must say beyond `sub` and `exp`: the configured `iss` and
//! `aud`, on HS256 tokens too, and a shop's id with the shop's role.

use super::*;

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
