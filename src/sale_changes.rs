//! Announcements that a sale's Redis state changed: a unit came back (a release, a
//! settle), it was loaded or rebuilt, or closed. Each API instance listens
//! (`admission::edge`) and forgets what it remembered of the sale, so none answers a
//! press from an old memory of it. Pub/sub is at most once: a lost announcement is
//! bounded by how long an instance believes a memory (`EDGE_VERDICT_TTL_MS`).

use redis::aio::ConnectionLike;
use redis::RedisResult;

use crate::domain::VoucherId;
use crate::keys::Keys;

/// Tells every instance that `voucher_id`'s state changed. Best effort: a failure is
/// logged, never returned (the move it follows has happened).
pub async fn announce<C: ConnectionLike + Send>(conn: &mut C, keys: &Keys, voucher_id: VoucherId) {
    let result: RedisResult<i64> = redis::cmd("PUBLISH")
        .arg(keys.sale_changes())
        .arg(voucher_id)
        .query_async(conn)
        .await;
    if let Err(e) = result {
        // (With Redis ACLs the user needs `&<prefix>seckill:sale-changes`: without it
        // every announcement fails here and instances rely on the bound alone.)
        tracing::warn!(voucher_id = voucher_id.get(), error = %e, "announcing a sale change failed; instances forget it within EDGE_VERDICT_TTL_MS");
    }
}
