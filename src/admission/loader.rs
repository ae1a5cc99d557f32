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

/// How [`load_sale`] treats existing state and orders in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// A sale just created: load if missing; no order can be in flight yet.
    Create,
    /// Load if missing, counting the orders in flight (state lost during a sale).
    Load,
    /// Overwrite live state (`seckill reconcile --repair`).
    Repair,
}

impl Mode {
    fn as_str(self) -> &'static str {
        match self {
            Mode::Create => "create",
            Mode::Load => "load",
            Mode::Repair => "repair",
        }
    }
}

/// What [`load_sale`] put into Redis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Loaded {
    pub stock: i64,
    pub buyers: i64,
    pub in_flight: i64,
}

/// Loads one sale from one Postgres snapshot (see `lua/load_voucher.lua`): buyers are
/// Postgres's buyers plus the orders in flight, stock is Postgres's minus those.
/// `None` when live state was left alone or the voucher has no flash sale.
#[tracing::instrument(skip(db, conn, keys))]
pub async fn load_sale<C: ConnectionLike + Send>(
    db: &PgPool,
    conn: &mut C,
    keys: &Keys,
    voucher_id: i64,
    retention: Duration,
    mode: Mode,
) -> anyhow::Result<Option<Loaded>> {
    let Some((sale, buyers)) = store::vouchers::sale_snapshot(db, voucher_id).await? else {
        return Ok(None);
    };
    let end_ms = sale.end_time.timestamp_millis();
    let mut load = LOAD.prepare_invoke();
    load.key(keys.voucher(voucher_id))
        .key(keys.stream(keys.shard_of(voucher_id)))
        .arg(mode.as_str())
        .arg(voucher_id)
        .arg(sale.stock)
        .arg(sale.begin_time.timestamp_millis())
        .arg(end_ms)
        .arg(end_ms.saturating_add(retention.as_millis() as i64))
        .arg(crate::stream::GROUP);
    for (user_id, order_id) in &buyers {
        load.arg(user_id).arg(order_id);
    }
    let reply: Vec<i64> = load.invoke_async(conn).await?;
    let [stock, buyers, in_flight] = reply[..] else {
        return Ok(None);
    };
    tracing::info!(
        voucher_id,
        stock,
        buyers,
        in_flight,
        ?mode,
        "sale state loaded into redis"
    );
    Ok(Some(Loaded {
        stock,
        buyers,
        in_flight,
    }))
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
        match load_sale(db, conn, keys, sale.voucher_id, retention, Mode::Load).await? {
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
            Mode::Load,
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
