//! The expiry sweeper, run by every worker process: expires unpaid orders past their
//! deadline (several sweepers share the work through `FOR UPDATE SKIP LOCKED`), and
//! makes the releases still owed to Redis (left by a crash, or by Redis being down,
//! between a close's commit and its release).

use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::keys::Keys;
use crate::redis_conn::RedisConn;
use crate::store::lifecycle as transitions;

#[derive(Debug, Clone, Copy)]
pub struct SweepConfig {
    /// Pause between passes: an order expires at most about this long after its
    /// deadline (the contract allows 5 s).
    pub every: Duration,
    /// Orders expired (and releases made) per transaction.
    pub batch: i64,
}

/// What one pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SweepReport {
    /// Orders expired by this pass.
    pub expired: u64,
    /// Units returned to Redis's live stock by this pass (expiries and owed releases).
    pub returned: u64,
    /// Owed releases made by this pass (left by earlier crashes or outages).
    pub owed_settled: u64,
}

/// One pass: expire what is due, then make what is owed.
pub async fn sweep_once(
    db: &PgPool,
    conn: &mut RedisConn,
    keys: &Keys,
    batch: i64,
) -> anyhow::Result<SweepReport> {
    let mut report = SweepReport::default();
    loop {
        let expired = transitions::expire_due(db, batch).await?;
        if expired.is_empty() {
            break;
        }
        report.expired += expired.len() as u64;
        metrics::counter!(crate::metrics::TRANSITIONS, "to" => "expired")
            .increment(expired.len() as u64);
        metrics::counter!(crate::metrics::UNITS_RETURNED, "store" => "postgres")
            .increment(expired.len() as u64);
        report.returned += super::settle(db, conn, keys, &expired).await?;
        if (expired.len() as i64) < batch {
            break;
        }
    }
    loop {
        // The rows stay locked while their releases are made, so two sweepers never
        // work on the same ones (a double run would change nothing, but costs).
        let mut tx = db.begin().await?;
        let owed = transitions::take_owed(&mut tx, batch).await?;
        if owed.is_empty() {
            break;
        }
        for r in &owed {
            report.returned += u64::from(super::release(conn, keys, r).await?);
        }
        let ids: Vec<i64> = owed.iter().map(|r| r.order_id).collect();
        transitions::released(&mut *tx, &ids).await?;
        tx.commit().await?;
        report.owed_settled += owed.len() as u64;
        if (owed.len() as i64) < batch {
            break;
        }
    }
    let (owed, _) = transitions::owed_summary(db).await?;
    metrics::gauge!(crate::metrics::RELEASES_OWED).set(owed as f64);
    Ok(report)
}

/// Sweeps every `config.every` until `cancel` fires; failures back off and retry.
pub async fn run(
    db: PgPool,
    mut conn: RedisConn,
    keys: Keys,
    config: SweepConfig,
    cancel: CancellationToken,
) {
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
    let mut failing = false;
    while !cancel.is_cancelled() {
        let pause = match sweep_once(&db, &mut conn, &keys, config.batch).await {
            Ok(report) => {
                if failing {
                    tracing::info!("expiry sweeper recovered");
                    failing = false;
                }
                if report != SweepReport::default() {
                    tracing::info!(?report, "expiry sweep");
                }
                backoff.reset();
                config.every
            }
            Err(e) => {
                if !failing {
                    tracing::warn!(error = format!("{e:#}"), "expiry sweeper failing, retrying");
                    failing = true;
                }
                backoff.next_delay().max(config.every)
            }
        };
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = tokio::time::sleep(pause) => {}
        }
    }
}
