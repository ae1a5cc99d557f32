//! `payment_events`: every notification of the payment provider whose signature held,
//! and what it did to its order. A payment is money: none is dropped. Each is recorded
//! in the transaction that applies it, so a replay (the same event id, or the same
//! provider transaction under another id, for the same order) finds it and changes
//! nothing. Each id is a key of what it names: a notification whose ids are recorded
//! for another order is refused and kept (`id_conflict`), never answered as a replay;
//! one refused for its amount keeps no hold on its transaction.
//!
//! Locks: the event's row (inserted, or taken by the settler), then the order's, then
//! the sale's ([`super::lifecycle`]'s order).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::{PgPool, Postgres, Transaction};

use super::lifecycle::{self, Payment, Release};
use super::orders::OrderRow;
use crate::domain::{OrderId, OrderStatus, VoucherId, CURRENCY};

/// What the provider tells.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, sqlx::Type, utoipa::ToSchema,
)]
#[sqlx(type_name = "text")]
pub enum Kind {
    /// The shopper paid the order.
    #[serde(rename = "payment.succeeded")]
    #[sqlx(rename = "payment.succeeded")]
    Payment,
    /// The money of a `refunding` order went back.
    #[serde(rename = "refund.succeeded")]
    #[sqlx(rename = "refund.succeeded")]
    Refund,
}

/// What a notification did (recorded with it, answered to the provider, counted).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, sqlx::Type, utoipa::ToSchema,
)]
#[serde(rename_all = "snake_case")]
#[sqlx(type_name = "text", rename_all = "snake_case")]
pub enum Outcome {
    /// The order is paid now.
    Paid,
    /// The order had closed (its unit back on sale): it is `refunding` now, reason
    /// `late_payment`; no unit was taken again.
    LatePayment,
    /// The order was paid already, by another transaction: this money must go back.
    AlreadyPaid,
    /// Refused: the amount or currency is not the order's price (the order unchanged).
    AmountMismatch,
    /// No such order in Postgres yet (still pending, or unknown): applied once written.
    AwaitingOrder,
    /// The order will never exist (dead-lettered): this money must go back.
    NoOrder,
    /// The refund is confirmed: the order is `refunded`.
    Refunded,
    /// Refused: a refund for an order that is not `refunding` (the order unchanged).
    NotRefunding,
    /// Refused: its transaction (or its event id) is recorded for another order, or its
    /// event id for another notification. Kept, nothing applied: the provider and the
    /// operators must tell which is right.
    IdConflict,
}

impl Outcome {
    pub const ALL: [Outcome; 9] = [
        Self::Paid,
        Self::LatePayment,
        Self::AlreadyPaid,
        Self::AmountMismatch,
        Self::AwaitingOrder,
        Self::NoOrder,
        Self::Refunded,
        Self::NotRefunding,
        Self::IdConflict,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Paid => "paid",
            Self::LatePayment => "late_payment",
            Self::AlreadyPaid => "already_paid",
            Self::AmountMismatch => "amount_mismatch",
            Self::AwaitingOrder => "awaiting_order",
            Self::NoOrder => "no_order",
            Self::Refunded => "refunded",
            Self::NotRefunding => "not_refunding",
            Self::IdConflict => "id_conflict",
        }
    }

    /// It moved its order.
    pub fn moves_order(self) -> bool {
        matches!(self, Self::Paid | Self::LatePayment | Self::Refunded)
    }

    /// Money the provider holds for us that must go back to the shopper, with no order
    /// to carry the refund (operators list these).
    pub fn owes_money_back(self) -> bool {
        matches!(
            self,
            Self::AlreadyPaid | Self::NoOrder | Self::AmountMismatch
        )
    }
}

/// A notification whose signature held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub event_id: String,
    pub kind: Kind,
    pub order_id: OrderId,
    pub transaction_id: String,
    pub amount: i64,
    pub currency: String,
}

/// What receiving a notification did.
#[derive(Debug, Clone)]
pub struct Received {
    pub outcome: Outcome,
    /// Recorded before: this one changed nothing.
    pub replay: bool,
    /// The order as this notification left it, if it exists.
    pub order: Option<OrderRow>,
    /// A unit that went back on sale now (an order found past its deadline, or a refund
    /// while the sale is open): its release is owed to Redis.
    pub release: Option<Release>,
    /// With [`Outcome::IdConflict`]: the notification recorded first under its ids.
    pub conflicts_with: Option<Conflict>,
}

/// The notification that holds the ids a refused one carried.
#[derive(Debug, Clone)]
pub struct Conflict {
    pub event_id: String,
    pub order_id: OrderId,
    /// It holds the event id (else the transaction).
    pub same_event: bool,
}

/// Records and applies one notification, once: a replay answers what the first did; a
/// notification whose event id or transaction is recorded for another order (see
/// [`Recorded::names`]) is refused as [`Outcome::IdConflict`] and kept, once.
#[tracing::instrument(skip(db), fields(event = %event.event_id, order = %event.order_id))]
pub(crate) async fn receive(db: &PgPool, event: &Event) -> Result<Received, sqlx::Error> {
    let mut tx = db.begin().await?;
    // First: a concurrent copy waits here for this one's commit, then finds it.
    let new: Option<i64> = sqlx::query_scalar(
        "INSERT INTO payment_events \
           (event_id, kind, order_id, transaction_id, amount, currency, outcome) \
         VALUES ($1, $2, $3, $4, $5, $6, 'received') ON CONFLICT DO NOTHING RETURNING seq",
    )
    .bind(&event.event_id)
    .bind(event.kind)
    .bind(event.order_id)
    .bind(&event.transaction_id)
    .bind(event.amount)
    .bind(&event.currency)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(seq) = new else {
        tx.rollback().await?;
        return replay(db, event).await;
    };
    let applied = apply(&mut tx, event, None).await?;
    record(&mut tx, seq, applied.outcome).await?;
    tx.commit().await?;
    Ok(applied)
}

/// A notification recorded before under the event id or transaction of a new one.
#[derive(Debug, sqlx::FromRow)]
struct Recorded {
    event_id: String,
    kind: Kind,
    order_id: OrderId,
    transaction_id: String,
    amount: i64,
    currency: String,
    outcome: Outcome,
}

impl Recorded {
    /// Whether `event` is this notification again (a replay) rather than another one
    /// under its ids: an event id names one notification (all of it), a transaction
    /// one order.
    fn names(&self, event: &Event) -> bool {
        if self.event_id == event.event_id {
            (
                self.kind,
                self.order_id,
                &self.transaction_id,
                self.amount,
                &self.currency,
            ) == (
                event.kind,
                event.order_id,
                &event.transaction_id,
                event.amount,
                &event.currency,
            )
        } else {
            self.order_id == event.order_id
        }
    }
}

/// The answer to a notification whose event id or transaction is recorded: the first
/// one's (a replay), or [`Outcome::IdConflict`] when they name another order.
async fn replay(db: &PgPool, event: &Event) -> Result<Received, sqlx::Error> {
    let first: Option<Recorded> = sqlx::query_as(
        "SELECT event_id, kind, order_id, transaction_id, amount, currency, outcome \
         FROM payment_events \
         WHERE outcome <> 'id_conflict' AND (event_id = $1 \
           OR (kind = $2 AND transaction_id = $3 AND outcome <> 'amount_mismatch')) \
         ORDER BY event_id = $1 DESC LIMIT 1",
    )
    .bind(&event.event_id)
    .bind(event.kind)
    .bind(&event.transaction_id)
    .fetch_optional(db)
    .await?;
    let first = match first {
        Some(first) => first,
        // What stood in the way was refused for its amount meanwhile: judged afresh.
        None => return Box::pin(receive(db, event)).await,
    };
    if !first.names(event) {
        return conflict(db, event, &first).await;
    }
    Ok(Received {
        outcome: first.outcome,
        replay: true,
        order: super::orders::get(db, event.order_id).await?,
        release: None,
        conflicts_with: None,
    })
}

/// Keeps a notification whose ids another order's notification holds (once per event
/// id), its order unchanged.
async fn conflict(db: &PgPool, event: &Event, first: &Recorded) -> Result<Received, sqlx::Error> {
    let kept: Option<i64> = sqlx::query_scalar(
        "INSERT INTO payment_events \
           (event_id, kind, order_id, transaction_id, amount, currency, outcome, settled_at) \
         VALUES ($1, $2, $3, $4, $5, $6, 'id_conflict', now()) \
         ON CONFLICT DO NOTHING RETURNING seq",
    )
    .bind(&event.event_id)
    .bind(event.kind)
    .bind(event.order_id)
    .bind(&event.transaction_id)
    .bind(event.amount)
    .bind(&event.currency)
    .fetch_optional(db)
    .await?;
    Ok(Received {
        outcome: Outcome::IdConflict,
        replay: kept.is_none(),
        order: None,
        release: None,
        conflicts_with: Some(Conflict {
            event_id: first.event_id.clone(),
            order_id: first.order_id,
            same_event: first.event_id == event.event_id,
        }),
    })
}

async fn record(
    tx: &mut Transaction<'_, Postgres>,
    seq: i64,
    outcome: Outcome,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE payment_events SET outcome = $2, \
           settled_at = CASE WHEN $2 = 'awaiting_order' THEN NULL ELSE now() END \
         WHERE seq = $1",
    )
    .bind(seq)
    .bind(outcome)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Decides and applies a notification to its order, under the order's lock. A payment
/// is in time if it was received before the order's deadline: `received_at` for one
/// that waited for its order, now for one just received.
async fn apply(
    tx: &mut Transaction<'_, Postgres>,
    event: &Event,
    received_at: Option<DateTime<Utc>>,
) -> Result<Received, sqlx::Error> {
    let found: Option<(OrderStatus, VoucherId, i64, Option<i64>, bool)> = sqlx::query_as(
        "SELECT o.status, o.voucher_id, v.pay_value, o.paid_amount, \
           o.pay_before <= coalesce($2, now()) \
         FROM voucher_orders o JOIN vouchers v ON v.id = o.voucher_id \
         WHERE o.id = $1 FOR UPDATE OF o",
    )
    .bind(event.order_id)
    .bind(received_at)
    .fetch_optional(&mut **tx)
    .await?;
    let done = |outcome, order, release| Received {
        outcome,
        replay: false,
        order,
        release,
        conflicts_with: None,
    };
    let Some((status, voucher_id, price, paid_amount, due)) = found else {
        let outcome = match event.kind {
            Kind::Refund => Outcome::NotRefunding,
            Kind::Payment if buried(tx, event.order_id).await? => Outcome::NoOrder,
            Kind::Payment => Outcome::AwaitingOrder,
        };
        return Ok(done(outcome, None, None));
    };
    let payment = Payment::Provider {
        transaction_id: &event.transaction_id,
        amount: event.amount,
        currency: &event.currency,
    };
    match event.kind {
        Kind::Payment if event.amount != price || event.currency != CURRENCY => Ok(done(
            Outcome::AmountMismatch,
            as_is(tx, event.order_id).await?,
            None,
        )),
        Kind::Payment => match status {
            OrderStatus::Created if !due => {
                let row = lifecycle::pay_locked(tx, event.order_id, voucher_id, payment).await?;
                Ok(done(Outcome::Paid, Some(row), None))
            }
            OrderStatus::Created => {
                // Past its deadline, not yet swept: it expires now (its unit back),
                // and the money is owed back like any late payment's.
                let mut released =
                    lifecycle::close_rows(tx, &[event.order_id], OrderStatus::Expired).await?;
                let row = lifecycle::pay_late(
                    tx,
                    event.order_id,
                    voucher_id,
                    OrderStatus::Expired,
                    payment,
                )
                .await?;
                Ok(done(Outcome::LatePayment, Some(row), released.pop()))
            }
            s if s.is_closed() => {
                let row = lifecycle::pay_late(tx, event.order_id, voucher_id, s, payment).await?;
                Ok(done(Outcome::LatePayment, Some(row), None))
            }
            _ => Ok(done(
                Outcome::AlreadyPaid,
                as_is(tx, event.order_id).await?,
                None,
            )),
        },
        Kind::Refund if status != OrderStatus::Refunding => Ok(done(
            Outcome::NotRefunding,
            as_is(tx, event.order_id).await?,
            None,
        )),
        Kind::Refund if Some(event.amount) != paid_amount || event.currency != CURRENCY => {
            Ok(done(
                Outcome::AmountMismatch,
                as_is(tx, event.order_id).await?,
                None,
            ))
        }
        Kind::Refund => {
            let (row, release) = lifecycle::refunded(tx, event.order_id, voucher_id).await?;
            Ok(done(Outcome::Refunded, Some(row), release))
        }
    }
}

async fn as_is(
    tx: &mut Transaction<'_, Postgres>,
    order_id: OrderId,
) -> Result<Option<OrderRow>, sqlx::Error> {
    super::orders::get(&mut **tx, order_id).await
}

/// Whether the order was dead-lettered: it will never be written.
async fn buried(
    tx: &mut Transaction<'_, Postgres>,
    order_id: OrderId,
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM dead_orders WHERE id = $1)")
        .bind(order_id)
        .fetch_one(&mut **tx)
        .await
}

/// A payment waiting for its order.
#[derive(sqlx::FromRow)]
struct Waiting {
    seq: i64,
    event_id: String,
    order_id: OrderId,
    transaction_id: String,
    amount: i64,
    currency: String,
    received_at: DateTime<Utc>,
}

/// Applies up to `limit` payments that were waiting for their order (`order`'s only, if
/// given), now written (or dead-lettered); rows another settler holds are skipped (or,
/// for one order's, waited for).
#[tracing::instrument(skip(db))]
pub(crate) async fn settle_awaiting(
    db: &PgPool,
    limit: i64,
    order: Option<OrderId>,
) -> Result<Vec<Received>, sqlx::Error> {
    let mut tx = db.begin().await?;
    let waiting: Vec<Waiting> = sqlx::query_as(&format!(
        "SELECT e.seq, e.event_id, e.order_id, e.transaction_id, e.amount, e.currency, \
               e.received_at \
             FROM payment_events e \
             WHERE e.outcome = 'awaiting_order' AND ($2::int8 IS NULL OR e.order_id = $2) \
               AND (EXISTS (SELECT 1 FROM voucher_orders o WHERE o.id = e.order_id) \
                    OR EXISTS (SELECT 1 FROM dead_orders d WHERE d.id = e.order_id)) \
             ORDER BY e.received_at LIMIT $1 FOR UPDATE OF e {}",
        // One order's: waits for a settler that holds them, so the caller then sees
        // the order as they left it.
        if order.is_some() { "" } else { "SKIP LOCKED" }
    ))
    .bind(limit)
    .bind(order)
    .fetch_all(&mut *tx)
    .await?;
    let mut settled = Vec::with_capacity(waiting.len());
    for w in waiting {
        let event = Event {
            event_id: w.event_id,
            kind: Kind::Payment,
            order_id: w.order_id,
            transaction_id: w.transaction_id,
            amount: w.amount,
            currency: w.currency,
        };
        let applied = apply(&mut tx, &event, Some(w.received_at)).await?;
        record(&mut tx, w.seq, applied.outcome).await?;
        settled.push(applied);
    }
    tx.commit().await?;
    Ok(settled)
}

/// One recorded notification, as operators list them (`GET /payments`).
#[derive(Debug, Clone, sqlx::FromRow, Serialize, utoipa::ToSchema)]
#[schema(as = PaymentEvent)]
pub struct EventRow {
    /// The list's cursor.
    #[serde(skip)]
    pub seq: i64,
    pub event_id: String,
    #[serde(rename = "type")]
    pub kind: Kind,
    #[schema(value_type = String, pattern = "^[1-9][0-9]{0,18}$")]
    pub order_id: OrderId,
    pub transaction_id: String,
    pub amount: i64,
    pub currency: String,
    pub outcome: Outcome,
    pub received_at: DateTime<Utc>,
    /// When it was applied (`null` while `awaiting_order`).
    pub settled_at: Option<DateTime<Utc>>,
}

/// Whether `seq` is a recorded notification's (a cursor of the list).
pub(crate) async fn recorded(db: &PgPool, seq: i64) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM payment_events WHERE seq = $1)")
        .bind(seq)
        .fetch_one(db)
        .await
}

/// A page of recorded notifications, newest first, of these outcomes if given; `after`
/// is the `seq` of the previous page's last (see [`recorded`]).
#[tracing::instrument(skip(db))]
pub(crate) async fn page(
    db: &PgPool,
    outcomes: Option<&[Outcome]>,
    after: Option<i64>,
    limit: i64,
) -> Result<Vec<EventRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT seq, event_id, kind, order_id, transaction_id, amount, currency, outcome, \
           received_at, settled_at \
         FROM payment_events \
         WHERE ($1::text[] IS NULL OR outcome = ANY($1)) \
           AND ($2::int8 IS NULL OR (received_at, seq) < \
                (SELECT received_at, seq FROM payment_events WHERE seq = $2)) \
         ORDER BY received_at DESC, seq DESC LIMIT $3",
    )
    .bind(outcomes.map(|o| o.iter().map(|o| o.as_str()).collect::<Vec<_>>()))
    .bind(after)
    .bind(limit)
    .fetch_all(db)
    .await
}
