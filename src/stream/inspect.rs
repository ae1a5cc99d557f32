//! Reading the stream as it is (admins' look-ups, the loader's paging).

use redis::aio::ConnectionLike;
use redis::{RedisResult, Value};

use crate::domain::OrderId;
use crate::keys::{Keys, Shard};

use super::entry::{parse_entries, parse_raw, Delivery, RawEntry};

/// The orders of up to `limit` entries of the shard's stream, oldest first.
pub(crate) async fn entries<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    shard: Shard,
    limit: usize,
) -> RedisResult<Vec<Delivery>> {
    Ok(range(conn, keys.stream(shard), limit)
        .await?
        .into_iter()
        .flat_map(|(id, fields)| Delivery::parse(id, fields))
        .collect())
}

/// Up to `count` entries of the shard's stream after the entry `after` (from the
/// start when `None`), oldest first: one XRANGE, so one bounded step for Redis.
pub(crate) async fn page<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    shard: Shard,
    after: Option<&str>,
    count: usize,
) -> RedisResult<Vec<Delivery>> {
    let start = after.map_or_else(|| "-".to_string(), |id| format!("({id}"));
    let reply: Value = redis::cmd("XRANGE")
        .arg(keys.stream(shard))
        .arg(start)
        .arg("+")
        .arg("COUNT")
        .arg(count)
        .query_async(conn)
        .await?;
    parse_entries(reply)
}

/// Which of `orders` (order id, its entry's id) the shard's stream holds in that entry:
/// one XRANGE of each entry, pipelined. An entry Redis lost is missing, or holds other
/// orders (a server that came back older gives its ids to new entries).
pub(crate) async fn held_in<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    shard: Shard,
    orders: &[(OrderId, (u64, u64))],
) -> RedisResult<std::collections::HashSet<OrderId>> {
    let mut held = std::collections::HashSet::new();
    for chunk in orders.chunks(500) {
        let mut pipe = redis::pipe();
        for (_, (ms, seq)) in chunk {
            let id = format!("{ms}-{seq}");
            pipe.cmd("XRANGE").arg(keys.stream(shard)).arg(&id).arg(&id);
        }
        let replies: Vec<Value> = pipe.query_async(conn).await?;
        for ((order, _), reply) in chunk.iter().zip(replies) {
            if parse_entries(reply)?
                .iter()
                .any(|e| e.order().is_some_and(|o| o.id == *order))
            {
                held.insert(*order);
            }
        }
    }
    Ok(held)
}

/// Up to `limit` entries of the stream at `key`, oldest first, read in pages of a
/// thousand.
pub(crate) async fn range<C: ConnectionLike + Send>(
    conn: &mut C,
    key: &str,
    limit: usize,
) -> RedisResult<Vec<RawEntry>> {
    let mut out: Vec<RawEntry> = Vec::new();
    let mut start = "-".to_string();
    while out.len() < limit {
        let reply: Value = redis::cmd("XRANGE")
            .arg(key)
            .arg(&start)
            .arg("+")
            .arg("COUNT")
            .arg(1000.min(limit - out.len()))
            .query_async(conn)
            .await?;
        let page = parse_raw(reply)?;
        let Some((last, _)) = page.last() else { break };
        start = format!("({last}");
        out.extend(page);
    }
    Ok(out)
}

/// A shard's stream as the worker sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct StreamStats {
    /// Entries in the stream (written or not; trimmed later).
    pub length: u64,
    /// Delivered to a worker, not yet acknowledged (being written, or to be replayed).
    pub pending: u64,
    /// Not yet delivered to any worker; `None` when Redis cannot tell (`XINFO GROUPS`
    /// failed, or gave the group a NULL lag: Redis cannot count it once entries past
    /// the group's last delivery were deleted or trimmed). Shown as unknown, never as
    /// 0, which would read as "all delivered".
    pub lag: Option<u64>,
    /// Entries in the shard's dead-letter stream.
    pub dead_letters: u64,
}

impl std::ops::AddAssign for StreamStats {
    fn add_assign(&mut self, o: Self) {
        self.length += o.length;
        self.pending += o.pending;
        // Unknown for one shard, unknown for all.
        self.lag = self.lag.zip(o.lag).map(|(a, b)| a + b);
        self.dead_letters += o.dead_letters;
    }
}

/// The shard's [`StreamStats`] (a missing stream counts as empty).
pub async fn stats<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    shard: Shard,
) -> RedisResult<StreamStats> {
    let stream = keys.stream(shard);
    // Separate commands: with one shard the two keys live in different slots.
    let length: u64 = redis::cmd("XLEN").arg(stream).query_async(conn).await?;
    let dead_letters: u64 = redis::cmd("XLEN")
        .arg(keys.dead_letters(shard))
        .query_async(conn)
        .await?;
    let pending: u64 = match redis::cmd("XPENDING")
        .arg(stream)
        .arg(super::GROUP)
        .query_async::<Value>(conn)
        .await
    {
        Ok(Value::Array(parts)) if !parts.is_empty() => {
            redis::from_redis_value_ref(&parts[0]).unwrap_or(0)
        }
        _ => 0,
    };
    // Entries not yet delivered to any worker (Redis 7 keeps the count per group).
    let groups: RedisResult<Vec<std::collections::HashMap<String, Value>>> = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(stream)
        .query_async(conn)
        .await;
    let lag = match groups {
        // The one group of the workers; no group yet (no worker ever started): every
        // entry is still to be delivered.
        Ok(groups) => match groups.iter().find(|g| {
            g.get("name")
                .and_then(|v| redis::from_redis_value_ref::<String>(v).ok())
                .is_some_and(|name| name == super::GROUP)
        }) {
            Some(group) => group
                .get("lag")
                .and_then(|v| redis::from_redis_value_ref::<u64>(v).ok()),
            None => Some(length),
        },
        // No stream yet: nothing to deliver.
        Err(_) if length == 0 => Some(0),
        Err(_) => None,
    };
    Ok(StreamStats {
        length,
        pending,
        lag,
        dead_letters,
    })
}
