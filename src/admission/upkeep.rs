//! Keeping an API process's order-id node lease (see [`super::order_id`]).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::order_id::{Claimed, Claims, NodeLease, OrderIds, Renewal, LEASE_RENEW_EVERY};
use crate::backoff::Backoff;
use crate::keys::Keys;
use crate::redis_conn::RedisConn;
use crate::scripts::Replicas;

/// What keeping the lease works with.
#[derive(Clone)]
pub(crate) struct Upkeep {
    pub redis: RedisConn,
    pub keys: Keys,
    /// Told the leased node number, and how long it is good for.
    pub ids: Arc<OrderIds>,
    pub replicas: Replicas,
    /// Woken when the lease's key was gone (Redis lost its data): the term watcher
    /// rebuilds what else went with it.
    pub redis_lost_data: Arc<Notify>,
    /// This process's claims (one token; a number whose claim's outcome is unknown).
    pub claims: Arc<Claims>,
}

/// Claims a node number and waits out its grace (see [`super::order_id::LEASE_GRACE`]),
/// then tells `ids` to mint with it.
pub(crate) async fn claim(u: &Upkeep) -> anyhow::Result<NodeLease> {
    let Claimed { lease, sent, wait } =
        NodeLease::acquire(&mut u.redis.clone(), &u.keys, u.replicas, &u.claims).await?;
    if !wait.is_zero() {
        tracing::info!(
            node = lease.node,
            ?wait,
            "the redis server's term is young (it started, failed over or was restored \
             moments ago, so it may have lost another process's live lease on this node \
             number): waiting out the lease's renewal window before minting order ids, \
             so that no order id is minted twice (docs/durability.md)"
        );
        tokio::time::sleep(wait).await;
    }
    // The grace ran past the claim's own validity: confirm it again before minting.
    let renewed = Instant::now();
    let good_from = match wait.is_zero() {
        true => sent,
        false => match lease.renew(&mut u.redis.clone(), u.replicas).await? {
            Renewal::Extended => renewed,
            _ => anyhow::bail!("order-id node {} was taken during its grace", lease.node),
        },
    };
    u.ids
        .set_node(lease.node, good_from + super::order_id::LEASE_VALID);
    tracing::info!(node = lease.node, "order-id node leased");
    Ok(lease)
}

/// Holds the lease until `cancel`: renews it every [`LEASE_RENEW_EVERY`] (each renewal
/// Redis confirms extends the minting), claims a new one when it was lost.
/// `lease`: one claimed at start-up, if any.
pub(crate) async fn run(u: Upkeep, lease: Option<NodeLease>, cancel: CancellationToken) {
    let mut conn = u.redis.clone();
    let mut backoff = Backoff::new(Duration::from_millis(200), LEASE_RENEW_EVERY);
    let mut lease = lease;
    while !cancel.is_cancelled() {
        let step = async {
            match &lease {
                Some(l) => {
                    let sent = Instant::now();
                    match l.renew(&mut conn, u.replicas).await? {
                        Renewal::Extended => u.ids.confirm(sent),
                        Renewal::Recreated => {
                            tracing::warn!("redis lost the order-id lease: it lost its data");
                            u.ids.confirm(sent);
                            u.redis_lost_data.notify_one();
                        }
                        Renewal::Lost => {
                            // Stop minting with a number somebody else holds.
                            u.ids.clear_node();
                            tracing::warn!(node = l.node, "order-id node lease lost");
                            lease = None;
                        }
                    }
                }
                None => lease = Some(claim(&u).await?),
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
                tracing::warn!(error = %e, "order-id lease step failed, retrying");
                backoff.next_delay()
            }
        };
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = tokio::time::sleep(pause) => {}
        }
    }
}
