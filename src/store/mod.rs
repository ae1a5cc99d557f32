//! Postgres, the source of truth: small query functions per table.

pub mod admitted;
pub mod dead_orders;
pub mod draws;
pub mod epochs;
pub mod keepers;
pub mod lifecycle;
pub mod live;
pub mod orders;
pub mod payments;
pub mod segments;
mod tls;
pub mod vouchers;

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;

/// Bounds on every session of the service's pools. A worker waiting behind a row lock
/// (an operator's, a loader's) gives up and retries with backoff instead of hanging;
/// a transaction whose client stalled cannot hold the sale's row lock for long.
const SESSION_TIMEOUTS: [(&str, &str); 3] = [
    ("statement_timeout", "10s"),
    ("lock_timeout", "5s"),
    ("idle_in_transaction_session_timeout", "30s"),
];

/// Migrations embedded in the binary (`seckill migrate`, and start-up of `serve`/`api`).
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// A lazily connecting pool: processes start (and report not-ready) while Postgres is down.
/// `sslmode` and `sslrootcert` in the URL (or `PGSSLMODE`, `PGSSLROOTCERT`) turn TLS on
/// (rustls); certificate and key files that cannot be read are refused here, naming
/// the setting ([`tls::TlsSettings`]).
pub(crate) fn pool(url: &str, max_connections: u32) -> anyhow::Result<PgPool> {
    let options: PgConnectOptions = url
        .parse()
        .map_err(|e| anyhow::anyhow!("DATABASE_URL: {e}"))?;
    let tls = tls::TlsSettings::of(url);
    tls.check()?;
    Ok(PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(3))
        .connect_lazy_with(tls.apply(options).options(SESSION_TIMEOUTS)))
}

/// A pool whose first connection has been tried: a TLS failure (a handshake or
/// certificate check, a server without TLS under `sslmode=require`) stops the start with
/// an error naming the settings; Postgres merely down is only logged.
pub(crate) async fn connect(url: &str, max_connections: u32) -> anyhow::Result<PgPool> {
    let db = pool(url, max_connections)?;
    match tokio::time::timeout(Duration::from_secs(5), db.acquire()).await {
        Ok(Ok(_)) | Err(_) => {}
        Ok(Err(e)) => match tls_failure(&e) {
            Some(cause) => {
                return Err(tls_error(Some(&tls::TlsSettings::of(url)), &cause));
            }
            None => tracing::warn!(error = %e, "postgres not reachable yet"),
        },
    }
    Ok(db)
}

/// The TLS failure inside a connection error, if that is what it is.
pub(crate) fn tls_failure(e: &sqlx::Error) -> Option<String> {
    match e {
        sqlx::Error::Tls(cause) => Some(cause.to_string()),
        e => crate::tls::failure(e),
    }
}

fn tls_error(settings: Option<&tls::TlsSettings>, cause: &str) -> anyhow::Error {
    let hint = settings.map_or_else(
        || "check DATABASE_URL's sslmode and sslrootcert".into(),
        tls::TlsSettings::hint,
    );
    anyhow::anyhow!("TLS with Postgres failed: {cause}; {hint}")
}

/// Why migrations were not applied.
#[derive(Debug)]
pub(crate) enum Unmigrated {
    /// Postgres did not answer: worth trying again.
    Unreachable(sqlx::Error),
    /// Anything else (a failed migration, a schema newer than this binary, TLS): not.
    Failed(anyhow::Error),
}

/// Applies pending migrations, one attempt.
pub(crate) async fn migrate_once(db: &PgPool) -> Result<(), Unmigrated> {
    // Migrations may legitimately run long: a connection of their own, without the
    // service's session bounds (the later settings win), closed when done.
    let options = (*db.connect_options())
        .clone()
        .options([("statement_timeout", "0"), ("lock_timeout", "0")]);
    let run = async {
        use sqlx::Connection;
        // (Bounded: a Postgres behind a silent link would hold the connect for minutes.)
        let connect = sqlx::PgConnection::connect_with(&options);
        let mut conn = tokio::time::timeout(Duration::from_secs(5), connect)
            .await
            .map_err(|_| sqlx::Error::PoolTimedOut)??;
        // (`run_direct`: `run`'s future is `Send` only for the lifetimes at hand, which
        // a task spawned to retry cannot name.)
        let ran = MIGRATOR.run_direct(&mut conn).await;
        let _ = conn.close().await;
        ran
    };
    match run.await {
        Ok(()) => Ok(()),
        Err(sqlx::migrate::MigrateError::Execute(e)) if tls_failure(&e).is_some() => {
            let cause = tls_failure(&e).unwrap_or_default();
            Err(Unmigrated::Failed(tls_error(None, &cause)))
        }
        Err(sqlx::migrate::MigrateError::Execute(e)) if is_connectivity(&e) => {
            Err(Unmigrated::Unreachable(e))
        }
        Err(e) => Err(Unmigrated::Failed(e.into())),
    }
}

/// Applies pending migrations, waiting up to `patience` for Postgres to answer
/// (`seckill migrate`).
pub(crate) async fn migrate(db: &PgPool, patience: Duration) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + patience;
    loop {
        match migrate_once(db).await {
            Ok(()) => return Ok(()),
            Err(Unmigrated::Unreachable(e)) if tokio::time::Instant::now() < deadline => {
                tracing::warn!(error = %e, "postgres not reachable yet, retrying migrations");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(Unmigrated::Unreachable(e)) => return Err(e.into()),
            Err(Unmigrated::Failed(e)) => return Err(e),
        }
    }
}

/// Applies pending migrations in the background of a process that started while
/// Postgres was away: tries again with backoff until it answers, then fires `migrated`.
/// A migration that fails for another reason is logged, and tried again later (the
/// process stays not ready). Stops at `cancel`.
pub(crate) async fn keep_migrating(
    db: PgPool,
    migrated: tokio_util::sync::CancellationToken,
    cancel: tokio_util::sync::CancellationToken,
) {
    let mut backoff =
        crate::backoff::Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
    let mut failing = false;
    loop {
        match migrate_once(&db).await {
            Ok(()) => {
                tracing::info!("postgres answers: migrations applied");
                migrated.cancel();
                return;
            }
            Err(Unmigrated::Unreachable(e)) => {
                if !failing {
                    tracing::warn!(error = %e, "postgres still not reachable, retrying migrations");
                }
            }
            Err(Unmigrated::Failed(e)) => {
                tracing::error!(
                    error = format!("{e:#}"),
                    "migrations failed; retrying later"
                );
            }
        }
        failing = true;
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(backoff.next_delay()) => {}
        }
    }
}

/// SQLSTATE classes that say "this data can never be written" (data exceptions and
/// integrity violations), as opposed to a fault worth retrying. A schema mismatch is
/// not one: no order is at fault, every order would be refused alike.
pub(crate) fn is_data_error(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => {
            db.code()
                .is_some_and(|c| c.starts_with("22") || c.starts_with("23"))
                && !is_schema_mismatch(e)
        }
        _ => false,
    }
}

/// SQLSTATEs that say the schema is not the one this binary was built for: a column it
/// does not fill that has no default (not_null_violation: every value it writes is set,
/// so the column is one it does not know), or a column, table, function, type or
/// conflict target it names that is missing or different.
const SCHEMA_MISMATCH: [&str; 7] = [
    "23502", // not_null_violation
    "42703", // undefined_column
    "42P01", // undefined_table
    "42883", // undefined_function
    "42704", // undefined_object
    "42804", // datatype_mismatch
    "42P10", // invalid_column_reference
];

/// Whether Postgres refused a statement because its schema is newer or older than this
/// binary expects: a fault to retry (the batch waits for a matching schema or worker),
/// never a reason to bury an order.
pub(crate) fn is_schema_mismatch(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => db.code().is_some_and(|c| SCHEMA_MISMATCH.contains(&&*c)),
        sqlx::Error::ColumnNotFound(_) | sqlx::Error::TypeNotFound { .. } => true,
        _ => false,
    }
}

/// Errors that say the database could not be reached or is going away, as opposed to
/// a bad query: the connection failed, or the server answered with a connection
/// exception (SQLSTATE class 08), too few resources (53: too many connections) or an
/// operator's intervention (57: shutting down, starting up, a statement cancelled).
pub(crate) fn is_connectivity(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Protocol(_) => true,
        sqlx::Error::Database(db) => db
            .code()
            .is_some_and(|c| ["08", "53", "57"].iter().any(|class| c.starts_with(class))),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    /// docs/development.md lists every migration (between its `migrations` markers), in
    /// order: a new file there is added to the list in the same change.
    #[test]
    fn the_development_guide_lists_every_migration() {
        let root = env!("CARGO_MANIFEST_DIR");
        let mut files: Vec<String> = std::fs::read_dir(format!("{root}/migrations"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|name| name.ends_with(".sql"))
            .collect();
        files.sort();
        let guide = std::fs::read_to_string(format!("{root}/docs/development.md")).unwrap();
        let (_, list) = guide
            .split_once("<!-- migrations -->")
            .expect("start marker");
        let (list, _) = list.split_once("<!-- /migrations -->").expect("end marker");
        let listed: Vec<String> = list
            .lines()
            .filter_map(|l| Some(l.trim().strip_prefix("- `")?.strip_suffix('`')?.to_string()))
            .collect();
        assert_eq!(listed, files, "docs/development.md's migration list");
    }
}
