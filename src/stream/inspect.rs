//! Reading the stream as it is (admins' look-ups, the loader's paging).

use redis::aio::ConnectionLike;
use redis::{RedisResult, Value};

use crate::keys::{Keys, Shard};

use super::entry::{parse_entries, parse_raw, Entry, RawEntry};

/// Up to `limit` entries of the shard's stream, oldest first.
pub(crate) async fn entries<C: ConnectionLike + Send>(
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
pub(crate) async fn page<C: ConnectionLike + Send>(
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
