//! Everything a request handler needs, shared by clone.

use std::sync::Arc;

use sqlx::PgPool;

use crate::admission::grab::{Admission, Limits, Setup};
use crate::admission::limits::RateLimiter;
use crate::admission::order_id::OrderIds;
use crate::auth::Verifier;
use crate::config::Settings;
use crate::domain::UserId;
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
    pub settings: Arc<Settings>,
    /// Everything that decides a grab.
    pub admission: Arc<Admission>,
    /// Redemption attempts per staff member: codes cannot be guessed at speed.
    pub(crate) redeem_attempts: RateLimiter<UserId>,
    /// The keys payment notifications must be signed with.
    pub(crate) payment_secrets: crate::lifecycle::signature::Secrets,
    /// The live view's snapshots (`/live/events`).
    pub(crate) live: crate::live::Live,
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
        let payment_secrets = crate::lifecycle::signature::Secrets::new(&settings.payment_secrets);
        let admission = Admission::new(Setup {
            db: db.clone(),
            redis: redis.clone(),
            keys: keys.clone(),
            ids,
            promises,
            limits: Limits {
                per_user: RateLimiter::new(
                    limits.rate_limit_per_user,
                    limits.rate_limit_per_user_burst,
                ),
                per_ip: RateLimiter::new(limits.rate_limit_per_ip, limits.rate_limit_per_ip_burst),
            },
            edge_ttl: std::time::Duration::from_millis(settings.edge.edge_verdict_ttl_ms),
            retention: settings.sale_state_retention,
            replicas: settings.replicas,
            linger: settings.admission_linger,
        });
        Self(Arc::new(Shared {
            db,
            redis,
            keys,
            auth,
            settings: Arc::new(settings),
            admission: Arc::new(admission),
            redeem_attempts: RateLimiter::new(REDEEM_PER_SECOND, REDEEM_BURST)
                .expect("a positive rate"),
            payment_secrets,
            live,
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
    /// [`FORGET_IDLE_EVERY`](crate::admission::limits::FORGET_IDLE_EVERY), until cancelled.
    pub(crate) async fn forget_idle_rate_limits(self, cancel: tokio_util::sync::CancellationToken) {
        let limits = &self.admission.limits;
        if limits.per_user.is_none() && limits.per_ip.is_none() {
            return;
        }
        let mut every = tokio::time::interval(crate::admission::limits::FORGET_IDLE_EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = every.tick() => {}
            }
            if let Some(limiter) = &limits.per_user {
                limiter.forget_idle();
            }
            if let Some(limiter) = &limits.per_ip {
                limiter.forget_idle();
            }
        }
    }
}
