//! One place decides a grab: [`Admission::grab`], a pipeline. The abuse limits and the
//! edge (presses answered from what Redis last said) answer without Redis; then a 202 of
//! this shopper's being recovered, the order id, the decision (the one admission call,
//! batched per shard, through a segmented sale's segments, and at a lottery what its
//! answer waits for: `lottery::held`), and one follow-up: remembering a sale that can
//! sell nothing, healing one Redis lost or built in another life. Every answer is counted
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
use super::lottery::Lottery;
use super::order_id::OrderIds;
use super::promises::Promises;
use super::segments::Segments;
use super::{loader, Outcome, Unavailable};
use crate::domain::{OrderId, UserId, VoucherId};
use crate::keys::Keys;
use crate::redis_conn::RedisConn;
use crate::scripts::Replicas;
use crate::store::vouchers::{self, SaleLookup};

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
    pub(in crate::admission) marking: Mutex<HashSet<VoucherId>>,
    /// Lottery sales' windows, and their draws as Postgres records them.
    pub(in crate::admission) lottery: Lottery,
    pub(in crate::admission) retention: Duration,
    pub(in crate::admission) replicas: Replicas,
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
        let order_id = match self.before_redis(&shopper, voucher_id) {
            Ok(order_id) => order_id,
            Err(answered) => return Ok(answered),
        };
        let outcome = self.decide(shopper.user_id, voucher_id, order_id).await;
        HotPath::get().count(&outcome);
        self.follow_up(voucher_id, outcome).await
    }

    /// What answers a press without Redis (each counted here): a limit, the edge, or
    /// no fresh admission possible now; else the order id the press is decided under.
    fn before_redis(&self, shopper: &Shopper, voucher_id: VoucherId) -> Result<OrderId, Outcome> {
        let hot = HotPath::get();
        if let Some(wait) = self.limited(shopper) {
            let outcome = Outcome::RateLimited {
                retry_after_secs: wait.as_secs_f64().ceil() as u64,
            };
            hot.count(&outcome);
            self.batcher.tally().add(voucher_id, &outcome);
            return Err(outcome);
        }
        // Most presses of a flash sale can win nothing: answered here when Redis told
        // this instance lately (sold out, not open yet, ended, no such sale).
        if let Some(known) = self
            .edge
            .answer(voucher_id, shopper.user_id, Instant::now())
        {
            hot.at_edge(&known);
            self.batcher.tally().add_at_edge(voucher_id, &known);
            return Err(known);
        }
        self.ready(shopper.user_id, voucher_id).map_err(|not| {
            let outcome = Outcome::Unavailable(not);
            hot.count(&outcome);
            outcome
        })
    }

    /// The one admission call (batched per shard, through a segmented sale's segments),
    /// and at a lottery what its answer waits for.
    async fn decide(
        self: &Arc<Self>,
        user_id: UserId,
        voucher_id: VoucherId,
        order_id: OrderId,
    ) -> Outcome {
        let started = Instant::now();
        let decided = self
            .segments
            .admit(&self.batcher, voucher_id, user_id, order_id)
            .await;
        let waited = started.elapsed().as_secs_f64();
        crate::metrics::record_admission_wait(&HotPath::get().admission_seconds, waited);
        let decided = Outcome::of(decided, order_id);
        self.settle_lottery(user_id, voucher_id, order_id, decided, started)
            .await
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
            // Nothing besides the answer.
            Outcome::RateLimited { .. }
            | Outcome::Admitted { .. }
            | Outcome::AlreadyOrdered { .. }
            | Outcome::Drained
            | Outcome::Evicting
            | Outcome::Entered { .. }
            | Outcome::Drawing
            | Outcome::NotFound
            | Outcome::NoVoucher
            | Outcome::Unavailable(_)
            | Outcome::Unknown { .. } => {}
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

    /// Starts a reload of one sale in the background unless one is already running.
    pub(in crate::admission) fn reload_in_background(
        self: &Arc<Self>,
        voucher_id: VoucherId,
        mode: loader::Mode,
    ) {
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

pub(in crate::admission) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
