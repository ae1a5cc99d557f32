//! Trimming what every consumer is done with.

use redis::aio::ConnectionLike;
use redis::streams::{StreamInfoGroupsReply, StreamPendingReply};
use redis::RedisResult;

use crate::keys::{Keys, Shard};

use super::entry::parse_id;

/// Trims entries every consumer is done with: below the oldest pending entry, or up to
/// the last delivered one when nothing is pending. Returns the entries removed.
pub(crate) async fn trim_acknowledged<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    shard: Shard,
) -> RedisResult<u64> {
    let Some((ms, seq)) = done_below(conn, keys, shard).await? else {
        return Ok(0);
    };
    redis::cmd("XTRIM")
        .arg(keys.stream(shard))
        .arg("MINID")
        .arg(format!("{ms}-{seq}"))
        .query_async(conn)
        .await
}

/// The entry id below which every group on the shard's stream is done with every entry
/// (acknowledged: written to Postgres, or settled otherwise): its oldest pending entry,
/// or just past its last delivered one when nothing is pending. `None` when there is no
/// group, or an id it cannot read.
pub(crate) async fn done_below<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    shard: Shard,
) -> RedisResult<Option<(u64, u64)>> {
    let stream = keys.stream(shard);
    let groups: StreamInfoGroupsReply = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(stream)
        .query_async(conn)
        .await?;
    // Every group on the stream must be done with an entry.
    let mut min_id: Option<(u64, u64)> = None;
    for group in &groups.groups {
        let pending: StreamPendingReply = redis::cmd("XPENDING")
            .arg(stream)
            .arg(&group.name)
            .query_async(conn)
            .await?;
        let keep_from = match pending {
            StreamPendingReply::Data(data) if data.count > 0 => parse_id(&data.start_id),
            _ => parse_id(&group.last_delivered_id).map(|(ms, seq)| (ms, seq + 1)),
        };
        let Some(keep_from) = keep_from else {
            return Ok(None);
        };
        min_id = Some(min_id.map_or(keep_from, |m| m.min(keep_from)));
    }
    Ok(min_id)
}
