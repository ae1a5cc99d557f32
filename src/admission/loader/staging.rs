//! What a load stages in Redis before its last step (Postgres's buyers, the stream's
//! candidates, paged), and the moves between parts it must know of.

use std::collections::HashMap;

use redis::aio::ConnectionLike;

use super::{Mode, PAGE, STAGE_CHUNK, STAGE_PIPELINE, STAGE_TTL};
use crate::domain::{OrderId, UserId};
use crate::keys::{Keys, SalePart};
use crate::scripts::Call;
use crate::store;

/// The moves of a part a load must know of (a segmented sale's only): moves into it
/// Postgres recorded and has not seen credited (their units are in its allotment, so the
/// load marks them credited), and, for a check, which of the moves taken out of it
/// Postgres recorded (the others are units on their way, not in Redis's stock).
#[derive(Default)]
pub(super) struct PartMoves {
    /// The part's label (`None`: a sale in one part).
    label: Option<String>,
    moved_in: Vec<(i64, i32)>,
    recorded_out: Vec<i64>,
}

impl PartMoves {
    pub(super) async fn read<C: ConnectionLike + Send>(
        tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
        conn: &mut C,
        keys: &Keys,
        part: SalePart,
        mode: Mode,
    ) -> anyhow::Result<Self> {
        let Some(label) = part.label() else {
            return Ok(Self::default());
        };
        let moved_in = store::parts::uncredited(&mut **tx, part.voucher_id)
            .await?
            .into_iter()
            .filter(|m| m.to == part.part)
            .map(|m| (m.id, m.units))
            .collect();
        let mut recorded_out = Vec::new();
        if mode == Mode::Check {
            let taken: Vec<i64> = redis::cmd("HKEYS")
                .arg(keys.moves_out(part))
                .query_async(conn)
                .await?;
            recorded_out = store::parts::recorded_among(tx, &taken).await?;
        }
        Ok(Self {
            label: Some(label),
            moved_in,
            recorded_out,
        })
    }

    /// The load step's arguments after the owed releases.
    pub(super) fn args(&self, call: &mut Call) {
        let Some(label) = &self.label else {
            call.arg("").arg(0).arg(0);
            return;
        };
        call.arg(label).arg(self.moved_in.len());
        for (id, units) in &self.moved_in {
            call.arg(id).arg(units);
        }
        call.arg(self.recorded_out.len());
        for id in &self.recorded_out {
            call.arg(id);
        }
    }
}

/// The keys a load stages its bulk in: beside the sale's hash (its hash tag, so one
/// slot), unique to this load, expiring if the loader dies.
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
    part: SalePart,
    known: &HashMap<UserId, OrderId>,
    last: &mut Option<String>,
    candidates: &mut Vec<Candidate>,
) -> anyhow::Result<()> {
    let shard = keys.shard_of_part(part);
    loop {
        let page = crate::stream::page(conn, keys, shard, last.as_deref(), PAGE).await?;
        if let Some(e) = page.last() {
            *last = Some(e.entry_id().to_string());
        }
        for e in &page {
            if let Some(o) = e.order() {
                if o.voucher_id == part.voucher_id
                    && o.part == part.part
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
