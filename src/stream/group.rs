//! The consumer group: reading, claiming, acknowledging, keeping entries fresh.

use redis::aio::ConnectionLike;
use redis::streams::StreamPendingCountReply;
use redis::{RedisResult, Value};

use crate::keys::{Keys, Shard};

use super::entry::{parse_entries, parse_read_reply, unexpected, Entry};

pub const GROUP: &str = "seckill-workers";

/// Creates the consumer group (and the stream) if missing; BUSYGROUP is fine.
pub(crate) async fn ensure_group<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    shard: Shard,
) -> RedisResult<()> {
    let created: RedisResult<()> = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(keys.stream(shard))
        .arg(GROUP)
        .arg("0")
        .arg("MKSTREAM")
        .query_async(conn)
        .await;
    match created {
        Err(e) if e.code() == Some("BUSYGROUP") => Ok(()),
        other => other,
    }
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
) -> RedisResult<Vec<Entry>> {
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
) -> RedisResult<(String, Vec<Entry>)> {
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

/// Acknowledges entries. A missing group (Redis lost its data) means there is nothing
/// left to acknowledge.
pub(crate) async fn ack<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    shard: Shard,
    entries: &[Entry],
) -> RedisResult<i64> {
    if entries.is_empty() {
        return Ok(0);
    }
    let mut cmd = redis::cmd("XACK");
    cmd.arg(keys.stream(shard)).arg(GROUP);
    for entry in entries {
        cmd.arg(entry.entry_id());
    }
    match cmd.query_async(conn).await {
        Err(e) if e.code() == Some("NOGROUP") => Ok(0),
        other => other,
    }
}

/// The pending entries (whoever holds them) with ids from `first` to `last`, for `n`
/// entries of ours in that range: one XPENDING.
async fn pending_range<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    shard: Shard,
    (first, last): (&str, &str),
    n: usize,
) -> RedisResult<StreamPendingCountReply> {
    redis::cmd("XPENDING")
        .arg(keys.stream(shard))
        .arg(GROUP)
        .arg(first)
        .arg(last)
        // The range may hold other consumers' entries too; the pending list is what the
        // workers hold right now, so this stays small.
        .arg(n.max(1) * 16 + 10_000)
        .query_async(conn)
        .await
}

/// How often each of `entries` (in id order) has been delivered; entries not pending
/// are left out.
pub(crate) async fn delivery_counts<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    shard: Shard,
    entries: &[Entry],
) -> RedisResult<std::collections::HashMap<String, u64>> {
    let (Some(first), Some(last)) = (entries.first(), entries.last()) else {
        return Ok(Default::default());
    };
    let range = (first.entry_id(), last.entry_id());
    let reply = pending_range(conn, keys, shard, range, entries.len()).await?;
    Ok(reply
        .ids
        .into_iter()
        .map(|p| (p.id, p.times_delivered as u64))
        .collect())
}

/// Which of `entry_ids` (in id order) are pending in the group, whoever holds them.
pub(crate) async fn still_pending<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    shard: Shard,
    entry_ids: &[&str],
) -> RedisResult<std::collections::HashSet<String>> {
    let (Some(first), Some(last)) = (entry_ids.first(), entry_ids.last()) else {
        return Ok(Default::default());
    };
    match pending_range(conn, keys, shard, (first, last), entry_ids.len()).await {
        Ok(reply) => Ok(reply.ids.into_iter().map(|p| p.id).collect()),
        // The group is gone with Redis's data: nothing is pending.
        Err(e) if e.code() == Some("NOGROUP") => Ok(Default::default()),
        Err(e) => Err(e),
    }
}

/// Resets the idle time of entries this consumer holds without counting a delivery, so
/// live workers do not take over a batch that is only waiting for Postgres.
pub(crate) async fn touch<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    shard: Shard,
    consumer: &str,
    entries: &[Entry],
) -> RedisResult<()> {
    if entries.is_empty() {
        return Ok(());
    }
    let mut cmd = redis::cmd("XCLAIM");
    cmd.arg(keys.stream(shard)).arg(GROUP).arg(consumer).arg(0);
    for e in entries {
        cmd.arg(e.entry_id());
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
