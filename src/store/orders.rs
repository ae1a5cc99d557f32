//! `voucher_orders`: written by the worker, read by the order endpoints.

use std::collections::{BTreeMap, HashMap, HashSet};

use futures_util::future::BoxFuture;
use sqlx::{PgPool, Postgres, Transaction};

use crate::domain::{OrderId, UserId, VoucherId};

pub(crate) use super::admitted::ACTIVE;
pub use super::admitted::{NewOrder, Rejection};
use super::vouchers::lock_sales;

mod reads;
pub use reads::OrderRow;
pub(crate) use reads::{get, list_by_user, page_of_sale, page_of_shop, ORDER_COLUMNS};

/// What became of one order of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Persisted {
    /// Written now, and the voucher's stock lowered by one.
    Inserted,
    /// Already written earlier (a replayed entry): nothing changed.
    AlreadyThere,
    /// Can never be written (or was dead-lettered before): it goes the dead-letter way.
    Rejected(Rejection),
    /// Not written: its stream entry is no longer pending (Redis lost it, or another
    /// worker finished it), so a reload of the sale may not have counted it.
    Vanished,
}

/// Asked under the sales' row locks, just before writing: which of these order ids
/// still have a pending stream entry. An order whose entry Redis lost may have been
/// left out of a reload that ran meanwhile (it saw neither the entry nor the row), so
/// writing it would sell a unit twice.
pub(crate) type PendingCheck<'a> =
    &'a (dyn Fn(Vec<OrderId>) -> BoxFuture<'a, anyhow::Result<HashSet<OrderId>>> + Send + Sync);

/// Writes a batch in ONE transaction: idempotent inserts, and each voucher's stock
/// lowered by exactly the rows inserted now, under a `stock >= n` guard.
///
/// The rows are inserted first, then the sales' `seckill_vouchers` rows are locked:
/// that lock is the fence every move of state between the stores takes (loading a sale
/// into Redis, burying a dead order), so none of them can interleave with a commit for
/// the same sale. Inserting before the lock lets several batches of one sale build
/// their rows at once (the lock then covers only the checks, the stock update and the
/// commit); the rows stay invisible to everyone until the commit, and whatever the
/// fence protects is decided again under the lock: rows of entries no longer pending
/// and of orders buried meanwhile are deleted before the stock is taken.
///
/// If a guard or constraint refuses the batch, it is rolled back and the orders are
/// written one by one, so one bad order cannot hold up the rest. `Err` means a fault
/// worth retrying (Postgres unreachable, lock timeout, a deadlock with a batch holding
/// the same users): nothing was committed for the orders concerned, and the caller keeps
/// them pending.
///
/// An id twice in `orders` (minted twice, or an entry added twice) is written in rounds
/// in which no id repeats, each committed before the next: the later round finds the
/// id taken (a duplicate) or its own order written (a replay), so one row takes one unit.
#[tracing::instrument(skip_all, fields(orders = orders.len()))]
pub async fn persist_batch(
    db: &PgPool,
    orders: &[NewOrder],
    still_pending: PendingCheck<'_>,
) -> anyhow::Result<Vec<Persisted>> {
    let rounds = rounds_of_unique_ids(orders.iter().map(|o| Some(o.id)));
    if rounds.len() <= 1 {
        return persist_unique(db, orders, still_pending).await;
    }
    let mut outcomes = vec![None; orders.len()];
    for round in rounds {
        let part: Vec<NewOrder> = round.iter().map(|&i| orders[i]).collect();
        for (i, outcome) in round
            .into_iter()
            .zip(persist_unique(db, &part, still_pending).await?)
        {
            outcomes[i] = Some(outcome);
        }
    }
    Ok(outcomes
        .into_iter()
        .map(|o| o.expect("every order is in a round"))
        .collect())
}

/// Splits a batch into rounds in which no order id repeats: the n-th occurrence of an
/// id goes to the n-th round, items without an id to the first. Indices, in order.
pub(crate) fn rounds_of_unique_ids(
    ids: impl IntoIterator<Item = Option<OrderId>>,
) -> Vec<Vec<usize>> {
    let mut seen: HashMap<OrderId, usize> = HashMap::new();
    let mut rounds: Vec<Vec<usize>> = Vec::new();
    for (i, id) in ids.into_iter().enumerate() {
        let round = id.map_or(0, |id| {
            let n = seen.entry(id).or_insert(0);
            *n += 1;
            *n - 1
        });
        if rounds.len() <= round {
            rounds.resize_with(round + 1, Vec::new);
        }
        rounds[round].push(i);
    }
    rounds
}

/// [`persist_batch`] of orders whose ids are all different.
async fn persist_unique(
    db: &PgPool,
    orders: &[NewOrder],
    still_pending: PendingCheck<'_>,
) -> anyhow::Result<Vec<Persisted>> {
    if orders.is_empty() {
        return Ok(Vec::new());
    }
    let mut tx = db.begin().await?;
    match write(&mut tx, orders, still_pending).await {
        Ok(Some(outcomes)) => {
            tx.commit().await?;
            Ok(outcomes)
        }
        Ok(None) => {
            tx.rollback().await?;
            one_by_one(db, orders, still_pending).await
        }
        Err(e)
            if e.downcast_ref::<sqlx::Error>()
                .is_some_and(super::is_data_error) =>
        {
            tracing::warn!(error = %e, "batch refused by a constraint, writing orders one by one");
            drop(tx);
            one_by_one(db, orders, still_pending).await
        }
        Err(e) => Err(e),
    }
}

/// Writes `all` in `tx` (not committed); `Ok(None)` when a stock guard failed. A
/// lottery's draw commits its winners' rows this way with its own record.
pub(crate) async fn write(
    tx: &mut Transaction<'_, Postgres>,
    all: &[NewOrder],
    still_pending: PendingCheck<'_>,
) -> anyhow::Result<Option<Vec<Persisted>>> {
    let mut inserted = insert_orders(tx, all).await?;
    let vouchers: Vec<VoucherId> = all.iter().map(|o| o.voucher_id).collect();
    lock_sales(tx, &vouchers).await?;
    // Under the lock, as the loader and burials see it: a reload may have run without
    // seeing an entry Redis lost (nor our row), a burial may have tombstoned an order
    // whose row we had not committed yet. Neither may be written.
    let pending = still_pending(all.iter().map(|o| o.id).collect()).await?;
    // The fence's epoch, as every build of a sale's state sees it under this lock: an
    // order admitted by a state that is not its sale's current build (and not carried
    // into it) was not counted by that build, so it never takes a unit.
    let alive: Vec<NewOrder> = all
        .iter()
        .filter(|o| pending.contains(&o.id))
        .copied()
        .collect();
    let admissible = super::epochs::admissible(tx, &alive).await?;
    let mut unwanted: Vec<OrderId> = inserted
        .iter()
        .filter(|id| !pending.contains(id) || !admissible.contains(id))
        .copied()
        .collect();
    let rows: Vec<OrderId> = inserted.iter().copied().collect();
    unwanted.extend(super::dead_orders::buried_among(tx, &rows).await?);
    if !unwanted.is_empty() {
        for id in delete_rows(tx, &unwanted).await? {
            inserted.remove(&id);
        }
    }
    let orders: Vec<NewOrder> = alive
        .into_iter()
        .filter(|o| admissible.contains(&o.id))
        .collect();
    // An order skipped before the lock (its user held another order) may be writable
    // now: that order may have been cancelled or expired meanwhile. Ask again under the
    // lock, as writing lock-first would have; mostly these are replays, found again.
    let skipped: Vec<NewOrder> = orders
        .iter()
        .filter(|o| !inserted.contains(&o.id))
        .copied()
        .collect();
    if !skipped.is_empty() {
        inserted.extend(insert_orders(tx, &skipped).await?);
    }

    let mut per_voucher: BTreeMap<VoucherId, i32> = BTreeMap::new();
    for o in orders.iter().filter(|o| inserted.contains(&o.id)) {
        *per_voucher.entry(o.voucher_id).or_default() += 1;
    }
    for (&voucher_id, &n) in &per_voucher {
        if !take_stock(tx, voucher_id, n).await? {
            return Ok(None);
        }
    }
    let mut outcomes = classify(tx, &orders, &inserted).await?.into_iter();
    Ok(Some(
        all.iter()
            .map(|o| {
                if !pending.contains(&o.id) {
                    Persisted::Vanished
                } else if !admissible.contains(&o.id) {
                    Persisted::Rejected(Rejection::StaleEpoch)
                } else {
                    outcomes.next().expect("one outcome per order written")
                }
            })
            .collect(),
    ))
}

/// The slow path: one transaction per order.
async fn one_by_one(
    db: &PgPool,
    orders: &[NewOrder],
    still_pending: PendingCheck<'_>,
) -> anyhow::Result<Vec<Persisted>> {
    let mut outcomes = Vec::with_capacity(orders.len());
    for order in orders {
        let one = std::slice::from_ref(order);
        let mut tx = db.begin().await?;
        let outcome = match write(&mut tx, one, still_pending).await {
            Ok(Some(mut outcome)) => outcome.remove(0),
            Ok(None) => Persisted::Rejected(Rejection::NoStock),
            Err(e) => match e.downcast_ref::<sqlx::Error>() {
                // The insert ran before the pending check: an entry finished elsewhere
                // (or lost) is not this batch's to bury.
                Some(db_error) if super::is_data_error(db_error) => {
                    match still_pending(vec![order.id]).await?.contains(&order.id) {
                        true => Persisted::Rejected(rejection(db_error)),
                        false => Persisted::Vanished,
                    }
                }
                _ => return Err(e),
            },
        };
        match outcome {
            Persisted::Inserted => tx.commit().await?,
            _ => tx.rollback().await?,
        }
        outcomes.push(outcome);
    }
    Ok(outcomes)
}

fn rejection(e: &sqlx::Error) -> Rejection {
    match e {
        sqlx::Error::Database(db) if db.is_foreign_key_violation() => Rejection::UnknownVoucher,
        sqlx::Error::Database(db) => Rejection::Refused(db.message().to_string()),
        other => Rejection::Refused(other.to_string()),
    }
}

/// Inserts what is new and not tombstoned; returns the ids inserted now. Its times are
/// Postgres's, of this transaction: the payment deadline runs from the order's writing,
/// so it is in the future when the order is (a late write, after an outage, still
/// leaves the winner the whole time to pay), whatever clock the writer runs on. Rows go
/// in id order, so two batches holding the same orders (a take-over) wait for each
/// other instead of deadlocking.
async fn insert_orders(
    tx: &mut Transaction<'_, Postgres>,
    orders: &[NewOrder],
) -> Result<HashSet<OrderId>, sqlx::Error> {
    let mut sorted = orders.to_vec();
    sorted.sort_unstable_by_key(|o| o.id);
    let ids: Vec<OrderId> = sorted.iter().map(|o| o.id).collect();
    let users: Vec<UserId> = sorted.iter().map(|o| o.user_id).collect();
    let vouchers: Vec<VoucherId> = sorted.iter().map(|o| o.voucher_id).collect();
    // An order of a voucher without a sale gets a window of 0 and then fails its
    // foreign key, as it should.
    let inserted: Vec<OrderId> = sqlx::query_scalar(
        "INSERT INTO voucher_orders (id, user_id, voucher_id, created_at, pay_before) \
         SELECT t.id, t.user_id, t.voucher_id, now(), \
                now() + make_interval(secs => coalesce(s.pay_within_secs, 0)) \
         FROM unnest($1::int8[], $2::int8[], $3::int8[]) \
             WITH ORDINALITY AS t (id, user_id, voucher_id, n) \
         LEFT JOIN seckill_vouchers s ON s.voucher_id = t.voucher_id \
         WHERE NOT EXISTS (SELECT 1 FROM dead_orders d WHERE d.id = t.id) \
         ORDER BY t.n \
         ON CONFLICT DO NOTHING RETURNING id",
    )
    .bind(&ids)
    .bind(&users)
    .bind(&vouchers)
    .fetch_all(&mut **tx)
    .await?;
    Ok(inserted.into_iter().collect())
}

/// Takes back rows this transaction inserted; returns the ids deleted.
async fn delete_rows(
    tx: &mut Transaction<'_, Postgres>,
    ids: &[OrderId],
) -> Result<Vec<OrderId>, sqlx::Error> {
    sqlx::query_scalar("DELETE FROM voucher_orders WHERE id = ANY($1) RETURNING id")
        .bind(ids)
        .fetch_all(&mut **tx)
        .await
}

/// `false` when the voucher has fewer than `n` units left (or no flash sale).
async fn take_stock(
    tx: &mut Transaction<'_, Postgres>,
    voucher_id: VoucherId,
    n: i32,
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE seckill_vouchers SET stock = stock - $2, updated_at = now() \
         WHERE voucher_id = $1 AND stock >= $2",
    )
    .bind(voucher_id)
    .bind(n)
    .execute(&mut **tx)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Tells a replay (the same order already stored) from a conflicting order.
async fn classify(
    tx: &mut Transaction<'_, Postgres>,
    orders: &[NewOrder],
    inserted: &HashSet<OrderId>,
) -> Result<Vec<Persisted>, sqlx::Error> {
    let skipped: Vec<OrderId> = orders
        .iter()
        .filter(|o| !inserted.contains(&o.id))
        .map(|o| o.id)
        .collect();
    let stored: HashMap<OrderId, (UserId, VoucherId)> = if skipped.is_empty() {
        HashMap::new()
    } else {
        sqlx::query_as::<_, (OrderId, UserId, VoucherId)>(
            "SELECT id, user_id, voucher_id FROM voucher_orders WHERE id = ANY($1)",
        )
        .bind(&skipped)
        .fetch_all(&mut **tx)
        .await?
        .into_iter()
        .map(|(id, u, v)| (id, (u, v)))
        .collect()
    };
    let mut dead: HashMap<OrderId, Vec<(UserId, VoucherId)>> = HashMap::new();
    for (id, u, v) in super::dead_orders::orders_among(tx, &skipped).await? {
        dead.entry(id).or_default().push((u, v));
    }
    Ok(orders
        .iter()
        .map(|o| {
            let this = (o.user_id, o.voucher_id);
            if inserted.contains(&o.id) {
                return Persisted::Inserted;
            }
            match (stored.get(&o.id), dead.get(&o.id)) {
                (Some(&row), _) if row == this => Persisted::AlreadyThere,
                (Some(_), _) => Persisted::Rejected(Rejection::IdTaken),
                (None, Some(buried)) if buried.contains(&this) => {
                    Persisted::Rejected(Rejection::AlreadyDead)
                }
                (None, Some(_)) => Persisted::Rejected(Rejection::IdTaken),
                (None, None) => Persisted::Rejected(Rejection::UserHoldsOther),
            }
        })
        .collect())
}

/// Which of these order ids Postgres holds, whatever their status. A loader must not
/// count such an order in flight even while its stream entry is unacknowledged: it is
/// written, and if it is closed its unit is back in Postgres's stock already.
pub(crate) async fn written_among(
    tx: &mut Transaction<'_, Postgres>,
    ids: &[OrderId],
) -> Result<Vec<OrderId>, sqlx::Error> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    sqlx::query_scalar("SELECT id FROM voucher_orders WHERE id = ANY($1)")
        .bind(ids)
        .fetch_all(&mut **tx)
        .await
}

/// Which of these order ids Postgres has settled: written (whatever their status), or
/// tombstoned, in one snapshot (under the sale's row lock, an answer that stands).
pub(crate) async fn settled_among<'e>(
    db: impl sqlx::PgExecutor<'e>,
    ids: &[OrderId],
) -> Result<HashSet<OrderId>, sqlx::Error> {
    if ids.is_empty() {
        return Ok(HashSet::new());
    }
    Ok(sqlx::query_scalar(
        "SELECT id FROM voucher_orders WHERE id = ANY($1) \
         UNION SELECT id FROM dead_orders WHERE id = ANY($1)",
    )
    .bind(ids)
    .fetch_all(db)
    .await?
    .into_iter()
    .collect())
}
