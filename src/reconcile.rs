//! `seckill reconcile`: compares each sale's Redis state with Postgres and (with
//! `--repair`) rebuilds Redis from Postgres.
//!
//! Each sale is read through the same fence as loading (see [`loader::check`]):
//! Postgres under the sale's row lock, Redis's state and stream position in one
//! read-only script. So a healthy sale in full swing balances exactly:
//! - Postgres: `initial_stock = stock + orders`;
//! - Redis stock = Postgres stock - orders in flight (admitted, not yet written);
//! - Redis buyers = Postgres's buyers + the buyers of orders in flight, each naming
//!   the right order.
//!
//! With the order lifecycle, "orders" means active orders, those holding a unit
//! (`closed_at` unset: created, paid, used, refunding, or refunded after the sale
//! ended): a cancelled or expired order, or one refunded while its sale was open, gave
//! its unit back to Postgres's stock in the transaction that closed it, and gives it
//! back to Redis through its release. Until
//! that release is made its buyer record still names it with the unit out, so a
//! release still owed explains one unit and one record of difference ("owed").
//!
//! Dead-lettered orders are buried with their unit returned and their buyer record
//! settled (see `seckill_settle_dead` in `lua/lifecycle.lua`), so they leave no difference behind; they are
//! shown for information.

use std::fmt::Write as _;
use std::time::Duration;

use redis::aio::ConnectionLike;
use sqlx::PgPool;

use crate::admission::loader::{self, check::Checked, Mode};
use crate::domain::{OrderStatus, VoucherId};
use crate::keys::{Keys, SaleSegment};
use crate::scripts::Replicas;

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct VoucherBooks {
    pub voucher_id: VoucherId,
    pub initial_stock: i64,
    pub pg_stock: i64,
    pub pg_orders: i64,
    pub open: bool,
    /// `None`: the sale's state is not in Redis.
    pub redis_stock: Option<i64>,
    pub redis_buyers: i64,
    pub in_flight: i64,
    /// What Redis's stock and buyer count must be.
    pub expected_stock: i64,
    pub expected_buyers: i64,
    /// Buyer records missing or naming another order.
    pub mismatched_buyers: i64,
    pub dead_letters: i64,
    /// Orders paid (and not refunded: paid or used), and orders that gave their unit
    /// back (cancelled, expired, refunded while the sale was open), in Postgres.
    pub paid: i64,
    pub closed: i64,
    /// Releases owed to Redis whose buyer record still holds the unit (counted in the
    /// expected stock and buyers).
    pub owed: i64,
    /// Segments the sale is split over, and how many of them are out of balance (a
    /// segmented sale balances segment by segment, not only in sum).
    pub segments: u8,
    pub drifting_segments: u8,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Finding {
    Balanced,
    /// An ended sale whose Redis state has expired: nothing to compare.
    Expired,
    /// An open sale with no Redis state: admission fails closed until it is loaded.
    Missing,
    Drift,
}

impl Finding {
    pub(crate) fn is_ok(self) -> bool {
        matches!(self, Finding::Balanced | Finding::Expired)
    }

    fn as_str(self) -> &'static str {
        match self {
            Finding::Balanced => "ok",
            Finding::Expired => "expired",
            Finding::Missing => "MISSING",
            Finding::Drift => "DRIFT",
        }
    }
}

impl VoucherBooks {
    fn new(
        voucher_id: VoucherId,
        f: &Checked,
        dead_letters: i64,
        statuses: &[(OrderStatus, bool, i64)],
    ) -> Self {
        let count = |wanted: &dyn Fn(OrderStatus, bool) -> bool| -> i64 {
            statuses
                .iter()
                .filter(|(s, back, _)| wanted(*s, *back))
                .map(|(_, _, n)| n)
                .sum()
        };
        Self {
            voucher_id,
            initial_stock: f.initial_stock,
            pg_stock: f.sale_stock,
            pg_orders: f.sale_orders,
            open: f.end_time > crate::clock::now(),
            redis_stock: f.actual_stock,
            redis_buyers: f.actual_buyers,
            in_flight: f.expected.in_flight,
            expected_stock: f.expected.stock,
            expected_buyers: f.expected.buyers,
            mismatched_buyers: f.mismatched_buyers,
            dead_letters,
            paid: count(&|s, _| matches!(s, OrderStatus::Paid | OrderStatus::Used)),
            closed: count(&|_, unit_back| unit_back),
            owed: f.owed_held,
            segments: 1,
            drifting_segments: 0,
        }
    }

    /// Redis stock minus what it must be (positive: Redis could sell units Postgres
    /// does not have).
    pub(crate) fn stock_drift(&self) -> Option<i64> {
        self.redis_stock.map(|s| s - self.expected_stock)
    }

    pub(crate) fn buyers_drift(&self) -> i64 {
        self.redis_buyers - self.expected_buyers
    }

    pub(crate) fn verdict(&self) -> Finding {
        if self.initial_stock != self.pg_stock + self.pg_orders {
            return Finding::Drift;
        }
        let Some(stock_drift) = self.stock_drift() else {
            return if self.open {
                Finding::Missing
            } else {
                Finding::Expired
            };
        };
        if stock_drift == 0
            && self.buyers_drift() == 0
            && self.mismatched_buyers == 0
            && self.drifting_segments == 0
        {
            Finding::Balanced
        } else {
            Finding::Drift
        }
    }
}

/// The books of the given voucher, or of every sale not ended longer than `retention`
/// ago, each read through the fence.
pub(crate) async fn books<C: ConnectionLike + Send>(
    db: &PgPool,
    conn: &mut C,
    keys: &Keys,
    voucher: Option<VoucherId>,
    retention: Duration,
) -> anyhow::Result<Vec<VoucherBooks>> {
    let ids = match voucher {
        Some(id) => vec![id],
        None => {
            let since = crate::clock::now() - chrono::Duration::from_std(retention)?;
            crate::store::vouchers::sales_ending_after(db, since)
                .await?
                .into_iter()
                .map(|s| s.voucher_id)
                .collect()
        }
    };
    let dead = crate::store::dead_orders::dead_per_voucher(db).await?;
    let mut out = Vec::with_capacity(ids.len());
    for id in ids {
        match checked(db, conn, keys, id).await? {
            Some((f, segments, drifting_segments)) => {
                let statuses = crate::store::lifecycle::status_counts(db, id).await?;
                let mut books =
                    VoucherBooks::new(id, &f, dead.get(&id).copied().unwrap_or(0), &statuses);
                books.segments = segments;
                books.drifting_segments = drifting_segments;
                out.push(books)
            }
            None if voucher.is_some() => anyhow::bail!("voucher {id} has no flash sale"),
            None => {}
        }
    }
    Ok(out)
}

/// A sale read through the fence segment by segment: the segments' figures summed (Redis's
/// stock known only if every segment's is), how many segments it has, and how many of them
/// are out of balance on their own.
async fn checked<C: ConnectionLike + Send>(
    db: &PgPool,
    conn: &mut C,
    keys: &Keys,
    voucher_id: VoucherId,
) -> anyhow::Result<Option<(Checked, u8, u8)>> {
    let Some(segments) = crate::store::segments::segments_of(db, voucher_id).await? else {
        return Ok(None);
    };
    let mut sum: Option<Checked> = None;
    let mut drifting = 0;
    for segment in SaleSegment::all(voucher_id, segments) {
        let Some(f) = loader::check::check_segment(db, conn, keys, segment).await? else {
            return Ok(None);
        };
        // (A segment whose buyers hold more units than its allotment was sold into by
        // units it never had: drift, whatever Redis holds. A state of another epoch
        // than Postgres's is not the sale's: its orders would never be written.)
        if f.actual_stock.is_some_and(|s| s != f.expected.stock)
            || f.actual_buyers != f.expected.buyers
            || f.mismatched_buyers != 0
            || f.pg_stock < 0
            || (f.actual_stock.is_some() && f.pg_epoch.is_some() && f.actual_epoch != f.pg_epoch)
        {
            drifting += 1;
        }
        sum = Some(match sum {
            None => f,
            // Postgres's whole-sale figures from the last segment's read (one lock).
            Some(s) => Checked {
                pg_stock: s.pg_stock + f.pg_stock,
                pg_orders: s.pg_orders + f.pg_orders,
                sale_stock: f.sale_stock,
                sale_orders: f.sale_orders,
                expected: loader::Loaded {
                    stock: s.expected.stock + f.expected.stock,
                    buyers: s.expected.buyers + f.expected.buyers,
                    in_flight: s.expected.in_flight + f.expected.in_flight,
                },
                actual_stock: s.actual_stock.zip(f.actual_stock).map(|(a, b)| a + b),
                actual_buyers: s.actual_buyers + f.actual_buyers,
                mismatched_buyers: s.mismatched_buyers + f.mismatched_buyers,
                owed_held: s.owed_held + f.owed_held,
                ..s
            },
        });
    }
    Ok(sum.map(|s| (s, segments, drifting)))
}

/// Where the report goes, a piece at a time (standard output, in the binary).
pub(crate) type Emit<'a> = dyn FnMut(&str) -> anyhow::Result<()> + 'a;

/// `seckill reconcile [--voucher ID] [--repair]`: prints the books, repairs what is out
/// of balance (or the given voucher) when asked (each repair waiting for the given
/// replicas), and says whether the books balance.
pub(crate) async fn run<C: ConnectionLike + Send>(
    db: &PgPool,
    conn: &mut C,
    keys: &Keys,
    voucher: Option<VoucherId>,
    repair_waiting_for: Option<Replicas>,
    retention: Duration,
    emit: &mut Emit<'_>,
) -> anyhow::Result<bool> {
    let out_of_balance = |rows: &[VoucherBooks]| -> Vec<VoucherId> {
        rows.iter()
            .filter(|r| !r.verdict().is_ok())
            .map(|r| r.voucher_id)
            .collect()
    };
    // Each sale is read through the loader's fence, so a sale in full swing balances:
    // what is out of balance is drift, not timing.
    let mut rows = books(db, conn, keys, voucher, retention).await?;
    emit(&render(&rows))?;
    let mut bad = out_of_balance(&rows);
    if let Some(replicas) = repair_waiting_for {
        let targets = match voucher {
            Some(id) => vec![id],
            None => bad.clone(),
        };
        for id in targets {
            let loaded = repair(db, conn, keys, id, retention, replicas).await?;
            emit(&format!(
                "repaired voucher {id}: redis stock {}, buyers {} ({} in flight)\n",
                loaded.stock, loaded.buyers, loaded.in_flight
            ))?;
        }
        rows = books(db, conn, keys, voucher, retention).await?;
        emit(&format!("after repair:\n{}", render(&rows)))?;
        bad = out_of_balance(&rows);
    }
    if bad.is_empty() {
        emit("books balance\n")?;
    } else {
        emit(&format!("drift in voucher(s) {bad:?}; `seckill reconcile --repair` rebuilds Redis from Postgres (safe during a sale)\n"))?;
    }
    Ok(bad.is_empty())
}

/// `seckill dead-letters [--limit N]`: the newest dead letters with their reason and
/// fields, and the total.
pub(crate) async fn list_dead_letters<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    limit: usize,
    emit: &mut Emit<'_>,
) -> anyhow::Result<()> {
    let letters = dead_letters(conn, keys, limit).await?;
    let mut listing = String::new();
    for letter in &letters {
        let fields: Vec<String> = letter
            .fields
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        listing.push_str(&format!("{} {}\n", letter.id, fields.join(" ")));
    }
    emit(&listing)?;
    let mut total = 0u64;
    for shard in keys.shards() {
        let n: u64 = redis::cmd("XLEN")
            .arg(keys.dead_letters(shard))
            .query_async(conn)
            .await?;
        total += n;
    }
    emit(&format!(
        "{total} dead letter(s) in all, {} shown\n",
        letters.len()
    ))
}

/// One entry of the dead-letter stream.
#[derive(Debug, Clone)]
pub(crate) struct DeadLetter {
    pub id: String,
    pub fields: Vec<(String, String)>,
}

/// Up to `limit` dead letters of every shard, oldest first.
pub(crate) async fn dead_letters<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    limit: usize,
) -> anyhow::Result<Vec<DeadLetter>> {
    let mut out = Vec::new();
    for shard in keys.shards() {
        let page = crate::stream::range(conn, keys.dead_letters(shard), limit - out.len()).await?;
        out.extend(page.into_iter().map(|(id, fields)| DeadLetter {
            id,
            fields: fields.unwrap_or_default(),
        }));
    }
    Ok(out)
}

/// Rebuilds one sale's Redis state from Postgres through the fence (see
/// [`loader`]): safe during a live sale.
pub(crate) async fn repair<C: ConnectionLike + Send>(
    db: &PgPool,
    conn: &mut C,
    keys: &Keys,
    voucher_id: VoucherId,
    retention: Duration,
    replicas: Replicas,
) -> anyhow::Result<loader::Loaded> {
    loader::load_sale(
        db,
        conn,
        keys,
        voucher_id,
        retention,
        Mode::Repair,
        replicas,
    )
    .await?
    .ok_or_else(|| anyhow::anyhow!("voucher {voucher_id} has no flash sale"))
}

/// The table `seckill reconcile` prints.
pub(crate) fn render(rows: &[VoucherBooks]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:>10} {:>9} {:>9} {:>9} {:>11} {:>12} {:>9} {:>12} {:>7} {:>7} {:>5} {:>11} {:>12}  verdict",
        "voucher",
        "initial",
        "pg_stock",
        "pg_active",
        "redis_stock",
        "redis_buyers",
        "in_flight",
        "dead_letters",
        "paid",
        "closed",
        "owed",
        "stock_drift",
        "buyers_drift"
    );
    for r in rows {
        let opt = |v: Option<i64>| v.map_or("-".to_string(), |v| v.to_string());
        let _ = writeln!(
            out,
            "{:>10} {:>9} {:>9} {:>9} {:>11} {:>12} {:>9} {:>12} {:>7} {:>7} {:>5} {:>11} {:>12}  {}",
            r.voucher_id,
            r.initial_stock,
            r.pg_stock,
            r.pg_orders,
            opt(r.redis_stock),
            r.redis_buyers,
            r.in_flight,
            r.dead_letters,
            r.paid,
            r.closed,
            r.owed,
            opt(r.stock_drift()),
            match (r.redis_stock, r.mismatched_buyers) {
                (None, _) => "-".to_string(),
                (Some(_), 0) => r.buyers_drift().to_string(),
                (Some(_), m) => format!("{}/{m}≠", r.buyers_drift()),
            },
            match (r.segments, r.drifting_segments) {
                (1, _) | (_, 0) => r.verdict().as_str().to_string(),
                (k, n) => format!("{} ({n} of {k} segments)", r.verdict().as_str()),
            }
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn books() -> VoucherBooks {
        VoucherBooks {
            voucher_id: VoucherId::new(1).unwrap(),
            initial_stock: 100,
            pg_stock: 60,
            pg_orders: 40,
            open: true,
            redis_stock: Some(50),
            redis_buyers: 50,
            in_flight: 10,
            expected_stock: 50,
            expected_buyers: 50,
            mismatched_buyers: 0,
            dead_letters: 0,
            paid: 0,
            closed: 0,
            owed: 0,
            segments: 1,
            drifting_segments: 0,
        }
    }

    #[test]
    fn books_that_balance_with_orders_in_flight_are_ok() {
        assert_eq!(books().verdict(), Finding::Balanced);
    }

    #[test]
    fn a_segment_out_of_balance_is_drift_even_when_the_sums_balance() {
        let books = VoucherBooks {
            segments: 3,
            drifting_segments: 2,
            ..books()
        };
        assert_eq!(books.verdict(), Finding::Drift);
    }

    #[test]
    fn redis_holding_more_or_less_stock_than_expected_is_drift() {
        for stock in [49, 51] {
            let b = VoucherBooks {
                redis_stock: Some(stock),
                ..books()
            };
            assert_eq!(b.verdict(), Finding::Drift);
        }
    }

    #[test]
    fn dead_letters_explain_nothing_since_burial_settles_them() {
        let b = VoucherBooks {
            redis_stock: Some(48),
            redis_buyers: 52,
            dead_letters: 2,
            ..books()
        };
        assert_eq!(b.verdict(), Finding::Drift);
    }

    #[test]
    fn lost_or_wrong_buyers_or_postgres_out_of_balance_is_drift() {
        let b = VoucherBooks {
            redis_buyers: 49,
            ..books()
        };
        assert_eq!(b.verdict(), Finding::Drift);
        let b = VoucherBooks {
            mismatched_buyers: 1,
            ..books()
        };
        assert_eq!(b.verdict(), Finding::Drift);
        let b = VoucherBooks {
            pg_stock: 61,
            ..books()
        };
        assert_eq!(b.verdict(), Finding::Drift);
    }

    #[test]
    fn missing_state_matters_only_while_the_sale_is_open() {
        let b = VoucherBooks {
            redis_stock: None,
            redis_buyers: 0,
            ..books()
        };
        assert_eq!(b.verdict(), Finding::Missing);
        assert_eq!(
            VoucherBooks { open: false, ..b }.verdict(),
            Finding::Expired
        );
    }
}
