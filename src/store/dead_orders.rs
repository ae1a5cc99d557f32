//! `dead_orders`: orders the worker gave up on. An id here is never written to
//! `voucher_orders` afterwards: the worker's inserts skip tombstoned ids, and a batch
//! checks again under the sale's row lock (which every burial takes) for tombstones
//! laid since it inserted, deleting those rows before it commits.
//!
//! An id belongs to the first order that claims it, by its row or its tombstone; an
//! order of another user or voucher minted with the same id is a duplicate, buried here
//! beside it (the key is the whole order).

use std::collections::HashMap;

use sqlx::{PgPool, Postgres, Transaction};

use super::admitted::{NewOrder, Rejection};
use super::vouchers::lock_sales;
use crate::domain::{OrderId, UserId, VoucherId};

/// The end of an order that will not be written, decided under the sale's row lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Burial {
    /// It is in `voucher_orders` after all (a slow worker committed it): acknowledge.
    Written,
    /// Buried as `stale_epoch`, but a build of its sale carried it into the current
    /// epoch since it was judged: it is to be written, not buried.
    Admissible,
    /// Tombstoned in `dead_orders` (`newly`: by this call). `holder` is the order the
    /// user holds for the voucher instead, if any; `returns_unit` whether settling it
    /// gives its unit back to Redis, as decided by the burial that laid the tombstone;
    /// `duplicate` that its id belongs to another order (so it was buried as
    /// [`Rejection::IdTaken`], whatever the caller's reason).
    Dead {
        newly: bool,
        holder: Option<OrderId>,
        returns_unit: bool,
        duplicate: bool,
    },
}

/// Buries an order that will not be written: under the sale's row lock (so no worker
/// can be half-way through committing it), either finds it written after all, or
/// tombstones it so that no replay can ever write it.
#[tracing::instrument(skip(db))]
pub async fn bury(
    db: &PgPool,
    order: &NewOrder,
    reason: &str,
    returns_unit: bool,
) -> Result<Burial, sqlx::Error> {
    bury_as(db, order, reason, returns_unit, false).await
}

/// [`bury`] for an order of a stale epoch ([`Rejection::StaleEpoch`]): judged again
/// under the lock, as a build of its sale may have carried it since.
pub async fn bury_stale(db: &PgPool, order: &NewOrder) -> Result<Burial, sqlx::Error> {
    let why = Rejection::StaleEpoch;
    bury_as(db, order, &why.reason(), why.returns_unit(), true).await
}

async fn bury_as(
    db: &PgPool,
    order: &NewOrder,
    reason: &str,
    returns_unit: bool,
    stale: bool,
) -> Result<Burial, sqlx::Error> {
    let mut tx = db.begin().await?;
    lock_sales(&mut tx, &[order.voucher_id]).await?;
    if stale
        && super::epochs::admissible(&mut tx, std::slice::from_ref(order))
            .await?
            .contains(&order.id)
    {
        tx.commit().await?;
        return Ok(Burial::Admissible);
    }
    let duplicate = match owner(&mut tx, order).await? {
        Owner::This => {
            tx.commit().await?;
            return Ok(Burial::Written);
        }
        Owner::Another => true,
        Owner::Nobody => false,
    };
    // A duplicate never took a unit in Postgres: the one Redis gave it goes back.
    let (reason, returns_unit) = match duplicate {
        true => (Rejection::IdTaken.reason(), true),
        false => (reason.to_string(), returns_unit),
    };
    let newly: Option<OrderId> = sqlx::query_scalar(
        "INSERT INTO dead_orders (id, user_id, voucher_id, reason, returns_unit) \
         VALUES ($1, $2, $3, $4, $5) \
         ON CONFLICT (id, user_id, voucher_id) DO NOTHING RETURNING id",
    )
    .bind(order.id)
    .bind(order.user_id)
    .bind(order.voucher_id)
    .bind(&reason)
    .bind(returns_unit)
    .fetch_optional(&mut *tx)
    .await?;
    // Buried before (by a peer that may not have settled it yet): settle as it decided.
    let returns_unit = match newly {
        Some(_) => returns_unit,
        None => {
            sqlx::query_scalar(
                "SELECT returns_unit FROM dead_orders \
                 WHERE id = $1 AND user_id = $2 AND voucher_id = $3",
            )
            .bind(order.id)
            .bind(order.user_id)
            .bind(order.voucher_id)
            .fetch_one(&mut *tx)
            .await?
        }
    };
    let holder: Option<OrderId> = sqlx::query_scalar(&format!(
        "SELECT id FROM voucher_orders WHERE user_id = $1 AND voucher_id = $2 AND {}",
        super::admitted::ACTIVE
    ))
    .bind(order.user_id)
    .bind(order.voucher_id)
    .fetch_optional(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(Burial::Dead {
        newly: newly.is_some(),
        holder,
        returns_unit,
        duplicate,
    })
}

/// Whom an order's id belongs to.
enum Owner {
    /// Written: this very order.
    This,
    /// Another order (another user or voucher), written or buried.
    Another,
    Nobody,
}

async fn owner(tx: &mut Transaction<'_, Postgres>, order: &NewOrder) -> sqlx::Result<Owner> {
    let written: Option<(UserId, VoucherId)> =
        sqlx::query_as("SELECT user_id, voucher_id FROM voucher_orders WHERE id = $1")
            .bind(order.id)
            .fetch_optional(&mut **tx)
            .await?;
    let mine = (order.user_id, order.voucher_id);
    Ok(match written {
        Some(theirs) if theirs == mine => Owner::This,
        Some(_) => Owner::Another,
        None => {
            let buried: Vec<(UserId, VoucherId)> =
                sqlx::query_as("SELECT user_id, voucher_id FROM dead_orders WHERE id = $1")
                    .bind(order.id)
                    .fetch_all(&mut **tx)
                    .await?;
            match buried.iter().any(|b| *b != mine) {
                true => Owner::Another,
                false => Owner::Nobody,
            }
        }
    })
}

/// Which of these order ids are tombstoned (in `dead_orders`): whatever order claims
/// such an id, it is never written.
pub(crate) async fn buried_among(
    tx: &mut Transaction<'_, Postgres>,
    ids: &[OrderId],
) -> Result<Vec<OrderId>, sqlx::Error> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    sqlx::query_scalar("SELECT DISTINCT id FROM dead_orders WHERE id = ANY($1)")
        .bind(ids)
        .fetch_all(&mut **tx)
        .await
}

/// `(id, user_id, voucher_id)` of the orders buried under these ids.
pub(crate) async fn orders_among(
    tx: &mut Transaction<'_, Postgres>,
    ids: &[OrderId],
) -> Result<Vec<(OrderId, UserId, VoucherId)>, sqlx::Error> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    sqlx::query_as("SELECT id, user_id, voucher_id FROM dead_orders WHERE id = ANY($1)")
        .bind(ids)
        .fetch_all(&mut **tx)
        .await
}

/// Buried (dead-lettered) orders per voucher.
#[tracing::instrument(skip(db))]
pub(crate) async fn dead_per_voucher(db: &PgPool) -> Result<HashMap<VoucherId, i64>, sqlx::Error> {
    Ok(sqlx::query_as::<_, (VoucherId, i64)>(
        "SELECT voucher_id, count(*) FROM dead_orders GROUP BY voucher_id",
    )
    .fetch_all(db)
    .await?
    .into_iter()
    .collect())
}
