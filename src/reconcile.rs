//! `seckill reconcile`: compares each sale's Redis state with Postgres, explains the
//! difference by orders in flight and dead letters, and (with `--repair`) rebuilds Redis
//! from Postgres.
//!
//! The books balance when, per voucher:
//! - Postgres: `initial_stock = stock + orders`;
//! - Redis stock = Postgres stock - orders in flight (admitted, not yet written);
//! - Redis buyers = Postgres orders + orders in flight.
//!
//! Dead-lettered orders took a unit in Redis but never reached Postgres (their buyer
//! record is released when they are dead-lettered), so Redis may hold up to that many
//! units fewer (and, until the release, buyers more) than the rule says; anything else
//! is unexplained drift.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::time::Duration;

use chrono::{DateTime, Utc};
use redis::aio::ConnectionLike;
use sqlx::PgPool;

use crate::admission::keys::Keys;
use crate::admission::keys::SALE_FIELDS;
use crate::admission::loader::{self, Mode};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VoucherBooks {
    pub voucher_id: i64,
    pub initial_stock: i64,
    pub pg_stock: i64,
    pub pg_orders: i64,
    pub open: bool,
    /// `None`: the sale's state is not in Redis.
    pub redis_stock: Option<i64>,
    pub redis_buyers: i64,
    pub in_flight: i64,
    pub dead_letters: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Balanced,
    /// Differences the dead letters account for.
    Explained,
    /// An ended sale whose Redis state has expired: nothing to compare.
    Expired,
    /// An open sale with no Redis state: admission fails closed until it is loaded.
    Missing,
    Drift,
}

impl Verdict {
    pub fn is_ok(self) -> bool {
        matches!(
            self,
            Verdict::Balanced | Verdict::Explained | Verdict::Expired
        )
    }

    fn as_str(self) -> &'static str {
        match self {
            Verdict::Balanced => "ok",
            Verdict::Explained => "ok (dead letters)",
            Verdict::Expired => "expired",
            Verdict::Missing => "MISSING",
            Verdict::Drift => "DRIFT",
        }
    }
}

impl VoucherBooks {
    /// Redis stock minus what the rule expects (positive: Redis could sell units
    /// Postgres does not have).
    pub fn stock_drift(&self) -> Option<i64> {
        self.redis_stock
            .map(|s| s - (self.pg_stock - self.in_flight))
    }

    pub fn buyers_drift(&self) -> i64 {
        self.redis_buyers - (self.pg_orders + self.in_flight)
    }

    pub fn verdict(&self) -> Verdict {
        if self.initial_stock != self.pg_stock + self.pg_orders {
            return Verdict::Drift;
        }
        let Some(stock_drift) = self.stock_drift() else {
            return if self.open {
                Verdict::Missing
            } else {
                Verdict::Expired
            };
        };
        let buyers_drift = self.buyers_drift();
        if stock_drift == 0 && buyers_drift == 0 {
            return Verdict::Balanced;
        }
        let dead = self.dead_letters;
        if stock_drift <= 0 && -stock_drift <= dead && (0..=dead).contains(&buyers_drift) {
            Verdict::Explained
        } else {
            Verdict::Drift
        }
    }
}

/// The books of the given vouchers, or of every sale not ended longer ago than
/// `retention` ago.
pub async fn books<C: ConnectionLike + Send>(
    db: &PgPool,
    conn: &mut C,
    keys: &Keys,
    voucher: Option<i64>,
    retention: Duration,
) -> anyhow::Result<Vec<VoucherBooks>> {
    let since = Utc::now() - chrono::Duration::from_std(retention)?;
    let sales: Vec<(i64, i32, i32, DateTime<Utc>, i64)> = sqlx::query_as(
        "SELECT s.voucher_id, s.initial_stock, s.stock, s.end_time, \
                (SELECT count(*) FROM voucher_orders o WHERE o.voucher_id = s.voucher_id) \
         FROM seckill_vouchers s \
         WHERE ($1::int8 IS NULL AND s.end_time > $2) OR s.voucher_id = $1 \
         ORDER BY s.voucher_id",
    )
    .bind(voucher)
    .bind(since)
    .fetch_all(db)
    .await?;
    if let (Some(id), true) = (voucher, sales.is_empty()) {
        anyhow::bail!("voucher {id} has no flash sale");
    }

    let in_flight = in_flight_orders(db, conn, keys).await?;
    let dead = dead_letters_per_voucher(conn, keys).await?;
    let now = Utc::now();
    let mut out = Vec::with_capacity(sales.len());
    for (voucher_id, initial, stock, end, orders) in sales {
        let (redis_stock, fields): (Option<i64>, i64) = redis::pipe()
            .cmd("HGET")
            .arg(keys.voucher(voucher_id))
            .arg("stock")
            .cmd("HLEN")
            .arg(keys.voucher(voucher_id))
            .query_async(conn)
            .await?;
        let redis_buyers = (fields - SALE_FIELDS).max(0);
        out.push(VoucherBooks {
            voucher_id,
            initial_stock: initial as i64,
            pg_stock: stock as i64,
            pg_orders: orders,
            open: end > now,
            redis_stock,
            redis_buyers,
            in_flight: in_flight.get(&voucher_id).copied().unwrap_or(0),
            dead_letters: dead.get(&voucher_id).copied().unwrap_or(0),
        });
    }
    Ok(out)
}

/// Orders admitted in Redis and not yet in Postgres, per voucher: unacknowledged
/// stream entries whose order Postgres does not hold (an entry committed but not yet
/// acknowledged does not count).
async fn in_flight_orders<C: ConnectionLike + Send>(
    db: &PgPool,
    conn: &mut C,
    keys: &Keys,
) -> anyhow::Result<HashMap<i64, i64>> {
    let mut admitted: Vec<(i64, i64)> = Vec::new(); // (order_id, voucher_id)
    for shard in keys.shards() {
        for entry in crate::stream::unacknowledged(conn, keys, shard).await? {
            if let Some(order) = entry.order() {
                admitted.push((order.id, order.voucher_id));
            }
        }
    }
    let ids: Vec<i64> = admitted.iter().map(|(id, _)| *id).collect();
    let committed: HashSet<i64> =
        sqlx::query_scalar("SELECT id FROM voucher_orders WHERE id = ANY($1)")
            .bind(&ids)
            .fetch_all(db)
            .await?
            .into_iter()
            .collect();
    let mut per_voucher = HashMap::new();
    for (order_id, voucher_id) in admitted {
        if !committed.contains(&order_id) {
            *per_voucher.entry(voucher_id).or_default() += 1;
        }
    }
    Ok(per_voucher)
}

/// Dead letters per voucher (of the ones whose fields named a voucher).
pub async fn dead_letters_per_voucher<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
) -> anyhow::Result<HashMap<i64, i64>> {
    let mut per_voucher = HashMap::new();
    for entry in dead_letters(conn, keys, usize::MAX).await? {
        if let Some(Ok(voucher_id)) = entry.field("orig.voucher_id").map(str::parse::<i64>) {
            *per_voucher.entry(voucher_id).or_default() += 1;
        }
    }
    Ok(per_voucher)
}

/// One entry of the dead-letter stream.
#[derive(Debug, Clone)]
pub struct DeadLetter {
    pub id: String,
    pub fields: Vec<(String, String)>,
}

impl DeadLetter {
    pub fn field(&self, name: &str) -> Option<&str> {
        self.fields
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Up to `limit` dead letters of every shard, oldest first.
pub async fn dead_letters<C: ConnectionLike + Send>(
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

/// Rebuilds one sale's Redis state from Postgres (see `lua/load_voucher.lua`).
pub async fn repair<C: ConnectionLike + Send>(
    db: &PgPool,
    conn: &mut C,
    keys: &Keys,
    voucher_id: i64,
    retention: Duration,
) -> anyhow::Result<loader::Loaded> {
    loader::load_sale(db, conn, keys, voucher_id, retention, Mode::Repair)
        .await?
        .ok_or_else(|| anyhow::anyhow!("voucher {voucher_id} has no flash sale"))
}

/// The table `seckill reconcile` prints.
pub fn render(rows: &[VoucherBooks]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:>10} {:>9} {:>9} {:>9} {:>11} {:>12} {:>9} {:>12} {:>11} {:>12}  verdict",
        "voucher",
        "initial",
        "pg_stock",
        "pg_orders",
        "redis_stock",
        "redis_buyers",
        "in_flight",
        "dead_letters",
        "stock_drift",
        "buyers_drift"
    );
    for r in rows {
        let opt = |v: Option<i64>| v.map_or("-".to_string(), |v| v.to_string());
        let _ = writeln!(
            out,
            "{:>10} {:>9} {:>9} {:>9} {:>11} {:>12} {:>9} {:>12} {:>11} {:>12}  {}",
            r.voucher_id,
            r.initial_stock,
            r.pg_stock,
            r.pg_orders,
            opt(r.redis_stock),
            r.redis_buyers,
            r.in_flight,
            r.dead_letters,
            opt(r.stock_drift()),
            if r.redis_stock.is_some() {
                r.buyers_drift().to_string()
            } else {
                "-".into()
            },
            r.verdict().as_str()
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn books() -> VoucherBooks {
        VoucherBooks {
            voucher_id: 1,
            initial_stock: 100,
            pg_stock: 60,
            pg_orders: 40,
            open: true,
            redis_stock: Some(50),
            redis_buyers: 50,
            in_flight: 10,
            dead_letters: 0,
        }
    }

    #[test]
    fn books_that_balance_with_orders_in_flight_are_ok() {
        assert_eq!(books().verdict(), Verdict::Balanced);
    }

    #[test]
    fn redis_holding_more_stock_than_postgres_allows_is_drift() {
        let b = VoucherBooks {
            redis_stock: Some(51),
            ..books()
        };
        assert_eq!(b.verdict(), Verdict::Drift);
    }

    #[test]
    fn dead_letters_explain_missing_units_and_extra_buyers_but_no_more() {
        let b = VoucherBooks {
            redis_stock: Some(48),
            redis_buyers: 52,
            dead_letters: 2,
            ..books()
        };
        assert_eq!(b.verdict(), Verdict::Explained);
        let b = VoucherBooks {
            redis_stock: Some(47),
            ..b
        };
        assert_eq!(b.verdict(), Verdict::Drift);
    }

    #[test]
    fn lost_buyers_or_postgres_out_of_balance_is_drift() {
        let b = VoucherBooks {
            redis_buyers: 49,
            ..books()
        };
        assert_eq!(b.verdict(), Verdict::Drift);
        let b = VoucherBooks {
            pg_stock: 61,
            ..books()
        };
        assert_eq!(b.verdict(), Verdict::Drift);
    }

    #[test]
    fn missing_state_matters_only_while_the_sale_is_open() {
        let b = VoucherBooks {
            redis_stock: None,
            redis_buyers: 0,
            ..books()
        };
        assert_eq!(b.verdict(), Verdict::Missing);
        assert_eq!(
            VoucherBooks { open: false, ..b }.verdict(),
            Verdict::Expired
        );
    }
}
