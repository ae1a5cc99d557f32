//! Settling a move of units between a sale's segments: recorded in Postgres while its donor
//! holds the units, then credited to its recipient once; and finishing the moves that
//! movers left half done.

use super::*;

impl Segments {
    /// Finishes every move of a sale found half done (taken and not recorded, or
    /// recorded and not credited): how many it found, and how many it credited itself.
    pub async fn finish(&self, voucher_id: VoucherId, segments: u8) -> anyhow::Result<Finished> {
        let mut conn = self.redis.clone();
        let mut done = Finished::default();
        for from in SaleSegment::all(voucher_id, segments) {
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
                done.add(self.settle(&mut conn, m).await?);
            }
        }
        for m in store::uncredited(&self.db, voucher_id).await? {
            done.add(self.settle(&mut conn, m).await?);
        }
        Ok(done)
    }

    /// Records, credits and clears one move, from wherever it stands; `true` when it
    /// was credited by this call.
    pub(super) async fn settle(&self, conn: &mut RedisConn, m: Move) -> anyhow::Result<Settled> {
        if let Some(early) = self.record(conn, m).await? {
            return Ok(early);
        }
        let Some(credited) = self.credit(conn, m).await? else {
            return Ok(Settled::Nothing);
        };
        let _: i64 = redis::cmd("HDEL")
            .arg(self.keys.moves_out(m.from))
            .arg(m.id)
            .query_async(conn)
            .await?;
        Ok(if credited {
            Settled::Credited
        } else {
            Settled::Nothing
        })
    }

    /// The move's first half: recorded in Postgres with the units its donor's record
    /// holds, unless recorded already. `Some`: the settle ends here with that.
    async fn record(&self, conn: &mut RedisConn, m: Move) -> anyhow::Result<Option<Settled>> {
        // Recorded only while the donor still holds the units (a load of the donor, which
        // would count them again, takes the same lock).
        let mut tx = self.db.begin().await?;
        crate::store::vouchers::lock_sales(&mut tx, &[m.from.voucher_id]).await?;
        if store::move_state(&mut tx, m.id).await? == MoveState::Unknown {
            // Only from the donor's current build: a record in a state of another epoch
            // (an old primary's) took units the sale's own state still holds.
            let epoch = crate::store::epochs::of(&mut *tx, m.from).await?;
            let held: i64 = Call::function("seckill_taken")
                .key(self.keys.segment(m.from))
                .key(self.keys.moves_out(m.from))
                .key(self.keys.segment_marker(m.from))
                .arg(m.id)
                .arg(epoch.map(|e| e.to_string()).unwrap_or_default())
                .invoke(conn)
                .await?;
            if held < 0 {
                // Its donor must be rebuilt first (which drops the record, voiding it),
                // or it is not the sale's current state.
                return Ok(Some(Settled::DonorUnsound));
            }
            if held == 0 {
                // Void: the donor was rebuilt with the units (or the move is settled and
                // its record gone).
                return Ok(Some(Settled::Nothing));
            }
            let units = held as i32;
            store::record_move(&mut tx, &Move { units, ..m }).await?;
        }
        tx.commit().await?;
        Ok(None)
    }

    /// The move's second half: its units credited to the recipient once, and marked so
    /// in Postgres. Whether credited now; `None`: the recipient's state here is not its
    /// current one (an old primary's), so the credit is left to a process that reaches
    /// it.
    async fn credit(&self, conn: &mut RedisConn, m: Move) -> anyhow::Result<Option<bool>> {
        let mut tx = self.db.begin().await?;
        crate::store::vouchers::lock_sales(&mut tx, &[m.from.voucher_id]).await?;
        let credited = match store::move_state(&mut tx, m.id).await? {
            MoveState::Recorded => {
                let units = store::units_of(&mut tx, m.id).await?;
                let epoch = crate::store::epochs::of(&mut *tx, m.recipient()).await?;
                // 1: credited now; 0: a load of the recipient counted it already; -1:
                // the recipient is not sound, and its rebuild will count it; -2: not
                // the recipient's current state.
                let credit: i64 = Call::function("seckill_credit")
                    .key(self.keys.segment(m.recipient()))
                    .key(self.keys.moves_in(m.recipient()))
                    .key(self.keys.segment_marker(m.recipient()))
                    .arg(m.id)
                    .arg(units)
                    .arg(epoch.map(|e| e.to_string()).unwrap_or_default())
                    .invoke(conn)
                    .await?;
                if credit == -2 {
                    return Ok(None);
                }
                store::mark_credited(&mut tx, m.id).await?;
                if credit == 1 {
                    metrics::counter!(crate::metrics::SEGMENT_UNITS_MOVED).increment(units as u64);
                }
                credit == 1
            }
            _ => false,
        };
        // Announced as soon as the units may be there: instances that remember the sale
        // sold out look again.
        if credited {
            crate::sale_changes::announce(conn, &self.keys, m.from.voucher_id).await;
        }
        tx.commit().await?;
        Ok(Some(credited))
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
                    "finishing moves between segments failed"
                );
            }
        }
    }

    /// Each sale on its own: one whose node is away does not hold up the others.
    async fn finish_open(&self) -> anyhow::Result<()> {
        for (voucher_id, segments) in store::open_segmented(&self.db).await? {
            match self.finish(voucher_id, segments).await {
                Ok(done) if done.credited > 0 => tracing::info!(
                    voucher_id = voucher_id.get(),
                    credited = done.credited,
                    "finished moves between segments"
                ),
                Ok(_) => {}
                Err(e) => tracing::warn!(
                    voucher_id = voucher_id.get(),
                    error = format!("{e:#}"),
                    "finishing moves between segments failed"
                ),
            }
        }
        Ok(())
    }
}

/// What settling one move did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Settled {
    /// Credited to its recipient by this call.
    Credited,
    /// Settled before, or void.
    Nothing,
    /// Left as it is: its donor's state is not sound (to be rebuilt, which voids it).
    DonorUnsound,
}

/// What [`Segments::finish`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Finished {
    /// Moves found half done.
    pub found: usize,
    /// Of those, the ones this call credited.
    pub credited: usize,
    /// Of those, the ones left as they are until their donor is rebuilt.
    pub blocked: usize,
}

impl Finished {
    fn add(&mut self, settled: Settled) {
        self.found += 1;
        match settled {
            Settled::Credited => self.credited += 1,
            Settled::Nothing => {}
            Settled::DonorUnsound => self.blocked += 1,
        }
    }
}
