//! An admitted order on its way into Postgres, and why one may never be written: what
//! the worker's writes (`orders`) and its burials (`dead_orders`) both speak of.

use chrono::{DateTime, Utc};

use crate::domain::{Epoch, OrderId, UserId, VoucherId};

/// An admitted order on its way from the stream into Postgres.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NewOrder {
    pub id: OrderId,
    pub user_id: UserId,
    pub voucher_id: VoucherId,
    /// When Redis admitted it (by Redis's clock), as its stream entry carries it; the
    /// row's times are Postgres's, of its writing.
    pub admitted_at: DateTime<Utc>,
    /// The segment of its sale that took the unit, and the sale's segments (0 and 1 for a sale
    /// in one segment): where its buyer record lives in Redis.
    pub segment: u8,
    pub segments: u8,
    /// The epoch of the state that admitted it (`None`: an entry without one, as
    /// earlier releases and tools write them).
    pub epoch: Option<Epoch>,
}

impl NewOrder {
    /// The sale segment whose unit the order took.
    pub fn sale_segment(&self) -> crate::keys::SaleSegment {
        crate::keys::SaleSegment::new(self.voucher_id, self.segment, self.segments)
    }
}

/// Why an order can never be written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rejection {
    /// The user already holds another order for the voucher.
    UserHoldsOther,
    /// Postgres has no unit left for it.
    NoStock,
    UnknownVoucher,
    /// Its id belongs to another order (another user or voucher, written or buried
    /// first): the id was minted twice.
    IdTaken,
    /// Dead-lettered earlier (tombstoned in `dead_orders`).
    AlreadyDead,
    /// Delivered too often without being written (it keeps killing workers); the
    /// text says how often.
    Poison(String),
    /// Admitted by a Redis state that is not its sale's current build (an old primary
    /// after a failover, a copy rebuilt away from), and not carried into it: that
    /// build did not count it, so it never takes a unit.
    StaleEpoch,
    Refused(String),
}

impl Rejection {
    /// The reason written with the dead letter.
    pub(crate) fn reason(&self) -> String {
        match self {
            Rejection::UserHoldsOther => "user already holds another order for this voucher".into(),
            Rejection::NoStock => "no stock left in postgres".into(),
            Rejection::UnknownVoucher => "unknown voucher".into(),
            Rejection::IdTaken => "order id already used by another order".into(),
            Rejection::AlreadyDead => "dead-lettered before".into(),
            Rejection::Poison(why) => format!("poison: {why}"),
            Rejection::StaleEpoch => format!(
                "{STALE_EPOCH}: admitted by a redis state that is no longer the sale's \
                 (it was rebuilt elsewhere)"
            ),
            Rejection::Refused(msg) => format!("refused by postgres: {msg}"),
        }
    }

    /// A stable name for metrics.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Rejection::Poison(_) => "poison",
            // Redis admitted an order Postgres had no unit for: a 202 broken, the one
            // dead letter worth paging someone for, so apart from the other refusals.
            Rejection::NoStock => "no_stock",
            // Two 202s with one id: the order ids minted are not unique.
            Rejection::IdTaken => "duplicate_id",
            // Admitted where the sale no longer lives: the fence refused it.
            Rejection::StaleEpoch => "stale_epoch",
            _ => "rejected",
        }
    }

    /// Whether the unit the order took in Redis goes back on sale. Not when Postgres
    /// had no unit for it: then Redis sold one too many, and giving it back would sell
    /// it again.
    pub(crate) fn returns_unit(&self) -> bool {
        !matches!(self, Rejection::NoStock)
    }
}

/// How the reason of every dead letter of [`Rejection::StaleEpoch`] begins.
pub(crate) const STALE_EPOCH: &str = "stale_epoch";

/// An order that holds its unit (at most one per user and voucher): one that has not
/// given it back (cancelled, expired, or refunded while its sale was open).
pub(crate) const ACTIVE: &str = "closed_at IS NULL";
