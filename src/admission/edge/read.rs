//! Reading a sale's state for the edge: one segment (`seckill_peek`), all segments as one,
//! the moves on their way between them, the buyers.

use std::collections::HashSet;

use redis::aio::ConnectionLike;
use redis::RedisResult;

use crate::domain::UserId;
use crate::keys::{self, Keys, SaleSegment};
use crate::scripts::Call;

/// The keys `seckill_peek` reads for one segment: its hash, and its slot's term marker.
pub(crate) struct StateKeys {
    pub(crate) sale: String,
    marker: String,
}

impl StateKeys {
    pub(crate) fn of(keys: &Keys, segment: SaleSegment) -> Self {
        Self {
            sale: keys.segment(segment),
            marker: keys.segment_marker(segment),
        }
    }

    /// Every segment of a sale in `segments` segments.
    pub(crate) fn all(
        keys: &Keys,
        voucher_id: crate::domain::VoucherId,
        segments: u8,
    ) -> Vec<Self> {
        SaleSegment::all(voucher_id, segments)
            .map(|p| Self::of(keys, p))
            .collect()
    }
}

/// A sale's state as `seckill_peek` reads it.
pub(crate) struct Peeked {
    pub(super) now_ms: i64,
    pub(super) begin_ms: i64,
    pub(super) end_ms: i64,
    pub(super) stock: i64,
    pub(super) gen: String,
    pub(super) term: String,
    pub(super) epoch: String,
    /// It holds a lottery's window not drawn yet, or a draw not recorded yet.
    pub(super) window: bool,
}

impl Peeked {
    pub(crate) fn stock(&self) -> i64 {
        self.stock
    }

    pub(crate) fn gen(&self) -> &str {
        &self.gen
    }

    /// The term of the server life the state was built in.
    pub(crate) fn term(&self) -> &str {
        &self.term
    }

    /// The epoch the state was armed with.
    pub(crate) fn epoch(&self) -> &str {
        &self.epoch
    }

    /// Whether it holds a lottery's window not drawn yet (its stock is what the draw
    /// shares out, not units to give), or a draw not recorded yet.
    pub(crate) fn holds_window(&self) -> bool {
        self.window
    }
}

/// Reads a sale's state; `None` when it is not loaded (or not armed), stale (built in
/// an earlier term of the server) or corrupt.
pub(crate) async fn peek<C: ConnectionLike + Send>(
    conn: &mut C,
    key: &StateKeys,
) -> RedisResult<Option<Peeked>> {
    let mut call = Call::function("seckill_peek");
    call.key(&key.sale).key(&key.marker);
    let reply: Vec<String> = call.invoke(conn).await?;
    let number = |i: usize| reply.get(i).and_then(|v| v.parse::<i64>().ok());
    Ok(
        match (
            reply.first().map(String::as_str),
            number(1),
            number(2),
            number(3),
            number(4),
        ) {
            (Some("0"), Some(now_ms), Some(begin_ms), Some(end_ms), Some(stock)) => Some(Peeked {
                now_ms,
                begin_ms,
                end_ms,
                stock,
                gen: reply.get(5).cloned().unwrap_or_default(),
                term: reply.get(6).cloned().unwrap_or_default(),
                epoch: reply.get(7).cloned().unwrap_or_default(),
                window: reply.get(8).is_some_and(|w| w == "1"),
            }),
            _ => None,
        },
    )
}

/// A sale's segments read one after the other, as one state: the first segment's window and
/// clock, the stock summed, and the gens and terms side by side (a unit that comes back
/// to any segment changes its gen, so the whole). `None` when some segment cannot be trusted.
pub(super) async fn peek_all<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &[StateKeys],
) -> RedisResult<Option<Peeked>> {
    let mut whole: Option<Peeked> = None;
    for key in keys {
        let Some(segment) = peek(conn, key).await? else {
            return Ok(None);
        };
        whole = Some(match whole {
            None => segment,
            Some(w) => Peeked {
                stock: w.stock + segment.stock,
                // (A segment without a gen tells nothing: none for the whole.)
                gen: match w.gen.is_empty() || segment.gen.is_empty() {
                    true => String::new(),
                    false => format!("{}.{}", w.gen, segment.gen),
                },
                term: format!("{}.{}", w.term, segment.term),
                window: w.window || segment.window,
                ..w
            },
        });
    }
    Ok(whole)
}

/// Whether units are on their way between a segmented sale's segments: a move's record
/// stays beside its donor from the take until after the credit (see `admission::segments`).
pub(super) async fn on_their_way<C: ConnectionLike + Send>(
    conn: &mut C,
    moves_out: &[String],
) -> RedisResult<bool> {
    for key in moves_out {
        let n: i64 = redis::cmd("HLEN").arg(key).query_async(conn).await?;
        if n > 0 {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Every buyer recorded in a sale's hash (a page at a time: a large sale never stalls
/// Redis).
pub(super) async fn scan_buyers<C: ConnectionLike + Send>(
    conn: &mut C,
    key: &str,
) -> RedisResult<HashSet<UserId>> {
    let pattern = format!("{}*", keys::BUYER_PREFIX);
    let mut users = HashSet::new();
    let mut cursor = 0u64;
    loop {
        let (next, page): (u64, Vec<String>) = redis::cmd("HSCAN")
            .arg(key)
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(conn)
            .await?;
        for field in page.iter().step_by(2) {
            if let Some(user) = field
                .strip_prefix(keys::BUYER_PREFIX)
                .and_then(|u| u.parse::<i64>().ok())
                .and_then(UserId::new)
            {
                users.insert(user);
            }
        }
        if next == 0 {
            return Ok(users);
        }
        cursor = next;
    }
}
