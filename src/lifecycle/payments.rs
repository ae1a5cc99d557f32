//! Payments confirmed by the payment provider, never by the shopper: its notification
//! (`POST /payments/notifications`), signed ([`super::signature`]), is parsed here and
//! applied once ([`store::payments`]). A payment that arrives after its order closed is
//! kept and sent to `refunding`; one for an order not written yet waits for it (the
//! sweeper applies it, [`settle_awaiting`]).

use redis::aio::ConnectionLike;
use serde::Deserialize;
use sqlx::PgPool;

use crate::domain::OrderId;
use crate::keys::Keys;
use crate::metrics::PAYMENT_NOTIFICATIONS;
use crate::scripts::Replicas;
use crate::store::payments::{self, Event, Kind, Received};

/// The longest event id and transaction id accepted (the provider's own ids).
const MAX_ID: usize = 128;

/// A notification's body, as the provider sends it.
#[derive(Debug, Deserialize)]
struct Body {
    id: String,
    #[serde(rename = "type")]
    kind: Kind,
    order_id: OrderId,
    amount: i64,
    currency: String,
    transaction_id: String,
}

/// Why a (correctly signed) body is not a notification: the message says which field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Malformed(pub String);

/// Parses a notification's raw body (after its signature held).
pub fn parse(raw: &[u8]) -> Result<Event, Malformed> {
    let body: Body = serde_json::from_slice(raw).map_err(|e| {
        Malformed(format!(
            "the notification must be JSON {{\"id\", \"type\": \"payment.succeeded\" | \
             \"refund.succeeded\", \"order_id\": \"<digits>\", \"amount\": <cents>, \
             \"currency\", \"transaction_id\"}}: {e}"
        ))
    })?;
    let id_ok =
        |s: &str| !s.is_empty() && s.len() <= MAX_ID && s.bytes().all(|b| b.is_ascii_graphic());
    if !id_ok(&body.id) {
        return Err(Malformed(format!(
            "id must be 1 to {MAX_ID} visible ASCII characters"
        )));
    }
    if !id_ok(&body.transaction_id) {
        return Err(Malformed(format!(
            "transaction_id must be 1 to {MAX_ID} visible ASCII characters"
        )));
    }
    if body.amount < 0 {
        return Err(Malformed("amount must be cents: zero or more".into()));
    }
    if body.currency.len() != 3 || !body.currency.bytes().all(|b| b.is_ascii_uppercase()) {
        return Err(Malformed(
            "currency must be an ISO 4217 code, like CNY".into(),
        ));
    }
    Ok(Event {
        event_id: body.id,
        kind: body.kind,
        order_id: body.order_id,
        transaction_id: body.transaction_id,
        amount: body.amount,
        currency: body.currency,
    })
}

/// Records and applies a notification; a unit that went back on sale now is released
/// in Redis (or left owed to the sweeper).
pub async fn receive<C: ConnectionLike + Send>(
    db: &PgPool,
    conn: &mut C,
    keys: &Keys,
    replicas: Replicas,
    event: &Event,
) -> anyhow::Result<Received> {
    let received = payments::receive(db, event).await?;
    if !received.replay {
        settled(db, conn, keys, replicas, &received).await;
    }
    Ok(received)
}

/// Applies the payments that waited for their order, now written (or dead-lettered).
pub async fn settle_awaiting<C: ConnectionLike + Send>(
    db: &PgPool,
    conn: &mut C,
    keys: &Keys,
    replicas: Replicas,
    limit: i64,
) -> anyhow::Result<usize> {
    let settled = payments::settle_awaiting(db, limit, None).await?;
    for received in &settled {
        self::settled(db, conn, keys, replicas, received).await;
    }
    Ok(settled.len())
}

/// Applies the payments that waited for `order_id`, now written: a request about the
/// order (checkout, cancel) sees it as its payment left it, not as the sweeper's next
/// round will. Returns how many were applied here.
pub async fn settle_waiting_for<C: ConnectionLike + Send>(
    db: &PgPool,
    conn: &mut C,
    keys: &Keys,
    replicas: Replicas,
    order_id: OrderId,
) -> anyhow::Result<usize> {
    let settled = payments::settle_awaiting(db, 8, Some(order_id)).await?;
    for received in &settled {
        self::settled(db, conn, keys, replicas, received).await;
    }
    Ok(settled.len())
}

/// Counts what a notification did, and makes the release of a unit it gave back.
async fn settled<C: ConnectionLike + Send>(
    db: &PgPool,
    conn: &mut C,
    keys: &Keys,
    replicas: Replicas,
    received: &Received,
) {
    metrics::counter!(PAYMENT_NOTIFICATIONS, "outcome" => received.outcome.as_str()).increment(1);
    if let Some(row) = &received.order {
        if received.outcome.moves_order() {
            super::count(row, received.release.is_some());
        }
        if received.release.is_some() {
            super::release_now(db, conn, keys, replicas, row).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_payment_notification_parses() {
        let raw = br#"{"id":"evt_1","type":"payment.succeeded","order_id":"42","amount":990,"currency":"CNY","transaction_id":"tx_1"}"#;
        let event = parse(raw).unwrap();
        assert_eq!(event.kind, Kind::Payment);
        assert_eq!(event.order_id.get(), 42);
        assert_eq!(event.amount, 990);
    }

    #[test]
    fn malformed_notifications_say_what_is_wrong() {
        for (raw, says) in [
            (
                r#"{"id":"e","type":"payment.failed","order_id":"1","amount":1,"currency":"CNY","transaction_id":"t"}"#,
                "payment.succeeded",
            ),
            (
                r#"{"id":"e","type":"payment.succeeded","order_id":"01","amount":1,"currency":"CNY","transaction_id":"t"}"#,
                "order id",
            ),
            (
                r#"{"id":"","type":"payment.succeeded","order_id":"1","amount":1,"currency":"CNY","transaction_id":"t"}"#,
                "id must be",
            ),
            (
                r#"{"id":"e","type":"payment.succeeded","order_id":"1","amount":-1,"currency":"CNY","transaction_id":"t"}"#,
                "amount",
            ),
            (
                r#"{"id":"e","type":"payment.succeeded","order_id":"1","amount":1,"currency":"cny","transaction_id":"t"}"#,
                "currency",
            ),
            (
                r#"{"id":"e","type":"payment.succeeded","order_id":"1","amount":1,"currency":"CNY","transaction_id":"t x"}"#,
                "transaction_id",
            ),
        ] {
            let err = parse(raw.as_bytes()).unwrap_err();
            assert!(err.0.contains(says), "{raw}: {err}");
        }
    }
}
