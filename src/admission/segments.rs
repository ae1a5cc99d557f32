//! Segmented sales: one sale's stock split over K segments, each on its own hash slot, so
//! that on Redis Cluster one hot sale's admissions spread over several masters.
//!
//! A user's grabs go to their home segment ([`home_segment`]), which holds their buyer record:
//! one order per user holds across segments with no cross-slot step. When a home segment has
//! no unit left (`Drained`), units are moved to it from the richest other segment; only
//! when no segment has a unit (and none is on its way) is the sale sold out.
//!
//! A move, and why a crash at any point neither loses nor doubles a unit:
//! 1. **take** (`seckill_take`, on the donor): its stock goes down and a record of the
//!    move is written beside it (its moves-out hash), atomically;
//! 2. **record** (Postgres, under the sale's row lock): only while the donor still holds
//!    that record, the move is recorded and the two allotments shift. A load of the donor
//!    (after Redis lost writes, or a repair) takes the same lock and drops the records:
//!    a move not recorded by then is void, and the load counts its units in the donor
//!    again (its allotment still has them);
//! 3. **credit** (`seckill_credit`, on the recipient, under the lock again): the units
//!    join the recipient's stock once (its moves-in hash remembers the move), and
//!    Postgres marks the move credited in the same transaction. A load of the recipient
//!    marks every move Postgres has not seen credited as credited (its allotment holds
//!    them already);
//! 4. the donor's record goes.
//!
//! Whoever finds a move half done finishes it from where it stands ([`Segments::finish`]):
//! the mover, any other instance on its next round, a refill that finds no unit.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::RedisResult;
use sqlx::PgPool;
use tokio::sync::OnceCell;

use super::batcher::Batcher;
use super::order_id::OrderIds;
use super::{Grab, Outcome};
use crate::domain::{OrderId, UserId, VoucherId};
use crate::keys::{home_segment, Keys, SaleSegment};
use crate::redis_conn::RedisConn;
use crate::scripts::Call;
use crate::store::segments::{self as store, Move, MoveState};

mod moves;
pub use moves::Finished;

/// Refills a grab may wait for before it is answered `unavailable` (units taken by
/// others each time: a storm on the last few units).
const MAX_REFILLS: usize = 8;
/// Reads of the segments one refill makes at most.
const MAX_LOOKS: usize = 16;

/// The segments of each sale and the moves between them, for one process.
pub struct Segments {
    db: PgPool,
    redis: RedisConn,
    keys: Keys,
    ids: Arc<OrderIds>,
    /// Segments per sale (they never change once a sale exists); one lookup at a time each.
    known: Mutex<HashMap<VoucherId, Arc<OnceCell<u8>>>>,
    /// One refill at a time per segment in this process: grabs that find their segment drained
    /// together wait for one move.
    refills: Mutex<HashMap<SaleSegment, Arc<tokio::sync::Mutex<()>>>>,
}

impl Segments {
    pub fn new(db: PgPool, redis: RedisConn, keys: Keys, ids: Arc<OrderIds>) -> Self {
        Self {
            db,
            redis,
            keys,
            ids,
            known: Mutex::default(),
            refills: Mutex::default(),
        }
    }

    /// Remembers a sale's segments (a sale just created).
    pub fn remember(&self, voucher_id: VoucherId, segments: u8) {
        let cell = OnceCell::new_with(Some(segments));
        self.lock_known().insert(voucher_id, Arc::new(cell));
    }

    fn lock_known(&self) -> std::sync::MutexGuard<'_, HashMap<VoucherId, Arc<OnceCell<u8>>>> {
        self.known.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How many segments the sale has, as its segment 0 (the sale's usual key) names itself:
    /// read from Redis once per process (a sale's segments never change, and admission needs
    /// only Redis). 1 when segment 0 is not loaded: the grab then goes where an unsegmented
    /// sale's would and hears that it is not loaded (the admission function compares the
    /// label it was routed by with the state's); nothing is remembered then, so a sale
    /// loaded later is seen as it is.
    pub async fn of(&self, voucher_id: VoucherId) -> RedisResult<u8> {
        let cell = self.lock_known().entry(voucher_id).or_default().clone();
        let found = cell
            .get_or_try_init(|| async {
                let mut conn = self.redis.clone();
                let (stock, label): (Option<String>, Option<String>) = redis::cmd("HMGET")
                    .arg(self.keys.voucher(voucher_id))
                    .arg("stock")
                    .arg("part")
                    .query_async(&mut conn)
                    .await
                    .map_err(Some)?;
                match (stock, label) {
                    (Some(_), None) => Ok(1),
                    (_, Some(label)) => SaleSegment::parse_label(voucher_id, &label)
                        .map(|p| p.segments)
                        .ok_or(None),
                    (None, None) => Err(None),
                }
            })
            .await
            .copied();
        match found {
            Ok(segments) => Ok(segments),
            Err(e) => {
                self.lock_known().remove(&voucher_id);
                match e {
                    None => Ok(1),
                    Some(e) => Err(e),
                }
            }
        }
    }

    /// Decides a grab: in the user's home segment, and, while that segment is drained, again
    /// after units moved to it. `SoldOut` only when no segment had a unit.
    pub async fn admit(
        &self,
        batcher: &Batcher,
        voucher_id: VoucherId,
        user_id: UserId,
        order_id: OrderId,
    ) -> RedisResult<Outcome> {
        let segments = self.of(voucher_id).await.map_err(|e| {
            tracing::warn!(voucher_id = voucher_id.get(), error = %e, "cannot read the sale's segments");
            unavailable("the sale's segments cannot be read from redis")
        })?;
        let grab = Grab {
            voucher_id,
            user_id,
            order_id,
            segment: home_segment(user_id, segments),
            segments,
        };
        for _ in 0..MAX_REFILLS {
            let outcome = batcher.admit(grab).await?;
            if outcome != Outcome::Drained {
                return Ok(outcome);
            }
            match self.refill(grab.sale_segment(), segments).await {
                Ok(true) => {}
                Ok(false) => {
                    // (The drained segment's answer was not counted: this one is.)
                    batcher.tally().add(voucher_id, &Outcome::SoldOut);
                    return Ok(Outcome::SoldOut);
                }
                Err(e) => {
                    tracing::warn!(
                        voucher_id = voucher_id.get(),
                        error = format!("{e:#}"),
                        "moving units between segments failed"
                    );
                    return Err(unavailable(
                        "units cannot be moved between the sale's segments now",
                    ));
                }
            }
        }
        Err(unavailable(
            "the last units of the sale are being moved; try again",
        ))
    }

    /// Brings units to a drained segment: `true` when units came (or may have: a move of
    /// somebody else's finished, a unit came back), `false` when no segment has any.
    async fn refill(&self, to: SaleSegment, segments: u8) -> anyhow::Result<bool> {
        let gate = self.gate(to);
        let one = gate.lock().await;
        let refilled = self.refill_alone(to, segments).await;
        drop(one);
        self.forget_gate(to, gate);
        refilled
    }

    async fn refill_alone(&self, to: SaleSegment, segments: u8) -> anyhow::Result<bool> {
        let mut conn = self.redis.clone();
        // `sold_out` needs two reads of every segment, the same to the last gen (a take and
        // a credit each move their segment's gen), with no move found half done between
        // them: a move somebody else is making shows in one or the other.
        let mut previous: Option<Vec<Option<SegmentRead>>> = None;
        for _ in 0..MAX_LOOKS {
            let read = sound_reads(&mut conn, &self.keys, to.voucher_id, segments).await?;
            if read[to.segment as usize]
                .as_ref()
                .is_some_and(|r| r.stock > 0)
            {
                // Another grab's refill (or a returned unit) got here first.
                return Ok(true);
            }
            let donor = read
                .iter()
                .enumerate()
                .filter(|(p, _)| *p != to.segment as usize)
                .filter_map(|(p, r)| Some((p, r.as_ref()?.stock)))
                .filter(|(_, s)| *s > 0)
                .max_by_key(|(_, s)| *s);
            if let Some((donor, stock)) = donor {
                previous = None;
                if self
                    .take_and_settle(&mut conn, to, donor as u8, stock)
                    .await?
                {
                    return Ok(true);
                }
                continue;
            }
            // Nothing anywhere: units may still be on their way (a mover died, or is
            // between its steps). Finish those, and look again.
            let done = self.finish(to.voucher_id, segments).await?;
            // A segment not sound (being rebuilt from Postgres, its node away) may have
            // units, and may hold a move's record: not sold out, not yet.
            anyhow::ensure!(
                done.blocked == 0 && read.iter().all(Option::is_some),
                "a segment of the sale is being rebuilt from postgres"
            );
            if done.found == 0 && previous.as_ref() == Some(&read) {
                return Ok(false);
            }
            previous = (done.found == 0).then_some(read);
        }
        anyhow::bail!("the sale's segments kept changing while units were moved")
    }

    /// Takes half of `stock` from `donor` for `to` and settles the move; `false` when the
    /// donor had none left (or was not sound) by then.
    async fn take_and_settle(
        &self,
        conn: &mut RedisConn,
        to: SaleSegment,
        donor: u8,
        stock: i64,
    ) -> anyhow::Result<bool> {
        let Some(id) = self.ids.next() else {
            anyhow::bail!("no move id can be minted yet (no node number leased)");
        };
        let mut m = Move {
            id: id.get(),
            from: to.sibling(donor),
            to: to.segment,
            // Half of the richest segment: segments that drain together share what is left.
            units: ((stock + 1) / 2) as i32,
        };
        let taken: i64 = Call::function("seckill_take")
            .key(self.keys.segment(m.from))
            .key(self.keys.moves_out(m.from))
            .key(self.keys.segment_marker(m.from))
            .arg(m.id)
            .arg(m.units)
            .arg(m.to)
            .invoke(conn)
            .await?;
        if taken <= 0 {
            // Sold meanwhile (0), or its state went unsound (-1): look again.
            return Ok(false);
        }
        m.units = taken as i32;
        self.settle(conn, m).await?;
        Ok(true)
    }

    /// The refill gate of a segment (one refill at a time per segment in this process).
    fn gate(&self, segment: SaleSegment) -> Arc<tokio::sync::Mutex<()>> {
        self.lock_refills().entry(segment).or_default().clone()
    }

    /// Drops a segment's gate once nobody else holds or waits for it.
    fn forget_gate(&self, segment: SaleSegment, gate: Arc<tokio::sync::Mutex<()>>) {
        let mut refills = self.lock_refills();
        // Ours and the map's: nobody else's.
        if Arc::strong_count(&gate) == 2 {
            refills.remove(&segment);
        }
    }

    fn lock_refills(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<SaleSegment, Arc<tokio::sync::Mutex<()>>>> {
        self.refills.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One read of a segment: its stock, and the gen that moves with every unit in or out.
#[derive(Debug, Clone, PartialEq, Eq)]
struct SegmentRead {
    stock: i64,
    gen: String,
}

/// Each segment's stock and gen, when its state is sound (`None`: not loaded, built in
/// another term of its server, or corrupt: it is rebuilt from Postgres before it counts).
async fn sound_reads(
    conn: &mut RedisConn,
    keys: &Keys,
    voucher_id: VoucherId,
    segments: u8,
) -> RedisResult<Vec<Option<SegmentRead>>> {
    let lookups = SaleSegment::all(voucher_id, segments).map(|segment| {
        let mut conn = conn.clone();
        let key = super::edge::StateKeys::of(keys, segment);
        async move {
            // A segment holding a lottery's window is not sound to take from: the
            // draw's rebuild sets its stock.
            let state = super::edge::peek(&mut conn, &key)
                .await?
                .filter(|s| !s.holds_window());
            Ok::<_, redis::RedisError>(state.map(|s| SegmentRead {
                stock: s.stock(),
                gen: s.gen().to_string(),
            }))
        }
    });
    futures_util::future::try_join_all(lookups).await
}

/// An error that says nothing was reserved (the grab surely did not run).
fn unavailable(why: &'static str) -> redis::RedisError {
    std::io::Error::new(std::io::ErrorKind::ConnectionRefused, why).into()
}
