//! Order ids: 64-bit, time-ordered, unique across API instances and restarts, minted
//! in-process (no network round trip on the hot path).
//!
//! Layout (a positive i64): 41 bits of milliseconds since 2026-01-01, 10 bits of node
//! number, 12 bits of sequence. The node number is leased in Redis (see
//! [`NodeLease`]) so no two live instances share one; a restarted instance only gets a
//! number after the lease of its previous holder expired, i.e. after every id that
//! holder minted lies in the past.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use redis::aio::ConnectionLike;

use crate::keys::Keys;

/// 2026-01-01T00:00:00Z in Unix milliseconds.
const EPOCH_MS: u64 = 1_767_225_600_000;
const NODE_BITS: u32 = 10;
const SEQ_BITS: u32 = 12;
pub(crate) const NODES: u16 = 1 << NODE_BITS;
const NO_NODE: u64 = u64::MAX;

/// Mints order ids once a node number is set.
#[derive(Debug)]
pub struct OrderIds {
    node: AtomicU64,
    /// `(ms << SEQ_BITS) | seq` of the last id: ids never go backwards, even if the
    /// wall clock does; a sequence overflow borrows the next millisecond.
    last: AtomicU64,
}

impl Default for OrderIds {
    fn default() -> Self {
        Self {
            node: AtomicU64::new(NO_NODE),
            last: AtomicU64::new(0),
        }
    }
}

impl OrderIds {
    #[cfg(test)]
    fn with_node(node: u16) -> Self {
        let ids = Self::default();
        ids.set_node(node);
        ids
    }

    pub(crate) fn set_node(&self, node: u16) {
        assert!(node < NODES, "node number out of range");
        self.node.store(node as u64, Ordering::Release);
    }

    /// Stops minting until a node number is set again.
    pub(crate) fn clear_node(&self) {
        self.node.store(NO_NODE, Ordering::Release);
    }

    pub(crate) fn node(&self) -> Option<u16> {
        match self.node.load(Ordering::Acquire) {
            NO_NODE => None,
            n => Some(n as u16),
        }
    }

    /// The next id, or `None` while no node number is leased.
    pub fn next(&self) -> Option<i64> {
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
        Some(((ms << (NODE_BITS + SEQ_BITS)) | (node << SEQ_BITS) | seq) as i64)
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64
}

/// The admission time encoded in an order id.
pub(crate) fn timestamp_ms(order_id: i64) -> u64 {
    ((order_id as u64) >> (NODE_BITS + SEQ_BITS)) + EPOCH_MS
}

static RENEW: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("../../lua/renew_lease.lua")));

/// A node number held in Redis with a time-to-live, renewed while the process lives.
pub(crate) struct NodeLease {
    keys: Keys,
    token: String,
    pub node: u16,
}

pub(crate) const LEASE_TTL: Duration = Duration::from_secs(60);
/// How often a lease is renewed (also how soon an API notices Redis lost its data).
pub(crate) const LEASE_RENEW_EVERY: Duration = Duration::from_secs(5);

impl NodeLease {
    /// Claims a free node number, starting from a rotating counter so restarts spread out.
    pub(crate) async fn acquire<C: ConnectionLike + Send>(
        conn: &mut C,
        keys: &Keys,
    ) -> anyhow::Result<Self> {
        let token = format!("{}-{}", std::process::id(), rand::random::<u64>());
        let start: u64 = redis::cmd("INCR")
            .arg(keys.node_counter())
            .query_async(conn)
            .await?;
        for i in 0..NODES as u64 {
            let node = ((start + i) % NODES as u64) as u16;
            let ok: Option<String> = redis::cmd("SET")
                .arg(keys.node_lease(node))
                .arg(&token)
                .arg("NX")
                .arg("PX")
                .arg(LEASE_TTL.as_millis() as u64)
                .query_async(conn)
                .await?;
            if ok.is_some() {
                return Ok(Self {
                    keys: keys.clone(),
                    token,
                    node,
                });
            }
        }
        anyhow::bail!("all {NODES} order-id node numbers are leased")
    }

    /// Extends the lease.
    pub(crate) async fn renew<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
    ) -> anyhow::Result<Renewal> {
        let code: i64 = RENEW
            .key(self.keys.node_lease(self.node))
            .arg(&self.token)
            .arg(LEASE_TTL.as_millis() as u64)
            .invoke_async(conn)
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
            let id = ids.next().unwrap();
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
    fn the_timestamp_of_an_id_is_now() {
        let id = OrderIds::with_node(5).next().unwrap();
        let diff = timestamp_ms(id).abs_diff(now_ms());
        assert!(diff < 5_000, "{diff}");
    }
}
