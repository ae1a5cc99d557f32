//! Background duties of every API process.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::loader;
use super::order_id::{NodeLease, Renewal, LEASE_RENEW_EVERY};
use std::sync::Arc;

use sqlx::PgPool;

use super::order_id::OrderIds;
use crate::backoff::Backoff;
use crate::keys::Keys;
use crate::redis_conn::RedisConn;

/// What the background duties work with.
#[derive(Clone)]
pub(crate) struct Upkeep {
    pub db: PgPool,
    pub redis: RedisConn,
    pub keys: Keys,
    /// Told the leased node number (and told to stop minting when the lease is lost).
    pub ids: Arc<OrderIds>,
    /// How long a sale's Redis state outlives its end.
    pub retention: Duration,
}

/// Holds an order-id node lease, and loads every open sale whose Redis state is missing:
/// at start, and again whenever the lease shows that Redis lost its data (restart
/// without persistence, FLUSHALL, failover).
/// `lease`: one already acquired at start-up, if any.
pub(crate) async fn run(state: Upkeep, lease: Option<NodeLease>, cancel: CancellationToken) {
    let mut conn: RedisConn = state.redis.clone();
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
    let mut lease = lease;
    // Cleared only once a load of the open sales has succeeded (Postgres may be down).
    let mut reload = true;
    while !cancel.is_cancelled() {
        let step = async {
            if let Some(l) = &lease {
                match l.renew(&mut conn).await? {
                    Renewal::Extended => {}
                    Renewal::Recreated => {
                        tracing::warn!("redis lost its data: reloading open sales");
                        reload = true;
                    }
                    Renewal::Lost => {
                        // Stop minting with a number somebody else holds.
                        state.ids.clear_node();
                        lease = None;
                        reload = true;
                    }
                }
            }
            if lease.is_none() {
                let l = NodeLease::acquire(&mut conn, &state.keys).await?;
                state.ids.set_node(l.node);
                tracing::info!(node = l.node, "order-id node leased");
                lease = Some(l);
            }
            if reload {
                let report =
                    loader::load_open_sales(&state.db, &mut conn, &state.keys, state.retention)
                        .await?;
                tracing::info!(?report, "open sales checked");
                reload = false;
            }
            anyhow::Ok(())
        }
        .await;
        let pause = match step {
            Ok(()) => {
                backoff.reset();
                LEASE_RENEW_EVERY
            }
            Err(e) => {
                tracing::warn!(error = %e, "bootstrap step failed, retrying");
                backoff.next_delay()
            }
        };
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = tokio::time::sleep(pause) => {}
        }
    }
}
