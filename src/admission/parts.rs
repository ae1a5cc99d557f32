//! Segmented sales: one sale's stock split over K parts, each on its own hash slot, so
//! that on Redis Cluster one hot sale's admissions spread over several masters.
//!
//! A user's grabs go to their home part ([`home_part`]), which holds their buyer record:
//! one order per user holds across parts with no cross-slot step. When a home part has
//! no unit left (`Drained`), units are moved to it from the richest other part; only
//! when no part has a unit (and none is on its way) is the sale sold out.
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
//! Whoever finds a move half done finishes it from where it stands ([`Parts::finish`]):
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
use crate::keys::{home_part, Keys, SalePart};
use crate::redis_conn::RedisConn;
use crate::scripts::Call;
use crate::store::parts::{self as store, Move, MoveState};

/// Refills a grab may wait for before it is answered `unavailable` (units taken by
/// others each time: a storm on the last few units).
const MAX_REFILLS: usize = 8;

/// The parts of each sale and the moves between them, for one process.
pub struct Parts {
    db: PgPool,
    redis: RedisConn,
    keys: Keys,
    ids: Arc<OrderIds>,
    /// Parts per sale (they never change once a sale exists); one lookup at a time each.
    known: Mutex<HashMap<VoucherId, Arc<OnceCell<u8>>>>,
    /// One refill at a time per part in this process: grabs that find their part drained
    /// together wait for one move.
    refills: Mutex<HashMap<SalePart, Arc<tokio::sync::Mutex<()>>>>,
}

impl Parts {
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

    /// Remembers a sale's parts (a sale just created).
    pub fn remember(&self, voucher_id: VoucherId, parts: u8) {
        let cell = OnceCell::new_with(Some(parts));
        self.lock_known().insert(voucher_id, Arc::new(cell));
    }

    fn lock_known(&self) -> std::sync::MutexGuard<'_, HashMap<VoucherId, Arc<OnceCell<u8>>>> {
        self.known.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How many parts the sale has: 1 when Postgres has no such sale (the grab then
    /// goes where an unsegmented sale's would and hears that it is not loaded; nothing
    /// is remembered, so a sale created later under the id is seen as it is).
    pub async fn of(&self, voucher_id: VoucherId) -> Result<u8, sqlx::Error> {
        let cell = self.lock_known().entry(voucher_id).or_default().clone();
        let found = cell
            .get_or_try_init(|| async {
                match store::parts_of(&self.db, voucher_id).await? {
                    Some(parts) => Ok(parts),
                    None => Err(None),
                }
            })
            .await
            .copied();
        match found {
            Ok(parts) => Ok(parts),
            Err(e) => {
                self.lock_known().remove(&voucher_id);
                match e {
                    None => Ok(1),
                    Some(e) => Err(e),
                }
            }
        }
    }

    /// Decides a grab: in the user's home part, and, while that part is drained, again
    /// after units moved to it. `SoldOut` only when no part had a unit.
    pub async fn admit(
        &self,
        batcher: &Batcher,
        voucher_id: VoucherId,
        user_id: UserId,
        order_id: OrderId,
    ) -> RedisResult<Outcome> {
        let parts = self.of(voucher_id).await.map_err(|e| {
            tracing::warn!(voucher_id = voucher_id.get(), error = %e, "cannot read the sale's parts");
            unavailable("the sale's parts cannot be read from postgres")
        })?;
        let grab = Grab {
            voucher_id,
            user_id,
            order_id,
            part: home_part(user_id, parts),
            parts,
        };
        for _ in 0..MAX_REFILLS {
            let outcome = batcher.admit(grab).await?;
            if outcome != Outcome::Drained {
                return Ok(outcome);
            }
            match self.refill(grab.sale_part(), parts).await {
                Ok(true) => {}
                Ok(false) => {
                    // (The drained part's answer was not counted: this one is.)
                    batcher.tally().add(voucher_id, super::tally::SOLD_OUT);
                    return Ok(Outcome::SoldOut);
                }
                Err(e) => {
                    tracing::warn!(
                        voucher_id = voucher_id.get(),
                        error = format!("{e:#}"),
                        "moving units between parts failed"
                    );
                    return Err(unavailable(
                        "units cannot be moved between the sale's parts now",
                    ));
                }
            }
        }
        Err(unavailable(
            "the last units of the sale are being moved; try again",
        ))
    }

    /// Brings units to a drained part: `true` when units came (or may have: a move of
    /// somebody else's finished), `false` when no part has any.
    async fn refill(&self, to: SalePart, parts: u8) -> anyhow::Result<bool> {
        let gate = self
            .refills
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(to)
            .or_default()
            .clone();
        let _one = gate.lock().await;
        let mut conn = self.redis.clone();
        let mut unsound = Vec::new();
        loop {
            let stocks = stocks(&mut conn, &self.keys, to.voucher_id, parts).await?;
            if stocks[to.part as usize].is_some_and(|s| s > 0) {
                // Another grab's refill (or a returned unit) got here first.
                return Ok(true);
            }
            let donor = stocks
                .iter()
                .enumerate()
                .filter(|(p, _)| *p != to.part as usize && !unsound.contains(p))
                .filter_map(|(p, s)| Some((p, (*s)?)))
                .filter(|(_, s)| *s > 0)
                .max_by_key(|(_, s)| *s);
            let Some((donor, stock)) = donor else {
                // Nothing anywhere: units may still be on their way (a mover died, or
                // is between its steps). Finish those; if any did, look again.
                if self.finish(to.voucher_id, parts).await? > 0 {
                    return Ok(true);
                }
                // A part being rebuilt may have units: not sold out, not yet.
                let unknown = (0..parts as usize).any(|p| {
                    p != to.part as usize && (stocks[p].is_none() || unsound.contains(&p))
                });
                anyhow::ensure!(
                    !unknown,
                    "a part of the sale is being rebuilt from postgres"
                );
                return Ok(false);
            };
            let Some(id) = self.ids.next() else {
                anyhow::bail!("no move id can be minted yet (no node number leased)");
            };
            let mut m = Move {
                id: id.get(),
                from: to.sibling(donor as u8),
                to: to.part,
                // Half of the richest part: parts that drain together share what is left.
                units: ((stock + 1) / 2) as i32,
            };
            let taken: i64 = Call::function("seckill_take")
                .key(self.keys.part(m.from))
                .key(self.keys.moves_out(m.from))
                .arg(m.id)
                .arg(m.units)
                .arg(m.to)
                .invoke(&mut conn)
                .await?;
            match taken {
                n if n > 0 => {
                    m.units = n as i32;
                    self.settle(&mut conn, m).await?;
                    return Ok(true);
                }
                // Sold meanwhile: look again.
                0 => continue,
                // Missing, stale or corrupt: it is rebuilt from Postgres before it gives.
                _ => unsound.push(donor),
            }
        }
    }

    /// Finishes every move of a sale found half done (taken and not recorded, or
    /// recorded and not credited); how many it credited now.
    pub async fn finish(&self, voucher_id: VoucherId, parts: u8) -> anyhow::Result<usize> {
        let mut conn = self.redis.clone();
        let mut credited = 0;
        for from in SalePart::all(voucher_id, parts) {
            let taken: HashMap<i64, String> = redis::cmd("HGETALL")
                .arg(self.keys.moves_out(from))
                .query_async(&mut conn)
                .await?;
            for (id, what) in taken {
                let Some((to, units)) = what.split_once(' ') else {
                    continue;
                };
                let (Ok(to), Ok(units)) = (to.parse::<u8>(), units.parse::<i32>()) else {
                    continue;
                };
                let m = Move {
                    id,
                    from,
                    to,
                    units,
                };
                credited += usize::from(self.settle(&mut conn, m).await?);
            }
        }
        for m in store::uncredited(&self.db, voucher_id).await? {
            credited += usize::from(self.settle(&mut conn, m).await?);
        }
        Ok(credited)
    }

    /// Records, credits and clears one move, from wherever it stands; `true` when it
    /// was credited by this call.
    async fn settle(&self, conn: &mut RedisConn, m: Move) -> anyhow::Result<bool> {
        let voucher_id = m.from.voucher_id;
        // Recorded only while the donor still holds the units (a load of the donor, which
        // would count them again, takes the same lock).
        let mut tx = self.db.begin().await?;
        crate::store::vouchers::lock_sales(&mut tx, &[voucher_id]).await?;
        if store::move_state(&mut tx, m.id).await? == MoveState::Unknown {
            let held: i64 = Call::function("seckill_taken")
                .key(self.keys.moves_out(m.from))
                .arg(m.id)
                .invoke(conn)
                .await?;
            if held <= 0 {
                // Void: the donor was rebuilt with the units (or the move is settled and
                // its record gone).
                return Ok(false);
            }
            store::record_move(
                &mut tx,
                &Move {
                    units: held as i32,
                    ..m
                },
            )
            .await?;
        }
        tx.commit().await?;

        let mut tx = self.db.begin().await?;
        crate::store::vouchers::lock_sales(&mut tx, &[voucher_id]).await?;
        let credited = match store::move_state(&mut tx, m.id).await? {
            MoveState::Recorded => {
                let units = store::units_of(&mut tx, m.id).await?;
                // 1: credited now; 0: a load of the recipient counted it already; -1:
                // the recipient is not sound, and its rebuild will count it.
                let credit: i64 = Call::function("seckill_credit")
                    .key(self.keys.part(m.recipient()))
                    .key(self.keys.moves_in(m.recipient()))
                    .arg(m.id)
                    .arg(units)
                    .invoke(conn)
                    .await?;
                store::mark_credited(&mut tx, m.id).await?;
                if credit == 1 {
                    metrics::counter!(crate::metrics::PART_UNITS_MOVED).increment(units as u64);
                }
                credit == 1
            }
            _ => false,
        };
        // Announced as soon as the units may be there: instances that remember the sale
        // sold out look again.
        if credited {
            crate::sale_changes::announce(conn, &self.keys, voucher_id).await;
        }
        tx.commit().await?;
        let _: i64 = redis::cmd("HDEL")
            .arg(self.keys.moves_out(m.from))
            .arg(m.id)
            .query_async(conn)
            .await?;
        Ok(credited)
    }

    /// Finishes half-done moves of every open segmented sale, every `every`, until
    /// cancelled (movers that died leave units on their way).
    pub async fn keep_finishing(
        self: Arc<Self>,
        every: Duration,
        cancel: tokio_util::sync::CancellationToken,
    ) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tick.tick() => {}
            }
            if let Err(e) = self.finish_open().await {
                tracing::warn!(
                    error = format!("{e:#}"),
                    "finishing moves between parts failed"
                );
            }
        }
    }

    async fn finish_open(&self) -> anyhow::Result<()> {
        for (voucher_id, parts) in store::open_segmented(&self.db).await? {
            let credited = self.finish(voucher_id, parts).await?;
            if credited > 0 {
                tracing::info!(
                    voucher_id = voucher_id.get(),
                    credited,
                    "finished moves between parts"
                );
            }
        }
        Ok(())
    }
}

/// Each part's stock (`None`: not loaded).
async fn stocks(
    conn: &mut RedisConn,
    keys: &Keys,
    voucher_id: VoucherId,
    parts: u8,
) -> RedisResult<Vec<Option<i64>>> {
    let lookups = SalePart::all(voucher_id, parts).map(|part| {
        let mut conn = conn.clone();
        let cmd = redis::cmd("HGET").arg(keys.part(part)).arg("stock").clone();
        async move { cmd.query_async::<Option<i64>>(&mut conn).await }
    });
    futures_util::future::try_join_all(lookups).await
}

/// An error that says nothing was reserved (the grab surely did not run).
fn unavailable(why: &'static str) -> redis::RedisError {
    std::io::Error::new(std::io::ErrorKind::ConnectionRefused, why).into()
}
