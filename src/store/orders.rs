//! `voucher_orders`: written by the worker, read by the order endpoints.

use std::collections::{BTreeMap, HashMap, HashSet};

use chrono::{DateTime, Utc};
use futures_util::future::BoxFuture;
use sqlx::{FromRow, PgPool, Postgres, Transaction};

/// An admitted order on its way from the stream into Postgres.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NewOrder {
    pub id: i64,
    pub user_id: i64,
    pub voucher_id: i64,
    pub admitted_at: DateTime<Utc>,
}

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
pub(crate) type LiveCheck<'a> =
    &'a (dyn Fn(Vec<i64>) -> BoxFuture<'a, anyhow::Result<HashSet<i64>>> + Send + Sync);

/// Why an order can never be written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rejection {
    /// The user already holds another order for the voucher.
    UserHoldsOther,
    /// Postgres has no unit left for it.
    NoStock,
    UnknownVoucher,
    /// Its id names another order.
    IdTaken,
    /// Dead-lettered earlier (tombstoned in `dead_orders`).
    AlreadyDead,
    /// Delivered too often without being written (it keeps killing workers); the
    /// text says how often.
    Poison(String),
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
            Rejection::Refused(msg) => format!("refused by postgres: {msg}"),
        }
    }

    /// A stable name for metrics.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Rejection::Poison(_) => "poison",
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

#[derive(Debug, Clone, FromRow)]
pub struct OrderRow {
    pub id: i64,
    pub user_id: i64,
    pub voucher_id: i64,
    /// `created`, `paid`, `cancelled` or `expired`.
    pub status: String,
    pub created_at: DateTime<Utc>,
    pub pay_before: DateTime<Utc>,
    pub paid_at: Option<DateTime<Utc>>,
    pub closed_at: Option<DateTime<Utc>>,
    pub payment_ref: Option<String>,
}

/// The columns of an [`OrderRow`], for `SELECT` and `RETURNING`.
pub(crate) const ORDER_COLUMNS: &str =
    "id, user_id, voucher_id, status, created_at, pay_before, paid_at, closed_at, payment_ref";

/// Statuses of an order that holds its unit (at most one per user and voucher).
pub(crate) const ACTIVE: &str = "status IN ('created', 'paid')";

/// Writes a batch in ONE transaction: idempotent inserts, and each voucher's stock
/// lowered by exactly the rows inserted now, under a `stock >= n` guard.
///
/// The transaction first locks the sales' `seckill_vouchers` rows: that is the fence
/// every move of state between the stores takes (loading a sale into Redis, burying a
/// dead order), so none of them can interleave with a commit for the same sale.
///
/// If a guard or constraint refuses the batch, it is rolled back and the orders are
/// written one by one, so one bad order cannot hold up the rest. `Err` means a fault
/// worth retrying (Postgres unreachable, lock timeout): nothing was committed for the
/// orders concerned, and the caller keeps them pending.
#[tracing::instrument(skip_all, fields(orders = orders.len()))]
pub async fn persist_batch(
    db: &PgPool,
    orders: &[NewOrder],
    live: LiveCheck<'_>,
) -> anyhow::Result<Vec<Persisted>> {
    if orders.is_empty() {
        return Ok(Vec::new());
    }
    match try_batch(db, orders, live).await {
        Ok(Some(outcomes)) => Ok(outcomes),
        Ok(None) => one_by_one(db, orders, live).await,
        Err(e)
            if e.downcast_ref::<sqlx::Error>()
                .is_some_and(super::is_data_error) =>
        {
            tracing::warn!(error = %e, "batch refused by a constraint, writing orders one by one");
            one_by_one(db, orders, live).await
        }
        Err(e) => Err(e),
    }
}

/// Payment windows (seconds) of the sales a transaction has locked, by voucher.
pub(crate) type PayWindows = HashMap<i64, i32>;

/// Locks the flash-sale rows of the given vouchers, in voucher order so concurrent
/// workers cannot deadlock each other, and returns their payment windows. Waits at
/// most the session's `lock_timeout`.
pub(crate) async fn lock_sales(
    tx: &mut Transaction<'_, Postgres>,
    voucher_ids: &[i64],
) -> Result<PayWindows, sqlx::Error> {
    let mut ids = voucher_ids.to_vec();
    ids.sort_unstable();
    ids.dedup();
    Ok(sqlx::query_as::<_, (i64, i32)>(
        "SELECT voucher_id, pay_within_secs FROM seckill_vouchers WHERE voucher_id = ANY($1) \
         ORDER BY voucher_id FOR NO KEY UPDATE",
    )
    .bind(&ids)
    .fetch_all(&mut **tx)
    .await?
    .into_iter()
    .collect())
}

/// `Ok(None)` when a stock guard failed (the batch was rolled back).
async fn try_batch(
    db: &PgPool,
    all: &[NewOrder],
    live: LiveCheck<'_>,
) -> anyhow::Result<Option<Vec<Persisted>>> {
    let mut tx = db.begin().await?;
    let vouchers: Vec<i64> = all.iter().map(|o| o.voucher_id).collect();
    let windows = lock_sales(&mut tx, &vouchers).await?;
    let alive = live(all.iter().map(|o| o.id).collect()).await?;
    let orders: Vec<NewOrder> = all
        .iter()
        .filter(|o| alive.contains(&o.id))
        .copied()
        .collect();
    let orders = &orders[..];
    let inserted = insert_orders(&mut tx, orders, &windows).await?;

    let mut per_voucher: BTreeMap<i64, i32> = BTreeMap::new();
    for o in orders.iter().filter(|o| inserted.contains(&o.id)) {
        *per_voucher.entry(o.voucher_id).or_default() += 1;
    }
    for (&voucher_id, &n) in &per_voucher {
        if !take_stock(&mut tx, voucher_id, n).await? {
            tx.rollback().await?;
            return Ok(None);
        }
    }
    let mut outcomes = classify(&mut tx, orders, &inserted).await?.into_iter();
    tx.commit().await?;
    Ok(Some(
        all.iter()
            .map(|o| match alive.contains(&o.id) {
                true => outcomes.next().expect("one outcome per live order"),
                false => Persisted::Vanished,
            })
            .collect(),
    ))
}

/// The slow path: one transaction per order.
async fn one_by_one(
    db: &PgPool,
    orders: &[NewOrder],
    live: LiveCheck<'_>,
) -> anyhow::Result<Vec<Persisted>> {
    let mut outcomes = Vec::with_capacity(orders.len());
    for order in orders {
        let mut tx = db.begin().await?;
        let windows = lock_sales(&mut tx, &[order.voucher_id]).await?;
        if !live(vec![order.id]).await?.contains(&order.id) {
            tx.rollback().await?;
            outcomes.push(Persisted::Vanished);
            continue;
        }
        let outcome = match insert_orders(&mut tx, std::slice::from_ref(order), &windows).await {
            Ok(inserted) if inserted.is_empty() => {
                classify(&mut tx, std::slice::from_ref(order), &inserted)
                    .await?
                    .remove(0)
            }
            Ok(_) => {
                if take_stock(&mut tx, order.voucher_id, 1).await? {
                    Persisted::Inserted
                } else {
                    Persisted::Rejected(Rejection::NoStock)
                }
            }
            Err(e) if super::is_data_error(&e) => Persisted::Rejected(rejection(&e)),
            Err(e) => return Err(e.into()),
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

/// Inserts what is new and not tombstoned; returns the ids inserted now. The payment
/// deadline runs from admission, so an order written late (after an outage) may be
/// due at once: the sweeper expires it, and it can never be paid.
async fn insert_orders(
    tx: &mut Transaction<'_, Postgres>,
    orders: &[NewOrder],
    windows: &PayWindows,
) -> Result<HashSet<i64>, sqlx::Error> {
    let ids: Vec<i64> = orders.iter().map(|o| o.id).collect();
    let users: Vec<i64> = orders.iter().map(|o| o.user_id).collect();
    let vouchers: Vec<i64> = orders.iter().map(|o| o.voucher_id).collect();
    let times: Vec<DateTime<Utc>> = orders.iter().map(|o| o.admitted_at).collect();
    // An order of a voucher without a sale has no window; its insert fails anyway.
    let deadlines: Vec<DateTime<Utc>> = orders
        .iter()
        .map(|o| {
            let secs = windows.get(&o.voucher_id).copied().unwrap_or(0);
            o.admitted_at + chrono::Duration::seconds(secs.into())
        })
        .collect();
    let inserted: Vec<i64> = sqlx::query_scalar(
        "INSERT INTO voucher_orders (id, user_id, voucher_id, created_at, pay_before) \
         SELECT * FROM unnest($1::int8[], $2::int8[], $3::int8[], $4::timestamptz[], \
                              $5::timestamptz[]) \
             AS t (id, user_id, voucher_id, created_at, pay_before) \
         WHERE NOT EXISTS (SELECT 1 FROM dead_orders d WHERE d.id = t.id) \
         ON CONFLICT DO NOTHING RETURNING id",
    )
    .bind(&ids)
    .bind(&users)
    .bind(&vouchers)
    .bind(&times)
    .bind(&deadlines)
    .fetch_all(&mut **tx)
    .await?;
    Ok(inserted.into_iter().collect())
}

/// `false` when the voucher has fewer than `n` units left (or no flash sale).
async fn take_stock(
    tx: &mut Transaction<'_, Postgres>,
    voucher_id: i64,
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
    inserted: &HashSet<i64>,
) -> Result<Vec<Persisted>, sqlx::Error> {
    let skipped: Vec<i64> = orders
        .iter()
        .filter(|o| !inserted.contains(&o.id))
        .map(|o| o.id)
        .collect();
    let stored: HashMap<i64, (i64, i64)> = if skipped.is_empty() {
        HashMap::new()
    } else {
        sqlx::query_as::<_, (i64, i64, i64)>(
            "SELECT id, user_id, voucher_id FROM voucher_orders WHERE id = ANY($1)",
        )
        .bind(&skipped)
        .fetch_all(&mut **tx)
        .await?
        .into_iter()
        .map(|(id, u, v)| (id, (u, v)))
        .collect()
    };
    let dead: HashSet<i64> = if skipped.is_empty() {
        HashSet::new()
    } else {
        sqlx::query_scalar("SELECT id FROM dead_orders WHERE id = ANY($1)")
            .bind(&skipped)
            .fetch_all(&mut **tx)
            .await?
            .into_iter()
            .collect()
    };
    Ok(orders
        .iter()
        .map(|o| {
            if inserted.contains(&o.id) {
                Persisted::Inserted
            } else if dead.contains(&o.id) {
                Persisted::Rejected(Rejection::AlreadyDead)
            } else {
                match stored.get(&o.id) {
                    Some(&(u, v)) if (u, v) == (o.user_id, o.voucher_id) => Persisted::AlreadyThere,
                    Some(_) => Persisted::Rejected(Rejection::IdTaken),
                    None => Persisted::Rejected(Rejection::UserHoldsOther),
                }
            }
        })
        .collect())
}

#[tracing::instrument(skip(db))]
pub(crate) async fn get<'e>(
    db: impl sqlx::PgExecutor<'e>,
    order_id: i64,
) -> Result<Option<OrderRow>, sqlx::Error> {
    sqlx::query_as(&format!(
        "SELECT {ORDER_COLUMNS} FROM voucher_orders WHERE id = $1"
    ))
    .bind(order_id)
    .fetch_optional(db)
    .await
}

/// The user's newest 1000 orders. Active and closed orders are found through two
/// partial indexes (the worker's inserts touch only the first).
#[tracing::instrument(skip(db))]
pub(crate) async fn list_by_user(db: &PgPool, user_id: i64) -> Result<Vec<OrderRow>, sqlx::Error> {
    sqlx::query_as(&format!(
        "(SELECT {ORDER_COLUMNS} FROM voucher_orders WHERE user_id = $1 AND {ACTIVE}) \
         UNION ALL \
         (SELECT {ORDER_COLUMNS} FROM voucher_orders \
          WHERE user_id = $1 AND status IN ('cancelled', 'expired') \
          ORDER BY id DESC LIMIT 1000) \
         ORDER BY id DESC LIMIT 1000"
    ))
    .bind(user_id)
    .fetch_all(db)
    .await
}

/// Which of these order ids Postgres holds, whatever their status. A loader must not
/// count such an order in flight even while its stream entry is unacknowledged: it is
/// written, and if it is closed its unit is back in Postgres's stock already.
pub(crate) async fn written_among(
    tx: &mut Transaction<'_, Postgres>,
    ids: &[i64],
) -> Result<Vec<i64>, sqlx::Error> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    sqlx::query_scalar("SELECT id FROM voucher_orders WHERE id = ANY($1)")
        .bind(ids)
        .fetch_all(&mut **tx)
        .await
}
