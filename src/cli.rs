//! The subcommands: wiring of configuration, connections and tasks.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use tokio_util::sync::CancellationToken;

use crate::admission::keys::Keys;
use crate::admission::order_id::OrderIds;
use crate::admission::upkeep;
use crate::auth::JwtKeys;
use crate::config::{ApiArgs, Cli, Command, RedisArgs, Settings, WorkerOptions};
use crate::redis_conn;
use crate::state::AppState;
use crate::worker::{Worker, WorkerConfig};
use crate::{store, telemetry};

pub async fn main() -> ExitCode {
    let cli = Cli::parse();
    telemetry::init(cli.log.log_format);
    match run(cli.command).await {
        Ok(code) => code,
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "fatal");
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}

async fn run(command: Command) -> anyhow::Result<ExitCode> {
    let done = |r: anyhow::Result<()>| r.map(|()| ExitCode::SUCCESS);
    match command {
        Command::Reconcile(args) => reconcile(args).await,
        Command::Token(args) => done(token(args)),
        Command::Migrate(args) => {
            let db = store::pool(&args.database.database_url, 2)?;
            store::migrate(&db, Duration::from_secs(30)).await?;
            tracing::info!("migrations applied");
            Ok(ExitCode::SUCCESS)
        }
        Command::Api(api) => done(serve(api, None).await),
        Command::Serve(args) => done(serve(args.api, Some(args.worker)).await),
        Command::Worker(args) => {
            let keys = keys(&args.redis)?;
            let db = store::pool(
                &args.database.database_url,
                args.database.database_max_connections,
            )?;
            let cancel = shutdown_token();
            worker(&db, &args.redis, keys, args.worker)
                .await?
                .run(cancel)
                .await;
            Ok(ExitCode::SUCCESS)
        }
        Command::DeadLetters(args) => {
            let keys = keys(&args.redis)?;
            let mut conn = redis(&args.redis, redis_conn::COMMAND_TIMEOUT).await?;
            let letters = crate::reconcile::dead_letters(&mut conn, &keys, args.limit).await?;
            let mut listing = String::new();
            for letter in &letters {
                let fields: Vec<String> = letter
                    .fields
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect();
                listing.push_str(&format!("{} {}\n", letter.id, fields.join(" ")));
            }
            print_out(&listing)?;
            let mut total = 0u64;
            for shard in keys.shards() {
                let n: u64 = redis::cmd("XLEN")
                    .arg(keys.dead_letters(shard))
                    .query_async(&mut conn)
                    .await?;
                total += n;
            }
            print_out(&format!(
                "{total} dead letter(s) in all, {} shown\n",
                letters.len()
            ))?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

async fn reconcile(args: crate::config::ReconcileArgs) -> anyhow::Result<ExitCode> {
    use crate::reconcile::{books, render, repair, VoucherBooks};
    let keys = keys(&args.redis)?;
    let db = store::pool(&args.database.database_url, 4)?;
    let mut conn = redis(&args.redis, Duration::from_secs(30)).await?;
    let retention = Duration::from_secs(args.sale_state_retention_secs);
    let out_of_balance = |rows: &[VoucherBooks]| -> Vec<i64> {
        rows.iter()
            .filter(|r| !r.verdict().is_ok())
            .map(|r| r.voucher_id)
            .collect()
    };
    // Each sale is read through the loader's fence, so a sale in full swing balances:
    // what is out of balance is drift, not timing.
    let mut rows = books(&db, &mut conn, &keys, args.voucher, retention).await?;
    print_out(&render(&rows))?;
    let mut bad = out_of_balance(&rows);
    if args.repair {
        let targets = match args.voucher {
            Some(id) => vec![id],
            None => bad.clone(),
        };
        for id in targets {
            let loaded = repair(&db, &mut conn, &keys, id, retention).await?;
            print_out(&format!(
                "repaired voucher {id}: redis stock {}, buyers {} ({} in flight)\n",
                loaded.stock, loaded.buyers, loaded.in_flight
            ))?;
        }
        rows = books(&db, &mut conn, &keys, args.voucher, retention).await?;
        print_out(&format!("after repair:\n{}", render(&rows)))?;
        bad = out_of_balance(&rows);
    }
    if bad.is_empty() {
        print_out("books balance\n")?;
        Ok(ExitCode::SUCCESS)
    } else {
        print_out(&format!("drift in voucher(s) {bad:?}; `seckill reconcile --repair` rebuilds Redis from Postgres (safe during a sale)\n"))?;
        Ok(ExitCode::from(1))
    }
}

/// Writes to standard output; a reader that went away (`| head`) is not an error.
fn print_out(text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

/// Prints `count` tokens for users `user`, `user + 1`, ...
fn token(args: crate::config::TokenArgs) -> anyhow::Result<()> {
    use std::io::Write;
    let keys = JwtKeys::new(&args.jwt_secret)?;
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let written = (|| -> anyhow::Result<()> {
        for i in 0..args.count as i64 {
            let user = args
                .user
                .checked_add(i)
                .ok_or_else(|| anyhow::anyhow!("user id overflows"))?;
            writeln!(out, "{}", keys.mint(user, args.admin, args.ttl)?)?;
        }
        out.flush()?;
        Ok(())
    })();
    match written {
        // `seckill token --count N | head` stops reading early: not an error.
        Err(e)
            if e.downcast_ref::<std::io::Error>()
                .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe) =>
        {
            Ok(())
        }
        other => other,
    }
}

fn keys(redis: &RedisArgs) -> anyhow::Result<Keys> {
    Keys::with_shards(redis.redis_key_prefix.clone(), redis.stream_shards)
}

/// A connection to the configured Redis (a cluster must answer within a minute).
async fn redis(
    args: &RedisArgs,
    response_timeout: Duration,
) -> anyhow::Result<redis_conn::RedisConn> {
    let target = redis_conn::RedisTarget::new(&args.redis_url, &args.redis_cluster_urls);
    redis_conn::connect_to(&target, response_timeout, Duration::from_secs(60)).await
}

async fn worker(
    db: &sqlx::PgPool,
    redis: &RedisArgs,
    keys: Keys,
    opts: WorkerOptions,
) -> anyhow::Result<Worker> {
    let block = Duration::from_millis(opts.worker_block_ms);
    // Its own connection, with room for the blocking read in the response timeout.
    let conn = self::redis(redis, block + redis_conn::COMMAND_TIMEOUT).await?;
    let config = WorkerConfig {
        consumer: opts
            .worker_consumer
            .unwrap_or_else(WorkerConfig::unique_consumer_name),
        batch_size: opts.worker_batch_size as usize,
        block,
        claim_idle: Duration::from_millis(opts.worker_claim_idle_ms),
        max_deliveries: opts.worker_max_deliveries,
        ..WorkerConfig::default()
    };
    Ok(Worker::new(db.clone(), conn, keys, config))
}

/// SIGINT or SIGTERM cancels the token.
fn shutdown_token() -> CancellationToken {
    let token = CancellationToken::new();
    let fire = token.clone();
    tokio::spawn(async move {
        let ctrl_c = tokio::signal::ctrl_c();
        #[cfg(unix)]
        let term = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(_) => std::future::pending().await,
            }
        };
        #[cfg(not(unix))]
        let term = std::future::pending::<()>();
        tokio::select! {
            _ = ctrl_c => {},
            _ = term => {},
        }
        tracing::info!("shutdown requested");
        fire.cancel();
    });
    token
}

async fn serve(api: ApiArgs, worker_opts: Option<WorkerOptions>) -> anyhow::Result<()> {
    let keys = keys(&api.redis)?;
    let db = store::pool(
        &api.database.database_url,
        api.database.database_max_connections,
    )?;
    if !api.skip_migrations {
        store::migrate(&db, Duration::from_secs(60)).await?;
    }
    let redis = redis(&api.redis, redis_conn::COMMAND_TIMEOUT).await?;
    let settings = Settings {
        sale_state_retention: Duration::from_secs(api.sale_state_retention_secs),
        limits: api.limits.clone(),
    };
    let ids = Arc::new(OrderIds::default());
    let state = AppState::new(
        db.clone(),
        redis.clone(),
        keys.clone(),
        JwtKeys::new(&api.jwt_secret)?,
        ids.clone(),
        settings.clone(),
    );
    let cancel = shutdown_token();
    let tasks = tokio_util::task::TaskTracker::new();

    tasks.spawn(upkeep::run(state.clone(), cancel.clone()));
    tasks.spawn(crate::http::limits::forget_idle(
        state.clone(),
        cancel.clone(),
    ));
    if let Some(opts) = worker_opts {
        let worker = worker(&db, &api.redis, keys, opts).await?;
        tasks.spawn(worker.run(cancel.clone()));
    }

    let listener = tokio::net::TcpListener::bind(api.bind).await?;
    tracing::info!(addr = %listener.local_addr()?, "listening");
    let app = crate::build_app(state);
    crate::http::server::serve(listener, app, (&api.server).into(), cancel.clone()).await;
    cancel.cancel();
    tasks.close();
    tasks.wait().await;
    tracing::info!("stopped");
    Ok(())
}
