//! Redis key layout.
//!
//! Every key the admission script touches for a voucher carries the hash tag of the
//! stream that voucher's orders go to, so one script call stays in one cluster slot.
//! With one shard the stream is plain `stream.orders` (its slot is that of the whole
//! name), and the voucher keys carry `{stream.orders}` as their tag.

/// Key names, optionally under a prefix (tests use one to get their own key space).
/// The names that do not depend on a voucher are built once.
#[derive(Clone, Debug)]
pub struct Keys {
    prefix: String,
    shards: std::sync::Arc<[ShardKeys]>,
}

#[derive(Debug)]
struct ShardKeys {
    stream: String,
    dead_letters: String,
    /// `<prefix>seckill:{<stream>}:voucher:`, completed by a voucher id.
    voucher_prefix: String,
}

/// The field of a sale's hash recording a buyer's order id.
pub fn buyer_field(user_id: i64) -> String {
    format!("u:{user_id}")
}

/// Fields of a sale's hash besides the buyers.
pub const SALE_FIELDS: i64 = 3;

/// Which stream shard a voucher's orders go to (always 0 with one shard).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Shard(pub u32);

impl Keys {
    /// `prefix` must not contain `{` or `}` (it would change the hash tag).
    pub fn new(prefix: impl Into<String>) -> anyhow::Result<Self> {
        let prefix = prefix.into();
        anyhow::ensure!(
            !prefix.contains(['{', '}']),
            "the Redis key prefix must not contain braces"
        );
        let stream = format!("{prefix}stream.orders");
        let shard = ShardKeys {
            voucher_prefix: format!("{prefix}seckill:{{{stream}}}:voucher:"),
            dead_letters: format!("{stream}.dlq"),
            stream,
        };
        Ok(Self {
            prefix,
            shards: vec![shard].into(),
        })
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// All shards that exist (one, until stream sharding is configured).
    pub fn shards(&self) -> impl Iterator<Item = Shard> {
        (0..self.shards.len() as u32).map(Shard)
    }

    pub fn shard_of(&self, _voucher_id: i64) -> Shard {
        Shard(0)
    }

    fn shard(&self, shard: Shard) -> &ShardKeys {
        &self.shards[shard.0 as usize]
    }

    /// The shard's order stream; also the hash tag of all keys in the shard.
    pub fn stream(&self, shard: Shard) -> &str {
        &self.shard(shard).stream
    }

    /// Dead letters of the shard: entries that can never become an order row.
    /// Written apart from the admission script, so it need not share the slot.
    pub fn dead_letters(&self, shard: Shard) -> &str {
        &self.shard(shard).dead_letters
    }

    /// A sale's hash: `stock`, `begin_ms`, `end_ms`, and a [`buyer_field`] per buyer.
    pub fn voucher(&self, voucher_id: i64) -> String {
        let prefix = &self.shard(self.shard_of(voucher_id)).voucher_prefix;
        let mut key = String::with_capacity(prefix.len() + 20);
        key.push_str(prefix);
        key.push_str(itoa::Buffer::new().format(voucher_id));
        key
    }

    /// Lease of an order-id node number (not tied to a shard).
    pub fn node_lease(&self, node: u16) -> String {
        format!("{}seckill:node:{node}", self.prefix)
    }

    pub fn node_counter(&self) -> String {
        format!("{}seckill:node-counter", self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CRC16 hash slot as Redis Cluster computes it (hash tag aware).
    fn slot(key: &str) -> u16 {
        let bytes = key.as_bytes();
        let hashed = match key.find('{') {
            Some(open) => match key[open + 1..].find('}') {
                Some(len) if len > 0 => &bytes[open + 1..open + 1 + len],
                _ => bytes,
            },
            None => bytes,
        };
        let mut crc: u16 = 0;
        for &b in hashed {
            crc ^= (b as u16) << 8;
            for _ in 0..8 {
                crc = if crc & 0x8000 != 0 {
                    (crc << 1) ^ 0x1021
                } else {
                    crc << 1
                };
            }
        }
        crc % 16384
    }

    #[test]
    fn every_key_of_a_voucher_shares_the_slot_of_its_stream() {
        for prefix in ["", "t42:"] {
            let keys = Keys::new(prefix).unwrap();
            let shard = keys.shard_of(7);
            let stream_slot = slot(keys.stream(shard));
            let key = keys.voucher(7);
            assert_eq!(slot(&key), stream_slot, "{key}");
        }
    }

    #[test]
    fn the_single_shard_stream_is_named_as_the_contract_says() {
        let keys = Keys::new("").unwrap();
        assert_eq!(keys.stream(Shard(0)), "stream.orders");
        assert_eq!(keys.dead_letters(Shard(0)), "stream.orders.dlq");
    }

    #[test]
    fn a_prefix_with_braces_is_refused() {
        assert!(Keys::new("a{b}").is_err());
    }
}
