//! The order stream between admission and the worker: `stream.orders`, read by the
//! consumer group `seckill-workers`.

use std::sync::LazyLock;

use chrono::{DateTime, Utc};
use redis::aio::ConnectionLike;
use redis::{RedisResult, Script, Value};

use crate::admission::keys::{Keys, Shard};
use crate::store::orders::NewOrder;

pub const GROUP: &str = "seckill-workers";

static ACK: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("../../lua/ack.lua")));

/// One stream entry as the worker sees it.
#[derive(Debug, Clone, PartialEq)]
pub enum Entry {
    Order {
        entry_id: String,
        order: NewOrder,
    },
    /// Missing or non-numeric fields (or deleted from the stream): it can never
    /// become an order row.
    Malformed {
        entry_id: String,
        fields: Vec<(String, String)>,
        reason: String,
    },
}

impl Entry {
    pub fn entry_id(&self) -> &str {
        match self {
            Entry::Order { entry_id, .. } | Entry::Malformed { entry_id, .. } => entry_id,
        }
    }

    fn parse(entry_id: String, fields: Option<Vec<(String, String)>>) -> Entry {
        let Some(fields) = fields else {
            return Entry::Malformed {
                entry_id,
                fields: Vec::new(),
                reason: "entry no longer in the stream".into(),
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
            None => Entry::Malformed {
                entry_id,
                fields,
                reason: "missing or non-numeric fields".into(),
            },
        }
    }
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
    let Value::Array(entries) = entries else {
        return Err(unexpected());
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
                        [k, v] => Some((
                            redis::from_redis_value_ref::<String>(k).ok()?,
                            redis::from_redis_value_ref::<String>(v).ok()?,
                        )),
                        _ => None,
                    })
                    .collect(),
            ),
            _ => return Err(unexpected()),
        };
        out.push(Entry::parse(id, fields));
    }
    Ok(out)
}

fn unexpected() -> redis::RedisError {
    redis::RedisError::from((
        redis::ErrorKind::UnexpectedReturnType,
        "unexpected reply to a stream read",
    ))
}

/// Acknowledges entries and forgets their pending-order records, in one script call.
pub async fn ack<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    shard: Shard,
    entries: &[&Entry],
) -> RedisResult<i64> {
    if entries.is_empty() {
        return Ok(0);
    }
    let mut call = ACK.prepare_invoke();
    call.key(keys.stream(shard))
        .key(keys.pending(shard))
        .arg(GROUP);
    for entry in entries {
        match entry {
            Entry::Order { entry_id, order } => call
                .key(keys.user_pending(shard, order.user_id))
                .arg(entry_id)
                .arg(order.id),
            Entry::Malformed { entry_id, .. } => {
                call.key(keys.pending(shard)).arg(entry_id).arg("")
            }
        };
    }
    call.invoke_async(conn).await
}

/// Moves an entry to the dead-letter stream with the reason. The caller acks it after.
pub async fn dead_letter<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    shard: Shard,
    entry: &Entry,
    reason: &str,
) -> RedisResult<()> {
    let mut cmd = redis::cmd("XADD");
    cmd.arg(keys.dead_letters(shard))
        .arg("*")
        .arg("entry_id")
        .arg(entry.entry_id())
        .arg("reason")
        .arg(reason);
    match entry {
        Entry::Order { order, .. } => {
            cmd.arg("order_id")
                .arg(order.id)
                .arg("voucher_id")
                .arg(order.voucher_id)
                .arg("user_id")
                .arg(order.user_id)
                .arg("admitted_ms")
                .arg(order.admitted_at.timestamp_millis());
        }
        Entry::Malformed { fields, .. } => {
            for (k, v) in fields {
                // Prefixed so a stray field cannot pose as one of ours.
                cmd.arg(format!("orig.{k}")).arg(v);
            }
        }
    }
    cmd.query_async(conn).await
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
                Entry::Malformed { .. }
            ));
        }
    }
}
