//! Redis key layout.
//!
//! Every key the admission script touches for a voucher carries the hash tag of the
//! stream that voucher's orders go to, so one script call stays in one cluster slot.
//! With one shard the stream is plain `stream.orders` (its slot is that of the whole
//! name), and the voucher keys carry `{stream.orders}` as their tag. With S shards the
//! streams are `stream.orders:{<tag>}`, one tag per shard, the tags chosen so their
//! slots spread evenly over the 16384 slots (and so over the nodes of a cluster); a
//! voucher belongs to shard `voucher_id mod S`.

use crate::domain::{UserId, VoucherId};

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
pub(crate) fn buyer_field(user_id: UserId) -> String {
    format!("{BUYER_PREFIX}{user_id}")
}

/// The prefix of a buyer's field in a sale's hash (`u:<user_id>`).
pub(crate) const BUYER_PREFIX: &str = "u:";

/// The fields of the stream's entries. `lua/seckill.lua` writes one entry per call: its
/// first field is [`ORDERS`](entry_field::ORDERS) (their number), then `admitted_ms`, then
/// per sale `voucher_id` (and `part`, its segment) and `epoch`, followed by `order_id` and
/// `user_id` of each of its orders. An entry of one order without `orders` (earlier releases,
/// tools) names each field once, in any order. The field names are shared with processes of
/// other releases: they never change with the Rust names.
pub(crate) mod entry_field {
    pub(crate) const ORDERS: &str = "orders";
    pub(crate) const ORDER_ID: &str = "order_id";
    pub(crate) const VOUCHER_ID: &str = "voucher_id";
    pub(crate) const USER_ID: &str = "user_id";
    pub(crate) const ADMITTED_MS: &str = "admitted_ms";
    /// Only in the entries of a segmented sale: the segment that took the unit (named
    /// `part` on the wire, where processes of other releases read and write it).
    pub(crate) const SEGMENT: &str = "part";
    /// The epoch of the sale state that admitted the orders that follow.
    pub(crate) const EPOCH: &str = "epoch";
}

/// One segment of a sale's stock. A sale in K segments (its `segments`) keeps segment p on the
/// slot of stream shard (voucher + p x max(1, S / K)) mod S: shards lie in order over the
/// slot space (and so over a cluster's masters), so segments a stride apart land on
/// different masters, and each segment's orders go to its own shard's stream. Segment 0 is the
/// sale's own key: a sale in one segment is laid out exactly as an unsegmented sale.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SaleSegment {
    pub voucher_id: VoucherId,
    pub segment: u8,
    /// How many segments the sale has.
    pub segments: u8,
}

impl SaleSegment {
    pub fn new(voucher_id: VoucherId, segment: u8, segments: u8) -> Self {
        Self {
            voucher_id,
            segment,
            segments: segments.max(1),
        }
    }

    /// `user_id`'s home segment of a sale in `segments` segments (see [`home_segment`]).
    pub fn home_of(voucher_id: VoucherId, user_id: UserId, segments: u8) -> Self {
        Self::new(voucher_id, home_segment(user_id, segments), segments)
    }

    /// Every segment of a sale in `segments` segments.
    pub fn all(voucher_id: VoucherId, segments: u8) -> impl Iterator<Item = SaleSegment> {
        (0..segments.max(1)).map(move |segment| SaleSegment::new(voucher_id, segment, segments))
    }

    /// Another segment of the same sale.
    pub fn sibling(&self, segment: u8) -> SaleSegment {
        SaleSegment { segment, ..*self }
    }

    /// How the segment names itself in its state and its orders' stream entries
    /// (`<segment>/<segments>`); `None` for a sale in one segment, whose entries carry no segment.
    pub fn label(&self) -> Option<String> {
        (self.segments > 1).then(|| format!("{}/{}", self.segment, self.segments))
    }

    /// Whether this segment is `user_id`'s home segment (holds their buyer record).
    pub fn is_home_of(&self, user_id: UserId) -> bool {
        home_segment(user_id, self.segments) == self.segment
    }

    /// The segment a label names (`None`: not a label of a segment).
    pub fn parse_label(voucher_id: VoucherId, label: &str) -> Option<SaleSegment> {
        let (segment, segments) = label.split_once('/')?;
        let (segment, segments) = (segment.parse::<u8>().ok()?, segments.parse::<u8>().ok()?);
        (segment < segments && segments <= MAX_SEGMENTS)
            .then(|| SaleSegment::new(voucher_id, segment, segments))
    }
}

/// The most segments a sale may be split into.
pub const MAX_SEGMENTS: u8 = 64;

/// The segment a user's grabs of a sale in `segments` segments go to: it holds their buyer
/// record, so one order per user holds across segments without a cross-slot step. A mix
/// of the id (not the id mod K): ids handed out in patterns still spread evenly.
pub fn home_segment(user_id: UserId, segments: u8) -> u8 {
    if segments <= 1 {
        return 0;
    }
    let mut x = user_id.get() as u64;
    // splitmix64's finaliser.
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^= x >> 31;
    (x % segments as u64) as u8
}

/// Which stream shard a voucher's orders go to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Shard(pub u32);

impl Keys {
    /// One shard. `prefix` must not contain `{` or `}` (it would change the hash tag).
    pub fn new(prefix: impl Into<String>) -> anyhow::Result<Self> {
        Self::with_shards(prefix, 1)
    }

    /// `shards` streams (1 to 1024); every process of a deployment must use the same.
    pub fn with_shards(prefix: impl Into<String>, shards: u32) -> anyhow::Result<Self> {
        let prefix = prefix.into();
        anyhow::ensure!(
            !prefix.contains(['{', '}']),
            "the Redis key prefix must not contain braces"
        );
        anyhow::ensure!(
            (1..=1024).contains(&shards),
            "the number of stream shards must be between 1 and 1024"
        );
        let shards: Vec<ShardKeys> = if shards == 1 {
            let stream = format!("{prefix}stream.orders");
            vec![ShardKeys {
                voucher_prefix: format!("{prefix}seckill:{{{stream}}}:voucher:"),
                dead_letters: format!("{stream}.dlq"),
                stream,
            }]
        } else {
            (0..shards)
                .map(|i| {
                    let tag = spread_tag(i, shards);
                    let stream = format!("{prefix}stream.orders:{{{tag}}}");
                    ShardKeys {
                        voucher_prefix: format!("{prefix}seckill:{{{tag}}}:voucher:"),
                        dead_letters: format!("{stream}.dlq"),
                        stream,
                    }
                })
                .collect()
        };
        Ok(Self {
            prefix,
            shards: shards.into(),
        })
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Every shard.
    pub fn shards(&self) -> impl Iterator<Item = Shard> {
        (0..self.shards.len() as u32).map(Shard)
    }

    pub fn shard_of(&self, voucher_id: VoucherId) -> Shard {
        Shard(voucher_id.get().rem_euclid(self.shards.len() as i64) as u32)
    }

    /// The shard of one segment of a sale (segment 0: the voucher's shard).
    pub fn shard_of_segment(&self, segment: SaleSegment) -> Shard {
        let n = self.shards.len() as i64;
        let stride = (n / segment.segments as i64).max(1);
        let first = segment.voucher_id.get().rem_euclid(n);
        Shard((first + segment.segment as i64 * stride).rem_euclid(n) as u32)
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
    pub fn voucher(&self, voucher_id: VoucherId) -> String {
        let prefix = &self.shard(self.shard_of(voucher_id)).voucher_prefix;
        let mut key = String::with_capacity(prefix.len() + 20);
        key.push_str(prefix);
        key.push_str(itoa::Buffer::new().format(voucher_id.get()));
        key
    }

    /// One segment's hash (as [`Keys::voucher`]; segment 0 is the voucher's own key). The
    /// key says `:part:`, as every release that knows segments names it.
    pub fn segment(&self, segment: SaleSegment) -> String {
        if segment.segment == 0 {
            return self.voucher(segment.voucher_id);
        }
        let prefix = &self.shard(self.shard_of_segment(segment)).voucher_prefix;
        format!("{prefix}{}:part:{}", segment.voucher_id, segment.segment)
    }

    /// Units taken out of a segment for another, not yet recorded in Postgres (move id ->
    /// `<to segment> <units>`); in the segment's slot.
    pub fn moves_out(&self, segment: SaleSegment) -> String {
        format!("{}:moves-out", self.segment(segment))
    }

    /// Moves credited to a segment (move id -> units), so a credit is applied once; in
    /// the segment's slot.
    pub fn moves_in(&self, segment: SaleSegment) -> String {
        format!("{}:moves-in", self.segment(segment))
    }

    /// A sale's grab outcomes counted for the live view (see `admission::tally`);
    /// written apart from the admission script, so not in the shard's slot.
    pub fn live_counts(&self, voucher_id: VoucherId) -> String {
        format!("{}seckill:live:{voucher_id}", self.prefix)
    }

    /// The pub/sub channel announcing that a sale's state changed (see
    /// `admission::edge`); the message is the voucher id.
    pub fn sale_changes(&self) -> String {
        format!("{}seckill:sale-changes", self.prefix)
    }

    /// Lease of an order-id node number (not tied to a shard).
    pub(crate) fn node_lease(&self, node: u16) -> String {
        format!("{}seckill:node:{node}", self.prefix)
    }

    /// The term marker of the shard's slot: the term of the server life that last
    /// wrote the shard's data (see `current_term` in `lua/seckill.lua`).
    pub fn term_marker(&self, shard: Shard) -> String {
        self.marker_beside(self.stream(shard))
    }

    /// A key in the shard's slot that API instances write to probe that its master's
    /// replicas acknowledge (see `admission::guard::probe_replicas`).
    pub fn replica_probe(&self, shard: Shard) -> String {
        let marker = self.term_marker(shard);
        format!("{}probe", marker.strip_suffix("term").unwrap_or(&marker))
    }

    /// The term marker of the slot a sale segment lives on.
    pub fn segment_marker(&self, segment: SaleSegment) -> String {
        self.term_marker(self.shard_of_segment(segment))
    }

    /// The term marker of the slot `key` lives on (its hash tag, or the whole key).
    pub(crate) fn marker_beside(&self, key: &str) -> String {
        let tag = key
            .find('{')
            .and_then(|open| {
                let rest = &key[open + 1..];
                rest.find('}')
                    .filter(|len| *len > 0)
                    .map(|len| &rest[..len])
            })
            .unwrap_or(key);
        format!("{}seckill:{{{tag}}}:term", self.prefix)
    }
}

/// CRC16 hash slot as Redis Cluster computes it (hash tag aware).
pub(crate) fn slot(key: &str) -> u16 {
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

/// A hash tag for shard `i` of `n` whose slot lies in the `i`-th of `n` equal slices of
/// the slot space, so shards spread evenly over cluster nodes that own contiguous
/// ranges (as `redis-cli --cluster create` assigns them).
fn spread_tag(i: u32, n: u32) -> String {
    let lo = (i as u64 * 16384 / n as u64) as u16;
    let hi = ((i as u64 + 1) * 16384 / n as u64) as u16;
    (0u32..)
        .map(|k| format!("s{i}.{k}"))
        .find(|tag| (lo..hi).contains(&slot(tag)))
        .expect("some tag lands in every slice")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_of_a_voucher_shares_the_slot_of_its_stream() {
        for prefix in ["", "t42:"] {
            let keys = Keys::new(prefix).unwrap();
            let seven = VoucherId::new(7).unwrap();
            let shard = keys.shard_of(seven);
            let stream_slot = slot(keys.stream(shard));
            let key = keys.voucher(seven);
            assert_eq!(slot(&key), stream_slot, "{key}");
        }
    }

    #[test]
    fn a_term_marker_shares_the_slot_of_what_it_marks() {
        for shards in [1, 6] {
            let keys = Keys::with_shards("p:", shards).unwrap();
            for shard in keys.shards() {
                let marker = keys.term_marker(shard);
                assert!(marker.starts_with("p:"), "{marker}");
                assert_eq!(slot(&marker), slot(keys.stream(shard)), "{marker}");
            }
            let lease = keys.node_lease(7);
            assert_eq!(slot(&keys.marker_beside(&lease)), slot(&lease));
        }
    }

    #[test]
    fn the_single_shard_stream_is_named_as_the_contract_says() {
        let keys = Keys::new("").unwrap();
        assert_eq!(keys.stream(Shard(0)), "stream.orders");
        assert_eq!(keys.dead_letters(Shard(0)), "stream.orders.dlq");
    }

    #[test]
    fn sharded_keys_share_their_shards_slot_and_shards_spread_over_the_slot_space() {
        let keys = Keys::with_shards("p:", 6).unwrap();
        let mut slots = Vec::new();
        for n in 1..=12 {
            let voucher = VoucherId::new(n).unwrap();
            let shard = keys.shard_of(voucher);
            assert_eq!(shard.0 as i64, n % 6);
            let stream_slot = slot(keys.stream(shard));
            assert_eq!(slot(&keys.voucher(voucher)), stream_slot);
            assert_eq!(slot(keys.dead_letters(shard)), stream_slot);
            assert!(keys.stream(shard).starts_with("p:stream.orders:{"));
            slots.push(stream_slot);
        }
        // Shard i's slot lies in the i-th sixth: three nodes get two shards each.
        for (i, shard) in keys.shards().enumerate() {
            let s = slot(keys.stream(shard)) as usize;
            assert_eq!(s * 6 / 16384, i, "shard {i} at slot {s}");
        }
    }

    /// The scripts cannot import Rust constants: they spell the layout out, and this
    /// keeps them in step with the constants above.
    #[test]
    fn the_lua_scripts_spell_the_layout_as_keys_rs_does() {
        let seckill = include_str!("../lua/seckill.lua");
        let load = include_str!("../lua/load_voucher.lua");
        for script in [seckill, load] {
            assert!(script.contains(&format!("'{BUYER_PREFIX}'")));
            for field in [
                entry_field::ORDER_ID,
                entry_field::VOUCHER_ID,
                entry_field::USER_ID,
            ] {
                assert!(script.contains(&format!("'{field}'")), "{field}");
            }
        }
        assert!(seckill.contains(&format!("'{}'", entry_field::ADMITTED_MS)));
        assert!(seckill.contains(&format!("'{}'", entry_field::ORDERS)));
        assert!(seckill.contains(&format!("'{}'", entry_field::EPOCH)));
    }

    #[test]
    fn a_sales_segments_lie_a_stride_apart_so_they_spread_over_the_slot_space() {
        let voucher = VoucherId::new(7).unwrap();
        for shards in [3u32, 6, 12] {
            let keys = Keys::with_shards("p:", shards).unwrap();
            let thirds: Vec<usize> = SaleSegment::all(voucher, 3)
                .map(|p| {
                    let key = keys.segment(p);
                    assert_eq!(slot(&key), slot(keys.stream(keys.shard_of_segment(p))));
                    slot(&key) as usize * 3 / 16384
                })
                .collect();
            let mut distinct = thirds.clone();
            distinct.sort_unstable();
            assert_eq!(distinct, [0, 1, 2], "{shards} shards: {thirds:?}");
        }
        // Segment 0 is the voucher's own key; more segments than shards still fit.
        let keys = Keys::with_shards("", 2).unwrap();
        assert_eq!(
            keys.segment(SaleSegment::new(voucher, 0, 5)),
            keys.voucher(voucher)
        );
        let segments: Vec<Shard> = SaleSegment::all(voucher, 5)
            .map(|p| keys.shard_of_segment(p))
            .collect();
        assert_eq!(segments, [Shard(1), Shard(0), Shard(1), Shard(0), Shard(1)]);
    }

    #[test]
    fn home_segments_spread_users_evenly_and_a_single_segment_is_home_to_all() {
        let mut counts = [0usize; 4];
        for user in 1..=40_000 {
            let user = UserId::new(user).unwrap();
            assert_eq!(home_segment(user, 1), 0);
            counts[home_segment(user, 4) as usize] += 1;
        }
        for n in counts {
            assert!((9_500..=10_500).contains(&n), "{counts:?}");
        }
    }

    #[test]
    fn a_segment_label_names_its_segment_and_nothing_else_parses() {
        let voucher = VoucherId::new(3).unwrap();
        let segment = SaleSegment::new(voucher, 2, 5);
        assert_eq!(segment.label().as_deref(), Some("2/5"));
        assert_eq!(SaleSegment::parse_label(voucher, "2/5"), Some(segment));
        assert_eq!(SaleSegment::new(voucher, 0, 1).label(), None);
        for bad in ["5/5", "1/65", "2", "a/b", "/3", "2/"] {
            assert_eq!(SaleSegment::parse_label(voucher, bad), None, "{bad}");
        }
    }

    #[test]
    fn a_prefix_with_braces_is_refused() {
        assert!(Keys::new("a{b}").is_err());
    }
}
