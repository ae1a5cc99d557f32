//! Every refused token is told which rule it broke, on both verification paths.

use super::*;

/// What a token is, the token, and the rule it breaks.
type Case = (&'static str, String, &'static str);

#[tokio::test]
async fn every_refusal_names_the_rule_that_failed() {
    let exp = in_an_hour();
    let past = exp - 7200;
    let fast = verifier(Some(keys()), None);
    let expected = Expected::new(Some("https://idp.example"), Some("seckill"));
    let checked = verifier(
        Some(JwtKeys::with_expected("test-secret", expected).unwrap()),
        None,
    );
    let (good, cases) = refusal_cases(exp, past);
    for (what, token, why) in &cases {
        for (path, v) in [("fast", &fast), ("checked", &checked)] {
            assert_eq!(
                v.verify(token).await.map(|u| u.user_id.get()),
                Err(Refused::Unauthorized(why)),
                "{what} ({path} path)"
            );
        }
    }
    assert_eq!(fast.verify(&good).await.unwrap().user_id.get(), 1);
    assert_eq!(checked.verify(&good).await.unwrap().user_id.get(), 1);
    // Signed claims that are not a JSON object.
    let header = URL_SAFE_NO_PAD.encode(r#"{"alg":"HS256","typ":"JWT"}"#);
    let payload = URL_SAFE_NO_PAD.encode("5");
    let signing = format!("{header}.{payload}");
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, b"test-secret");
    let mac = URL_SAFE_NO_PAD.encode(ring::hmac::sign(&key, signing.as_bytes()));
    let not_an_object = format!("{signing}.{mac}");
    for v in [&fast, &checked] {
        assert_eq!(
            v.verify(&not_an_object).await.map(|u| u.user_id.get()),
            Err(Refused::Unauthorized(MALFORMED))
        );
    }
    every_message_is_its_own_and_keeps_the_secret();
}

/// Signed with `test-secret` for issuer `https://idp.example` and audience `seckill`: a
/// good token, and each refused one with what it is and the rule it breaks.
fn refusal_cases(exp: u64, past: u64) -> (String, Vec<Case>) {
    use serde_json::json;
    let with = |claims: serde_json::Value| {
        let mut claims = claims;
        claims["iss"] = "https://idp.example".into();
        claims["aud"] = "seckill".into();
        claims
    };
    let signed = |claims| sign(with(claims), "test-secret");
    let good = signed(json!({"sub": 1, "exp": exp}));
    let mut forged = good.clone();
    forged.truncate(good.len() - 2);
    forged.push_str("AA");
    let after_header = &good[good.find('.').unwrap() + 1..];
    let not_an_object = [r#"{"alg":"HS256","typ":"JWT"}"#, "5"].map(|p| URL_SAFE_NO_PAD.encode(p));
    let cases: Vec<Case> = vec![
        ("not three parts", "abc.def".into(), MALFORMED),
        ("empty", String::new(), MALFORMED),
        ("header not base64", format!("!!.{after_header}"), MALFORMED),
        (
            "wrong secret",
            sign(with(json!({"sub": 1, "exp": exp})), "other"),
            BAD_SIGNATURE,
        ),
        ("altered signature", forged, BAD_SIGNATURE),
        ("expired", signed(json!({"sub": 1, "exp": past})), EXPIRED),
        (
            "expired, and a bad sub",
            signed(json!({"sub": "x", "exp": past})),
            EXPIRED,
        ),
        ("no exp", signed(json!({"sub": 1})), NO_EXP),
        (
            "exp a word",
            signed(json!({"sub": 1, "exp": "soon"})),
            BAD_EXP,
        ),
        (
            "exp negative",
            signed(json!({"sub": 1, "exp": -1})),
            BAD_EXP,
        ),
        ("no sub", signed(json!({"exp": exp})), NO_SUB),
        ("sub zero", signed(json!({"sub": 0, "exp": exp})), BAD_SUB),
        (
            "sub a word",
            signed(json!({"sub": "auth0|1", "exp": exp})),
            BAD_SUB,
        ),
        ("sub 1.5", signed(json!({"sub": 1.5, "exp": exp})), BAD_SUB),
        (
            "role root",
            signed(json!({"sub": 1, "exp": exp, "role": "root"})),
            UNKNOWN_ROLE,
        ),
        (
            "role a number",
            signed(json!({"sub": 1, "exp": exp, "role": 5})),
            UNKNOWN_ROLE,
        ),
        (
            "claims not an object",
            format!("{}.{}.AA", not_an_object[0], not_an_object[1]),
            BAD_SIGNATURE,
        ),
    ];
    (good, cases)
}

fn every_message_is_its_own_and_keeps_the_secret() {
    // Every message is its own, and none says anything of the secret.
    let mut messages = vec![
        MALFORMED,
        BAD_SIGNATURE,
        EXPIRED,
        NO_EXP,
        BAD_EXP,
        NO_SUB,
        BAD_SUB,
        UNKNOWN_ROLE,
        WRONG_ISSUER,
        WRONG_AUDIENCE,
        ALG_NOT_ACCEPTED,
        ALG_MISMATCH,
        NO_KID,
        UNKNOWN_KID,
        INVALID,
    ];
    assert!(messages.iter().all(|m| !m.contains("test-secret")));
    let all = messages.len();
    messages.sort();
    messages.dedup();
    assert_eq!(messages.len(), all);
}
