//! The order stream between admission and the worker: `stream.orders`, read by the
//! consumer group `seckill-workers`.

use chrono::{DateTime, Utc};
use redis::aio::ConnectionLike;
use redis::{RedisResult, Value};

use crate::keys::{Keys, Shard};
use crate::store::orders::NewOrder;

pub const GROUP: &str = "seckill-workers";

/// One stream entry as the worker sees it.
#[derive(Debug, Clone, PartialEq)]
pub enum Entry {
    Order {
        entry_id: String,
        order: NewOrder,
    },
    /// An entry that must go to the dead-letter stream without being written: malformed
    /// (missing or non-numeric fields, or deleted from the stream), or a poison entry
    /// delivered too often. `order` is set when the fields did parse.
    DeadLetter {
        entry_id: String,
        fields: Vec<(String, String)>,
        order: Option<NewOrder>,
        reason: String,
    },
}

impl Entry {
    pub fn entry_id(&self) -> &str {
        match self {
            Entry::Order { entry_id, .. } | Entry::DeadLetter { entry_id, .. } => entry_id,
        }
    }

    pub fn order(&self) -> Option<&NewOrder> {
        match self {
            Entry::Order { order, .. } => Some(order),
            Entry::DeadLetter { order, .. } => order.as_ref(),
        }
    }

    /// Turns the entry into a dead letter with `reason`.
    pub fn into_dead_letter(self, reason: String) -> Entry {
        match self {
            Entry::Order { entry_id, order } => Entry::DeadLetter {
                entry_id,
                fields: order_fields(&order),
                order: Some(order),
                reason,
            },
            Entry::DeadLetter {
                entry_id,
                fields,
                order,
                ..
            } => Entry::DeadLetter {
                entry_id,
                fields,
                order,
                reason,
            },
        }
    }

    fn parse(entry_id: String, fields: Option<Vec<(String, String)>>) -> Entry {
        let Some(fields) = fields else {
            return Entry::DeadLetter {
                entry_id,
                fields: Vec::new(),
                order: None,
                reason: "malformed: entry no longer in the stream".into(),
            };
        };
        let get = |name: &str| {
            fields
                .iter()
                .find(|(k, _)| k == name)
                .and_then(|(_, v)| v.parse::<i64>().ok())
                .filter(|n| *n > 0)
        };
        let order = (|| {
            Some(NewOrder {
                id: get("order_id")?,
                voucher_id: get("voucher_id")?,
                user_id: get("user_id")?,
                admitted_at: DateTime::<Utc>::from_timestamp_millis(get("admitted_ms")?)?,
            })
        })();
        match order {
            Some(order) => Entry::Order { entry_id, order },
            None => Entry::DeadLetter {
                entry_id,
                fields,
                order: None,
                reason: "malformed: missing or non-numeric fields".into(),
            },
        }
    }
}

fn order_fields(order: &NewOrder) -> Vec<(String, String)> {
    vec![
        ("order_id".into(), order.id.to_string()),
        ("voucher_id".into(), order.voucher_id.to_string()),
        ("user_id".into(), order.user_id.to_string()),
        (
            "admitted_ms".into(),
            order.admitted_at.timestamp_millis().to_string(),
        ),
    ]
}

/// Creates the consumer group (and the stream) if missing; BUSYGROUP is fine.
pub async fn ensure_group<C: ConnectionLike + Send>(
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
pub async fn read<C: ConnectionLike + Send>(
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
pub async fn claim<C: ConnectionLike + Send>(
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

/// `[[stream, [[id, [field, value, ...] | nil], ...]], ...]` or nil on timeout.
fn parse_read_reply(reply: Value) -> RedisResult<Vec<Entry>> {
    let mut out = Vec::new();
    let streams = match reply {
        Value::Nil => return Ok(out),
        Value::Array(streams) => streams,
        Value::Map(pairs) => pairs
            .into_iter()
            .map(|(k, v)| Value::Array(vec![k, v]))
            .collect(),
        _ => return Err(unexpected()),
    };
    for stream in streams {
        let Value::Array(mut parts) = stream else {
            return Err(unexpected());
        };
        let Some(entries) = parts.pop() else {
            return Err(unexpected());
        };
        out.extend(parse_entries(entries)?);
    }
    Ok(out)
}

fn parse_entries(entries: Value) -> RedisResult<Vec<Entry>> {
    Ok(parse_raw(entries)?
        .into_iter()
        .map(|(id, fields)| Entry::parse(id, fields))
        .collect())
}

/// Entry ids and fields of a stream reply (`None`: the entry was deleted). Field names
/// and values that are not UTF-8 are kept, lossily, so a poison entry stays visible.
fn parse_raw(entries: Value) -> RedisResult<Vec<RawEntry>> {
    let Value::Array(entries) = entries else {
        return Err(unexpected());
    };
    let text = |v: &Value| match v {
        Value::BulkString(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
        other => redis::from_redis_value_ref::<String>(other).ok(),
    };
    let mut out = Vec::with_capacity(entries.len());
    for entry in entries {
        let Value::Array(mut pair) = entry else {
            return Err(unexpected());
        };
        if pair.len() != 2 {
            return Err(unexpected());
        }
        let fields = pair.pop().expect("two elements");
        let id: String = redis::from_redis_value(pair.pop().expect("two elements"))?;
        let fields = match fields {
            Value::Nil => None,
            Value::Array(flat) => Some(
                flat.chunks(2)
                    .filter_map(|kv| match kv {
                        [k, v] => Some((text(k)?, text(v)?)),
                        _ => None,
                    })
                    .collect(),
            ),
            _ => return Err(unexpected()),
        };
        out.push((id, fields));
    }
    Ok(out)
}

/// A stream entry's id and its fields (`None` when the entry was deleted).
pub type RawEntry = (String, Option<Vec<(String, String)>>);

fn unexpected() -> redis::RedisError {
    redis::RedisError::from((
        redis::ErrorKind::UnexpectedReturnType,
        "unexpected reply to a stream read",
    ))
}

/// Acknowledges entries. A missing group (Redis lost its data) means there is nothing
/// left to acknowledge.
pub async fn ack<C: ConnectionLike + Send>(
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

/// Up to `limit` entries of the shard's stream, oldest first.
pub async fn entries<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    shard: Shard,
    limit: usize,
) -> RedisResult<Vec<Entry>> {
    Ok(range(conn, keys.stream(shard), limit)
        .await?
        .into_iter()
        .map(|(id, fields)| Entry::parse(id, fields))
        .collect())
}

/// Up to `count` entries of the shard's stream after the entry `after` (from the
/// start when `None`), oldest first: one XRANGE, so one bounded step for Redis.
pub async fn page<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    shard: Shard,
    after: Option<&str>,
    count: usize,
) -> RedisResult<Vec<Entry>> {
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

/// Up to `limit` entries of the stream at `key`, oldest first, read in pages of a
/// thousand.
pub async fn range<C: ConnectionLike + Send>(
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

/// Most dead letters kept; older ones are trimmed away.
pub const DEAD_LETTERS_KEPT: usize = 1_000_000;

/// Appends an entry to the dead-letter stream with its reason. The caller acks it after.
pub async fn dead_letter<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    shard: Shard,
    entry: &Entry,
) -> RedisResult<()> {
    let Entry::DeadLetter { fields, reason, .. } = entry else {
        return Err(redis::RedisError::from((
            redis::ErrorKind::Client,
            "only dead letters go to the dead-letter stream",
        )));
    };
    let mut cmd = redis::cmd("XADD");
    cmd.arg(keys.dead_letters(shard))
        .arg("MAXLEN")
        .arg("~")
        .arg(DEAD_LETTERS_KEPT)
        .arg("*")
        .arg("entry_id")
        .arg(entry.entry_id())
        .arg("reason")
        .arg(reason);
    for (k, v) in fields {
        // Prefixed so a stray field cannot pose as one of ours.
        cmd.arg(format!("orig.{k}")).arg(v);
    }
    cmd.query_async(conn).await
}

/// How often each of `entries` has been delivered (XPENDING); entries not pending are
/// left out.
pub async fn delivery_counts<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    shard: Shard,
    entries: &[Entry],
) -> RedisResult<std::collections::HashMap<String, u64>> {
    let (Some(first), Some(last)) = (entries.first(), entries.last()) else {
        return Ok(Default::default());
    };
    // Entries arrive in id order, so one range covers them all.
    let rows: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
        .arg(keys.stream(shard))
        .arg(GROUP)
        .arg(first.entry_id())
        .arg(last.entry_id())
        // The range may hold other consumers' entries too (the pending list is small).
        .arg(entries.len().max(1) * 16 + 10_000)
        .query_async(conn)
        .await?;
    Ok(rows
        .into_iter()
        .map(|(id, _consumer, _idle, deliveries)| (id, deliveries))
        .collect())
}

static SETTLE_DEAD: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("../../lua/settle_dead.lua")));

/// Settles a dead order in Redis (see `lua/settle_dead.lua`): acknowledges its entry
/// and, if the user's buyer record still names it, points the record at `holder` (the
/// order Postgres holds for the user) or drops it, and returns the unit when
/// `return_unit`. `true` when the buyer record was settled now.
#[allow(clippy::too_many_arguments)]
pub async fn settle_dead<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    entry_id: &str,
    voucher_id: i64,
    user_id: i64,
    order_id: i64,
    holder: Option<i64>,
    return_unit: bool,
) -> RedisResult<bool> {
    let settled: i64 = SETTLE_DEAD
        .key(keys.voucher(voucher_id))
        .key(keys.stream(keys.shard_of(voucher_id)))
        .arg(GROUP)
        .arg(entry_id)
        .arg(crate::keys::buyer_field(user_id))
        .arg(order_id)
        .arg(holder.map(|h| h.to_string()).unwrap_or_default())
        .arg(if return_unit { "1" } else { "0" })
        .invoke_async(conn)
        .await?;
    Ok(settled == 1)
}

/// Which of `entry_ids` (in id order) are pending in the group, whoever holds them:
/// one XPENDING over their id range.
pub async fn still_pending<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    shard: Shard,
    entry_ids: &[&str],
) -> RedisResult<std::collections::HashSet<String>> {
    let (Some(first), Some(last)) = (entry_ids.first(), entry_ids.last()) else {
        return Ok(Default::default());
    };
    // The range may hold other consumers' entries too; the pending list is what the
    // workers hold right now, so this stays small.
    let rows: Result<Vec<(String, String, u64, u64)>, _> = redis::cmd("XPENDING")
        .arg(keys.stream(shard))
        .arg(GROUP)
        .arg(first)
        .arg(last)
        .arg(entry_ids.len().max(1) * 16 + 10_000)
        .query_async(conn)
        .await;
    match rows {
        Ok(rows) => Ok(rows.into_iter().map(|(id, ..)| id).collect()),
        // The group is gone with Redis's data: nothing is pending.
        Err(e) if e.code() == Some("NOGROUP") => Ok(Default::default()),
        Err(e) => Err(e),
    }
}

/// Resets the idle time of entries this consumer holds without counting a delivery, so
/// live workers do not take over a batch that is only waiting for Postgres.
pub async fn touch<C: ConnectionLike + Send>(
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

/// Trims entries every consumer is done with: below the oldest pending entry, or up to
/// the last delivered one when nothing is pending. Returns the entries removed.
pub async fn trim_acknowledged<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    shard: Shard,
) -> RedisResult<u64> {
    let stream = keys.stream(shard);
    let groups: Vec<std::collections::HashMap<String, redis::Value>> = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(stream)
        .query_async(conn)
        .await?;
    // Every group on the stream must be done with an entry before it goes.
    let mut min_id: Option<(u64, u64)> = None;
    for group in &groups {
        let name: String = group
            .get("name")
            .map(redis::from_redis_value_ref)
            .transpose()?
            .unwrap_or_default();
        let last: String = group
            .get("last-delivered-id")
            .map(redis::from_redis_value_ref)
            .transpose()?
            .unwrap_or_default();
        let summary: (u64, Option<String>) = redis::cmd("XPENDING")
            .arg(stream)
            .arg(&name)
            .query_async::<redis::Value>(conn)
            .await
            .and_then(|v| match v {
                redis::Value::Array(parts) if parts.len() >= 2 => Ok((
                    redis::from_redis_value_ref(&parts[0])?,
                    redis::from_redis_value_ref(&parts[1])?,
                )),
                _ => Err(unexpected()),
            })?;
        let keep_from = match summary {
            (n, Some(oldest)) if n > 0 => parse_id(&oldest),
            _ => parse_id(&last).map(|(ms, seq)| (ms, seq + 1)),
        };
        let Some(keep_from) = keep_from else {
            return Ok(0);
        };
        min_id = Some(min_id.map_or(keep_from, |m| m.min(keep_from)));
    }
    let Some((ms, seq)) = min_id else {
        return Ok(0);
    };
    redis::cmd("XTRIM")
        .arg(stream)
        .arg("MINID")
        .arg(format!("{ms}-{seq}"))
        .query_async(conn)
        .await
}

/// Deletes consumers that hold nothing and have not read for `idle_ms` (dead workers;
/// each process is a consumer of its own, so they would pile up). A live consumer reads
/// at least once per block and is never that idle; if it were, its next read would
/// simply re-create it.
pub async fn forget_idle_consumers<C: ConnectionLike + Send>(
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

pub(crate) fn parse_id(id: &str) -> Option<(u64, u64)> {
    let (ms, seq) = id.split_once('-')?;
    Some((ms.parse().ok()?, seq.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(pairs: &[(&str, &str)]) -> Option<Vec<(String, String)>> {
        Some(
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    #[test]
    fn a_complete_entry_parses_into_an_order() {
        let e = Entry::parse(
            "1-0".into(),
            fields(&[
                ("order_id", "9"),
                ("voucher_id", "2"),
                ("user_id", "3"),
                ("admitted_ms", "1790000000000"),
            ]),
        );
        let Entry::Order { order, .. } = e else {
            panic!("not an order: {e:?}")
        };
        assert_eq!((order.id, order.voucher_id, order.user_id), (9, 2, 3));
    }

    #[test]
    fn entries_with_missing_or_bad_fields_or_no_fields_are_malformed() {
        for f in [
            fields(&[("order_id", "9"), ("voucher_id", "2"), ("admitted_ms", "1")]),
            fields(&[
                ("order_id", "x"),
                ("voucher_id", "2"),
                ("user_id", "3"),
                ("admitted_ms", "1"),
            ]),
            fields(&[
                ("order_id", "-9"),
                ("voucher_id", "2"),
                ("user_id", "3"),
                ("admitted_ms", "1"),
            ]),
            None,
        ] {
            assert!(matches!(
                Entry::parse("1-0".into(), f),
                Entry::DeadLetter { .. }
            ));
        }
    }
}
