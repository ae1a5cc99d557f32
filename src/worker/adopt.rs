//! Admitting again what the fence refused or Redis lost. An order whose entry carries a
//! stale epoch (admitted by a state that is no longer its sale's: an old primary's after
//! a failover) or whose entry is gone (lost with Redis's data: a restart from an older
//! copy, a failover to a replica that never got it) was never counted by its sale's
//! current state. Its shopper may hold a 202 for it all the same: its acknowledgement
//! came from a replica that then followed another primary. Before such an order is
//! buried, or dropped, it is admitted again into the sale's current state under its own
//! id ([`stream::readmit`]), and written from there. It is kept whenever the sale segment
//! still has a unit for it and its user holds no other order; otherwise it goes the old
//! way.

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;

use super::batch::Fate;
use super::{BatchReport, Worker};
use crate::keys::SaleSegment;
use crate::store::orders::{NewOrder, Rejection};
use crate::stream::{self, Readmission, Readmitted};

/// How long a sale segment may stay out of this worker's reach (its current state not in
/// the Redis the worker uses: an old primary's worker, partitioned with it) before its
/// stale or lost orders go the old way.
pub(super) const ADOPT_PATIENCE: Duration = Duration::from_secs(30);

impl Worker {
    /// Admits again, where they can be, the batch's orders the fence refused as stale
    /// and those whose entry is gone; their fates become [`Fate::Adopted`]. An `Err`
    /// while some order's sale segment is out of reach, for at most [`ADOPT_PATIENCE`] per
    /// segment: the batch is held and tried again.
    pub(super) async fn adopt(
        &self,
        fates: &mut [Fate],
        report: &mut BatchReport,
    ) -> anyhow::Result<()> {
        let mut waiting = false;
        for fate in fates.iter_mut() {
            let order = match fate {
                Fate::Bury(order, Rejection::StaleEpoch) | Fate::Gone(order) => *order,
                _ => continue,
            };
            let segment = order.sale_segment();
            match self.adopt_one(&order).await? {
                Readmitted::Kept { .. } => {
                    self.in_reach(segment);
                    tracing::warn!(
                        order_id = order.id.get(),
                        voucher_id = order.voucher_id.get(),
                        "admitted again into the sale's current state an order its entry \
                         could not make"
                    );
                    metrics::counter!(crate::metrics::WORKER_ORDERS, "result" => "adopted")
                        .increment(1);
                    report.adopted += 1;
                    *fate = Fate::Adopted;
                }
                // Postgres holds it: the usual paths settle it.
                Readmitted::Settled => {}
                Readmitted::Refused => self.in_reach(segment),
                Readmitted::Elsewhere => waiting |= self.out_of_reach(segment),
            }
        }
        anyhow::ensure!(
            !waiting,
            "the sale's current state is not in the redis this worker reaches (an old \
             primary?): its stale or lost orders wait to be admitted again there"
        );
        Ok(())
    }

    async fn adopt_one(&self, order: &NewOrder) -> anyhow::Result<Readmitted> {
        let r = Readmission {
            segment: order.sale_segment(),
            user_id: order.user_id,
            order_id: order.id,
            admitted_at: order.admitted_at,
        };
        stream::readmit(
            &self.db,
            &mut self.redis.clone(),
            &self.keys,
            r,
            self.config.replicas,
        )
        .await
    }

    fn segments_out_of_reach(&self) -> std::sync::MutexGuard<'_, HashMap<SaleSegment, OutOfReach>> {
        self.out_of_reach.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `segment` found out of reach now: `true` while the batch is to wait for it (each
    /// order is still tried, so that one the sale's state comes back for is kept).
    fn out_of_reach(&self, segment: SaleSegment) -> bool {
        let mut segments = self.segments_out_of_reach();
        let seen = segments.entry(segment).or_insert_with(|| OutOfReach {
            since: Instant::now(),
            told: false,
        });
        if seen.since.elapsed() < ADOPT_PATIENCE {
            return true;
        }
        if std::mem::replace(&mut seen.told, true) {
            return false;
        }
        tracing::warn!(
            voucher_id = segment.voucher_id.get(),
            segment = segment.segment,
            "the sale's current state stayed out of reach for {ADOPT_PATIENCE:?}: its stale \
             or lost orders go unwritten"
        );
        false
    }

    fn in_reach(&self, segment: SaleSegment) {
        self.segments_out_of_reach().remove(&segment);
    }
}

/// Since when a sale segment's current state has been out of this worker's reach, and
/// whether that was logged once past [`ADOPT_PATIENCE`].
#[derive(Debug, Clone, Copy)]
pub(super) struct OutOfReach {
    since: Instant,
    told: bool,
}
