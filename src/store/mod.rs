//! Postgres, the source of truth: small query functions per table.

pub mod orders;
pub mod vouchers;

use std::time::Duration;

use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;

/// A lazily connecting pool: processes start (and report not-ready) while Postgres is down.
pub fn pool(url: &str, max_connections: u32) -> anyhow::Result<PgPool> {
    Ok(PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(3))
        .connect_lazy(url)?)
}

/// Applies pending migrations, waiting up to `patience` for Postgres to answer.
pub async fn migrate(db: &PgPool, patience: Duration) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + patience;
    loop {
        match crate::MIGRATOR.run(db).await {
            Ok(()) => return Ok(()),
            Err(sqlx::migrate::MigrateError::Execute(e))
                if crate::error::is_connectivity(&e) && tokio::time::Instant::now() < deadline =>
            {
                tracing::warn!(error = %e, "postgres not reachable yet, retrying migrations");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// SQLSTATE classes that say "this data can never be written" (data exceptions and
/// integrity violations), as opposed to a fault worth retrying.
pub fn is_data_error(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => db
            .code()
            .is_some_and(|c| c.starts_with("22") || c.starts_with("23")),
        _ => false,
    }
}
