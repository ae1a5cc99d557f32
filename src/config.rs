//! Command line and environment: every option is a flag and an environment variable.

use std::net::SocketAddr;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::secret::{Secret, ServerUrl};

mod tools;
pub(crate) use tools::{DemoArgs, NotifyArgs, NotifyKind, TokenArgs};

/// Every default, written once: the flags' defaults and the `Default` impls use these.
pub mod defaults {
    pub(crate) const RATE_LIMIT_PER_USER: u32 = 5;
    pub(crate) const RATE_LIMIT_PER_USER_BURST: u32 = 10;
    pub(crate) const RATE_LIMIT_PER_IP: u32 = 0;
    pub(crate) const RATE_LIMIT_PER_IP_BURST: u32 = 200;
    pub(crate) const MAX_CONCURRENT_REQUESTS: u32 = 10_000;
    pub(crate) const EDGE_VERDICT_TTL_MS: u64 = 500;
    pub(crate) const ADMISSION_LINGER_US: u64 = 0;
    pub const LIVE_MAX_VIEWERS: u32 = 1_000;
    pub const LIVE_MAX_SALES: u32 = 100;
    pub(crate) const REQUEST_TIMEOUT_SECS: u64 = 10;
    pub(crate) const WORKER_BATCH_SIZE: u32 = 2048;
    /// Lanes of `seckill worker`; `seckill serve` runs one (see `WorkerOptions`).
    pub(crate) const WORKER_CONCURRENCY: u32 = 3;
    pub(crate) const SERVE_WORKER_CONCURRENCY: u32 = 1;
    pub(crate) const WORKER_BLOCK_MS: u64 = 1000;
    pub(crate) const WORKER_CLAIM_IDLE_MS: u64 = 15_000;
    pub(crate) const WORKER_MAX_DELIVERIES: u64 = 5;
    pub(crate) const SALE_STATE_RETENTION_SECS: u64 = 86_400;
    pub(crate) const HTTP_HEADER_READ_TIMEOUT_SECS: u64 = 5;
    pub(crate) const HTTP_KEEPALIVE_IDLE_SECS: u64 = 75;
    pub(crate) const HTTP_MAX_CONNECTIONS: u32 = 10_000;
    pub(crate) const DATABASE_MAX_CONNECTIONS: u32 = 16;
    pub(crate) const EXPIRY_SWEEP_MS: u64 = 1000;
    pub(crate) const EXPIRY_BATCH: u32 = 500;
    pub(crate) const PAY_WITHIN_SECS: i64 = 900;
    pub(crate) const REDIS_WAIT_REPLICAS: u32 = 0;
    pub(crate) const REDIS_WAIT_TIMEOUT_MS: u64 = 500;
    pub(crate) const REDIS_REPLICA_MAX_LAG_SECS: u64 = 1;
}

#[derive(Debug, Parser)]
#[command(name = "seckill", version, about = "Flash-sale voucher service")]
pub(crate) struct Cli {
    #[command(flatten)]
    pub log: LogArgs,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// API and order worker in one process (the default deployment).
    Serve(ServeArgs),
    /// API only (scale out behind a load balancer).
    Api(ApiArgs),
    /// Order worker only (run several; each is one consumer in the group).
    Worker(WorkerArgs),
    /// Apply the migrations and exit.
    Migrate(MigrateArgs),
    /// Print a signed bearer token.
    Token(TokenArgs),
    /// Compare each sale's Redis state with Postgres; exit 1 on unexplained drift.
    Reconcile(ReconcileArgs),
    /// List the dead-lettered stream entries (orders that could not be written).
    DeadLetters(DeadLetterArgs),
    /// Simulate a sale against a running server: distinct shoppers grab over a few
    /// seconds; prints the outcomes and waits until the admitted orders are in Postgres.
    Demo(DemoArgs),
    /// Sign and send a notification as the payment provider would (the stand-in
    /// provider of tests, demos and the walk-through).
    Notify(NotifyArgs),
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub(crate) enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, Args)]
pub(crate) struct LogArgs {
    /// Log output format.
    #[arg(
        long,
        env = "LOG_FORMAT",
        value_enum,
        default_value = "text",
        global = true
    )]
    pub log_format: LogFormat,
}

#[derive(Debug, Clone, Args)]
pub struct DatabaseArgs {
    /// Postgres connection string.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: ServerUrl,
    /// Largest number of Postgres connections this process opens.
    #[arg(long, env = "DATABASE_MAX_CONNECTIONS", default_value_t = defaults::DATABASE_MAX_CONNECTIONS)]
    pub database_max_connections: u32,
}

pub const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";

#[derive(Debug, Clone, Args)]
pub struct RedisArgs {
    /// Single Redis node.
    #[arg(long, env = "REDIS_URL", default_value = DEFAULT_REDIS_URL)]
    pub redis_url: ServerUrl,
    /// Comma-separated Redis Cluster seed nodes; when set, cluster mode.
    #[arg(long, env = "REDIS_CLUSTER_URLS", value_delimiter = ',')]
    pub redis_cluster_urls: Vec<ServerUrl>,
    /// PEM file of the CA(s) that signed the Redis servers' certificates, for
    /// `rediss://` URLs; unset: the system's roots.
    #[arg(long, env = "REDIS_TLS_CA_FILE")]
    pub redis_tls_ca_file: Option<std::path::PathBuf>,
    /// Prefix of every Redis key (to share one Redis between deployments or tests).
    #[arg(long, env = "REDIS_KEY_PREFIX", default_value = "")]
    pub redis_key_prefix: String,
    /// Order streams; each voucher belongs to one (`voucher_id mod S`). Every process
    /// of a deployment must use the same number; change it only with the streams drained.
    #[arg(long, env = "STREAM_SHARDS", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub stream_shards: u32,
    /// Comma-separated Sentinel addresses (`redis://` or `rediss://`); when set, the
    /// master named by REDIS_SENTINEL_MASTER is found and followed through them, and
    /// REDIS_URL is not used.
    #[arg(long, env = "REDIS_SENTINEL_URLS", value_delimiter = ',')]
    pub redis_sentinel_urls: Vec<ServerUrl>,
    /// The master's name in Sentinel (required with REDIS_SENTINEL_URLS).
    #[arg(long, env = "REDIS_SENTINEL_MASTER")]
    pub redis_sentinel_master: Option<String>,
    #[command(flatten)]
    pub durability: DurabilityArgs,
}

/// How many replicas must hold a state move before it counts.
#[derive(Debug, Clone, Copy, Args)]
pub struct DurabilityArgs {
    /// Replicas that must acknowledge an admission (and every other state move a
    /// failover could undo: releases, settles, closes, loads) before it counts; 0: do
    /// not wait. A grab whose replicas do not answer in time gets 503 with
    /// `"outcome": "unknown"`.
    #[arg(long, env = "REDIS_WAIT_REPLICAS", default_value_t = defaults::REDIS_WAIT_REPLICAS,
          value_parser = clap::value_parser!(u32).range(0..=16))]
    pub redis_wait_replicas: u32,
    /// How long to wait for those acknowledgements, in milliseconds.
    #[arg(long, env = "REDIS_WAIT_TIMEOUT_MS", default_value_t = defaults::REDIS_WAIT_TIMEOUT_MS,
          value_parser = clap::value_parser!(u64).range(1..=60_000))]
    pub redis_wait_timeout_ms: u64,
    /// With replicas to wait for: how long ago (whole seconds, as Redis counts them) a
    /// replica may have acknowledged last and still count. A master with fewer such
    /// replicas refuses every admission before taking its unit (503, nothing reserved);
    /// the service sets this as `min-replicas-max-lag` on the masters it uses.
    #[arg(long, env = "REDIS_REPLICA_MAX_LAG_SECS", default_value_t = defaults::REDIS_REPLICA_MAX_LAG_SECS,
          value_parser = clap::value_parser!(u64).range(1..=60))]
    pub redis_replica_max_lag_secs: u64,
}

impl DurabilityArgs {
    /// The replicas to wait for, as these settings say.
    pub(crate) fn replicas(&self) -> crate::scripts::Replicas {
        crate::scripts::Replicas {
            n: self.redis_wait_replicas,
            timeout: std::time::Duration::from_millis(self.redis_wait_timeout_ms),
            max_lag: std::time::Duration::from_secs(self.redis_replica_max_lag_secs),
        }
    }
}

impl Default for DurabilityArgs {
    fn default() -> Self {
        Self {
            redis_wait_replicas: defaults::REDIS_WAIT_REPLICAS,
            redis_wait_timeout_ms: defaults::REDIS_WAIT_TIMEOUT_MS,
            redis_replica_max_lag_secs: defaults::REDIS_REPLICA_MAX_LAG_SECS,
        }
    }
}

#[derive(Debug, Clone, Args)]
pub struct ApiArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,
    #[command(flatten)]
    pub redis: RedisArgs,
    #[command(flatten)]
    pub jwt: JwtArgs,
    /// Listen address of the API.
    #[arg(long, env = "BIND", default_value = "0.0.0.0:8080")]
    pub bind: SocketAddr,
    /// The internal listener, for operators and Prometheus: `/metrics`, `/live` and
    /// `/live/events` without a token (on the API port they need an administrator's).
    /// Keep it off the public network; each instance on a host needs its own.
    #[arg(long, env = "ADMIN_BIND", default_value = "127.0.0.1:9090")]
    pub admin_bind: SocketAddr,
    /// A file where the instance also writes each 202 it keeps until its order is
    /// written, so that an instance started again on it (after a crash, a `kill -9`)
    /// still admits again the ones Redis lost. One file per instance, kept across its
    /// restarts; unset: kept in memory only.
    #[arg(long, env = "PROMISES_FILE")]
    pub promises_file: Option<std::path::PathBuf>,
    /// Do not apply pending migrations at start-up. `--skip-migrations` alone means
    /// true; the variable takes 1/0, true/false, yes/no, on/off (any case).
    #[arg(long, env = "SKIP_MIGRATIONS", action = clap::ArgAction::Set,
          num_args = 0..=1, default_value_t = false, default_missing_value = "true",
          value_parser = clap::builder::BoolishValueParser::new())]
    pub skip_migrations: bool,
    /// How long buyer records and sale state stay in Redis after a sale ends, in seconds.
    #[arg(long, env = "SALE_STATE_RETENTION_SECS", default_value_t = defaults::SALE_STATE_RETENTION_SECS)]
    pub sale_state_retention_secs: u64,
    /// Origins allowed to call the API from a browser, comma-separated
    /// (`https://shop.example.com,http://localhost:3000`). Unset: no CORS headers, and a
    /// browser on another origin cannot call the API.
    #[arg(long, env = "CORS_ALLOWED_ORIGINS", value_delimiter = ',', value_parser = origin)]
    pub cors_allowed_origins: Vec<String>,
    /// Pages watching `/live/events` on this instance at once; more get 503. Each costs
    /// a connection and a copy of the snapshot a second, never a store read.
    #[arg(long, env = "LIVE_MAX_VIEWERS", default_value_t = defaults::LIVE_MAX_VIEWERS,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub live_max_viewers: u32,
    /// Sales shown on `/live` at most (selling first, then upcoming, then sold out, then
    /// just ended); the snapshot says how many there are (`open_total`) and whether some
    /// were left out (`truncated`). Every page gets every sale each second, so this bounds
    /// its size.
    #[arg(long, env = "LIVE_MAX_SALES", default_value_t = defaults::LIVE_MAX_SALES,
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub live_max_sales: u32,
    /// Secrets the payment provider signs its notifications with, comma-separated (two
    /// while it rotates them). Unset: `POST /payments/notifications` accepts nothing.
    #[arg(
        long,
        env = "PAYMENT_WEBHOOK_SECRETS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub payment_webhook_secrets: Vec<Secret>,
    #[command(flatten)]
    pub limits: LimitArgs,
    #[command(flatten)]
    pub server: ServerArgs,
    #[command(flatten)]
    pub edge: EdgeArgs,
    /// How long, in microseconds, a shard's next admission call may wait for more grabs
    /// while the shard is busy (grabs were already queued when its last call returned,
    /// and fewer than its recent calls carried): fewer, larger calls for the sale's
    /// Redis. Tokio's timer counts whole milliseconds, so a wait may run up to one
    /// more. A grab reaching an idle shard leaves at once. 0 (the default): never
    /// wait; in a closed-loop benchmark on shared cores a wait costs more throughput
    /// than it saves Redis (at most 10000).
    #[arg(long, env = "ADMISSION_LINGER_US", default_value_t = defaults::ADMISSION_LINGER_US,
          value_parser = clap::value_parser!(u64).range(0..=10_000))]
    pub admission_linger_us: u64,
}

/// The edge: sales an instance answers by itself (sold out, not yet open, ended, no
/// such sale), from what Redis last told it.
#[derive(Debug, Clone, Args)]
pub struct EdgeArgs {
    /// How long an instance believes what it last read of a sale, in ms, when no
    /// announcement of a change reached it (0: no edge, every grab goes to Redis; at
    /// most 1000). A unit that comes back is grabbable through every instance within
    /// this even if the announcement is lost.
    #[arg(long, env = "EDGE_VERDICT_TTL_MS", default_value_t = defaults::EDGE_VERDICT_TTL_MS,
          value_parser = clap::value_parser!(u64).range(0..=1_000))]
    pub edge_verdict_ttl_ms: u64,
    /// The Redis node this instance listens to for announcements of sale changes
    /// (default: REDIS_URL's node, a cluster's first reachable node, or the master
    /// Sentinel names). Any node of a cluster hears them all, a replica its master's.
    #[arg(long, env = "REDIS_PUBSUB_URL")]
    pub redis_pubsub_url: Option<ServerUrl>,
}

impl Default for EdgeArgs {
    fn default() -> Self {
        Self {
            edge_verdict_ttl_ms: defaults::EDGE_VERDICT_TTL_MS,
            redis_pubsub_url: None,
        }
    }
}

/// How bearer tokens are verified: HS256 with a shared secret, an identity provider's
/// published keys (JWKS), or both. At least one of the two is required.
#[derive(Debug, Clone, Default, Args)]
pub struct JwtArgs {
    /// HS256 secret for bearer tokens (no built-in default). Required unless
    /// JWT_JWKS_URL is set.
    #[arg(long, env = "JWT_SECRET", hide_env_values = true)]
    pub jwt_secret: Option<Secret>,
    /// An identity provider's JWKS (`https://.../.well-known/jwks.json`): RS256 and ES256
    /// tokens whose `kid` names one of its keys are accepted.
    #[arg(long, env = "JWT_JWKS_URL")]
    pub jwt_jwks_url: Option<ServerUrl>,
    /// When set, every token's `iss` must be this (HS256 ones too).
    #[arg(long, env = "JWT_ISSUER")]
    pub jwt_issuer: Option<String>,
    /// When set, every token's `aud` must be this, or an array holding it (HS256 ones too).
    #[arg(long, env = "JWT_AUDIENCE")]
    pub jwt_audience: Option<String>,
}

impl Default for ServerArgs {
    fn default() -> Self {
        Self {
            http_header_read_timeout_secs: defaults::HTTP_HEADER_READ_TIMEOUT_SECS,
            http_keepalive_idle_secs: defaults::HTTP_KEEPALIVE_IDLE_SECS,
            http_max_connections: defaults::HTTP_MAX_CONNECTIONS,
        }
    }
}

/// Limits of the HTTP server itself: what a connection may cost before any request.
#[derive(Debug, Clone, Args)]
pub struct ServerArgs {
    /// A request's headers must arrive within this many seconds of its first byte (of
    /// the connection's opening, for its first request); slower clients are cut off.
    #[arg(long, env = "HTTP_HEADER_READ_TIMEOUT_SECS", default_value_t = defaults::HTTP_HEADER_READ_TIMEOUT_SECS,
          value_parser = clap::value_parser!(u64).range(1..=300))]
    pub http_header_read_timeout_secs: u64,
    /// A keep-alive connection idle this many seconds between requests is closed (keep
    /// it above the idle timeout of a load balancer in front).
    #[arg(long, env = "HTTP_KEEPALIVE_IDLE_SECS", default_value_t = defaults::HTTP_KEEPALIVE_IDLE_SECS,
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub http_keepalive_idle_secs: u64,
    /// Open client connections at most; beyond, new ones wait in the listen backlog
    /// until one closes. Lowered to fit the process's descriptor limit.
    #[arg(long, env = "HTTP_MAX_CONNECTIONS", default_value_t = defaults::HTTP_MAX_CONNECTIONS,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub http_max_connections: u32,
}

/// Abuse limits of the HTTP API.
#[derive(Debug, Clone, Args)]
pub struct LimitArgs {
    /// Grabs per second one user may make, on average (0: off). Per API instance.
    #[arg(long, env = "RATE_LIMIT_PER_USER", default_value_t = defaults::RATE_LIMIT_PER_USER)]
    pub rate_limit_per_user: u32,
    /// Grabs one user may make at once before the per-user rate applies.
    #[arg(long, env = "RATE_LIMIT_PER_USER_BURST", default_value_t = defaults::RATE_LIMIT_PER_USER_BURST)]
    pub rate_limit_per_user_burst: u32,
    /// Grabs per second from one client IP address (0: off, the default: behind a proxy
    /// every client shares one address). Per API instance.
    #[arg(long, env = "RATE_LIMIT_PER_IP", default_value_t = defaults::RATE_LIMIT_PER_IP)]
    pub rate_limit_per_ip: u32,
    /// Grabs one IP address may make at once before the per-IP rate applies.
    #[arg(long, env = "RATE_LIMIT_PER_IP_BURST", default_value_t = defaults::RATE_LIMIT_PER_IP_BURST)]
    pub rate_limit_per_ip_burst: u32,
    /// Requests in progress at once; beyond that, answer 503 at once instead of queueing.
    #[arg(long, env = "MAX_CONCURRENT_REQUESTS", default_value_t = defaults::MAX_CONCURRENT_REQUESTS,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_concurrent_requests: u32,
    /// A request still unanswered after this many seconds gets 503.
    #[arg(long, env = "REQUEST_TIMEOUT_SECS", default_value_t = defaults::REQUEST_TIMEOUT_SECS,
          value_parser = clap::value_parser!(u64).range(1..=600))]
    pub request_timeout_secs: u64,
}

impl Default for LimitArgs {
    fn default() -> Self {
        Self {
            rate_limit_per_user: defaults::RATE_LIMIT_PER_USER,
            rate_limit_per_user_burst: defaults::RATE_LIMIT_PER_USER_BURST,
            rate_limit_per_ip: defaults::RATE_LIMIT_PER_IP,
            rate_limit_per_ip_burst: defaults::RATE_LIMIT_PER_IP_BURST,
            max_concurrent_requests: defaults::MAX_CONCURRENT_REQUESTS,
            request_timeout_secs: defaults::REQUEST_TIMEOUT_SECS,
        }
    }
}

#[derive(Debug, Clone, Args)]
pub struct WorkerOptions {
    /// About the most orders read and written to Postgres per batch (a read asks for this
    /// many orders' worth of entries; an entry holds one admission call's orders): a read
    /// takes what is there, so batches stay small (and quick) under light traffic and grow
    /// to amortise each transaction under a backlog.
    #[arg(long, env = "WORKER_BATCH_SIZE", default_value_t = defaults::WORKER_BATCH_SIZE,
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub worker_batch_size: u32,
    /// Batches one worker process writes at once, each by a consumer of its own in the
    /// group (named `<consumer>`, `<consumer>/1`, ...): while one batch waits for its
    /// commit, the next is read and inserted, so Postgres's group commit and both of its
    /// cores are used. Default 3 for `seckill worker`, 1 for `seckill serve`: there the
    /// API shares the process and the cores, and one lane keeps up in larger (cheaper)
    /// batches, leaving more to the API during a storm.
    #[arg(long, env = "WORKER_CONCURRENCY", value_parser = clap::value_parser!(u32).range(1..=16))]
    pub worker_concurrency: Option<u32>,
    /// How long one read waits for new entries when idle, in milliseconds.
    #[arg(long, env = "WORKER_BLOCK_MS", default_value_t = defaults::WORKER_BLOCK_MS,
          value_parser = clap::value_parser!(u64).range(1..=30_000))]
    pub worker_block_ms: u64,
    /// Take over entries another consumer left unacknowledged this long (ms): that
    /// consumer is presumed dead. Must exceed the time one batch takes.
    #[arg(long, env = "WORKER_CLAIM_IDLE_MS", default_value_t = defaults::WORKER_CLAIM_IDLE_MS,
          value_parser = clap::value_parser!(u64).range(100..))]
    pub worker_claim_idle_ms: u64,
    /// An entry delivered more often than this (workers died holding it) is written in a
    /// transaction of its own; delivered more than twice as often, it is buried as poison
    /// (dead-lettered, after asking Postgres whether it was written) instead of retried
    /// forever.
    #[arg(long, env = "WORKER_MAX_DELIVERIES", default_value_t = defaults::WORKER_MAX_DELIVERIES,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub worker_max_deliveries: u64,
    /// Consumer name in the group (default: host-pid-random, unique per process); lanes
    /// past the first add `/1`, `/2`, ... Two live processes must never share a name.
    #[arg(long, env = "WORKER_CONSUMER", value_parser = consumer_name)]
    pub worker_consumer: Option<String>,
    /// Pause between passes of the expiry sweeper (ms): an unpaid order expires at most
    /// about this long after its deadline. Every worker process sweeps; they share the
    /// work.
    #[arg(long, env = "EXPIRY_SWEEP_MS", default_value_t = defaults::EXPIRY_SWEEP_MS,
          value_parser = clap::value_parser!(u64).range(10..=4_000))]
    pub expiry_sweep_ms: u64,
    /// Orders expired (or owed releases made) per transaction of the sweeper.
    #[arg(long, env = "EXPIRY_BATCH", default_value_t = defaults::EXPIRY_BATCH,
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub expiry_batch: u32,
}

#[derive(Debug, Clone, Args)]
pub(crate) struct ServeArgs {
    #[command(flatten)]
    pub api: ApiArgs,
    #[command(flatten)]
    pub worker: WorkerOptions,
}

#[derive(Debug, Clone, Args)]
pub(crate) struct WorkerArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,
    #[command(flatten)]
    pub redis: RedisArgs,
    #[command(flatten)]
    pub worker: WorkerOptions,
    /// Serve `GET /metrics` (and `/healthz`) on this address: a worker's own figures
    /// (batches, commits, dead letters, releases owed) exist only in its process.
    /// Unset: no listener.
    #[arg(long, env = "METRICS_BIND")]
    pub metrics_bind: Option<std::net::SocketAddr>,
    /// How long a sale's Redis state lives after its end, in seconds (a worker rebuilds
    /// sales too when Redis lost writes).
    #[arg(long, env = "SALE_STATE_RETENTION_SECS", default_value_t = defaults::SALE_STATE_RETENTION_SECS)]
    pub sale_state_retention_secs: u64,
}

#[derive(Debug, Clone, Args)]
pub(crate) struct MigrateArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,
}

#[derive(Debug, Clone, Args)]
pub(crate) struct ReconcileArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,
    #[command(flatten)]
    pub redis: RedisArgs,
    /// Only this voucher (default: every sale not ended longer ago than the retention).
    #[arg(long, value_parser = clap::value_parser!(i64).range(1..))]
    pub voucher: Option<i64>,
    /// Rebuild Redis from Postgres for the vouchers out of balance (or for `--voucher`).
    #[arg(long)]
    pub repair: bool,
    /// How long a sale's Redis state lives after its end, in seconds.
    #[arg(long, env = "SALE_STATE_RETENTION_SECS", default_value_t = defaults::SALE_STATE_RETENTION_SECS)]
    pub sale_state_retention_secs: u64,
}

#[derive(Debug, Clone, Args)]
pub(crate) struct DeadLetterArgs {
    #[command(flatten)]
    pub redis: RedisArgs,
    /// Most entries to print.
    #[arg(long, default_value_t = 100)]
    pub limit: usize,
}

/// Settings the HTTP layer needs at run time.
#[derive(Debug, Clone)]
pub struct Settings {
    pub sale_state_retention: Duration,
    pub limits: LimitArgs,
    /// Browser origins allowed by CORS (empty: none).
    pub cors_allowed_origins: Vec<String>,
    /// Replicas that must hold a state move before it counts.
    pub replicas: crate::scripts::Replicas,
    /// What the instance answers by itself.
    pub edge: EdgeArgs,
    /// How long a busy shard's admission call may wait for more grabs.
    pub admission_linger: Duration,
    /// How often the instance looks for moves between a segmented sale's segments left half
    /// done (by a mover that died); `None`: never (tests that leave one on purpose).
    pub finish_moves_every: Option<Duration>,
    /// What payment notifications must be signed with (none empty).
    pub payment_secrets: Vec<crate::secret::Secret>,
}

/// How often an API instance finishes half-done moves between segments.
pub const FINISH_MOVES_EVERY: Duration = Duration::from_secs(1);

impl Default for Settings {
    fn default() -> Self {
        Self {
            sale_state_retention: Duration::from_secs(defaults::SALE_STATE_RETENTION_SECS),
            limits: LimitArgs::default(),
            cors_allowed_origins: Vec::new(),
            replicas: crate::scripts::Replicas::NONE,
            edge: EdgeArgs::default(),
            admission_linger: Duration::from_micros(defaults::ADMISSION_LINGER_US),
            finish_moves_every: Some(FINISH_MOVES_EVERY),
            payment_secrets: Vec::new(),
        }
    }
}

/// A browser origin as it appears in an `Origin` header: `scheme://host[:port]`, http or
/// https, nothing after the authority.
fn origin(s: &str) -> Result<String, String> {
    let s = s.trim();
    // `CORS_ALLOWED_ORIGINS=` (set but empty) means none, as unset does.
    if s.is_empty() {
        return Ok(String::new());
    }
    // Browsers leave the default port out of `Origin`: so must the list, to match.
    let s = s
        .strip_suffix(":443")
        .filter(|_| s.starts_with("https://"))
        .or_else(|| s.strip_suffix(":80").filter(|_| s.starts_with("http://")))
        .unwrap_or(s);
    let rest = s
        .strip_prefix("https://")
        .or_else(|| s.strip_prefix("http://"))
        .ok_or_else(|| format!("{s:?} is not an origin: it must start with http:// or https://"))?;
    let valid = !rest.is_empty()
        && !rest.ends_with(':')
        && rest
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':' | '[' | ']'));
    if !valid {
        return Err(format!(
            "{s:?} is not an origin: scheme://host[:port], with no path, query or trailing slash"
        ));
    }
    Ok(s.to_ascii_lowercase())
}

/// A consumer name: printable, 1-200 characters, no `/` (it separates lanes).
fn consumer_name(s: &str) -> Result<String, String> {
    if s.is_empty() || s.len() > 200 {
        return Err("must be 1 to 200 characters".into());
    }
    if s.contains('/') || s.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err("must not contain '/', spaces or control characters".into());
    }
    Ok(s.to_string())
}

#[cfg(test)]
mod tests;
