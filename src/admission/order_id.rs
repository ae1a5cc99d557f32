//! Order ids: 64-bit, time-ordered, unique across API instances and restarts, minted
//! in-process (no network round trip on the hot path).
//!
//! Layout (a positive i64): 41 bits of milliseconds since 2026-01-01, 10 bits of node
//! number, 12 bits of sequence. The node number is leased in Redis (see [`NodeLease`])
//! so no two live instances mint with one:
//! - a process mints only while its lease was confirmed lately: until
//!   [`LEASE_VALID`] after sending the last renewal Redis answered (a renewal that
//!   fails, or never comes back, stops the minting);
//! - Redis can lose a live holder's lease (a restart from an older copy, a failover to
//!   a replica that never got it). The server's term (see [`super::term`]) is drawn
//!   anew then, so a claim on a server whose term is younger than [`LEASE_GRACE`] waits
//!   until it is that old: by then the old holder has either renewed (and the claim
//!   found the number taken) or stopped minting.
//!
//! A restarted instance only gets a number after the lease of its previous holder
//! expired, i.e. after every id that holder minted lies in the past: by Redis's clock,
//! which every process mints by ([`crate::clock`]), not by its own.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::LazyLock;
use std::time::Duration;

use redis::aio::ConnectionLike;
use tokio::time::Instant;

use crate::domain::OrderId;
use crate::keys::Keys;
use crate::scripts::{Call, Replicas};

/// 2026-01-01T00:00:00Z in Unix milliseconds.
pub const EPOCH_MS: u64 = 1_767_225_600_000;
const NODE_BITS: u32 = 10;
const SEQ_BITS: u32 = 12;
pub(crate) const NODES: u16 = 1 << NODE_BITS;
const NO_NODE: u64 = u64::MAX;

/// Mints order ids once a node number is set, while its lease is confirmed.
#[derive(Debug)]
pub struct OrderIds {
    node: AtomicU64,
    /// Milliseconds after [`START`] until which the lease is known good.
    valid_until: AtomicU64,
    /// `(ms << SEQ_BITS) | seq` of the last id: ids never go backwards, even if the
    /// wall clock does; a sequence overflow borrows the next millisecond.
    last: AtomicU64,
}

/// The monotonic clock's origin for [`OrderIds`]' validity.
static START: LazyLock<Instant> = LazyLock::new(Instant::now);

fn mono_ms(at: Instant) -> u64 {
    at.saturating_duration_since(*START).as_millis() as u64
}

impl Default for OrderIds {
    fn default() -> Self {
        Self {
            node: AtomicU64::new(NO_NODE),
            valid_until: AtomicU64::new(0),
            last: AtomicU64::new(0),
        }
    }
}

impl OrderIds {
    #[cfg(test)]
    fn with_node(node: u16) -> Self {
        let ids = Self::default();
        ids.set_node(node, Instant::now() + Duration::from_secs(3600));
        ids
    }

    /// Mints with `node` until `valid_until` (or a later [`OrderIds::confirm`]).
    pub(crate) fn set_node(&self, node: u16, valid_until: Instant) {
        assert!(node < NODES, "node number out of range");
        self.valid_until
            .store(mono_ms(valid_until), Ordering::Release);
        self.node.store(node as u64, Ordering::Release);
    }

    /// The lease was renewed by a request sent at `sent`.
    pub(crate) fn confirm(&self, sent: Instant) {
        self.valid_until
            .fetch_max(mono_ms(sent + LEASE_VALID), Ordering::AcqRel);
    }

    /// Stops minting until a node number is set again.
    pub(crate) fn clear_node(&self) {
        self.node.store(NO_NODE, Ordering::Release);
    }

    /// The node number, while its lease is confirmed.
    pub(crate) fn node(&self) -> Option<u16> {
        match self.node.load(Ordering::Acquire) {
            NO_NODE => None,
            _ if mono_ms(Instant::now()) >= self.valid_until.load(Ordering::Acquire) => None,
            n => Some(n as u16),
        }
    }

    /// The next id, or `None` while no node number is leased.
    pub fn next(&self) -> Option<OrderId> {
        let node = self.node()? as u64;
        let now = now_ms().saturating_sub(EPOCH_MS) << SEQ_BITS;
        let mut cur = self.last.load(Ordering::Relaxed);
        let next = loop {
            let candidate = now.max(cur + 1);
            match self.last.compare_exchange_weak(
                cur,
                candidate,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => break candidate,
                Err(seen) => cur = seen,
            }
        };
        let ms = next >> SEQ_BITS;
        let seq = next & ((1 << SEQ_BITS) - 1);
        OrderId::new(((ms << (NODE_BITS + SEQ_BITS)) | (node << SEQ_BITS) | seq) as i64)
    }
}

/// Redis's clock, as this process knows it (see [`crate::clock`]): two processes that
/// hold one node number in turn mint by the same clock, whatever their own say.
fn now_ms() -> u64 {
    crate::clock::now_ms().max(0) as u64
}

/// When an order id was minted (ms since the Unix epoch, by Redis's clock): its
/// admission, read from the id alone.
pub fn timestamp_ms(order_id: OrderId) -> u64 {
    ((order_id.get() as u64) >> (NODE_BITS + SEQ_BITS)) + EPOCH_MS
}

/// A node number held in Redis with a time-to-live, renewed while the process lives.
pub(crate) struct NodeLease {
    keys: Keys,
    token: String,
    pub node: u16,
}

pub(crate) const LEASE_TTL: Duration = Duration::from_secs(60);
/// How often a lease is renewed.
pub(crate) const LEASE_RENEW_EVERY: Duration = Duration::from_secs(1);
/// How long after sending a renewal (or claim) that Redis confirmed, ids may be minted.
pub(crate) const LEASE_VALID: Duration = Duration::from_secs(3);
/// How old the server's term must be before a number claimed on it is used: longer
/// than any holder whose lease the server lost may still mint.
pub(crate) const LEASE_GRACE: Duration = Duration::from_secs(4);

/// One process's claims of node numbers: one token for all of them, and the number
/// whose last claim has an unknown outcome (its answer was lost, or its replicas did
/// not acknowledge in time: Redis may hold it for us). That number is claimed again
/// first, with the same token, so claims that keep failing do not leave numbers leased
/// to nobody until their keys expire.
#[derive(Debug)]
pub(crate) struct Claims {
    token: String,
    unsettled: std::sync::Mutex<Option<u16>>,
}

impl Default for Claims {
    fn default() -> Self {
        Self {
            token: format!("{}-{}", std::process::id(), rand::random::<u64>()),
            unsettled: std::sync::Mutex::new(None),
        }
    }
}

impl Claims {
    fn unsettled(&self) -> std::sync::MutexGuard<'_, Option<u16>> {
        self.unsettled.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A claimed lease, and how long to wait before minting with it.
pub(crate) struct Claimed {
    pub lease: NodeLease,
    /// When the claim was sent (the lease is good for [`LEASE_VALID`] after it).
    pub sent: Instant,
    pub wait: Duration,
}

impl NodeLease {
    /// Claims a free node number: the one whose last claim has an unknown outcome, if
    /// any, else starting from a random one (a restart spreads out, and after Redis lost
    /// its data two claims rarely meet).
    pub(crate) async fn acquire<C: ConnectionLike + Send>(
        conn: &mut C,
        keys: &Keys,
        replicas: Replicas,
        claims: &Claims,
    ) -> anyhow::Result<Claimed> {
        // Ids carry the minting time by Redis's clock: heard before the first is minted.
        crate::clock::sync(conn).await?;
        let start: u64 = match *claims.unsettled() {
            Some(node) => node as u64,
            None => rand::random::<u64>() % NODES as u64,
        };
        for i in 0..NODES as u64 {
            let node = ((start + i) % NODES as u64) as u16;
            let sent = Instant::now();
            let lease = keys.node_lease(node);
            let claim: redis::RedisResult<(bool, u64)> = Call::function("seckill_claim_lease")
                .key(&lease)
                .key(keys.marker_beside(&lease))
                .arg(&claims.token)
                .arg(LEASE_TTL.as_millis() as u64)
                .invoke_waiting(conn, replicas)
                .await;
            let (claimed, term_age_ms) = match claim {
                Ok(answer) => answer,
                Err(e) => {
                    // Sent, its outcome unknown: this number first next time. (Refused:
                    // nothing changed, and an earlier unknown claim of it still stands.)
                    if !crate::scripts::surely_not_run(&e) {
                        *claims.unsettled() = Some(node);
                    }
                    return Err(e.into());
                }
            };
            *claims.unsettled() = None;
            if claimed {
                let age = Duration::from_millis(term_age_ms);
                return Ok(Claimed {
                    lease: Self {
                        keys: keys.clone(),
                        token: claims.token.clone(),
                        node,
                    },
                    sent,
                    wait: LEASE_GRACE.saturating_sub(age),
                });
            }
        }
        anyhow::bail!("all {NODES} order-id node numbers are leased")
    }

    /// Extends the lease.
    pub(crate) async fn renew<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        replicas: Replicas,
    ) -> anyhow::Result<Renewal> {
        let lease = self.keys.node_lease(self.node);
        let code: i64 = Call::function("seckill_renew_lease")
            .key(&lease)
            .key(self.keys.marker_beside(&lease))
            .arg(&self.token)
            .arg(LEASE_TTL.as_millis() as u64)
            .invoke_waiting(conn, replicas)
            .await?;
        Ok(match code {
            1 => Renewal::Extended,
            2 => Renewal::Recreated,
            _ => Renewal::Lost,
        })
    }
}

/// What renewing a lease found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Renewal {
    Extended,
    /// The lease key was gone (Redis restarted empty or lost data) and is ours again.
    Recreated,
    /// Another process holds the number now: stop minting with it.
    Lost,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn ids_are_positive_strictly_increasing_and_carry_the_node() {
        let ids = OrderIds::with_node(1023);
        let mut prev = 0;
        for _ in 0..100_000 {
            let id = ids.next().unwrap().get();
            assert!(id > prev);
            assert_eq!((id >> SEQ_BITS) & 0x3ff, 1023);
            prev = id;
        }
    }

    #[test]
    fn no_id_is_minted_before_a_node_is_leased() {
        assert_eq!(OrderIds::default().next(), None);
    }

    #[test]
    fn two_nodes_never_mint_the_same_id_even_in_the_same_millisecond() {
        let a = OrderIds::with_node(1);
        let b = OrderIds::with_node(2);
        let mut seen = HashSet::new();
        for _ in 0..20_000 {
            assert!(seen.insert(a.next().unwrap()));
            assert!(seen.insert(b.next().unwrap()));
        }
    }

    #[test]
    fn no_id_is_minted_once_the_lease_was_not_confirmed_lately() {
        let ids = OrderIds::default();
        let sent = Instant::now();
        ids.set_node(7, sent + LEASE_VALID);
        assert!(ids.next().is_some());
        ids.set_node(7, sent);
        assert_eq!(ids.next(), None, "past the validity");
        ids.confirm(Instant::now());
        assert!(ids.next().is_some(), "a renewal confirmed it again");
    }

    #[test]
    fn the_timestamp_of_an_id_is_now() {
        let id = OrderIds::with_node(5).next().unwrap();
        let diff = timestamp_ms(id).abs_diff(now_ms());
        assert!(diff < 5_000, "{diff}");
    }
}
