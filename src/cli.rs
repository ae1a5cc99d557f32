//! The subcommands: wiring of configuration, connections and tasks.

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use tokio_util::sync::CancellationToken;

use crate::auth::{Expected, JwtKeys, Role};
use crate::config::{ApiArgs, Cli, Command, WorkerOptions};
use crate::domain::{ShopId, VoucherId};
use crate::redis_conn;
use crate::startup::{build_workers, connect_redis, key_layout, prepare_sweeper, Application};
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
        Command::Demo(args) => crate::demo::run(args).await,
        Command::Token(args) => done(token(args)),
        Command::Notify(args) => notify(args).await,
        Command::Migrate(args) => {
            let db = store::connect(args.database.database_url.expose(), 2).await?;
            store::migrate(&db, Duration::from_secs(30)).await?;
            tracing::info!("migrations applied");
            Ok(ExitCode::SUCCESS)
        }
        Command::Api(api) => done(serve(api, None).await),
        Command::Serve(args) => done(serve(args.api, Some(args.worker)).await),
        Command::Worker(args) => {
            let cancel = shutdown_token();
            let keys = key_layout(&args.redis)?;
            let db = store::connect(
                args.database.database_url.expose(),
                args.database.database_max_connections,
            )
            .await?;
            crate::metrics::handle();
            let metrics = match args.metrics_bind {
                Some(addr) => {
                    let listener = tokio::net::TcpListener::bind(addr).await?;
                    tracing::info!(addr = %listener.local_addr()?, "metrics listening");
                    let serving = crate::http::health::serve_metrics(listener, cancel.clone());
                    Some(tokio::spawn(serving))
                }
                None => None,
            };
            let sweeper =
                prepare_sweeper(&db, &args.redis, keys.clone(), &args.worker, cancel.clone());
            let sweeper = sweeper.await?;
            let watched = connect_redis(&args.redis, redis_conn::COMMAND_TIMEOUT).await?;
            crate::admission::guard::refuse_eviction(&mut watched.clone(), &keys).await?;
            let watch = crate::admission::term::Watch {
                db: db.clone(),
                redis: watched,
                keys: keys.clone(),
                retention: Duration::from_secs(args.sale_state_retention_secs),
                replicas: args.redis.durability.replicas(),
                wake: Default::default(),
                look_soon: Default::default(),
                promises: None,
            };
            let mut watcher = crate::admission::term::Watcher::new(watch);
            watcher.look().await;
            let watching = tokio::spawn(watcher.run(cancel.clone()));
            let lanes = crate::config::defaults::WORKER_CONCURRENCY;
            let workers = build_workers(&db, &args.redis, keys, args.worker, lanes).await?;
            let running =
                futures_util::future::join_all(workers.into_iter().map(|w| w.run(cancel.clone())));
            tokio::join!(sweeper, running);
            let _ = watching.await;
            if let Some(metrics) = metrics {
                let _ = metrics.await;
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::DeadLetters(args) => {
            let keys = key_layout(&args.redis)?;
            let mut conn = connect_redis(&args.redis, redis_conn::COMMAND_TIMEOUT).await?;
            crate::reconcile::list_dead_letters(&mut conn, &keys, args.limit, &mut print_out)
                .await?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

async fn reconcile(args: crate::config::ReconcileArgs) -> anyhow::Result<ExitCode> {
    let keys = key_layout(&args.redis)?;
    let db = store::connect(args.database.database_url.expose(), 4).await?;
    let mut conn = connect_redis(&args.redis, Duration::from_secs(30)).await?;
    for shard in keys.shards() {
        let route = keys.stream(shard).as_bytes().to_vec();
        crate::scripts::install_library(&mut conn, Some(&route)).await?;
    }
    // Which sales are still open is Redis's clock's word, not this machine's.
    crate::clock::sync(&mut conn).await?;
    let retention = Duration::from_secs(args.sale_state_retention_secs);
    let balanced = crate::reconcile::run(
        &db,
        &mut conn,
        &keys,
        // Positive, as clap checked: never an error.
        args.voucher.map(VoucherId::try_from).transpose()?,
        args.repair.then(|| args.redis.durability.replicas()),
        retention,
        &mut print_out,
    )
    .await?;
    Ok(if balanced {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
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

/// Signs a notification as the payment provider would and sends it; prints the
/// answer. Exit 0 on a 2xx, 1 otherwise.
async fn notify(args: crate::config::NotifyArgs) -> anyhow::Result<ExitCode> {
    let secret = args
        .secret
        .iter()
        .find(|s| !s.expose().is_empty())
        .ok_or_else(|| {
            anyhow::anyhow!("no secret to sign with: set PAYMENT_WEBHOOK_SECRETS or pass --secret")
        })?;
    let base = crate::demo::base_url(args.url.as_deref(), args.bind.as_deref())?;
    let fresh = || uuid::Uuid::new_v4().simple().to_string();
    let body = serde_json::to_vec(&serde_json::json!({
        "id": args.event.unwrap_or_else(|| format!("evt_{}", fresh())),
        "type": match args.kind {
            crate::config::NotifyKind::Payment => "payment.succeeded",
            crate::config::NotifyKind::Refund => "refund.succeeded",
        },
        "order_id": args.order,
        "amount": args.amount,
        "currency": args.currency,
        "transaction_id": args.transaction.unwrap_or_else(|| format!("tx_{}", fresh())),
    }))?;
    let at = args.at.unwrap_or_else(|| chrono::Utc::now().timestamp());
    let signature = crate::lifecycle::signature::sign(secret, at, &body);
    let answer = reqwest::Client::new()
        .post(format!(
            "{}/payments/notifications",
            base.trim_end_matches('/')
        ))
        .header(crate::lifecycle::signature::HEADER, signature)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .body(body)
        .send()
        .await?;
    let status = answer.status();
    let text = answer.text().await.unwrap_or_default();
    // As `curl -w ' %{http_code}'` prints it: the body, then the status.
    print_out(&format!("{text} {}\n", status.as_u16()))?;
    Ok(if status.is_success() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// Prints `count` tokens for users `user`, `user + 1`, ...
fn token(args: crate::config::TokenArgs) -> anyhow::Result<()> {
    use std::io::Write;
    let expected = Expected::new(args.jwt_issuer.as_deref(), args.jwt_audience.as_deref());
    let keys = JwtKeys::with_expected(args.jwt_secret.expose(), expected)?;
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let written = (|| -> anyhow::Result<()> {
        for i in 0..args.count as i64 {
            let user = args
                .user
                .checked_add(i)
                .ok_or_else(|| anyhow::anyhow!("user id overflows"))?;
            let role = match (args.admin, args.shop) {
                (true, _) => Role::Admin,
                (false, Some(shop)) => {
                    Role::Shop(ShopId::new(shop).ok_or_else(|| anyhow::anyhow!("bad shop id"))?)
                }
                (false, None) => Role::Shopper,
            };
            writeln!(out, "{}", keys.mint_as(user, role, args.ttl)?)?;
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

/// SIGINT or SIGTERM cancels the token. Both are caught from this call on (not from
/// the first poll of a task): a stop asked while the process is still starting ends it
/// as gracefully as one asked later.
fn shutdown_token() -> CancellationToken {
    let token = CancellationToken::new();
    let fire = token.clone();
    #[cfg(unix)]
    let signals = {
        use tokio::signal::unix::{signal, SignalKind};
        (
            signal(SignalKind::interrupt()).ok(),
            signal(SignalKind::terminate()).ok(),
        )
    };
    tokio::spawn(async move {
        #[cfg(unix)]
        {
            let (int, term) = signals;
            let caught = |s: Option<tokio::signal::unix::Signal>| async move {
                match s {
                    Some(mut s) => {
                        s.recv().await;
                    }
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = caught(int) => {},
                _ = caught(term) => {},
            }
        }
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
        tracing::info!("shutdown requested");
        fire.cancel();
    });
    token
}

async fn serve(api: ApiArgs, worker_opts: Option<WorkerOptions>) -> anyhow::Result<()> {
    let app = Application::build(api, worker_opts, shutdown_token()).await?;
    tracing::info!(addr = %app.local_addr()?, admin = %app.admin_addr()?, "listening");
    app.run().await;
    tracing::info!("stopped");
    Ok(())
}
