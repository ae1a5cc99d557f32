//! A lottery's presses, held until its draw: an entrant's press waits for the window's
//! end and is answered from the draw as Postgres records it; a press that meets a draw
//! being made or a segment not rebuilt after it waits for that; and the draws nobody's
//! press makes are made by [`Admission::keep_drawing`]. Called from a grab's follow-up
//! ([`Admission::grab`]) with what the admission call decided.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::admission::grab::{lock, Admission};
use crate::admission::{loader, lottery, Outcome};
use crate::domain::{OrderId, UserId, VoucherId};

/// How soon a held lottery press asks again when the draw is not done yet.
const RETRY_DRAW: Duration = Duration::from_millis(20);

/// How a lottery sale's draw is read, when it is in one segment: by grabbing again as an
/// entrant (which draws, if no call has yet), or, known made, from its record alone.
#[derive(Debug, Clone, Copy)]
enum Reader {
    Entrant(UserId, OrderId),
    Made,
}

impl Admission {
    /// What the press the admission call answered `decided` is answered at last: an
    /// entry is held until the draw; a refusal by a draw being made (or a segment not
    /// rebuilt after it) waits for that; any other outcome stands. `pressed`: when the
    /// press reached admission.
    pub(in crate::admission) async fn settle_lottery(
        self: &Arc<Self>,
        user_id: UserId,
        voucher_id: VoucherId,
        order_id: OrderId,
        decided: Outcome,
        pressed: Instant,
    ) -> Outcome {
        match decided {
            Outcome::Entered { order_id } => {
                self.await_draw(user_id, voucher_id, order_id, pressed)
                    .await
            }
            outcome if outcome.may_await_a_draw() => {
                self.after_draw(user_id, voucher_id, order_id, outcome)
                    .await
            }
            outcome => outcome,
        }
    }

    /// A lottery entrant's press, held until the draw. Once the window is over, one held
    /// press of this instance grabs again under the order id it entered with (drawing, if
    /// no call has yet) and reads the draw as Postgres records it; every held press is
    /// answered from that record: drawn, the order recorded for it (the 202 of the one it
    /// entered under); not, `sold_out`. Answered at the latest [`lottery::ANSWER_WITHIN`]
    /// after the window (then as unknown: a press again tells). `pressed`: when the
    /// press reached admission.
    async fn await_draw(
        self: &Arc<Self>,
        user_id: UserId,
        voucher_id: VoucherId,
        entered: OrderId,
        pressed: Instant,
    ) -> Outcome {
        // The press is an entry already: whatever stops it from being held (Postgres not
        // answering the window's lookup), its answer names the order it entered under.
        let window = match self.lottery.window(&self.db, voucher_id).await {
            Ok(Some(window)) => window,
            Ok(None) => return Outcome::Unknown { order_id: entered },
            Err(e) => {
                tracing::warn!(voucher_id = voucher_id.get(), error = %e, "an entry's window could not be read: answered unknown");
                return Outcome::Unknown { order_id: entered };
            }
        };
        // (Redis's clock, as this instance knows it: the window is Redis's.)
        let now = crate::clock::now();
        let left = (window.end - now).to_std().unwrap_or_default();
        // Pressed after the window, as at a segment of a segmented sale the draw has
        // not rebuilt yet, which still marks its entrants.
        let held = now - pressed.elapsed() < window.end;
        let end = tokio::time::Instant::now() + left;
        tokio::time::sleep_until(end).await;
        let outcome = self
            .held_answer(user_id, voucher_id, entered, window, end, held)
            .await;
        if held {
            crate::metrics::record_lottery_answer(end.elapsed().as_secs_f64());
        }
        outcome
    }

    /// What an entrant's press is answered, the window over at `end`. It is told of an
    /// order the draw gave only while that order still holds its unit: a press made
    /// after the window (not `held`) may come after the winner closed it, the draw's
    /// record long made. Should Postgres not say, a `held` press is answered from the
    /// record (its order was written with the draw, moments ago).
    async fn held_answer(
        self: &Arc<Self>,
        user_id: UserId,
        voucher_id: VoucherId,
        entered: OrderId,
        window: lottery::Window,
        end: tokio::time::Instant,
        held: bool,
    ) -> Outcome {
        let deadline = end + lottery::ANSWER_WITHIN;
        let reader = Reader::Entrant(user_id, entered);
        let Some(drawn) = self.drawn(voucher_id, window, deadline, reader).await else {
            return match held {
                true => Outcome::Unknown { order_id: entered },
                // (Not naming the draw's order: it may have closed.)
                false => Outcome::Drawing,
            };
        };
        let user = user_id.get();
        match drawn.winners.get(&user) {
            Some(&order_id) if !self.still_holds(order_id, user_id, voucher_id, held).await => {
                // Closed since (its unit back on sale), or Postgres cannot say: the
                // segment's rebuild from Postgres tells.
                self.reload_in_background(voucher_id, loader::Mode::Drawn);
                Outcome::Drawing
            }
            Some(&order_id) if order_id == entered => Outcome::Admitted { order_id },
            // (Entered again under another id after a rebuild lost the first entry.)
            Some(&order_id) => Outcome::AlreadyOrdered { order_id },
            None if drawn.entrants.contains(&user) => Outcome::SoldOut,
            // Not among the entrants the draw found (the entry was lost with the sale's
            // state, rebuilt before the draw): a grab as any after the window.
            None => {
                let decided = self
                    .segments
                    .admit(&self.batcher, voucher_id, user_id, entered)
                    .await;
                match Outcome::of(decided, entered) {
                    Outcome::AlreadyOrdered { order_id } if order_id == entered => {
                        Outcome::Admitted { order_id }
                    }
                    outcome if outcome.may_await_a_draw() => {
                        self.after_draw(user_id, voucher_id, entered, outcome).await
                    }
                    outcome => outcome,
                }
            }
        }
    }

    /// Whether the draw's order still holds its unit; when Postgres cannot say,
    /// `otherwise`.
    async fn still_holds(
        &self,
        order_id: OrderId,
        user_id: UserId,
        voucher_id: VoucherId,
        otherwise: bool,
    ) -> bool {
        crate::store::draws::holds_unit(&self.db, order_id, user_id, voucher_id)
            .await
            .unwrap_or(otherwise)
    }

    /// A press that took nothing (`refused`) from a lottery sale past its window: its
    /// draw not recorded yet (`Drawing`), or, at a segmented sale, its segment not
    /// rebuilt after the draw yet (`Drawing`) or being rebuilt (not armed, or a move of
    /// units refused by a segment being rebuilt). Waits, at most
    /// [`lottery::ANSWER_WITHIN`], for this instance to read the draw (which records it,
    /// and rebuilds the segments) and grabs again until it is decided; any other sale's
    /// refusal stands.
    async fn after_draw(
        self: &Arc<Self>,
        user_id: UserId,
        voucher_id: VoucherId,
        order_id: OrderId,
        refused: Outcome,
    ) -> Outcome {
        // (At a sale in one segment only a drawn state answers `Drawing`, whatever this
        // instance's clock says.)
        let waits = |w: &lottery::Window| match w.segments {
            1 => matches!(refused, Outcome::Drawing),
            _ => crate::clock::now() >= w.end,
        };
        let window = match self.lottery.window(&self.db, voucher_id).await {
            Ok(Some(window)) if waits(&window) => window,
            _ => return refused,
        };
        let deadline = tokio::time::Instant::now() + lottery::ANSWER_WITHIN;
        // (Refused by a state of the draw: made. A grab to make it could admit this
        // press unheard, should the record be slow.)
        if self
            .drawn(voucher_id, window, deadline, Reader::Made)
            .await
            .is_none()
        {
            return refused;
        }
        loop {
            let decided = self
                .segments
                .admit(&self.batcher, voucher_id, user_id, order_id)
                .await;
            match Outcome::of(decided, order_id) {
                outcome
                    if outcome.may_await_a_draw()
                        && tokio::time::Instant::now() + RETRY_DRAW < deadline =>
                {
                    tokio::time::sleep(RETRY_DRAW).await
                }
                Outcome::Drawing => {
                    // Drawn and recorded, and still waiting (a segment's rebuild cut
                    // short or failed; a mark of the record not made): made now,
                    // whoever would have.
                    match window.segments {
                        1 => self.mark_in_background(voucher_id),
                        _ => self.reload_in_background(voucher_id, loader::Mode::Drawn),
                    }
                    return Outcome::Drawing;
                }
                // (Admitted by an earlier call under this press's id: its own order.)
                Outcome::AlreadyOrdered { order_id: held } if held == order_id => {
                    return Outcome::Admitted { order_id }
                }
                outcome => return outcome,
            }
        }
    }

    /// The sale's draw as this instance read it, reading it if none has (one read at a
    /// time, asked again every [`RETRY_DRAW`]); `None`: not read by `deadline`.
    async fn drawn(
        &self,
        voucher_id: VoucherId,
        window: lottery::Window,
        deadline: tokio::time::Instant,
        reader: Reader,
    ) -> Option<Arc<lottery::Drawn>> {
        let draw = self.lottery.draw_of(voucher_id);
        loop {
            let read = draw.get_or_try_init(|| async {
                match (window.segments, reader) {
                    (1, Reader::Entrant(user_id, entered)) => {
                        self.read_draw(user_id, voucher_id, entered).await
                    }
                    (1, Reader::Made) => self.read_record(voucher_id).await,
                    (segments, _) => self.read_parts_draw(voucher_id, segments).await,
                }
            });
            match tokio::time::timeout_at(deadline, read).await {
                Ok(Ok(drawn)) => return Some(drawn.clone()),
                Ok(Err(())) if tokio::time::Instant::now() + RETRY_DRAW < deadline => {
                    tokio::time::sleep(RETRY_DRAW).await
                }
                _ => return None,
            }
        }
    }

    /// A segmented sale's draw, drawn and recorded if it is not yet (see
    /// [`lottery::parts`]). `Err`: not drawn yet, or not recorded now.
    async fn read_parts_draw(
        &self,
        voucher_id: VoucherId,
        segments: u8,
    ) -> Result<Arc<lottery::Drawn>, ()> {
        let stores = self.stores();
        match lottery::parts::draw(&stores, voucher_id, segments).await {
            Ok(Some(drawn)) => {
                // The held presses are answered from the record; presses that meet a
                // segment not rebuilt yet wait for it.
                tokio::spawn(async move {
                    lottery::parts::rebuild_after(&stores, voucher_id, segments).await
                });
                Ok(Arc::new(drawn))
            }
            Ok(None) => Err(()),
            Err(e) => {
                tracing::warn!(voucher_id = voucher_id.get(), error = %e, "the segmented lottery's draw failed");
                Err(())
            }
        }
    }

    fn stores(&self) -> lottery::parts::Stores {
        lottery::parts::Stores {
            db: self.db.clone(),
            redis: self.redis.clone(),
            keys: self.keys.clone(),
            retention: self.retention,
            replicas: self.replicas,
        }
    }

    /// Grabs again under the order id the shopper entered with (which draws, if no call
    /// has yet), and reads the draw once Postgres records it (recording it first). `Err`:
    /// not drawn yet, or not recorded now.
    async fn read_draw(
        &self,
        user_id: UserId,
        voucher_id: VoucherId,
        entered: OrderId,
    ) -> Result<Arc<lottery::Drawn>, ()> {
        let decided = self
            .segments
            .admit(&self.batcher, voucher_id, user_id, entered)
            .await;
        match Outcome::of(decided, entered) {
            // An answer after the draw (or the sale's end), or the draw not recorded yet.
            Outcome::Admitted { .. }
            | Outcome::AlreadyOrdered { .. }
            | Outcome::SoldOut
            | Outcome::Ended
            | Outcome::Drawing => {}
            // Not yet (Redis's clock is a little behind ours), or no answer now (a
            // failed call, a state being rebuilt): asked again.
            Outcome::Entered { .. }
            | Outcome::NotStarted
            | Outcome::NotLoaded
            | Outcome::Stale
            | Outcome::Corrupt
            | Outcome::Held
            | Outcome::Fenced
            | Outcome::Drained
            | Outcome::Evicting
            | Outcome::RateLimited { .. }
            | Outcome::NotFound
            | Outcome::NoVoucher
            | Outcome::Unavailable(_)
            | Outcome::Unknown { .. } => return Err(()),
        }
        self.read_record(voucher_id).await
    }

    /// The draw of a sale in one segment once Postgres records it (recording it first).
    /// `Err`: not drawn yet, or not recorded now.
    async fn read_record(&self, voucher_id: VoucherId) -> Result<Arc<lottery::Drawn>, ()> {
        match lottery::record_draw(&self.db, &self.redis, &self.keys, voucher_id).await {
            Ok(Some(drawn)) => Ok(Arc::new(drawn)),
            Ok(None) => Err(()),
            Err(e) => {
                tracing::warn!(voucher_id = voucher_id.get(), error = %e, "recording the lottery's draw failed");
                Err(())
            }
        }
    }

    /// Draws the lottery sales whose window is over and whose draw Postgres does not
    /// record yet, every [`lottery::DUE_LOOK`] until `cancel`: a draw happens at the
    /// first admission call after the window, which a held press makes; with none held
    /// (every instance holding presses gone, their shoppers not pressing again), this
    /// one grabs again as one of the sale's entrants (which changes nothing but the draw,
    /// as any entrant's press again would) and records the draw; a draw done but not
    /// recorded (Postgres away then) is recorded, and one recorded but not marked so in
    /// Redis is marked.
    pub(crate) async fn keep_drawing(self: Arc<Self>, cancel: tokio_util::sync::CancellationToken) {
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(lottery::DUE_LOOK) => {}
            }
            let due = match crate::store::draws::due(&self.db).await {
                Ok(due) => due,
                Err(e) => {
                    tracing::debug!(error = %e, "lottery draws due: postgres did not answer");
                    continue;
                }
            };
            for crate::store::draws::Due {
                voucher_id,
                recorded,
            } in due
            {
                if let Err(e) = self.draw_due(voucher_id, recorded).await {
                    tracing::warn!(voucher_id = voucher_id.get(), error = %e, "a due lottery draw failed");
                }
            }
        }
    }

    async fn draw_due(&self, voucher_id: VoucherId, recorded: bool) -> anyhow::Result<()> {
        let segments = match self.lottery.window(&self.db, voucher_id).await? {
            Some(window) => window.segments,
            None => return Ok(()),
        };
        if segments > 1 {
            let stores = self.stores();
            if lottery::parts::draw(&stores, voucher_id, segments)
                .await?
                .is_some()
            {
                lottery::parts::rebuild_after(&stores, voucher_id, segments).await;
            }
            return Ok(());
        }
        if recorded {
            // Its state may still wait for the record (its recorder gone before marking it).
            if lottery::marked_unrecorded(&mut self.redis.clone(), &self.keys, voucher_id).await? {
                lottery::record_draw(&self.db, &self.redis, &self.keys, voucher_id).await?;
            }
            return Ok(());
        }
        // Drawn already, not recorded (Postgres was away when the held presses read it).
        if lottery::record_draw(&self.db, &self.redis, &self.keys, voucher_id)
            .await?
            .is_some()
        {
            return Ok(());
        }
        let Some((user_id, entered)) =
            lottery::an_entrant(&mut self.redis.clone(), &self.keys, voucher_id).await?
        else {
            return Ok(());
        };
        let decided = self
            .segments
            .admit(&self.batcher, voucher_id, user_id, entered)
            .await;
        tracing::debug!(voucher_id = voucher_id.get(), outcome = ?Outcome::of(decided, entered), "a due lottery draw");
        lottery::record_draw(&self.db, &self.redis, &self.keys, voucher_id).await?;
        Ok(())
    }

    /// Records a sale's draw (if Redis holds one Postgres does not) and marks it recorded
    /// in Redis, in the background unless that is running already.
    fn mark_in_background(self: &Arc<Self>, voucher_id: VoucherId) {
        if !lock(&self.marking).insert(voucher_id) {
            return;
        }
        let this = self.clone();
        tokio::spawn(async move {
            let recorded =
                lottery::record_draw(&this.db, &this.redis, &this.keys, voucher_id).await;
            if let Err(e) = recorded {
                tracing::warn!(voucher_id = voucher_id.get(), error = %e, "recording the lottery's draw failed");
            }
            lock(&this.marking).remove(&voucher_id);
        });
    }
}
