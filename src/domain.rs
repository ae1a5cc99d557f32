//! The service's words, as types: ids that cannot be mixed up or be zero, and an
//! order's status as an enum. Text is parsed into them once, at the edge (a path, a
//! token, a Redis reply, a Postgres row); everything inside trusts them.
//!
//! The bottom layer: it uses nothing else of the crate.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use utoipa::openapi::schema::{KnownFormat, ObjectBuilder, SchemaFormat, Type};
use utoipa::openapi::{RefOr, Schema};

/// Why text is not an id: it must be a positive 64-bit integer written canonically.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("expected a positive 64-bit integer")]
pub struct NotAnId;

/// A positive 64-bit integer, written canonically: digits only, no sign, no leading
/// zero, no spaces. Anything else is not an id (`+1`, `01` and ` 1` would otherwise
/// name the same row as `1` under several spellings).
pub fn parse_id(s: &str) -> Option<i64> {
    let canonical = !s.is_empty()
        && s.len() <= 19
        && s.bytes().all(|b| b.is_ascii_digit())
        && !s.starts_with('0');
    if !canonical {
        return None;
    }
    s.parse::<i64>().ok().filter(|&id| id > 0)
}

/// An id type: a `Copy` newtype over a positive `i64`, bound and decoded by sqlx as
/// `bigint`, passed to and read from Redis as an integer, printed as its digits.
macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, sqlx::Type)]
        #[sqlx(transparent)]
        pub struct $name(i64);

        impl $name {
            /// The id, when it is positive.
            pub fn new(raw: i64) -> Option<Self> {
                (raw > 0).then_some(Self(raw))
            }

            /// The number itself, for arithmetic and foreign formats.
            pub fn get(self) -> i64 {
                self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }

        /// The bare number: spans (`#[tracing::instrument]`) and logs read as before.
        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }

        impl FromStr for $name {
            type Err = NotAnId;
            fn from_str(s: &str) -> Result<Self, NotAnId> {
                parse_id(s).map(Self).ok_or(NotAnId)
            }
        }

        impl TryFrom<i64> for $name {
            type Error = NotAnId;
            fn try_from(raw: i64) -> Result<Self, NotAnId> {
                Self::new(raw).ok_or(NotAnId)
            }
        }

        impl From<$name> for i64 {
            fn from(id: $name) -> i64 {
                id.0
            }
        }

        impl redis::ToRedisArgs for $name {
            fn write_redis_args<W: ?Sized + redis::RedisWrite>(&self, out: &mut W) {
                self.0.write_redis_args(out)
            }
        }

        impl redis::FromRedisValue for $name {
            fn from_redis_value_ref(v: &redis::Value) -> Result<Self, redis::ParsingError> {
                let raw = i64::from_redis_value_ref(v)?;
                Self::new(raw).ok_or_else(|| {
                    format!("{} must be positive, got {raw}", stringify!($name)).into()
                })
            }
            fn from_redis_value(v: redis::Value) -> Result<Self, redis::ParsingError> {
                Self::from_redis_value_ref(&v)
            }
        }
    };
}

id_type!(
    /// A voucher, and its flash sale (a sale is keyed by its voucher).
    VoucherId
);
id_type!(
    /// A shopper: a token's `sub`.
    UserId
);
id_type!(
    /// A shop (only ever read from a path: vouchers carry it as a plain number).
    ShopId
);
id_type!(
    /// An order: minted at admission (time-ordered, see `admission::order_id`), so a
    /// larger id is a later order.
    OrderId
);
id_type!(
    /// Which build of a sale's (segment's) Redis state: drawn from a Postgres sequence by
    /// each build and recorded with it (`sale_epochs`), so a later build has a larger
    /// epoch. Only orders of the current epoch (or carried into it) become rows.
    Epoch
);

/// Voucher and user ids are JSON numbers (they stay below 2^53 in practice).
macro_rules! json_number {
    ($name:ident) => {
        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_i64(self.0)
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let raw = i64::deserialize(d)?;
                Self::new(raw).ok_or_else(|| {
                    serde::de::Error::custom(format!("{raw} is not an id: {NotAnId}"))
                })
            }
        }

        impl utoipa::PartialSchema for $name {
            fn schema() -> RefOr<Schema> {
                ObjectBuilder::new()
                    .schema_type(Type::Integer)
                    .format(Some(SchemaFormat::KnownFormat(KnownFormat::Int64)))
                    .into()
            }
        }

        impl utoipa::ToSchema for $name {}
    };
}

json_number!(VoucherId);
json_number!(UserId);

/// The document's pattern for an order id: the digits of a positive `i64`.
pub const ORDER_ID_PATTERN: &str = "^[1-9][0-9]{0,18}$";

/// Order ids are JSON strings: they are minted above 2^53, where JavaScript's numbers
/// lose digits.
impl Serialize for OrderId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for OrderId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = std::borrow::Cow::<str>::deserialize(d)?;
        raw.parse()
            .map_err(|e| serde::de::Error::custom(format!("`{raw}` is not an order id: {e}")))
    }
}

impl utoipa::PartialSchema for OrderId {
    fn schema() -> RefOr<Schema> {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .pattern(Some(ORDER_ID_PATTERN))
            .into()
    }
}

impl utoipa::ToSchema for OrderId {}

/// What a voucher offers, as its shop published it: the fields every voucher has, in
/// one shape from the validated request through its row to the answer. Money in cents.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct VoucherTerms {
    pub shop_id: i64,
    pub title: String,
    pub sub_title: String,
    pub rules: String,
    /// What the shopper pays, in cents (at most `actual_value`).
    pub pay_value: i64,
    /// What the voucher is worth, in cents.
    pub actual_value: i64,
    /// Whether its owner may ask for a paid, unused coupon's refund.
    pub refundable: bool,
}

/// How a flash sale opens: first come, first served, or a lottery among every shopper
/// who presses in its first `window_ms` after `begin_time`, drawn once when the window
/// is over (`lua/seckill.lua`, draw_lottery); after the window it goes on first come.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(tag = "mode", rename_all = "snake_case")]
pub enum Opening {
    #[default]
    FirstCome,
    Lottery {
        /// The entry window, in milliseconds (100 to 10000).
        window_ms: i64,
    },
}

impl Opening {
    pub const WINDOW_MS: std::ops::RangeInclusive<i64> = 100..=10_000;

    /// As Postgres holds it: the mode's name and a lottery's window.
    pub fn of_row(mode: &str, window_ms: Option<i32>) -> Self {
        match (mode, window_ms) {
            ("lottery", Some(w)) => Opening::Lottery {
                window_ms: i64::from(w),
            },
            _ => Opening::FirstCome,
        }
    }

    pub fn mode(&self) -> &'static str {
        match self {
            Opening::FirstCome => "first_come",
            Opening::Lottery { .. } => "lottery",
        }
    }

    pub fn window_ms(&self) -> Option<i32> {
        match self {
            Opening::FirstCome => None,
            Opening::Lottery { window_ms } => Some(*window_ms as i32),
        }
    }
}

/// A lottery's secret seed: drawn at random when the sale is created, published (hex)
/// only once the draw is done; its SHA-256 (hex) is published at once, so nobody can
/// pick another seed after seeing the entrants.
pub struct DrawSeed(String);

impl DrawSeed {
    pub fn random() -> Self {
        Self(hex::encode(rand::random::<[u8; 32]>()))
    }

    pub fn hex(&self) -> &str {
        &self.0
    }

    /// SHA-256 of the seed's bytes, hex.
    pub fn commitment(&self) -> String {
        let bytes = hex::decode(&self.0).expect("a seed is hex");
        hex::encode(ring::digest::digest(&ring::digest::SHA256, &bytes))
    }
}

/// Where an order is in its life: `pending` while only Redis knows it, `created` once
/// written to Postgres, then `paid` (the payment provider confirmed it), and from there
/// `used` (redeemed at the shop) or `refunding` → `refunded`; an unpaid order ends
/// `cancelled` or `expired`. Postgres holds all but `pending`, as text.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema, sqlx::Type,
)]
#[serde(rename_all = "lowercase")]
#[schema(description = "Where an order is in its life.")]
#[sqlx(type_name = "text", rename_all = "lowercase")]
pub enum OrderStatus {
    Pending,
    Created,
    Paid,
    Used,
    Refunding,
    Refunded,
    Cancelled,
    Expired,
}

impl OrderStatus {
    /// Every status, in the order of an order's life.
    pub const ALL: [OrderStatus; 8] = [
        Self::Pending,
        Self::Created,
        Self::Paid,
        Self::Used,
        Self::Refunding,
        Self::Refunded,
        Self::Cancelled,
        Self::Expired,
    ];

    /// The word the contract, Postgres and the metrics use (and the name of the sale's
    /// counter column of orders in that status, but for `pending` and `created`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Created => "created",
            Self::Paid => "paid",
            Self::Used => "used",
            Self::Refunding => "refunding",
            Self::Refunded => "refunded",
            Self::Cancelled => "cancelled",
            Self::Expired => "expired",
        }
    }

    /// Cancelled or expired: it was never paid, and its unit went back on sale.
    pub fn is_closed(self) -> bool {
        matches!(self, Self::Cancelled | Self::Expired)
    }

    /// Nothing more happens to it: used, refunded, or closed.
    pub fn is_final(self) -> bool {
        matches!(self, Self::Used | Self::Refunded) || self.is_closed()
    }
}

/// Why an order's money goes back.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema, sqlx::Type,
)]
#[serde(rename_all = "snake_case")]
#[sqlx(type_name = "text", rename_all = "snake_case")]
pub enum RefundReason {
    /// Its owner asked (the voucher is refundable).
    Requested,
    /// The payment came after the order had closed (its unit back on sale).
    LatePayment,
    /// An administrator refunded it.
    Admin,
}

impl RefundReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Requested => "requested",
            Self::LatePayment => "late_payment",
            Self::Admin => "admin",
        }
    }
}

/// How an order was paid.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema, sqlx::Type,
)]
#[serde(rename_all = "lowercase")]
#[sqlx(type_name = "text", rename_all = "lowercase")]
pub enum PayType {
    /// The payment provider's signed notification confirmed it.
    Provider,
    /// An administrator marked it paid by hand, with a reason.
    Manual,
}

/// The one currency prices are in (amounts are in its cents).
pub const CURRENCY: &str = "CNY";

/// A paid coupon's redemption code: 16 characters of Crockford's base32 (80 random
/// bits), shown only to its owner, typed or scanned at the shop.
#[derive(Clone, PartialEq, Eq)]
pub struct RedeemCode(String);

impl RedeemCode {
    const ALPHABET: &'static [u8; 32] = b"0123456789ABCDEFGHJKMNPQRSTVWXYZ";
    const LEN: usize = 16;

    /// A new code from the operating system's random source.
    pub fn generate() -> Self {
        use rand::Rng;
        let mut rng = rand::rng();
        Self(
            (0..Self::LEN)
                .map(|_| Self::ALPHABET[rng.random_range(0..32)] as char)
                .collect(),
        )
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether `typed` is this code, compared in constant time (case and dashes do not
    /// matter: staff may type `abcd-efgh-…`).
    pub fn matches(&self, typed: &str) -> bool {
        let typed: Vec<u8> = typed
            .bytes()
            .filter(|&b| b != b'-' && b != b' ')
            .map(|b| b.to_ascii_uppercase())
            .collect();
        let diff = (self.0.bytes().zip(&typed)).fold(0u8, |acc, (a, &b)| acc | (a ^ b));
        typed.len() == self.0.len() && diff == 0
    }
}

impl From<String> for RedeemCode {
    fn from(stored: String) -> Self {
        Self(stored)
    }
}

/// Never printed whole in logs.
impl fmt::Debug for RedeemCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RedeemCode(***)")
    }
}

impl fmt::Display for OrderStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for OrderStatus {
    type Err = UnknownStatus;
    fn from_str(s: &str) -> Result<Self, UnknownStatus> {
        Self::ALL
            .into_iter()
            .find(|status| status.as_str() == s)
            .ok_or(UnknownStatus)
    }
}

/// Text that names no [`OrderStatus`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not an order status")]
pub struct UnknownStatus;

#[cfg(test)]
mod tests {
    use super::*;
    use redis::{FromRedisValue, ToRedisArgs};

    #[test]
    fn an_order_id_is_a_string_in_json() {
        let id: OrderId = "9007199254740993".parse().unwrap();
        assert_eq!(serde_json::to_string(&id).unwrap(), r#""9007199254740993""#);
        let back: OrderId = serde_json::from_str(r#""9007199254740993""#).unwrap();
        assert_eq!(back, id);
        assert!(serde_json::from_str::<OrderId>("9007199254740993").is_err());
        assert!(serde_json::from_str::<OrderId>(r#""0""#).is_err());
    }

    #[test]
    fn voucher_and_user_ids_are_numbers_in_json() {
        let voucher = VoucherId::new(7).unwrap();
        let user = UserId::new(42).unwrap();
        assert_eq!(serde_json::to_string(&voucher).unwrap(), "7");
        assert_eq!(serde_json::to_string(&user).unwrap(), "42");
        assert_eq!(serde_json::from_str::<VoucherId>("7").unwrap(), voucher);
        assert!(serde_json::from_str::<UserId>("0").is_err());
        assert!(serde_json::from_str::<UserId>("-3").is_err());
        assert!(serde_json::from_str::<UserId>(r#""42""#).is_err());
    }

    /// Texts that are no id: empty, zero, signed, padded, not decimal, too large.
    const NOT_IDS: [&str; 13] = [
        "",
        "0",
        "-1",
        "+1",
        "01",
        " 1",
        "1 ",
        "1.0",
        "1e3",
        "abc",
        "9223372036854775808",
        "99999999999999999999",
        "１",
    ];

    #[test]
    fn ids_are_parsed_strictly() {
        assert_eq!(parse_id("1"), Some(1));
        assert_eq!(parse_id("9223372036854775807"), Some(i64::MAX));
        for bad in NOT_IDS {
            assert_eq!(parse_id(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn zero_and_signs_are_not_ids() {
        for bad in NOT_IDS {
            assert_eq!(bad.parse::<OrderId>(), Err(NotAnId), "{bad:?}");
            assert_eq!(bad.parse::<VoucherId>(), Err(NotAnId), "{bad:?}");
        }
        assert_eq!(VoucherId::new(0), None);
        assert_eq!(UserId::new(-1), None);
    }

    proptest::proptest! {
        /// Every positive i64 written canonically parses back to itself.
        #[test]
        fn canonical_ids_round_trip(id in 1i64..=i64::MAX) {
            proptest::prop_assert_eq!(parse_id(&id.to_string()), Some(id));
        }

        /// Whatever the input, the answer is either None or a positive id that prints back
        /// as exactly the input: no lenient parse slips through.
        #[test]
        fn anything_parsed_is_canonical(s in "\\PC{0,24}") {
            if let Some(id) = parse_id(&s) {
                proptest::prop_assert!(id > 0);
                proptest::prop_assert_eq!(id.to_string(), s);
            }
        }
    }

    #[test]
    fn the_largest_id_parses_and_prints_back() {
        let id: OrderId = "9223372036854775807".parse().unwrap();
        assert_eq!(id.get(), i64::MAX);
        assert_eq!(id.to_string(), "9223372036854775807");
    }

    #[test]
    fn ids_go_to_redis_as_integers_and_come_back() {
        let id = VoucherId::new(12).unwrap();
        assert_eq!(id.to_redis_args(), 12i64.to_redis_args());
        let back = VoucherId::from_redis_value(redis::Value::BulkString(b"12".to_vec())).unwrap();
        assert_eq!(back, id);
        assert_eq!(
            OrderId::from_redis_value(redis::Value::Int(5)).unwrap(),
            OrderId::new(5).unwrap()
        );
        assert!(OrderId::from_redis_value(redis::Value::Int(0)).is_err());
        assert!(UserId::from_redis_value(redis::Value::Int(-4)).is_err());
    }

    #[test]
    fn a_status_round_trips_through_its_text() {
        for status in OrderStatus::ALL {
            let json = serde_json::to_string(&status).unwrap();
            assert_eq!(json, format!("\"{}\"", status.as_str()));
            assert_eq!(serde_json::from_str::<OrderStatus>(&json).unwrap(), status);
            assert_eq!(status.as_str().parse::<OrderStatus>(), Ok(status));
        }
        assert_eq!("Paid".parse::<OrderStatus>(), Err(UnknownStatus));
    }

    #[test]
    fn only_cancelled_and_expired_are_closed_and_used_or_refunded_are_final() {
        let closed: Vec<_> = OrderStatus::ALL
            .into_iter()
            .filter(|s| s.is_closed())
            .collect();
        assert_eq!(closed, [OrderStatus::Cancelled, OrderStatus::Expired]);
        let done: Vec<_> = OrderStatus::ALL
            .into_iter()
            .filter(|s| s.is_final())
            .collect();
        assert_eq!(
            done,
            [
                OrderStatus::Used,
                OrderStatus::Refunded,
                OrderStatus::Cancelled,
                OrderStatus::Expired
            ]
        );
    }

    #[test]
    fn the_documented_schemas_are_those_of_the_contract() {
        use utoipa::PartialSchema;
        let order = serde_json::to_value(OrderId::schema()).unwrap();
        assert_eq!(order["type"], "string");
        assert_eq!(order["pattern"], ORDER_ID_PATTERN);
        let voucher = serde_json::to_value(VoucherId::schema()).unwrap();
        assert_eq!(voucher["type"], "integer");
        assert_eq!(voucher["format"], "int64");
    }
}
