//! Loading flash-sale state from Postgres into Redis: at voucher creation, at start-up,
//! and on line when admission finds a sale's state missing (Redis restarted or lost data).
//! Live state is never overwritten.

use std::sync::LazyLock;
use std::time::Duration;

use redis::aio::ConnectionLike;
use redis::Script;
use sqlx::PgPool;

use super::keys::Keys;
use crate::state::AppState;
use crate::store;

static LOAD: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../lua/load_voucher.lua")));

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct LoadReport {
    /// Sales whose state was missing and is now loaded.
    pub loaded: usize,
    /// Sales whose live state was already there (left alone).
    pub live: usize,
}

/// Loads one sale unless its state is live. Returns the stock loaded, `None` when
/// the state was already there or the voucher has no flash sale.
#[tracing::instrument(skip(db, conn, keys))]
pub async fn load_sale<C: ConnectionLike + Send>(
    db: &PgPool,
    conn: &mut C,
    keys: &Keys,
    voucher_id: i64,
    retention: Duration,
) -> anyhow::Result<Option<i64>> {
    let Some((sale, buyers)) = store::vouchers::sale_snapshot(db, voucher_id).await? else {
        return Ok(None);
    };
    let end_ms = sale.end_time.timestamp_millis();
    let mut load = LOAD.prepare_invoke();
    load.key(keys.voucher(voucher_id))
        .key(keys.buyers(voucher_id))
        .arg(sale.stock)
        .arg(sale.begin_time.timestamp_millis())
        .arg(end_ms)
        .arg(end_ms.saturating_add(retention.as_millis() as i64));
    for (user_id, order_id) in &buyers {
        load.arg(user_id).arg(order_id);
    }
    let stock: i64 = load.invoke_async(conn).await?;
    if stock < 0 {
        return Ok(None);
    }
    tracing::info!(
        voucher_id,
        stock,
        buyers = buyers.len(),
        "sale state loaded into redis"
    );
    Ok(Some(stock))
}

/// Loads every sale that has not ended and whose Redis state is missing.
pub async fn load_open_sales<C: ConnectionLike + Send>(
    db: &PgPool,
    conn: &mut C,
    keys: &Keys,
    retention: Duration,
) -> anyhow::Result<LoadReport> {
    let mut report = LoadReport::default();
    for sale in store::vouchers::open_sales(db).await? {
        match load_sale(db, conn, keys, sale.voucher_id, retention).await? {
            Some(_) => report.loaded += 1,
            None => report.live += 1,
        }
    }
    Ok(report)
}

/// Starts a reload of one sale in the background unless one is already running.
pub fn reload_in_background(state: &AppState, voucher_id: i64) {
    if !state.reloading.lock().expect("poisoned").insert(voucher_id) {
        return;
    }
    let state = state.clone();
    tokio::spawn(async move {
        let mut conn = state.redis.clone();
        let result = load_sale(
            &state.db,
            &mut conn,
            &state.keys,
            voucher_id,
            state.settings.sale_state_retention,
        )
        .await;
        if let Err(e) = result {
            tracing::warn!(voucher_id, error = %e, "reloading sale state failed");
        }
        state
            .reloading
            .lock()
            .expect("poisoned")
            .remove(&voucher_id);
    });
}
