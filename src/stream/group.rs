//! The consumer group: reading, claiming, acknowledging, keeping entries fresh.

use std::collections::{HashMap, HashSet};

use redis::aio::ConnectionLike;
use redis::streams::StreamPendingCountReply;
use redis::{RedisResult, Value};

use crate::domain::OrderId;
use crate::keys::{Keys, Shard};

use super::entry::{parse_entries, parse_id, parse_raw, parse_read_reply, unexpected, Delivery};

pub const GROUP: &str = "seckill-workers";

/// Creates the consumer group (and the stream) if missing, through the library
/// (`seckill_group`): a stream of ours that vanished is noticed as lost writes (a new
/// term, see `admission::term`) before it is made anew, empty.
pub(crate) async fn ensure_group<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    shard: Shard,
) -> RedisResult<()> {
    crate::scripts::Call::function("seckill_group")
        .key(keys.stream(shard))
        .key(keys.term_marker(shard))
        .arg(GROUP)
        .invoke::<i64, _>(conn)
        .await
        .map(drop)
}

/// Where a read starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadFrom {
    /// Entries delivered to this consumer earlier and never acknowledged.
    OwnPending,
    /// New entries, waiting up to `block_ms` when there are none.
    New { block_ms: u64 },
    /// New entries there are now, without waiting.
    Ready,
}

/// XREADGROUP for one consumer.
pub(crate) async fn read<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    shard: Shard,
    consumer: &str,
    from: ReadFrom,
    count: usize,
) -> RedisResult<Vec<Delivery>> {
    let mut cmd = redis::cmd("XREADGROUP");
    cmd.arg("GROUP")
        .arg(GROUP)
        .arg(consumer)
        .arg("COUNT")
        .arg(count);
    let id = match from {
        ReadFrom::OwnPending => "0",
        ReadFrom::New { block_ms } => {
            cmd.arg("BLOCK").arg(block_ms);
            ">"
        }
        ReadFrom::Ready => ">",
    };
    cmd.arg("STREAMS").arg(keys.stream(shard)).arg(id);
    let reply: Value = cmd.query_async(conn).await?;
    parse_read_reply(reply)
}

/// XAUTOCLAIM: takes over entries other consumers (dead ones, typically) left pending
/// longer than `min_idle_ms`. Returns the cursor to continue from (`"0-0"` when the
/// pending list has been walked) and the entries now owned by `consumer`.
pub(crate) async fn claim<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    shard: Shard,
    consumer: &str,
    min_idle_ms: u64,
    cursor: &str,
    count: usize,
) -> RedisResult<(String, Vec<Delivery>)> {
    let reply: Value = redis::cmd("XAUTOCLAIM")
        .arg(keys.stream(shard))
        .arg(GROUP)
        .arg(consumer)
        .arg(min_idle_ms)
        .arg(cursor)
        .arg("COUNT")
        .arg(count)
        .query_async(conn)
        .await?;
    // [next_cursor, [[id, fields], ...], [deleted ids]]
    let Value::Array(mut parts) = reply else {
        return Err(unexpected());
    };
    if parts.len() < 2 {
        return Err(unexpected());
    }
    parts.truncate(2);
    let entries = parts.pop().expect("two elements");
    let next: String = redis::from_redis_value(parts.pop().expect("two elements"))?;
    Ok((next, parse_entries(entries)?))
}

/// Acknowledges the entries of these orders (each once). A missing group (Redis lost
/// its data) means there is nothing left to acknowledge.
pub(crate) async fn ack<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    shard: Shard,
    entries: &[Delivery],
) -> RedisResult<i64> {
    if entries.is_empty() {
        return Ok(0);
    }
    let mut cmd = redis::cmd("XACK");
    cmd.arg(keys.stream(shard)).arg(GROUP);
    for id in entry_ids(entries) {
        cmd.arg(id);
    }
    match cmd.query_async(conn).await {
        Err(e) if e.code() == Some("NOGROUP") => Ok(0),
        other => other,
    }
}

/// Looks up entries by id with one ranged command from the first id to the last
/// (`ranged(first, last, count)`, items in id order, `id_of` each), and,
/// when other entries in that range fill its page, the ids past the page one command
/// each (`ranged(id, id, 1)`), pipelined: at most two round trips, and a cost bounded
/// by the batch, however long the range.
async fn look_up<C, T>(
    conn: &mut C,
    ids: &[&str],
    ranged: impl Fn(&str, &str, usize) -> redis::Cmd,
    parse: impl Fn(Value) -> RedisResult<Vec<T>>,
    id_of: impl Fn(&T) -> &str,
) -> RedisResult<Vec<T>>
where
    C: ConnectionLike + Send,
{
    let mut ids = ids.to_vec();
    ids.sort_by_key(|id| parse_id(id));
    let (Some(first), Some(last)) = (ids.first(), ids.last()) else {
        return Ok(Vec::new());
    };
    let page = ids.len() * 2 + 100;
    let mut found = parse(ranged(first, last, page).query_async(conn).await?)?;
    let reached = match found.len() < page {
        true => None,
        false => found.last().and_then(|t| parse_id(id_of(t))),
    };
    let past: Vec<&str> = ids
        .iter()
        .copied()
        .filter(|id| reached.is_some_and(|r| parse_id(id).is_some_and(|i| i > r)))
        .collect();
    if !past.is_empty() {
        let mut pipe = redis::pipe();
        for id in &past {
            pipe.add_command(ranged(id, id, 1));
        }
        let replies: Vec<Value> = pipe.query_async(conn).await?;
        for reply in replies {
            found.extend(parse(reply)?);
        }
    }
    Ok(found)
}

/// How often each of `ids` pending in the group, whoever holds it, has been delivered;
/// ids not pending are left out.
async fn pending_among<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    shard: Shard,
    ids: &[&str],
) -> RedisResult<HashMap<String, u64>> {
    let xpending = |first: &str, last: &str, count: usize| {
        let mut cmd = redis::cmd("XPENDING");
        cmd.arg(keys.stream(shard))
            .arg(GROUP)
            .arg(first)
            .arg(last)
            .arg(count);
        cmd
    };
    let parse = |v: Value| Ok(redis::from_redis_value::<StreamPendingCountReply>(v)?.ids);
    let found = look_up(conn, ids, xpending, parse, |p| p.id.as_str()).await?;
    Ok(found
        .into_iter()
        .map(|p| (p.id, p.times_delivered as u64))
        .collect())
}

/// The order ids each of `ids` holds in the stream now (none: an entry without one);
/// ids no longer in the stream are left out.
async fn orders_among<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    shard: Shard,
    ids: &[&str],
) -> RedisResult<HashMap<String, Vec<OrderId>>> {
    let xrange = |first: &str, last: &str, count: usize| {
        let mut cmd = redis::cmd("XRANGE");
        cmd.arg(keys.stream(shard))
            .arg(first)
            .arg(last)
            .arg("COUNT")
            .arg(count);
        cmd
    };
    let found = look_up(conn, ids, xrange, parse_raw, |e| e.0.as_str()).await?;
    Ok(found
        .into_iter()
        .map(|(id, fields)| {
            let orders = fields
                .into_iter()
                .flatten()
                .filter(|(k, _)| k == crate::keys::entry_field::ORDER_ID)
                .filter_map(|(_, v)| v.parse::<i64>().ok().and_then(OrderId::new))
                .collect();
            (id, orders)
        })
        .collect())
}

/// The distinct entry ids of a batch's orders (an entry holds several), in order.
pub(crate) fn entry_ids(entries: &[Delivery]) -> Vec<&str> {
    distinct(entries.iter().map(Delivery::entry_id))
}

/// Each id once, in order of first appearance.
fn distinct<'a>(ids: impl Iterator<Item = &'a str>) -> Vec<&'a str> {
    let mut seen = HashSet::new();
    ids.filter(|id| seen.insert(*id)).collect()
}

/// How often each of `entries` has been delivered; entries not pending are left out.
pub(crate) async fn delivery_counts<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    shard: Shard,
    entries: &[Delivery],
) -> RedisResult<HashMap<String, u64>> {
    pending_among(conn, keys, shard, &entry_ids(entries)).await
}

/// A batch's entries as Redis has them now.
#[derive(Debug, Default)]
pub(crate) struct StillPending {
    /// Pending in the group (whoever holds them) and still holding the batch's order.
    pub alive: HashSet<String>,
    /// Holding another order now: Redis lost the batch's entry and gave its id to a new
    /// one (a restart from an older copy, a failover). Not the batch's to acknowledge.
    pub reused: HashSet<String>,
}

/// Which of `wanted` (entry id, order id) are still pending in the group, whoever holds
/// them, and still hold that order. The pending list and the entries are read side by
/// side (the connection is multiplexed): one round trip for a batch read in one piece.
pub(crate) async fn still_pending<C: ConnectionLike + Clone + Send>(
    conn: &C,
    keys: &Keys,
    shard: Shard,
    wanted: &[(&str, OrderId)],
) -> RedisResult<StillPending> {
    let ids = distinct(wanted.iter().map(|(id, _)| *id));
    let (mut pending_conn, mut orders_conn) = (conn.clone(), conn.clone());
    let (pending, orders) = futures_util::join!(
        pending_among(&mut pending_conn, keys, shard, &ids),
        orders_among(&mut orders_conn, keys, shard, &ids),
    );
    let pending = match pending {
        // The group is gone with Redis's data: nothing is pending.
        Err(e) if e.code() == Some("NOGROUP") => return Ok(StillPending::default()),
        other => other?,
    };
    let orders = orders?;
    let mut out = StillPending::default();
    for &(id, order) in wanted {
        let set = match orders.get(id) {
            Some(now) if now.contains(&order) && pending.contains_key(id) => &mut out.alive,
            Some(now) if now.contains(&order) => continue,
            Some(_) => &mut out.reused,
            // Deleted, or trimmed once acknowledged: gone.
            None => continue,
        };
        set.insert(id.to_string());
    }
    Ok(out)
}

/// Resets the idle time of entries this consumer holds without counting a delivery, so
/// live workers do not take over a batch that is only waiting for Postgres.
pub(crate) async fn touch<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    shard: Shard,
    consumer: &str,
    entries: &[Delivery],
) -> RedisResult<()> {
    if entries.is_empty() {
        return Ok(());
    }
    let mut cmd = redis::cmd("XCLAIM");
    cmd.arg(keys.stream(shard)).arg(GROUP).arg(consumer).arg(0);
    for id in entry_ids(entries) {
        cmd.arg(id);
    }
    cmd.arg("JUSTID");
    cmd.query_async::<redis::Value>(conn).await.map(drop)
}

/// Deletes consumers that hold nothing and have not read for `idle_ms` (dead workers;
/// each process is a consumer of its own, so they would pile up). A live consumer reads
/// at least once per block and is never that idle; if it were, its next read would
/// simply re-create it.
pub(crate) async fn forget_idle_consumers<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    shard: Shard,
    idle_ms: u64,
) -> RedisResult<u64> {
    static FORGET: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
        redis::Script::new(include_str!("../../lua/forget_idle_consumers.lua"))
    });
    FORGET
        .key(keys.stream(shard))
        .arg(GROUP)
        .arg(idle_ms)
        .invoke_async(conn)
        .await
}
