//! What a fenced step stages in Redis before it runs (Postgres's buyers, the stream's
//! candidates, paged).

use std::collections::HashMap;

use redis::aio::ConnectionLike;

use super::{PAGE, STAGE_CHUNK, STAGE_PIPELINE, STAGE_TTL};
use crate::domain::{OrderId, UserId};
use crate::keys::{Keys, SaleSegment};

/// The keys a step stages its bulk in: beside the sale's hash (its hash tag, so one
/// slot), unique to this step, expiring if the process dies first. A load's step
/// consumes them; a read-only one leaves them to [`Stage::remove`].
pub(super) struct Stage {
    pub(super) buyers: String,
    pub(super) candidates: String,
}

impl Stage {
    pub(super) fn new(sale_key: &str) -> Self {
        let token = format!("{:016x}", rand::random::<u64>());
        Self {
            buyers: format!("{sale_key}:stage:{token}:buyers"),
            candidates: format!("{sale_key}:stage:{token}:candidates"),
        }
    }

    /// Deletes both keys.
    pub(super) async fn remove<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
    ) -> anyhow::Result<()> {
        redis::cmd("DEL")
            .arg(&self.buyers)
            .arg(&self.candidates)
            .query_async::<()>(conn)
            .await?;
        Ok(())
    }

    /// Postgres's buyers as buyer records (`u:<user>` -> order).
    pub(super) async fn buyers<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        buyers: &[(UserId, OrderId)],
    ) -> anyhow::Result<()> {
        let commands = buyers.chunks(STAGE_CHUNK).map(|chunk| {
            let mut cmd = redis::cmd("HSET");
            cmd.arg(&self.buyers);
            for (user_id, order_id) in chunk {
                cmd.arg(crate::keys::buyer_field(*user_id)).arg(order_id);
            }
            cmd
        });
        send_staged(conn, &self.buyers, commands).await
    }

    /// Candidates, appended in stream order as `entry_id user_id order_id`.
    pub(super) async fn candidates<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        candidates: &[Candidate],
    ) -> anyhow::Result<()> {
        let commands = candidates.chunks(STAGE_CHUNK).map(|chunk| {
            let mut cmd = redis::cmd("RPUSH");
            cmd.arg(&self.candidates);
            for c in chunk {
                cmd.arg(format!("{} {} {}", c.entry_id, c.user_id, c.order_id));
            }
            cmd
        });
        send_staged(conn, &self.candidates, commands).await
    }
}

/// Sends staging commands a pipeline at a time, each pipeline renewing the key's TTL.
async fn send_staged<C: ConnectionLike + Send>(
    conn: &mut C,
    key: &str,
    commands: impl Iterator<Item = redis::Cmd>,
) -> anyhow::Result<()> {
    let commands: Vec<redis::Cmd> = commands.collect();
    for group in commands.chunks(STAGE_PIPELINE) {
        let mut pipe = redis::pipe();
        for cmd in group {
            pipe.add_command(cmd.clone()).ignore();
        }
        pipe.cmd("PEXPIRE")
            .arg(key)
            .arg(STAGE_TTL.as_millis() as u64)
            .ignore();
        pipe.query_async::<()>(conn).await?;
    }
    Ok(())
}

/// A stream entry of the sale being loaded whose order Postgres does not hold.
pub(super) struct Candidate {
    pub(super) entry_id: String,
    pub(super) user_id: UserId,
    pub(super) order_id: OrderId,
}

/// Pages through the shard's stream after `last` until a page comes back short,
/// collecting the sale's entries whose order is not in `known` (user → order);
/// `last` advances.
pub(super) async fn page_on<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    segment: SaleSegment,
    known: &HashMap<UserId, OrderId>,
    last: &mut Option<String>,
    candidates: &mut Vec<Candidate>,
) -> anyhow::Result<()> {
    let shard = keys.shard_of_segment(segment);
    loop {
        let page = crate::stream::page(conn, keys, shard, last.as_deref(), PAGE).await?;
        if let Some(e) = page.last() {
            *last = Some(e.entry_id().to_string());
        }
        for e in &page {
            if let Some(o) = e.order() {
                if o.voucher_id == segment.voucher_id
                    && o.segment == segment.segment
                    && known.get(&o.user_id) != Some(&o.id)
                {
                    candidates.push(Candidate {
                        entry_id: e.entry_id().to_string(),
                        user_id: o.user_id,
                        order_id: o.id,
                    });
                }
            }
        }
        if page.len() < PAGE {
            return Ok(());
        }
    }
}
