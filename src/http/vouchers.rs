//! `POST /vouchers`, `GET /vouchers/{id}`, `GET /shops/{shop_id}/vouchers`, and the
//! administrators' `POST /vouchers/{id}/close` (their `GET /vouchers/{id}/orders` is in
//! `sale_orders`).

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::admission::{self, loader};
use crate::auth::Admin;
use crate::domain::{Opening, ShopId, VoucherId, VoucherTerms};
use crate::http::error::{AdminOnly, AppError, AppResult, ErrorBody};
use crate::http::extract::{AppJson, PathId};
use crate::http::fallback_headers;
use crate::http::state::AppState;
use crate::http::text::{text, Needed};
use crate::store::vouchers::{self, NewSeckill, NewVoucher, VoucherRow};

pub(crate) const MAX_STOCK: i64 = 1_000_000;
const MAX_TITLE: usize = 255;
const MAX_RULES: usize = 4_000;
/// Sale times outside this range are typing errors, and some (chrono reaches year
/// -262143) Postgres cannot even store.
const EARLIEST: DateTime<Utc> = DateTime::UNIX_EPOCH;
const LATEST: DateTime<Utc> = match DateTime::from_timestamp(253_402_300_799, 0) {
    Some(t) => t, // 9999-12-31T23:59:59Z
    None => panic!("in range"),
};

/// A voucher to publish; with `seckill` it is a flash-sale voucher. Money in cents.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"shop_id": 1, "title": "50 off 100", "sub_title": "weekdays",
    "rules": "one per person", "pay_value": 5000, "actual_value": 10000,
    "seckill": {"stock": 100, "begin_time": "2026-11-21T10:00:00Z", "end_time": "2026-11-21T12:00:00Z"}}))]
pub(crate) struct CreateVoucher {
    #[schema(minimum = 1, maximum = 9223372036854775807_i64)]
    pub shop_id: i64,
    /// 1 to 255 characters, no NUL, and at least one of them visible: not only
    /// whitespace and invisible characters (Unicode's default-ignorable code points:
    /// zero-width spaces and joiners, U+FEFF, U+2060, soft hyphens, bidi controls,
    /// variation selectors, fillers).
    #[schema(
        min_length = 1,
        max_length = 255,
        pattern = "^[^\\u0000]*[^\\s\\u0000\\u00AD\\u034F\\u061C\\u115F\\u1160\\u17B4\\u17B5\\u180B-\\u180F\\u200B-\\u200F\\u202A-\\u202E\\u2060-\\u206F\\u3164\\uFE00-\\uFE0F\\uFEFF\\uFFA0\\uFFF0-\\uFFF8][^\\u0000]*$"
    )]
    pub title: String,
    /// Up to 255 characters, no NUL; empty, or with a visible character (as `title`).
    #[serde(default)]
    #[schema(
        max_length = 255,
        pattern = "^$|^[^\\u0000]*[^\\s\\u0000\\u00AD\\u034F\\u061C\\u115F\\u1160\\u17B4\\u17B5\\u180B-\\u180F\\u200B-\\u200F\\u202A-\\u202E\\u2060-\\u206F\\u3164\\uFE00-\\uFE0F\\uFEFF\\uFFA0\\uFFF0-\\uFFF8][^\\u0000]*$"
    )]
    pub sub_title: String,
    /// Up to 4000 characters, no NUL; empty, or with a visible character (as `title`).
    #[serde(default)]
    #[schema(
        max_length = 4000,
        pattern = "^$|^[^\\u0000]*[^\\s\\u0000\\u00AD\\u034F\\u061C\\u115F\\u1160\\u17B4\\u17B5\\u180B-\\u180F\\u200B-\\u200F\\u202A-\\u202E\\u2060-\\u206F\\u3164\\uFE00-\\uFE0F\\uFEFF\\uFFA0\\uFFF0-\\uFFF8][^\\u0000]*$"
    )]
    pub rules: String,
    /// What the shopper pays, in cents: at most `actual_value` (400 otherwise).
    #[schema(minimum = 0, maximum = 9223372036854775807_i64)]
    pub pay_value: i64,
    /// What the voucher is worth, in cents.
    #[schema(minimum = 0, maximum = 9223372036854775807_i64)]
    pub actual_value: i64,
    /// Whether a paid, unused coupon may be refunded at its owner's request (an
    /// administrator may refund any).
    #[serde(default)]
    pub refundable: bool,
    #[serde(default, deserialize_with = "crate::http::extract::object_or_null")]
    pub seckill: Option<CreateSeckill>,
}

/// The flash sale: `end_time` after `begin_time` and in the future; `begin_time` may
/// be in the past (the sale opens at once).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct CreateSeckill {
    #[schema(minimum = 1, maximum = 1000000)]
    pub stock: i64,
    /// RFC 3339 with a zone offset (`Z` or `+08:00`), from 1970 to 9999.
    #[serde(deserialize_with = "crate::http::extract::rfc3339")]
    pub begin_time: DateTime<Utc>,
    /// RFC 3339 with a zone offset, after `begin_time`, at most 9999-12-31T23:59:59Z.
    #[serde(deserialize_with = "crate::http::extract::rfc3339")]
    pub end_time: DateTime<Utc>,
    /// Seconds a shopper has to pay once the order is written
    /// (1 to 86400, default 900); an unpaid order then expires and its unit goes back
    /// on sale.
    // (The default is stated in words, not as the schema's `default`: some generators,
    // openapi-typescript's among them, make a property with a default required.)
    #[serde(default = "default_pay_within")]
    #[schema(minimum = 1, maximum = 86400)]
    pub pay_within_secs: i64,
    /// Segments the stock is split over (1 to 64, default 1), each on its own Redis hash
    /// slot: on Redis Cluster one hot sale's admissions spread over several masters. It
    /// still behaves as one sale (one order per user, `sold_out` only when no segment has a
    /// unit, `stock` the total). At most `stock` segments.
    #[serde(default = "one_segment")]
    #[schema(minimum = 1, maximum = 64)]
    pub segments: i64,
    /// How the sale opens (default `{"mode": "first_come"}`). A lottery
    /// (`{"mode": "lottery", "window_ms": W}`, W 100 to 10000) takes every shopper who
    /// presses in the first W ms after `begin_time` as an entrant and draws
    /// min(stock, entrants) winners once the window is over (once over all the sale's
    /// segments); it must begin in the future and end after its window.
    #[serde(default)]
    pub opening: Opening,
}

fn one_segment() -> i64 {
    1
}

fn default_pay_within() -> i64 {
    crate::config::defaults::PAY_WITHIN_SECS
}

pub(crate) const MAX_PAY_WITHIN_SECS: i64 = 86_400;

/// A lottery's window within its sale, on a sale not begun yet.
fn lottery_fits(s: &CreateSeckill, now: DateTime<Utc>) -> AppResult<()> {
    let Opening::Lottery { window_ms } = s.opening else {
        return Ok(());
    };
    if !Opening::WINDOW_MS.contains(&window_ms) {
        return Err(AppError::invalid(format!(
            "seckill.opening.window_ms must be between {} and {}",
            Opening::WINDOW_MS.start(),
            Opening::WINDOW_MS.end()
        )));
    }
    if s.begin_time <= now {
        return Err(AppError::invalid(
            "seckill.begin_time must be in the future for a lottery: its entry window \
             must not have begun",
        ));
    }
    if s.begin_time + chrono::Duration::milliseconds(window_ms) >= s.end_time {
        return Err(AppError::invalid(
            "seckill.end_time must be after the lottery's window (begin_time + window_ms)",
        ));
    }
    Ok(())
}

impl CreateVoucher {
    /// Checks every field; nothing unvalidated reaches Postgres.
    pub(crate) fn validate(self, now: DateTime<Utc>) -> AppResult<NewVoucher> {
        if self.shop_id <= 0 {
            return Err(AppError::invalid("shop_id must be a positive integer"));
        }
        if self.pay_value < 0 || self.actual_value < 0 {
            return Err(AppError::invalid(
                "pay_value and actual_value must not be negative",
            ));
        }
        // Each value is in range; together they are a typing error (400, where a value
        // out of range is a 422).
        if self.pay_value > self.actual_value {
            return Err(AppError::bad_request(format!(
                "pay_value ({}) must not exceed actual_value ({}): a voucher cannot cost \
                 more than it is worth",
                self.pay_value, self.actual_value
            )));
        }
        let seckill = match self.seckill {
            None => None,
            Some(s) => {
                if !(1..=MAX_STOCK).contains(&s.stock) {
                    return Err(AppError::invalid(format!(
                        "seckill.stock must be between 1 and {MAX_STOCK}"
                    )));
                }
                for (field, at) in [("begin_time", s.begin_time), ("end_time", s.end_time)] {
                    if !(EARLIEST..=LATEST).contains(&at) {
                        return Err(AppError::invalid(format!(
                            "seckill.{field} must lie between 1970-01-01 and 9999-12-31"
                        )));
                    }
                }
                if s.end_time <= s.begin_time {
                    return Err(AppError::invalid(
                        "seckill.end_time must be after seckill.begin_time",
                    ));
                }
                if s.end_time <= now {
                    return Err(AppError::invalid("seckill.end_time must be in the future"));
                }
                if !(1..=MAX_PAY_WITHIN_SECS).contains(&s.pay_within_secs) {
                    return Err(AppError::invalid(format!(
                        "seckill.pay_within_secs must be between 1 and {MAX_PAY_WITHIN_SECS}"
                    )));
                }
                if !(1..=crate::keys::MAX_SEGMENTS as i64).contains(&s.segments) {
                    return Err(AppError::invalid(format!(
                        "seckill.segments must be between 1 and {}",
                        crate::keys::MAX_SEGMENTS
                    )));
                }
                if s.segments > s.stock {
                    return Err(AppError::invalid(format!(
                        "seckill.segments ({}) must not exceed seckill.stock ({}): every \
                         segment starts with at least one unit",
                        s.segments, s.stock
                    )));
                }
                lottery_fits(&s, now)?;
                Some(NewSeckill {
                    opening: s.opening,
                    segments: s.segments as u8,
                    stock: s.stock as i32,
                    begin_time: s.begin_time,
                    end_time: s.end_time,
                    pay_within_secs: s.pay_within_secs as i32,
                })
            }
        };
        let terms = VoucherTerms {
            shop_id: self.shop_id,
            title: text("title", &self.title, MAX_TITLE, Needed::Required)?,
            sub_title: text("sub_title", &self.sub_title, MAX_TITLE, Needed::Optional)?,
            rules: text("rules", &self.rules, MAX_RULES, Needed::Optional)?,
            pay_value: self.pay_value,
            actual_value: self.actual_value,
            refundable: self.refundable,
        };
        Ok(NewVoucher { terms, seckill })
    }
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub(crate) struct VoucherResponse {
    #[schema(inline)]
    pub id: VoucherId,
    #[serde(flatten)]
    #[schema(inline)]
    pub terms: VoucherTerms,
    pub created_at: DateTime<Utc>,
    /// Live remaining stock of a flash-sale voucher (same as `seckill.stock`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stock: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seckill: Option<SeckillResponse>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub(crate) struct SeckillResponse {
    /// Remaining stock: Redis's live count while the sale is loaded, else Postgres's.
    pub stock: i64,
    pub initial_stock: i64,
    pub begin_time: DateTime<Utc>,
    pub end_time: DateTime<Utc>,
    /// Seconds an order has to be paid after admission.
    pub pay_within_secs: i64,
    /// Segments the stock is split over (`stock` is their total).
    pub segments: i64,
    pub opening: Opening,
    /// A lottery's commitment to its draw: the hex SHA-256 of the draw's secret seed,
    /// published when the sale is created (the seed is published after the draw, at
    /// `GET /vouchers/{id}/draw`). `null` for a first-come sale.
    pub draw_commitment: Option<String>,
}

impl VoucherResponse {
    fn new(row: VoucherRow, redis_stock: Option<i64>) -> Self {
        let seckill = match (
            row.initial_stock,
            row.stock,
            row.begin_time,
            row.end_time,
            row.pay_within_secs,
            row.segments,
        ) {
            (
                Some(initial),
                Some(stock),
                Some(begin_time),
                Some(end_time),
                Some(pay_within),
                Some(segments),
            ) => Some(SeckillResponse {
                stock: redis_stock.unwrap_or(stock as i64),
                initial_stock: initial as i64,
                begin_time,
                end_time,
                pay_within_secs: pay_within as i64,
                segments: segments as i64,
                opening: Opening::of_row(
                    row.opening_mode.as_deref().unwrap_or_default(),
                    row.lottery_window_ms,
                ),
                draw_commitment: row.draw_commitment.clone(),
            }),
            _ => None,
        };
        Self {
            id: row.id,
            terms: row.terms,
            created_at: row.created_at,
            stock: seckill.as_ref().map(|s| s.stock),
            seckill,
        }
    }
}

/// Redis's live stock for each flash-sale row (`None` where not loaded), all looked up
/// at once under one deadline; `None` in all if Redis is down or slow: the response
/// then shows Postgres's count rather than failing or waiting.
async fn redis_stocks(state: &AppState, rows: &[VoucherRow]) -> Option<Vec<Option<i64>>> {
    let lookups = rows.iter().map(|row| {
        let mut conn = state.redis.clone();
        let keys = &state.keys;
        let sale = row.segments.map(|k| (row.id, k as u8));
        async move {
            match sale {
                Some((id, segments)) => admission::redis_stock(&mut conn, keys, id, segments).await,
                None => Ok(None),
            }
        }
    });
    crate::http::redis_read("live stock", futures_util::future::try_join_all(lookups)).await
}

/// Said of every voucher read that shows stock.
const STOCK_NOTE: &str = "A flash sale's `stock` is Redis's live count; \
    if Redis does not answer within 500 ms it is Postgres's count (which trails the live one \
    by the orders not yet written) and the answer carries `x-seckill-fallback: postgres`.";

#[utoipa::path(post, path = "/vouchers", operation_id = "createVoucher", tag = "vouchers", security(("bearer" = [])),
    request_body = CreateVoucher,
    responses(
        (status = 201, description = "created", body = VoucherResponse),
        (status = 400, description = "unreadable JSON (`validation`)", body = ErrorBody),
        (status = 413, description = "body over 64 KiB (`validation`)", body = ErrorBody),
        (status = 422, description = "invalid fields (`validation`)", body = ErrorBody),
        AdminOnly,
    ))]
pub(crate) async fn create(
    State(state): State<AppState>,
    _admin: Admin,
    AppJson(body): AppJson<CreateVoucher>,
) -> AppResult<(StatusCode, Json<VoucherResponse>)> {
    let new = body.validate(crate::clock::now())?;
    let row = vouchers::insert(&state.db, &new).await?;
    let mut live = None;
    if let Some(sale) = &new.seckill {
        state.admission.segments.remember(row.id, sale.segments);
        // The voucher exists once committed; if Redis is down now, admission reloads
        // the sale on line (or at start-up), so this is not an error for the caller.
        let mut conn = state.redis.clone();
        match loader::load_sale(
            &state.db,
            &mut conn,
            &state.keys,
            row.id,
            state.settings.sale_state_retention,
            loader::Mode::Create,
            state.settings.replicas,
        )
        .await
        {
            Ok(loaded) => live = loaded.map(|l| l.stock),
            Err(e) => {
                tracing::warn!(voucher_id = row.id.get(), error = %e, "sale not loaded into redis yet")
            }
        }
    }
    Ok((StatusCode::CREATED, Json(VoucherResponse::new(row, live))))
}

#[utoipa::path(get, path = "/vouchers/{id}", operation_id = "getVoucher", tag = "vouchers", description = STOCK_NOTE,
    params(("id" = i64, Path, description = "voucher id", minimum = 1)),
    responses(
        (status = 200, description = "the voucher; a flash sale shows its live stock", body = VoucherResponse,
            headers(("x-seckill-fallback" = String, description = "`postgres` when Redis did not answer: `stock` is Postgres's"))),
        (status = 400, description = "not a valid id (`validation`)", body = ErrorBody),
        (status = 404, description = "no such voucher (`not_found`)", body = ErrorBody),
        (status = 503, description = "a dependency is down (`unavailable`)", body = ErrorBody),
    ))]
pub(crate) async fn get(
    State(state): State<AppState>,
    PathId(id): PathId<VoucherId>,
) -> AppResult<(HeaderMap, Json<VoucherResponse>)> {
    one_voucher(&state, id).await
}

/// A voucher as `GET /vouchers/{id}` shows it: live stock from Redis, or Postgres's
/// with the fallback header.
async fn one_voucher(
    state: &AppState,
    id: VoucherId,
) -> AppResult<(HeaderMap, Json<VoucherResponse>)> {
    let row = vouchers::get(&state.db, id)
        .await?
        .ok_or_else(|| AppError::no_voucher(id))?;
    let live = redis_stocks(state, std::slice::from_ref(&row)).await;
    Ok((
        fallback_headers(live.is_none()),
        Json(VoucherResponse::new(row, live.and_then(|l| l[0]))),
    ))
}

#[utoipa::path(get, path = "/shops/{shop_id}/vouchers", operation_id = "listShopVouchers", tag = "vouchers", description = STOCK_NOTE,
    params(("shop_id" = i64, Path, description = "shop id", minimum = 1)),
    responses(
        (status = 200, description = "the shop's vouchers (at most 1000)", body = [VoucherResponse],
            headers(("x-seckill-fallback" = String, description = "`postgres` when Redis did not answer: `stock` is Postgres's"))),
        (status = 400, description = "not a valid id (`validation`)", body = ErrorBody),
        (status = 503, description = "a dependency is down (`unavailable`)", body = ErrorBody),
    ))]
pub(crate) async fn list_by_shop(
    State(state): State<AppState>,
    PathId(shop_id): PathId<ShopId>,
) -> AppResult<(HeaderMap, Json<Vec<VoucherResponse>>)> {
    let rows = vouchers::list_by_shop(&state.db, shop_id.get()).await?;
    let live = redis_stocks(&state, &rows).await;
    let headers = fallback_headers(live.is_none());
    let live = live.unwrap_or_else(|| vec![None; rows.len()]);
    Ok((
        headers,
        Json(
            rows.into_iter()
                .zip(live)
                .map(|(row, live)| VoucherResponse::new(row, live))
                .collect(),
        ),
    ))
}

#[utoipa::path(post, path = "/vouchers/{id}/close", operation_id = "closeSale", tag = "vouchers",
    security(("bearer" = [])),
    params(("id" = i64, Path, description = "voucher id", minimum = 1)),
    responses(
        (status = 200, description = "the voucher; its sale ends now (it keeps an earlier end). Grabs decided \
            before the close are admitted as usual; every grab after it hears `ended`", body = VoucherResponse),
        (status = 400, description = "not a valid id (`validation`)", body = ErrorBody),
        (status = 401, description = "no or bad token (`unauthorized`)", body = ErrorBody),
        (status = 403, description = "not an administrator (`forbidden`)", body = ErrorBody),
        (status = 404, description = "no such voucher, or it has no flash sale (`not_found`)", body = ErrorBody),
        (status = 503, description = "a dependency is down (`unavailable`): the close may or may not \
            have taken effect; closing again is safe and finishes it", body = ErrorBody),
    ))]
pub(crate) async fn close(
    State(state): State<AppState>,
    _admin: Admin,
    PathId(id): PathId<VoucherId>,
) -> AppResult<(HeaderMap, Json<VoucherResponse>)> {
    let mut conn = state.redis.clone();
    let replicas = state.settings.replicas;
    match loader::close_sale(&state.db, &mut conn, &state.keys, id, replicas).await {
        Ok(true) => {}
        // Not the grab's hot path: one more query to say which is missing.
        Ok(false) => {
            return Err(match vouchers::get(&state.db, id).await? {
                Some(_) => AppError::no_sale(id),
                None => AppError::no_voucher(id),
            })
        }
        Err(e) => {
            return Err(match AppError::from(e) {
                // The script may have run (a timeout, a dropped connection): the close
                // may have taken effect in Redis. Closing again is safe and finishes it.
                AppError::Redis(redis) if redis.is_timeout() || redis.is_io_error() => {
                    AppError::Unavailable(
                        "the close may or may not have taken effect; close again to finish it"
                            .into(),
                    )
                }
                other => other,
            });
        }
    }
    one_voucher(&state, id).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(json: serde_json::Value) -> CreateVoucher {
        serde_json::from_value(json).unwrap()
    }

    fn valid() -> serde_json::Value {
        serde_json::json!({"shop_id": 1, "title": "t", "sub_title": "", "rules": "", "pay_value": 1, "actual_value": 2,
            "seckill": {"stock": 5, "begin_time": "2026-01-01T00:00:00Z", "end_time": "2099-01-01T00:00:00Z"}})
    }

    /// The payment window's default and bound are written once, in Rust; the migration
    /// that gave the column its default and check, and the document's words and
    /// bound, say the same.
    #[test]
    fn the_payment_windows_default_and_bound_are_the_same_everywhere() {
        let (default, max) = (
            crate::config::defaults::PAY_WITHIN_SECS,
            MAX_PAY_WITHIN_SECS,
        );
        let migration = include_str!("../../migrations/20261124000001_order_lifecycle.sql");
        assert!(migration.contains(&format!(
            "pay_within_secs integer NOT NULL DEFAULT {default}"
        )));
        assert!(migration.contains(&format!("pay_within_secs BETWEEN 1 AND {max}")));
        let schema =
            serde_json::to_value(<CreateSeckill as utoipa::PartialSchema>::schema()).unwrap();
        let field = &schema["properties"]["pay_within_secs"];
        assert_eq!(field["maximum"], max, "{field}");
        let words = field["description"].as_str().unwrap();
        assert!(
            words.contains(&format!("1 to {max}, default {default}")),
            "{words}"
        );
        assert_eq!(body(valid()).seckill.unwrap().pay_within_secs, default);
    }

    #[test]
    fn a_valid_voucher_passes() {
        let v = body(valid()).validate(Utc::now()).unwrap();
        assert_eq!(v.seckill.unwrap().stock, 5);
    }

    #[test]
    fn out_of_range_values_are_rejected() {
        let cases: Vec<(&str, serde_json::Value)> = vec![
            ("/shop_id", 0.into()),
            ("/shop_id", (-1).into()),
            ("/pay_value", (-1).into()),
            ("/actual_value", (-5).into()),
            ("/title", "".into()),
            ("/title", "   ".into()),
            ("/title", "\u{200B}".into()),
            ("/title", "\u{FEFF}\u{2060}".into()),
            ("/title", " \u{200C}\u{200D}\u{E0041} ".into()),
            ("/pay_value", 3.into()),
            ("/title", "a\u{0}b".into()),
            ("/title", "x".repeat(256).into()),
            ("/rules", "x".repeat(4001).into()),
            ("/sub_title", "\u{200B}".into()),
            ("/sub_title", " ".into()),
            ("/rules", "\u{FEFF}\n".into()),
            ("/seckill/stock", 0.into()),
            ("/seckill/stock", (MAX_STOCK + 1).into()),
            ("/seckill/end_time", "2025-12-31T00:00:00Z".into()),
            ("/seckill/end_time", "2026-01-01T00:00:00Z".into()),
            ("/seckill/begin_time", "-262143-01-01T00:00:00Z".into()),
            ("/seckill/begin_time", "1969-12-31T23:59:59Z".into()),
            ("/seckill/end_time", "+10000-01-01T00:00:00Z".into()),
        ];
        for (pointer, value) in cases {
            let mut json = valid();
            *json.pointer_mut(pointer).unwrap() = value.clone();
            assert!(
                body(json).validate(Utc::now()).is_err(),
                "{pointer} = {value}"
            );
        }
    }

    proptest::proptest! {
        /// Whatever JSON-typed values arrive, validation either refuses them or yields a
        /// voucher that satisfies every constraint the database has.
        #[test]
        fn what_validation_lets_through_fits_the_database(
            shop_id in proptest::prelude::any::<i64>(),
            pay in proptest::prelude::any::<i64>(),
            actual in proptest::prelude::any::<i64>(),
            stock in proptest::prelude::any::<i64>(),
            title in "\\PC{0,300}",
            begin_offset in -100_000i64..100_000,
            length in -100_000i64..100_000,
        ) {
            let now = Utc::now();
            let begin = now + chrono::Duration::seconds(begin_offset);
            let end = begin + chrono::Duration::seconds(length);
            let json = serde_json::json!({"shop_id": shop_id, "title": title, "pay_value": pay,
                "actual_value": actual, "seckill": {"stock": stock, "begin_time": begin, "end_time": end}});
            let Ok(body) = serde_json::from_value::<CreateVoucher>(json) else { return Ok(()) };
            if let Ok(new) = body.validate(now) {
                let v = &new.terms;
                proptest::prop_assert!(v.shop_id > 0 && v.pay_value >= 0 && v.actual_value >= 0);
                proptest::prop_assert!(v.pay_value <= v.actual_value);
                proptest::prop_assert!(!v.title.trim().is_empty() && v.title.chars().count() <= 255);
                proptest::prop_assert!(v.title.chars().any(crate::http::text::is_visible));
                proptest::prop_assert!(!v.title.contains('\0'));
                let s = new.seckill.unwrap();
                proptest::prop_assert!(s.stock >= 1 && s.stock as i64 <= MAX_STOCK);
                proptest::prop_assert!(s.end_time > s.begin_time && s.end_time > now);
            }
        }
    }

    #[test]
    fn an_ended_sale_cannot_be_created() {
        let mut json = valid();
        json["seckill"]["begin_time"] = "2020-01-01T00:00:00Z".into();
        json["seckill"]["end_time"] = "2020-01-02T00:00:00Z".into();
        assert!(body(json).validate(Utc::now()).is_err());
    }
}
