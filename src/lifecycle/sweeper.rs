//! The expiry sweeper, run by every worker process: expires unpaid orders past their
//! deadline (several sweepers share the work through `FOR UPDATE SKIP LOCKED`), makes
//! the releases owed to Redis (the expiries' own, and any left by a crash or an outage
//! between a close's commit and its release), and applies the payments that arrived
//! before their order was written.
//!
//! The two halves run apart: expiry needs only Postgres, so a Redis outage does not
//! hold it back (its releases wait, owed, until Redis answers again).

use std::collections::HashSet;
use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::domain::OrderStatus;
use crate::keys::Keys;
use crate::metrics::{RELEASES_OWED, TRANSITIONS, UNITS_RETURNED};
use crate::redis_conn::RedisConn;
use crate::scripts::Replicas;
use crate::store::lifecycle as transitions;

#[derive(Debug, Clone, Copy)]
pub struct SweepConfig {
    /// Pause between passes: an order expires at most about this long after its
    /// deadline (the contract allows 5 s).
    pub every: Duration,
    /// Orders expired (and releases made) per transaction.
    pub batch: i64,
    /// Replicas that must hold a release before its outbox row goes.
    pub replicas: Replicas,
}

/// What a pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SweepReport {
    /// Orders expired.
    pub expired: u64,
    /// Owed releases made (the expiries' own, and any left by earlier crashes or
    /// outages).
    pub released: u64,
    /// Of those, the ones that returned a unit to Redis's live stock (the others found
    /// nothing to do: made before, or the sale's state was rebuilt since).
    pub returned: u64,
}

/// Expires every order now due, `batch` per transaction; returns how many.
pub async fn expire_all_due(db: &PgPool, batch: i64) -> anyhow::Result<u64> {
    let mut expired = 0;
    loop {
        let closed = transitions::expire_due(db, batch).await?.len() as u64;
        expired += closed;
        metrics::counter!(TRANSITIONS, "to" => OrderStatus::Expired.as_str()).increment(closed);
        metrics::counter!(UNITS_RETURNED, "store" => "postgres").increment(closed);
        if closed < batch as u64 {
            return Ok(expired);
        }
    }
}

/// Makes the releases owed to Redis, `batch` per transaction (the rows stay locked
/// while their releases are made, so two sweepers never work on the same ones). A
/// release that fails leaves the rest of its shard for the next pass (the shard's node
/// is likely down) and the other shards go on; the first error is returned at the end.
pub async fn release_owed(
    db: &PgPool,
    conn: &mut RedisConn,
    keys: &Keys,
    batch: i64,
    replicas: Replicas,
) -> anyhow::Result<SweepReport> {
    let mut report = SweepReport::default();
    let mut failed = HashSet::new();
    let mut first_error: Option<redis::RedisError> = None;
    loop {
        let mut tx = db.begin().await?;
        let owed = transitions::take_owed(&mut tx, batch).await?;
        let mut made = Vec::with_capacity(owed.len());
        for r in &owed {
            let shard = keys.shard_of_segment(r.sale_segment());
            if failed.contains(&shard) {
                continue;
            }
            let epoch = crate::store::epochs::of(&mut *tx, r.sale_segment()).await?;
            match super::release(conn, keys, r, epoch, replicas).await {
                Ok(returned) => {
                    report.returned += u64::from(returned);
                    made.push(r.order_id);
                }
                Err(e) => {
                    failed.insert(shard);
                    first_error.get_or_insert(e);
                }
            }
        }
        transitions::released(&mut *tx, &made).await?;
        tx.commit().await?;
        report.released += made.len() as u64;
        // Short of a full batch, or some left owed: the next pass takes the rest.
        if (owed.len() as i64) < batch || made.len() < owed.len() {
            break;
        }
    }
    let owed = transitions::owed_count(db).await?;
    metrics::gauge!(RELEASES_OWED).set(owed as f64);
    match first_error {
        Some(e) => Err(e.into()),
        None => Ok(report),
    }
}

/// One pass of both halves: expire what is due, then make what is owed.
pub async fn sweep_once(
    db: &PgPool,
    conn: &mut RedisConn,
    keys: &Keys,
    batch: i64,
    replicas: Replicas,
) -> anyhow::Result<SweepReport> {
    super::payments::settle_awaiting(db, conn, keys, replicas, batch).await?;
    let expired = expire_all_due(db, batch).await?;
    let report = release_owed(db, conn, keys, batch, replicas).await?;
    Ok(SweepReport { expired, ..report })
}

/// Runs both halves every `config.every` until `cancel` fires, each with its own
/// backoff after failures.
pub async fn run(
    db: PgPool,
    conn: RedisConn,
    keys: Keys,
    config: SweepConfig,
    cancel: CancellationToken,
) {
    let expiry = every(&cancel, config.every, "expiry", || {
        let (db, mut conn, keys) = (db.clone(), conn.clone(), keys.clone());
        async move {
            // Payments that waited for their order first: they were in time.
            let settled = super::payments::settle_awaiting(
                &db,
                &mut conn,
                &keys,
                config.replicas,
                config.batch,
            )
            .await?;
            if settled > 0 {
                tracing::info!(settled, "payments applied to orders written after them");
            }
            let expired = expire_all_due(&db, config.batch).await?;
            if expired > 0 {
                tracing::info!(expired, "unpaid orders expired");
            }
            Ok(())
        }
    });
    let releases = every(&cancel, config.every, "release", || {
        let (db, mut conn, keys) = (db.clone(), conn.clone(), keys.clone());
        async move {
            let report = release_owed(&db, &mut conn, &keys, config.batch, config.replicas).await?;
            tracing::debug!(?report, "owed releases made");
            Ok(())
        }
    });
    tokio::join!(expiry, releases);
}

/// Calls `pass` every `period` (longer, with backoff, while it fails) until `cancel`.
/// The pause after a failure never exceeds the 5 s of the contract's expiry window.
async fn every<F, Fut>(cancel: &CancellationToken, period: Duration, what: &str, pass: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let mut backoff = Backoff::new(period, Duration::from_secs(4).max(period));
    let mut failing = false;
    while !cancel.is_cancelled() {
        let pause = match pass().await {
            Ok(()) => {
                if failing {
                    tracing::info!(what, "sweeper recovered");
                    failing = false;
                }
                backoff.reset();
                period
            }
            Err(e) => {
                if !failing {
                    tracing::warn!(what, error = format!("{e:#}"), "sweeper failing, retrying");
                    failing = true;
                }
                backoff.next_delay()
            }
        };
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = tokio::time::sleep(pause) => {}
        }
    }
}
