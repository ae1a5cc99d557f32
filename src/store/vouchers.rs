//! `vouchers` and `seckill_vouchers`.

use chrono::{DateTime, Utc};
use sqlx::{FromRow, PgPool};

use crate::domain::{DrawSeed, Opening, OrderId, UserId, VoucherId, VoucherTerms};

/// A validated voucher to create.
#[derive(Debug, Clone)]
pub struct NewVoucher {
    pub terms: VoucherTerms,
    pub seckill: Option<NewSeckill>,
}

#[derive(Debug, Clone)]
pub struct NewSeckill {
    pub stock: i32,
    pub begin_time: DateTime<Utc>,
    pub end_time: DateTime<Utc>,
    /// An order's payment deadline is its writing (`created_at`) plus this.
    pub pay_within_secs: i32,
    /// Segments the stock is split over (1 to 64).
    pub segments: u8,
    pub opening: Opening,
}

#[derive(Debug, Clone, FromRow)]
pub(crate) struct VoucherRow {
    pub id: VoucherId,
    #[sqlx(flatten)]
    pub terms: VoucherTerms,
    pub created_at: DateTime<Utc>,
    pub initial_stock: Option<i32>,
    pub stock: Option<i32>,
    pub begin_time: Option<DateTime<Utc>>,
    pub end_time: Option<DateTime<Utc>>,
    pub pay_within_secs: Option<i32>,
    pub segments: Option<i16>,
    pub opening_mode: Option<String>,
    pub lottery_window_ms: Option<i32>,
    pub draw_commitment: Option<String>,
}

/// A flash sale, as far as finding the ones to load needs.
#[derive(Debug, Clone, FromRow)]
pub(crate) struct SeckillState {
    pub voucher_id: VoucherId,
    pub end_time: DateTime<Utc>,
    pub segments: i16,
}

impl SeckillState {
    pub fn segments(&self) -> u8 {
        self.segments as u8
    }
}

const SELECT_VOUCHER: &str = "SELECT v.id, v.shop_id, v.title, v.sub_title, v.rules, \
     v.pay_value, v.actual_value, v.refundable, v.created_at, \
     s.initial_stock, s.stock, s.begin_time, s.end_time, s.pay_within_secs, s.segments, \
     s.opening_mode, s.lottery_window_ms, s.draw_commitment \
     FROM vouchers v LEFT JOIN seckill_vouchers s ON s.voucher_id = v.id";

/// Creates the voucher and its flash-sale part in one transaction.
#[tracing::instrument(skip_all, fields(shop_id = new.terms.shop_id))]
pub(crate) async fn insert(db: &PgPool, new: &NewVoucher) -> Result<VoucherRow, sqlx::Error> {
    let mut tx = db.begin().await?;
    let id: VoucherId = sqlx::query_scalar(
        "INSERT INTO vouchers \
           (shop_id, title, sub_title, rules, pay_value, actual_value, refundable) \
         VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING id",
    )
    .bind(new.terms.shop_id)
    .bind(&new.terms.title)
    .bind(&new.terms.sub_title)
    .bind(&new.terms.rules)
    .bind(new.terms.pay_value)
    .bind(new.terms.actual_value)
    .bind(new.terms.refundable)
    .fetch_one(&mut *tx)
    .await?;
    if let Some(s) = &new.seckill {
        // A lottery's seed is drawn here and kept secret until its draw; its commitment
        // is published with the voucher.
        let seed = matches!(s.opening, Opening::Lottery { .. }).then(DrawSeed::random);
        sqlx::query(
            "INSERT INTO seckill_vouchers \
                 (voucher_id, initial_stock, stock, begin_time, end_time, pay_within_secs, \
                  segments, opening_mode, lottery_window_ms, draw_seed, draw_commitment) \
             VALUES ($1, $2, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
        )
        .bind(id)
        .bind(s.stock)
        .bind(s.begin_time)
        .bind(s.end_time)
        .bind(s.pay_within_secs)
        .bind(s.segments as i16)
        .bind(s.opening.mode())
        .bind(s.opening.window_ms())
        .bind(seed.as_ref().map(DrawSeed::hex))
        .bind(seed.as_ref().map(DrawSeed::commitment))
        .execute(&mut *tx)
        .await?;
        super::segments::insert_allotments(&mut tx, id, s.stock, s.segments).await?;
    }
    let row = sqlx::query_as::<_, VoucherRow>(&format!("{SELECT_VOUCHER} WHERE v.id = $1"))
        .bind(id)
        .fetch_one(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(row)
}

#[tracing::instrument(skip(db))]
pub(crate) async fn get(db: &PgPool, id: VoucherId) -> Result<Option<VoucherRow>, sqlx::Error> {
    sqlx::query_as(&format!("{SELECT_VOUCHER} WHERE v.id = $1"))
        .bind(id)
        .fetch_optional(db)
        .await
}

#[tracing::instrument(skip(db))]
pub(crate) async fn list_by_shop(
    db: &PgPool,
    shop_id: i64,
) -> Result<Vec<VoucherRow>, sqlx::Error> {
    sqlx::query_as(&format!(
        "{SELECT_VOUCHER} WHERE v.shop_id = $1 ORDER BY v.id LIMIT 1000"
    ))
    .bind(shop_id)
    .fetch_all(db)
    .await
}

/// The sales that ended after `since` (or have not ended).
#[tracing::instrument(skip(db))]
pub(crate) async fn sales_ending_after(
    db: &PgPool,
    since: DateTime<Utc>,
) -> Result<Vec<SeckillState>, sqlx::Error> {
    sqlx::query_as(
        "SELECT voucher_id, end_time, segments FROM seckill_vouchers \
         WHERE end_time > $1 ORDER BY voucher_id",
    )
    .bind(since)
    .fetch_all(db)
    .await
}

/// What Postgres holds under a voucher id: [`sale`]'s answer.
#[derive(Debug)]
pub(crate) enum SaleLookup {
    NoVoucher,
    NoSale,
    Sale(SeckillState),
}

/// The voucher's flash sale, or which of voucher and sale is missing: one query, so a
/// grab of an unknown id can say which without asking twice.
#[tracing::instrument(skip(db))]
pub(crate) async fn sale(db: &PgPool, voucher_id: VoucherId) -> Result<SaleLookup, sqlx::Error> {
    let row: Option<(Option<DateTime<Utc>>, Option<i16>)> = sqlx::query_as(
        "SELECT s.end_time, s.segments FROM vouchers v \
         LEFT JOIN seckill_vouchers s ON s.voucher_id = v.id WHERE v.id = $1",
    )
    .bind(voucher_id)
    .fetch_optional(db)
    .await?;
    Ok(match row {
        None => SaleLookup::NoVoucher,
        Some((Some(end_time), Some(segments))) => SaleLookup::Sale(SeckillState {
            voucher_id,
            end_time,
            segments,
        }),
        Some(_) => SaleLookup::NoSale,
    })
}

/// Payment windows (seconds) of the given sales, for showing a pending order's deadline.
#[tracing::instrument(skip(db))]
pub(crate) async fn pay_windows(
    db: &PgPool,
    voucher_ids: &[VoucherId],
) -> Result<std::collections::HashMap<VoucherId, i32>, sqlx::Error> {
    if voucher_ids.is_empty() {
        return Ok(Default::default());
    }
    Ok(sqlx::query_as::<_, (VoucherId, i32)>(
        "SELECT voucher_id, pay_within_secs FROM seckill_vouchers WHERE voucher_id = ANY($1)",
    )
    .bind(voucher_ids)
    .fetch_all(db)
    .await?
    .into_iter()
    .collect())
}

/// `(user_id, order_id)` of every order of a sale: the buyers Redis must know.
pub(crate) type Buyers = Vec<(UserId, OrderId)>;

/// `(user_id, order_id)` of the sale's active orders (created or paid: the ones holding
/// a unit), without a lock (a hint, re-read under it).
#[tracing::instrument(skip(db))]
pub(crate) async fn buyers<'e>(
    db: impl sqlx::PgExecutor<'e>,
    voucher_id: VoucherId,
) -> Result<Buyers, sqlx::Error> {
    sqlx::query_as(&format!(
        "SELECT user_id, id FROM voucher_orders WHERE voucher_id = $1 AND {}",
        super::admitted::ACTIVE
    ))
    .bind(voucher_id)
    .fetch_all(db)
    .await
}

/// A sale as the loader sees it under its row lock.
#[derive(Debug, Clone, FromRow)]
pub(crate) struct LockedSale {
    pub initial_stock: i32,
    pub stock: i32,
    pub begin_time: DateTime<Utc>,
    pub end_time: DateTime<Utc>,
    pub segments: i16,
    /// A lottery's entry window (`None`: first come).
    pub lottery_window_ms: Option<i32>,
    /// A lottery's secret seed, until it is drawn.
    pub draw_seed: Option<String>,
    /// Whether the draw's record has reached Postgres.
    pub drawn: bool,
}

/// Locks a sale's row (the fence against the worker's commits and burials for it, which
/// take the same lock) and reads it with its buyers. Nothing about the sale can change
/// in Postgres until `tx` ends. `None` when the voucher has no flash sale.
#[tracing::instrument(skip(tx))]
pub(crate) async fn lock_sale(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    voucher_id: VoucherId,
) -> Result<Option<(LockedSale, Buyers)>, sqlx::Error> {
    let sale: Option<LockedSale> = sqlx::query_as(
        "SELECT initial_stock, stock, begin_time, end_time, segments, lottery_window_ms, \
           draw_seed, EXISTS (SELECT 1 FROM sale_draws d WHERE d.voucher_id = $1) AS drawn \
         FROM seckill_vouchers WHERE voucher_id = $1 FOR NO KEY UPDATE",
    )
    .bind(voucher_id)
    .fetch_optional(&mut **tx)
    .await?;
    let Some(sale) = sale else {
        return Ok(None);
    };
    // A new statement: it sees every commit made before the lock was granted.
    let buyers = buyers(&mut **tx, voucher_id).await?;
    Ok(Some((sale, buyers)))
}

/// Ends a sale at `end_ms` (Unix ms) unless it ends earlier already; its beginning moves
/// to at most a millisecond before, as `seckill_close` (`lua/lifecycle.lua`) does in Redis.
#[tracing::instrument(skip(tx))]
pub(crate) async fn end_sale_at(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    voucher_id: VoucherId,
    end_ms: i64,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE seckill_vouchers SET \
           end_time = least(end_time, to_timestamp($2::float8 / 1000)), \
           begin_time = least(begin_time, \
             least(end_time, to_timestamp($2::float8 / 1000)) - interval '1 millisecond'), \
           updated_at = now() \
         WHERE voucher_id = $1",
    )
    .bind(voucher_id)
    .bind(end_ms)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Locks the flash-sale rows of the given vouchers, in voucher order so concurrent
/// transactions cannot deadlock each other on them, and returns how many exist. Waits at
/// most the session's `lock_timeout`.
pub(crate) async fn lock_sales(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    voucher_ids: &[VoucherId],
) -> Result<u64, sqlx::Error> {
    let mut ids = voucher_ids.to_vec();
    ids.sort_unstable();
    ids.dedup();
    sqlx::query(
        "SELECT 1 FROM seckill_vouchers WHERE voucher_id = ANY($1) \
         ORDER BY voucher_id FOR NO KEY UPDATE",
    )
    .bind(&ids)
    .execute(&mut **tx)
    .await
    .map(|done| done.rows_affected())
}
