//! Starting the app under test: in-process with its settings, Redis and JWT
//! verification, or as a `seckill` server process of its own.

use super::*;

impl TestApp {
    pub async fn spawn(db: PgPool) -> Self {
        Self::spawn_with(db, redis_url(), false).await
    }

    /// The app against the Redis at `redis_url`; with `upkeep`, the background duties
    /// of an API process run too (lease renewal, reloading sales after data loss).
    pub async fn spawn_with(db: PgPool, redis_url: String, upkeep: bool) -> Self {
        Self::spawn_full(db, redis_url, upkeep, Settings::default(), hs256_only()).await
    }

    /// The app with its own settings (limits, retention).
    pub async fn spawn_with_settings(db: PgPool, settings: Settings) -> Self {
        Self::spawn_full(db, redis_url(), false, settings, hs256_only()).await
    }

    /// The app against the Redis at `redis_url`, with its own settings (replicas to
    /// wait for, limits, retention).
    pub async fn spawn_on(db: PgPool, redis_url: String, settings: Settings) -> Self {
        Self::spawn_full(db, redis_url, true, settings, hs256_only()).await
    }

    /// The app verifying tokens as `jwt` says (JWKS, issuer, audience; [`SECRET`] or
    /// no secret at all). [`TestApp::token`] mints with [`SECRET`], without `iss`/`aud`.
    pub async fn spawn_with_jwt(db: PgPool, jwt: JwtArgs) -> Self {
        Self::spawn_full(db, redis_url(), false, Settings::default(), jwt).await
    }

    /// The app started the way `seckill api` starts it ([`Application::build`]), on a
    /// spare loopback port, in the test's database and a key prefix of its own.
    /// (`_upkeep`: the background duties always run, as in production.)
    async fn spawn_full(
        db: PgPool,
        redis_url: String,
        _upkeep: bool,
        settings: Settings,
        jwt: JwtArgs,
    ) -> Self {
        let prefix = format!("test{:016x}:", rand::random::<u64>());
        let keys = Keys::new(prefix.clone()).unwrap();
        let api = ApiArgs {
            database: DatabaseArgs {
                database_url: faults::database_url(&db, None).into(),
                database_max_connections: 16,
            },
            redis: RedisArgs {
                redis_url: redis_url.clone().into(),
                redis_cluster_urls: Vec::new(),
                redis_tls_ca_file: None,
                redis_key_prefix: prefix,
                stream_shards: 1,
                redis_sentinel_urls: Vec::new(),
                redis_sentinel_master: None,
                durability: seckill::config::DurabilityArgs {
                    redis_wait_replicas: settings.replicas.n,
                    redis_wait_timeout_ms: settings.replicas.timeout.as_millis() as u64,
                    redis_replica_max_lag_secs: settings.replicas.max_lag.as_secs().max(1),
                },
            },
            jwt,
            bind: "127.0.0.1:0".parse().unwrap(),
            admin_bind: "127.0.0.1:0".parse().unwrap(),
            promises_file: None,
            skip_migrations: true,
            sale_state_retention_secs: settings.sale_state_retention.as_secs(),
            cors_allowed_origins: settings.cors_allowed_origins,
            payment_webhook_secrets: vec![super::PAYMENT_SECRET.into()],
            live_max_viewers: seckill::config::defaults::LIVE_MAX_VIEWERS,
            live_max_sales: seckill::config::defaults::LIVE_MAX_SALES,
            limits: settings.limits,
            server: ServerArgs::default(),
            edge: settings.edge,
            admission_linger_us: settings.admission_linger.as_micros() as u64,
        };
        let cancel = CancellationToken::new();
        let app = Application::build(api, None, cancel.clone()).await.unwrap();
        let addr = app.local_addr().unwrap();
        let admin_addr = app.admin_addr().unwrap();
        let state = app.state().clone();
        tokio::spawn(app.run());
        let redis = redis_conn::connect(&redis_url, redis_conn::COMMAND_TIMEOUT).unwrap();
        Self {
            redis_url,
            base: format!("http://{addr}"),
            admin_base: format!("http://{admin_addr}"),
            db,
            redis,
            keys,
            state,
            client: reqwest::Client::builder()
                .pool_max_idle_per_host(2000)
                .build()
                .unwrap(),
            jwt: JwtKeys::new(SECRET).unwrap(),
            cancel,
        }
    }

    /// Stops the in-process app as a stopping `seckill api` stops (it leaves the
    /// instances that hold a new term back); its HTTP server answers no more.
    pub fn stop_serving(&self) {
        self.cancel.cancel();
    }

    /// Starts `seckill <subcommand>` on a spare port, in this app's database and key
    /// space, and waits until it is ready. Returns the process and its base URL.
    pub async fn spawn_server(
        &self,
        subcommand: &str,
        env: &[(&str, String)],
    ) -> (faults::Process, String) {
        let (process, base) = self.spawn_server_unready(subcommand, env).await;
        faults::wait_ready(&base).await;
        (process, base)
    }

    /// [`TestApp::spawn_server`], waiting only until it listens (`/healthz`), ready or
    /// not (a dependency down at its start, say).
    pub async fn spawn_server_unready(
        &self,
        subcommand: &str,
        env: &[(&str, String)],
    ) -> (faults::Process, String) {
        let port = faults::free_port();
        let mut env = env.to_vec();
        env.push(("BIND", format!("127.0.0.1:{port}")));
        if !env.iter().any(|(k, _)| *k == "ADMIN_BIND") {
            env.push(("ADMIN_BIND", format!("127.0.0.1:{}", faults::free_port())));
        }
        let process = faults::Process::spawn(
            subcommand,
            &self.redis_url,
            self.keys.prefix(),
            &faults::database_url(&self.db, None),
            &env,
        );
        let base = format!("http://127.0.0.1:{port}");
        faults::wait_listening(&base).await;
        (process, base)
    }
}
