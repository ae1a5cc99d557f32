//! The JSON an order is shown as, and the bodies of the moves on it.

use super::*;

#[derive(Debug, Serialize, Deserialize, ToSchema)]
// Every field is always sent (`null` when it does not apply): required, so that
// generated clients read it as always present.
pub(crate) struct OrderResponse {
    /// 64-bit, as a string.
    #[schema(value_type = String, pattern = "^[1-9][0-9]{0,18}$")]
    pub order_id: OrderId,
    #[schema(inline)]
    pub voucher_id: VoucherId,
    #[schema(inline)]
    pub user_id: UserId,
    /// `pending` until the worker has written it to Postgres, then `created`; `paid`
    /// once the payment provider confirmed payment, then `used` (redeemed at the shop)
    /// or `refunding` → `refunded`; an unpaid order ends `cancelled` or `expired`.
    #[schema(example = "created")]
    pub status: OrderStatus,
    /// When the order was written to Postgres (Postgres's clock); a pending order
    /// shows its admission.
    pub created_at: DateTime<Utc>,
    /// Payment deadline: `created_at` + the sale's `pay_within_secs`. An unpaid order
    /// expires within a few seconds after it.
    #[schema(required = true)]
    pub pay_before: Option<DateTime<Utc>>,
    #[schema(required = true)]
    pub paid_at: Option<DateTime<Utc>>,
    /// When it gave its unit back on sale: cancelled, expired, or refunded while its
    /// sale was open.
    #[schema(required = true)]
    pub closed_at: Option<DateTime<Utc>>,
    /// When its shop redeemed it.
    #[schema(required = true)]
    pub used_at: Option<DateTime<Utc>>,
    /// When the provider confirmed its refund.
    #[schema(required = true)]
    pub refunded_at: Option<DateTime<Utc>>,
    /// Why its money goes (went) back, once `refunding`.
    #[schema(required = true)]
    pub refund_reason: Option<RefundReason>,
    /// How it was paid, once paid.
    #[schema(required = true)]
    pub payment: Option<PaymentView>,
    /// The code its shop redeems it with: shown to its owner only, while it is `paid`.
    #[schema(required = true)]
    pub redeem_code: Option<String>,
}

/// How an order was paid.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
// (Every field always sent, as in `OrderResponse`.)
pub(crate) struct PaymentView {
    /// `provider` (the payment provider's notification) or `manual` (an administrator).
    pub provider: PayType,
    /// The provider's transaction.
    #[schema(required = true)]
    pub transaction_id: Option<String>,
    /// Cents paid, and their currency.
    #[schema(required = true)]
    pub amount: Option<i64>,
    #[schema(required = true)]
    pub currency: Option<String>,
    /// Why an administrator marked it paid.
    #[schema(required = true)]
    pub reason: Option<String>,
}

impl From<OrderRow> for OrderResponse {
    /// As anyone allowed to see the order sees it: without its redemption code.
    fn from(row: OrderRow) -> Self {
        Self {
            order_id: row.id,
            voucher_id: row.voucher_id,
            user_id: row.user_id,
            status: row.status,
            created_at: row.created_at,
            pay_before: Some(row.pay_before),
            paid_at: row.paid_at,
            closed_at: row.closed_at,
            used_at: row.used_at,
            refunded_at: row.refunded_at,
            refund_reason: row.refund_reason,
            payment: row.pay_type.map(|provider| PaymentView {
                provider,
                transaction_id: row.transaction_id,
                amount: row.paid_amount,
                currency: row.paid_currency,
                reason: row.pay_reason,
            }),
            redeem_code: None,
        }
    }
}

impl OrderResponse {
    /// The order as `caller` sees it: its owner sees the redemption code of a paid one.
    pub(crate) fn for_caller(row: OrderRow, caller: &AuthUser) -> Self {
        let code = (row.user_id == caller.user_id && row.status == OrderStatus::Paid)
            .then(|| row.redeem_code.clone())
            .flatten();
        Self {
            redeem_code: code,
            ..row.into()
        }
    }

    /// A pending order; `pay_within_secs` is its sale's payment window, if known.
    pub(super) fn pending(p: PendingOrder, pay_within_secs: Option<i32>) -> Self {
        let created_at = DateTime::from_timestamp_millis(p.admitted_ms).unwrap_or_default();
        Self {
            order_id: p.order_id,
            voucher_id: p.voucher_id,
            user_id: p.user_id,
            status: OrderStatus::Pending,
            created_at,
            pay_before: pay_within_secs.map(|s| created_at + chrono::Duration::seconds(s.into())),
            paid_at: None,
            closed_at: None,
            used_at: None,
            refunded_at: None,
            refund_reason: None,
            payment: None,
            redeem_code: None,
        }
    }
}

/// Body of an administrator's `POST /orders/{order_id}/pay`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ManualPayment {
    /// Why the order is marked paid by hand (recorded): 1 to 256 characters, at least
    /// one of them visible.
    #[schema(min_length = 1, max_length = 256)]
    pub reason: String,
}

pub(super) const MAX_PAY_REASON: usize = 256;

/// Body of `POST /orders/{order_id}/redeem`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct RedeemOrder {
    /// The coupon's `redeem_code`, as its owner shows it (case and dashes do not matter).
    #[schema(min_length = 1, max_length = 64)]
    pub code: String,
}

/// What a client hands to the payment provider.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Checkout {
    #[schema(value_type = String, pattern = "^[1-9][0-9]{0,18}$")]
    pub order_id: OrderId,
    /// The voucher's `pay_value`, in cents.
    pub amount: i64,
    #[schema(example = "CNY")]
    pub currency: &'static str,
    /// The provider must confirm payment before this; a payment after it is refunded.
    pub pay_before: DateTime<Utc>,
}
