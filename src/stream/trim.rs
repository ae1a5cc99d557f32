//! Trimming what every consumer is done with.

use redis::aio::ConnectionLike;
use redis::RedisResult;

use crate::keys::{Keys, Shard};

use super::entry::{parse_id, unexpected};

/// Trims entries every consumer is done with: below the oldest pending entry, or up to
/// the last delivered one when nothing is pending. Returns the entries removed.
pub(crate) async fn trim_acknowledged<C: ConnectionLike + Send>(
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
