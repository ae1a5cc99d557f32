//! Starting the service: the one startup `seckill serve` / `seckill api` use, and the
//! one the tests use (zero-to-production's `Application::build`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admission::order_id::OrderIds;
use crate::auth::Verifier;
use crate::config::{defaults, ApiArgs, RedisArgs, Settings, WorkerOptions};
use crate::http::server::ServerLimits;
use crate::http::state::AppState;
use crate::keys::Keys;
use crate::lifecycle::sweeper::{self, SweepConfig};
use crate::redis_conn::{self, RedisConn};
use crate::secret::ServerUrl;
use crate::store;
use crate::worker::{Worker, WorkerConfig};

mod duties;
use duties::start_duties;

/// A bound, ready API process (and its worker, for `serve`), not yet serving.
pub struct Application {
    listener: TcpListener,
    /// The internal listener (`ADMIN_BIND`): metrics and the live view.
    admin_listener: TcpListener,
    state: AppState,
    limits: ServerLimits,
    tasks: TaskTracker,
    cancel: CancellationToken,
    /// Fires once the server has stopped and its last request has been answered.
    served: CancellationToken,
}

impl Application {
    /// Connects, applies migrations unless told not to, binds, and starts the
    /// background duties (and the worker when `worker` is given); they stop when
    /// `cancel` fires.
    pub async fn build(
        api: ApiArgs,
        worker: Option<WorkerOptions>,
        cancel: CancellationToken,
    ) -> anyhow::Result<Self> {
        // The recorder before anything runs: counts made before it are lost (the
        // sweeper's first pass expires what fell due while the process was down).
        crate::metrics::handle();
        // First: a configuration that cannot verify any token stops the start at once.
        let auth = Arc::new(Verifier::from_args(&api.jwt)?);
        let keys = key_layout(&api.redis)?;
        let db = store::connect(
            api.database.database_url.expose(),
            api.database.database_max_connections,
        )
        .await?;
        let tasks = TaskTracker::new();
        let migrated = migrate_or_later(&db, api.skip_migrations, &tasks, &cancel).await?;
        let (redis, target) =
            connect_redis_with_target(&api.redis, redis_conn::COMMAND_TIMEOUT).await?;
        crate::admission::guard::refuse_eviction(&mut redis.clone(), &keys).await?;
        let subscriber = redis_conn::Subscriber::new(
            &target,
            &redis,
            api.edge.redis_pubsub_url.as_ref().map(ServerUrl::expose),
        );
        let settings = settings(&api);
        let ids = Arc::new(OrderIds::default());
        if let Some(jwks) = auth.jwks() {
            // One attempt (at most the fetch timeout) before serving; if the provider
            // does not answer, its tokens get 503 until a retry succeeds.
            if !jwks.refresh().await {
                tracing::warn!(
                    "identity provider keys not loaded yet: its tokens get 503 until a \
                     fetch succeeds (retried in the background)"
                );
            }
            tasks.spawn(jwks.clone().keep_fresh(cancel.clone()));
        }
        let live = crate::live::Live::new(
            live_max_viewers(
                api.live_max_viewers as usize,
                crate::http::server::effective_max_connections(
                    api.server.http_max_connections as usize,
                ),
            ),
            api.live_max_sales.into(),
            cancel.clone(),
        );
        let promises = crate::admission::promises::Promises::open(api.promises_file.as_deref())?;
        let state = AppState::new(
            db.clone(),
            redis.clone(),
            keys.clone(),
            auth,
            ids.clone(),
            settings.clone(),
            live,
            migrated.clone(),
            Arc::new(promises),
        );
        let served = CancellationToken::new();
        if settings.replicas.waits() {
            // On a connection of its own: its WAITs hold their connection.
            let probing = connect_redis(&api.redis, redis_conn::COMMAND_TIMEOUT).await?;
            tasks.spawn(crate::admission::guard::probe_replicas(
                state.admission.batcher.replica_gate().clone(),
                probing,
                keys.clone(),
                settings.replicas,
                cancel.clone(),
            ));
        }
        start_duties(&state, &tasks, &served, subscriber, &cancel).await;
        if let Some(opts) = worker {
            tasks.spawn(
                prepare_sweeper(&db, &api.redis, keys.clone(), &opts, cancel.clone()).await?,
            );
            let lanes = defaults::SERVE_WORKER_CONCURRENCY;
            for worker in build_workers(&db, &api.redis, keys, opts, lanes).await? {
                // Not before the schema is this binary's (Postgres may be away now).
                let (migrated, cancel) = (migrated.clone(), cancel.clone());
                tasks.spawn(async move {
                    tokio::select! {
                        _ = migrated.cancelled() => worker.run(cancel).await,
                        _ = cancel.cancelled() => {}
                    }
                });
            }
        }
        let listener = TcpListener::bind(api.bind).await?;
        let admin_listener = TcpListener::bind(api.admin_bind).await.map_err(|e| {
            anyhow::anyhow!(
                "ADMIN_BIND {}: {e} (each instance on a host needs its own)",
                api.admin_bind
            )
        })?;
        Ok(Self {
            listener,
            admin_listener,
            state,
            limits: (&api.server).into(),
            tasks,
            cancel,
            served,
        })
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Where the internal listener (`ADMIN_BIND`) listens.
    pub fn admin_addr(&self) -> std::io::Result<SocketAddr> {
        self.admin_listener.local_addr()
    }

    pub fn state(&self) -> &AppState {
        &self.state
    }

    /// Serves until the token fires, lets requests in progress finish, then waits for
    /// the background duties and the worker (which finishes its batch) to stop.
    pub async fn run(self) {
        let admin = crate::http::build_admin_app(self.state.clone());
        let app = crate::build_app(self.state);
        let internal = crate::http::server::serve(
            self.admin_listener,
            admin,
            self.limits,
            self.cancel.clone(),
        );
        let public = async {
            crate::http::server::serve(self.listener, app, self.limits, self.cancel.clone()).await;
            // The internal listener stops with the API.
            self.cancel.cancel();
        };
        tokio::join!(public, internal);
        self.cancel.cancel();
        self.served.cancel();
        self.tasks.close();
        self.tasks.wait().await;
    }
}

/// Applies pending migrations (unless `skip`), or, when Postgres does not answer, keeps
/// trying in the background: the process starts and serves what Redis holds meanwhile
/// (`/readyz` says which store is away). The token fires once the schema is this
/// binary's. A migration that fails for another reason stops the start.
async fn migrate_or_later(
    db: &sqlx::PgPool,
    skip: bool,
    tasks: &TaskTracker,
    cancel: &CancellationToken,
) -> anyhow::Result<CancellationToken> {
    let migrated = CancellationToken::new();
    if skip {
        migrated.cancel();
        return Ok(migrated);
    }
    match store::migrate_once(db).await {
        Ok(()) => migrated.cancel(),
        Err(store::Unmigrated::Unreachable(e)) => {
            tracing::warn!(
                error = %e,
                "postgres not reachable: serving what redis holds; migrations are applied \
                 once it answers"
            );
            tasks.spawn(store::keep_migrating(
                db.clone(),
                migrated.clone(),
                cancel.clone(),
            ));
        }
        Err(store::Unmigrated::Failed(e)) => return Err(e),
    }
    Ok(migrated)
}

/// The Redis key layout the settings name (prefix, stream shards).
pub(crate) fn key_layout(redis: &RedisArgs) -> anyhow::Result<Keys> {
    Keys::with_shards(redis.redis_key_prefix.clone(), redis.stream_shards)
}

/// The settings a request handler reads, from the API's arguments.
fn settings(api: &ApiArgs) -> Settings {
    Settings {
        sale_state_retention: Duration::from_secs(api.sale_state_retention_secs),
        limits: api.limits.clone(),
        cors_allowed_origins: api
            .cors_allowed_origins
            .iter()
            .filter(|o| !o.is_empty())
            .cloned()
            .collect(),
        replicas: api.redis.durability.replicas(),
        edge: api.edge.clone(),
        admission_linger: Duration::from_micros(api.admission_linger_us),
        payment_secrets: (api.payment_webhook_secrets.iter())
            .filter(|s| !s.expose().is_empty())
            .cloned()
            .collect(),
        ..Settings::default()
    }
}

/// A connection to the configured Redis: one node, a cluster (which must answer within a
/// minute), or the master Sentinel names, followed across failovers.
pub(crate) async fn connect_redis(
    args: &RedisArgs,
    response_timeout: Duration,
) -> anyhow::Result<RedisConn> {
    Ok(connect_redis_with_target(args, response_timeout).await?.0)
}

/// [`connect_redis`], and where it is.
async fn connect_redis_with_target(
    args: &RedisArgs,
    response_timeout: Duration,
) -> anyhow::Result<(RedisConn, redis_conn::RedisTarget)> {
    let exposed = |urls: &[ServerUrl]| -> Vec<String> {
        urls.iter().map(|u| u.expose().to_owned()).collect()
    };
    let target = redis_conn::RedisTarget::new(
        args.redis_url.expose(),
        &exposed(&args.redis_cluster_urls),
        redis_conn::SentinelArgs {
            urls: &exposed(&args.redis_sentinel_urls),
            master: args.redis_sentinel_master.as_deref(),
        },
        args.redis_tls_ca_file.as_deref(),
    )?;
    let conn = redis_conn::connect_to(&target, response_timeout, Duration::from_secs(60)).await?;
    Ok((conn, target))
}

/// The expiry sweeper that runs beside each worker, on a Redis connection of its own
/// (the worker's blocks in its reads).
pub(crate) async fn prepare_sweeper(
    db: &sqlx::PgPool,
    redis: &RedisArgs,
    keys: Keys,
    opts: &WorkerOptions,
    cancel: CancellationToken,
) -> anyhow::Result<impl std::future::Future<Output = ()>> {
    let conn = connect_redis(redis, redis_conn::COMMAND_TIMEOUT).await?;
    let config = SweepConfig {
        every: Duration::from_millis(opts.expiry_sweep_ms),
        batch: opts.expiry_batch as i64,
        replicas: redis.durability.replicas(),
    };
    Ok(sweeper::run(db.clone(), conn, keys, config, cancel))
}

/// The worker lanes of one process (`WORKER_CONCURRENCY`, else `default_lanes`), each a
/// consumer of its own with a Redis connection of its own (a blocking read holds its
/// connection).
pub(crate) async fn build_workers(
    db: &sqlx::PgPool,
    redis: &RedisArgs,
    keys: Keys,
    opts: WorkerOptions,
    default_lanes: u32,
) -> anyhow::Result<Vec<Worker>> {
    let block = Duration::from_millis(opts.worker_block_ms);
    let base = opts
        .worker_consumer
        .clone()
        .unwrap_or_else(WorkerConfig::unique_consumer_name);
    let mut workers = Vec::new();
    let lanes = opts.worker_concurrency.unwrap_or(default_lanes);
    for lane in 0..lanes {
        // Room for the blocking read in the response timeout.
        let conn = connect_redis(redis, block + redis_conn::COMMAND_TIMEOUT).await?;
        let config = WorkerConfig {
            // `/` cannot appear in a configured name, so lanes never collide with it.
            consumer: match lane {
                0 => base.clone(),
                n => format!("{base}/{n}"),
            },
            batch_size: opts.worker_batch_size as usize,
            block,
            claim_idle: Duration::from_millis(opts.worker_claim_idle_ms),
            max_deliveries: opts.worker_max_deliveries,
            replicas: redis.durability.replicas(),
            ..WorkerConfig::default()
        };
        workers.push(Worker::new(db.clone(), conn, keys.clone(), config));
    }
    Ok(workers)
}

/// `LIVE_MAX_VIEWERS`, at most half the connections the server takes: each page holds
/// one for as long as it is open, so more would let watchers take every connection and
/// lock out shoppers (and `/healthz`).
fn live_max_viewers(wanted: usize, max_connections: usize) -> usize {
    let room = (max_connections / 2).max(1);
    if wanted > room {
        tracing::warn!(
            wanted,
            max_connections,
            using = room,
            "LIVE_MAX_VIEWERS exceeds half the connection cap (HTTP_MAX_CONNECTIONS, \
             lowered to fit ulimit -n); lowered"
        );
        return room;
    }
    wanted
}

#[cfg(test)]
mod tests {
    use super::duties::{restart_after_panic, RESTART_FIRST};
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[tokio::test(start_paused = true)]
    async fn a_task_that_panics_is_started_again_after_a_growing_wait_until_it_returns() {
        let starts = Arc::new(AtomicUsize::new(0));
        let times = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (counted, at) = (starts.clone(), times.clone());
        let began = tokio::time::Instant::now();
        restart_after_panic("test", CancellationToken::new(), move || {
            let n = counted.fetch_add(1, Ordering::SeqCst);
            at.lock().unwrap().push(began.elapsed());
            async move {
                if n < 3 {
                    panic!("bug number {n}");
                }
            }
        })
        .await;
        assert_eq!(
            starts.load(Ordering::SeqCst),
            4,
            "three panics, then it returned"
        );
        let times = times.lock().unwrap().clone();
        let waits: Vec<Duration> = times.windows(2).map(|w| w[1] - w[0]).collect();
        assert_eq!(waits, [RESTART_FIRST, RESTART_FIRST * 2, RESTART_FIRST * 4]);
    }

    #[tokio::test(start_paused = true)]
    async fn once_cancelled_a_task_that_panics_is_started_again_at_once() {
        let cancel = CancellationToken::new();
        let starts = Arc::new(AtomicUsize::new(0));
        let counted = starts.clone();
        let began = tokio::time::Instant::now();
        let stopping = cancel.clone();
        restart_after_panic("test", cancel.clone(), move || {
            let n = counted.fetch_add(1, Ordering::SeqCst);
            let stopping = stopping.clone();
            async move {
                if n == 0 {
                    // Shutdown begins just as the task panics.
                    stopping.cancel();
                    panic!("bug");
                }
            }
        })
        .await;
        assert_eq!(starts.load(Ordering::SeqCst), 2);
        assert_eq!(began.elapsed(), Duration::ZERO, "no backoff once cancelled");
    }

    #[test]
    fn live_viewers_are_held_to_half_the_connections() {
        assert_eq!(live_max_viewers(1000, 10_000), 1000);
        assert_eq!(live_max_viewers(1000, 960), 480);
        assert_eq!(live_max_viewers(1000, 1), 1);
    }
}
