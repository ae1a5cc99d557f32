//! Everything a request handler needs, shared by clone.

use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use sqlx::PgPool;

use crate::admission::batcher::{self, Batcher};
use crate::admission::edge::Edge;
use crate::admission::fence::Fence;
use crate::admission::order_id::OrderIds;
use crate::admission::parts::Parts;
use crate::auth::Verifier;
use crate::config::Settings;
use crate::domain::{UserId, VoucherId};
use crate::http::limits::RateLimiter;
use crate::keys::Keys;
use crate::redis_conn::RedisConn;

/// Cloned once per request, so it is one pointer to the shared [`Shared`].
#[derive(Clone)]
pub struct AppState(Arc<Shared>);

pub struct Shared {
    pub db: PgPool,
    pub redis: RedisConn,
    pub keys: Keys,
    /// Bearer tokens: the HS256 secret and/or the identity provider's keys.
    pub auth: Arc<Verifier>,
    pub ids: Arc<OrderIds>,
    pub settings: Arc<Settings>,
    /// Vouchers whose Redis state is being reloaded right now (one reload at a time).
    pub reloading: Arc<Mutex<HashSet<VoucherId>>>,
    pub(crate) per_user: Option<RateLimiter<UserId>>,
    pub(crate) per_ip: Option<RateLimiter<IpAddr>>,
    /// Redemption attempts per staff member: codes cannot be guessed at speed.
    pub(crate) redeem_attempts: RateLimiter<UserId>,
    /// Coalesces concurrent grabs of a shard into one admission script call.
    pub(crate) admissions: Batcher,
    /// The epoch Postgres names for each sale part, as last heard: admission refuses an
    /// older build's state (kept by a task of the startup).
    pub(crate) fence: Arc<Fence>,
    /// The live view's snapshots (`/live/events`).
    pub(crate) live: crate::live::Live,
    /// Wakes the term watcher (a grab met a sale built in an earlier term of Redis).
    pub(crate) heal: Arc<tokio::sync::Notify>,
    /// Asks the term watcher for a look soon (a grab met a held sale: this instance's
    /// vouch, or the opening, may be due).
    pub(crate) look_soon: Arc<tokio::sync::Notify>,
    /// Sales this instance answers by itself (sold out, not yet open, ended, none).
    pub edge: Arc<Edge>,
    /// The parts of segmented sales, and the moves of units between them.
    pub parts: Arc<Parts>,
    /// Fired once the database schema is this binary's (migrations applied, which waits
    /// for Postgres when it was away at start).
    pub(crate) migrated: tokio_util::sync::CancellationToken,
}

/// Redemptions a staff member may attempt: a counter's pace, with room for a queue.
const REDEEM_PER_SECOND: u32 = 2;
const REDEEM_BURST: u32 = 20;

impl AppState {
    // (Called once, by the one startup; each argument is a part of the state.)
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        db: PgPool,
        redis: RedisConn,
        keys: Keys,
        auth: Arc<Verifier>,
        ids: Arc<OrderIds>,
        settings: Settings,
        live: crate::live::Live,
        migrated: tokio_util::sync::CancellationToken,
        promises: Arc<crate::admission::promises::Promises>,
    ) -> Self {
        let limits = &settings.limits;
        let per_user =
            RateLimiter::new(limits.rate_limit_per_user, limits.rate_limit_per_user_burst);
        let per_ip = RateLimiter::new(limits.rate_limit_per_ip, limits.rate_limit_per_ip_burst);
        let fence = Arc::new(Fence::default());
        let admissions = Batcher::start(
            redis.clone(),
            keys.clone(),
            batcher::MAX_BATCH,
            settings.replicas,
            promises,
            fence.clone(),
        );
        let parts = Arc::new(Parts::new(
            db.clone(),
            redis.clone(),
            keys.clone(),
            ids.clone(),
        ));
        let edge = Arc::new(Edge::new(std::time::Duration::from_millis(
            settings.edge.edge_verdict_ttl_ms,
        )));
        Self(Arc::new(Shared {
            db,
            redis,
            keys,
            auth,
            ids,
            settings: Arc::new(settings),
            reloading: Arc::default(),
            per_user,
            per_ip,
            redeem_attempts: RateLimiter::new(REDEEM_PER_SECOND, REDEEM_BURST)
                .expect("a positive rate"),
            admissions,
            fence,
            live,
            heal: Arc::default(),
            look_soon: Arc::default(),
            edge,
            parts,
            migrated,
        }))
    }
}

impl std::ops::Deref for AppState {
    type Target = Shared;

    fn deref(&self) -> &Shared {
        &self.0
    }
}

/// The token verifier, for the extractors (`FromRef`, so they need no concrete state).
impl axum::extract::FromRef<AppState> for Arc<Verifier> {
    fn from_ref(state: &AppState) -> Self {
        state.auth.clone()
    }
}

impl AppState {
    /// Runs [`RateLimiter::forget_idle`] on the API's limiters every
    /// [`FORGET_IDLE_EVERY`](crate::http::limits::FORGET_IDLE_EVERY), until cancelled.
    pub(crate) async fn forget_idle_rate_limits(self, cancel: tokio_util::sync::CancellationToken) {
        if self.per_user.is_none() && self.per_ip.is_none() {
            return;
        }
        let mut every = tokio::time::interval(crate::http::limits::FORGET_IDLE_EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = every.tick() => {}
            }
            if let Some(limiter) = &self.per_user {
                limiter.forget_idle();
            }
            if let Some(limiter) = &self.per_ip {
                limiter.forget_idle();
            }
        }
    }
}
