//! One place decides a grab: [`Admission::grab`]. In order: the abuse limits, the edge
//! (presses answered from what Redis last said), a 202 of this shopper's being
//! recovered, the order id, the admission call (batched per shard, through a segmented
//! sale's segments), then what the answer asks for: remembering a sale that can sell
//! nothing, healing one Redis lost or built in another life. Every answer is counted
//! once, by its [`Outcome`]. The HTTP handler parses, calls, and maps the outcome.

use sqlx::PgPool;
use tokio::sync::Notify;

use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::batcher::{self, Batcher};
use super::edge::Edge;
use super::fence::Fence;
use super::hot::HotPath;
use super::limits::RateLimiter;
use super::lottery::{self, Lottery};
use super::order_id::OrderIds;
use super::promises::Promises;
use super::segments::Segments;
use super::{loader, Outcome, Unavailable};
use crate::domain::{OrderId, UserId, VoucherId};
use crate::keys::Keys;
use crate::redis_conn::RedisConn;
use crate::scripts::Replicas;
use crate::store::vouchers::{self, SaleLookup};

/// How soon a held lottery press asks again when the draw is not done yet.
const RETRY_DRAW: Duration = Duration::from_millis(20);

/// How a lottery sale's draw is read, when it is in one segment: by grabbing again as an
/// entrant (which draws, if no call has yet), or, known made, from its record alone.
#[derive(Debug, Clone, Copy)]
enum Reader {
    Entrant(UserId, OrderId),
    Made,
}

/// Who presses.
#[derive(Debug, Clone, Copy)]
pub struct Shopper {
    pub user_id: UserId,
    /// The client's address, when known (for the per-address limit).
    pub ip: Option<IpAddr>,
}

/// The per-user and per-address limits of the grab route (`None`: off).
pub struct Limits {
    pub(crate) per_user: Option<RateLimiter<UserId>>,
    pub(crate) per_ip: Option<RateLimiter<IpAddr>>,
}

/// Everything a grab's decision needs, held once per process.
pub struct Admission {
    pub(crate) db: PgPool,
    pub(crate) redis: RedisConn,
    pub(crate) keys: Keys,
    pub ids: Arc<OrderIds>,
    pub(crate) batcher: Batcher,
    /// The segments of segmented sales, and the moves of units between them.
    pub segments: Arc<Segments>,
    /// Sales this instance answers by itself (sold out, not yet open, ended, none).
    pub(crate) edge: Arc<Edge>,
    /// The epoch Postgres names for each sale segment, as last heard.
    pub(crate) fence: Arc<Fence>,
    pub(crate) limits: Limits,
    /// Wakes the term watcher (a grab met a sale built in an earlier term of Redis).
    pub(crate) heal: Arc<Notify>,
    /// Asks the term watcher for a look soon (a grab met a held sale).
    pub(crate) look_soon: Arc<Notify>,
    /// Vouchers whose Redis state is being reloaded right now (one reload at a time).
    reloading: Mutex<HashSet<VoucherId>>,
    /// Lottery sales whose draw is being recorded and marked so in the background.
    marking: Mutex<HashSet<VoucherId>>,
    /// Lottery sales' windows, and their draws as Postgres records them.
    lottery: Lottery,
    retention: Duration,
    replicas: Replicas,
}

/// What [`Admission::new`] is made of, besides what it starts itself.
pub struct Setup {
    pub db: PgPool,
    pub redis: RedisConn,
    pub keys: Keys,
    pub ids: Arc<OrderIds>,
    pub promises: Arc<Promises>,
    pub limits: Limits,
    pub edge_ttl: Duration,
    pub retention: Duration,
    pub replicas: Replicas,
    /// How long a busy shard's call may wait for more grabs (see [`Batcher::start`]).
    pub linger: Duration,
}

impl Admission {
    /// Starts the batcher's tasks (needs a Tokio runtime).
    pub(crate) fn new(p: Setup) -> Self {
        // Every grab series on the metrics page from the start, at zero.
        HotPath::get();
        let fence = Arc::new(Fence::default());
        let batcher = Batcher::start(
            p.redis.clone(),
            p.keys.clone(),
            batcher::MAX_BATCH,
            p.linger,
            p.replicas,
            p.promises,
            fence.clone(),
        );
        let segments = Arc::new(Segments::new(
            p.db.clone(),
            p.redis.clone(),
            p.keys.clone(),
            p.ids.clone(),
        ));
        Self {
            db: p.db,
            redis: p.redis,
            keys: p.keys,
            ids: p.ids,
            batcher,
            segments,
            edge: Arc::new(Edge::new(p.edge_ttl)),
            fence,
            limits: p.limits,
            heal: Arc::default(),
            look_soon: Arc::default(),
            reloading: Mutex::default(),
            marking: Mutex::default(),
            lottery: Lottery::default(),
            retention: p.retention,
            replicas: p.replicas,
        }
    }

    /// Decides `shopper`'s press on `voucher_id`: [`Outcome::Admitted`] is a 202, every
    /// other outcome a refusal. An error only when a sale Redis does not hold could not
    /// be looked up in Postgres.
    pub async fn grab(
        self: &Arc<Self>,
        shopper: Shopper,
        voucher_id: VoucherId,
    ) -> Result<Outcome, sqlx::Error> {
        let hot = HotPath::get();
        if let Some(wait) = self.limited(&shopper) {
            let outcome = Outcome::RateLimited {
                retry_after_secs: wait.as_secs_f64().ceil() as u64,
            };
            hot.count(&outcome);
            self.batcher.tally().add(voucher_id, &outcome);
            return Ok(outcome);
        }
        // Most presses of a flash sale can win nothing: answered here when Redis told
        // this instance lately (sold out, not open yet, ended, no such sale).
        if let Some(known) = self
            .edge
            .answer(voucher_id, shopper.user_id, Instant::now())
        {
            hot.at_edge(&known);
            self.batcher.tally().add_at_edge(voucher_id, &known);
            return Ok(known);
        }
        let order_id = match self.ready(shopper.user_id, voucher_id) {
            Ok(order_id) => order_id,
            Err(not) => {
                let outcome = Outcome::Unavailable(not);
                hot.count(&outcome);
                return Ok(outcome);
            }
        };
        let started = Instant::now();
        let decided = self
            .segments
            .admit(&self.batcher, voucher_id, shopper.user_id, order_id)
            .await;
        let waited = started.elapsed().as_secs_f64();
        crate::metrics::record_admission_wait(&hot.admission_seconds, waited);
        let outcome = match Outcome::of(decided, order_id) {
            Outcome::Entered { order_id } => {
                self.await_draw(shopper.user_id, voucher_id, order_id, started)
                    .await
            }
            outcome if outcome.may_await_a_draw() => {
                self.after_draw(shopper.user_id, voucher_id, order_id, outcome)
                    .await
            }
            outcome => outcome,
        };
        hot.count(&outcome);
        self.follow_up(voucher_id, outcome).await
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
            _ => return Err(()),
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

    /// The limit that refuses this press, if any: how long to wait.
    fn limited(&self, shopper: &Shopper) -> Option<Duration> {
        if let (Some(limiter), Some(ip)) = (&self.limits.per_ip, shopper.ip) {
            if let Err(wait) = limiter.check(&ip) {
                return Some(wait);
            }
        }
        let limiter = self.limits.per_user.as_ref()?;
        limiter.check(&shopper.user_id).err()
    }

    /// The order id for a fresh admission, unless it cannot be tried now.
    fn ready(&self, user_id: UserId, voucher_id: VoucherId) -> Result<OrderId, Unavailable> {
        // A 202 this instance gave that user there, which Redis may have lost and which
        // is not admitted again yet: a fresh admission would take its place.
        if self.batcher.promises().at_risk(user_id, voucher_id) {
            return Err(Unavailable::Recovering);
        }
        self.ids.next().ok_or(Unavailable::IdsNotReady)
    }

    /// What an outcome asks for besides its answer; a sale Redis does not hold is looked
    /// up in Postgres, which may say there is none.
    async fn follow_up(
        self: &Arc<Self>,
        voucher_id: VoucherId,
        outcome: Outcome,
    ) -> Result<Outcome, sqlx::Error> {
        match outcome {
            Outcome::NotStarted | Outcome::Ended | Outcome::SoldOut => {
                // (Known by now: the grab was routed by it.)
                let segments = self.segments.of(voucher_id).await.unwrap_or(1);
                self.edge
                    .learn_in_background(&self.redis, &self.keys, voucher_id, segments);
            }
            Outcome::NotLoaded => return self.not_loaded(voucher_id).await,
            Outcome::Stale => {
                // Redis came back in a new term: the watcher heals every sale on it,
                // this one included, and keeps this instance's promises there again
                // (meanwhile, their users' fresh grabs wait).
                self.batcher.promises().alarm(self.keys.shards());
                self.heal.notify_one();
            }
            // Every instance is admitting again the 202s the server may have lost: the
            // watcher looks soon (this instance's segment, and the opening).
            Outcome::Held => self.look_soon.notify_one(),
            // Nothing to heal here: the sale lives on another server, and this one (an
            // old primary) is on its way out (the term watch sees the change of server).
            // (Each refusal is logged by the request's failure and counted as `fenced`.)
            Outcome::Fenced => tracing::debug!(
                voucher_id = voucher_id.get(),
                "redis holds an older build of the sale than postgres names: refused"
            ),
            Outcome::Corrupt => {
                tracing::error!(
                    voucher_id = voucher_id.get(),
                    "the sale's redis state is corrupt: repairing it"
                );
                self.reload_in_background(voucher_id, loader::Mode::Repair);
            }
            _ => {}
        }
        Ok(outcome)
    }

    /// The sale is not in Redis: an unknown voucher, an ended sale whose state expired,
    /// or state lost with Redis. Only the last is worth a reload; until it is done, fail
    /// closed.
    async fn not_loaded(self: &Arc<Self>, voucher_id: VoucherId) -> Result<Outcome, sqlx::Error> {
        // A reload is already under way: a storm of presses must not become a storm of
        // Postgres queries.
        if self.reloading().contains(&voucher_id) {
            return Ok(Outcome::NotLoaded);
        }
        // Begun before Postgres is asked: a sale created meanwhile is announced, and
        // then its absence is not remembered.
        let lookup = self.edge.lookup(voucher_id);
        let asked_at = Instant::now();
        let sale = vouchers::sale(&self.db, voucher_id).await;
        if let Some(lookup) = lookup {
            match &sale {
                Ok(SaleLookup::NoSale) => lookup.not_found(asked_at),
                Ok(SaleLookup::NoVoucher) => lookup.no_voucher(asked_at),
                _ => lookup.nothing(),
            }
        }
        Ok(match sale? {
            SaleLookup::NoVoucher => Outcome::NoVoucher,
            SaleLookup::NoSale => Outcome::NotFound,
            SaleLookup::Sale(sale) if sale.end_time <= crate::clock::now() => Outcome::Ended,
            SaleLookup::Sale(_) => {
                self.reload_in_background(voucher_id, loader::Mode::Heal);
                Outcome::NotLoaded
            }
        })
    }

    fn reloading(&self) -> std::sync::MutexGuard<'_, HashSet<VoucherId>> {
        lock(&self.reloading)
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

    /// Starts a reload of one sale in the background unless one is already running.
    fn reload_in_background(self: &Arc<Self>, voucher_id: VoucherId, mode: loader::Mode) {
        if !self.reloading().insert(voucher_id) {
            return;
        }
        let this = self.clone();
        tokio::spawn(async move {
            let mut conn = this.redis.clone();
            let result = loader::load_sale(
                &this.db,
                &mut conn,
                &this.keys,
                voucher_id,
                this.retention,
                mode,
                this.replicas,
            )
            .await;
            if let Err(e) = result {
                tracing::warn!(voucher_id = voucher_id.get(), error = %e, "reloading sale state failed");
            }
            this.reloading().remove(&voucher_id);
        });
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
