//! Admitting again what the fence refused or Redis lost. An order whose entry carries a
//! stale epoch (admitted by a state that is no longer its sale's: an old primary's after
//! a failover) or whose entry is gone (lost with Redis's data: a restart from an older
//! copy, a failover to a replica that never got it) was never counted by its sale's
//! current state. Its shopper may hold a 202 for it all the same: its acknowledgement
//! came from a replica that then followed another primary. Before such an order is
//! buried, or dropped, it is admitted again into the sale's current state under its own
//! id (`seckill_adopt`): a unit taken there, its buyer recorded, a new entry stamped with
//! the current epoch, which a worker then writes like any other ([`stream::readmit`]). It is kept whenever the
//! sale still has a unit for it and its user holds no other order; otherwise it goes the
//! old way.

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;

use super::batch::Fate;
use super::{BatchReport, Worker};
use crate::domain::{Epoch, OrderId};
use crate::keys::SalePart;
use crate::store;
use crate::store::orders::{NewOrder, Rejection};
use crate::stream::{self, Readmitted};

/// How long a batch waits for its sale's current state before its orders go the old
/// way: a worker that reaches only an old primary (partitioned with it) is told the
/// sale lives elsewhere until it is demoted, or this long.
pub(super) const ADOPT_PATIENCE: Duration = Duration::from_secs(30);

impl Worker {
    /// Admits again, where they can be, the batch's orders the fence refused as stale
    /// and those whose entry is gone; their fates become [`Fate::Adopted`]. An `Err`
    /// while the sale's current state is not reachable here (for at most
    /// [`ADOPT_PATIENCE`]): the batch is held and tried again.
    pub(super) async fn adopt(
        &self,
        fates: &mut [Fate],
        report: &mut BatchReport,
    ) -> anyhow::Result<()> {
        let candidates: Vec<NewOrder> = fates
            .iter()
            .filter_map(|f| match f {
                Fate::Bury(order, Rejection::StaleEpoch) | Fate::Gone(order) => Some(*order),
                _ => None,
            })
            .collect();
        if candidates.is_empty() {
            return Ok(());
        }
        let ids: Vec<OrderId> = candidates.iter().map(|o| o.id).collect();
        // (Held already: the usual paths settle them.)
        let settled = store::orders::settled_among(&self.db, &ids).await?;
        let mut epochs: HashMap<SalePart, Option<Epoch>> = HashMap::new();
        let mut elsewhere = false;
        for fate in fates.iter_mut() {
            let order = match fate {
                Fate::Bury(order, Rejection::StaleEpoch) | Fate::Gone(order) => *order,
                _ => continue,
            };
            if settled.contains(&order.id) {
                continue;
            }
            let part = order.sale_part();
            let epoch = match epochs.get(&part) {
                Some(e) => *e,
                None => {
                    let e = store::epochs::of(&self.db, part).await?;
                    *epochs.entry(part).or_insert(e)
                }
            };
            let Some(epoch) = epoch else { continue };
            match self.adopt_one(&order, epoch).await {
                Readmitted::Kept => {
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
                Readmitted::Refused => {}
                Readmitted::Elsewhere => elsewhere = true,
            }
        }
        self.wait_for_the_sales_state(elsewhere)
    }

    /// One order into its sale's current state (see [`stream::readmit`]).
    async fn adopt_one(&self, order: &NewOrder, epoch: Epoch) -> Readmitted {
        stream::readmit(
            &mut self.redis.clone(),
            &self.keys,
            order.sale_part(),
            epoch,
            order.user_id,
            order.id,
            order.admitted_at,
            self.config.replicas,
        )
        .await
    }

    /// `Err` (the batch held, to be tried again) while some order's sale lives on a
    /// Redis this worker does not reach, up to [`ADOPT_PATIENCE`]; then its orders go
    /// the old way.
    fn wait_for_the_sales_state(&self, elsewhere: bool) -> anyhow::Result<()> {
        let mut since = self
            .adopt_blocked_since
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if !elsewhere {
            *since = None;
            return Ok(());
        }
        let began = *since.get_or_insert_with(Instant::now);
        if began.elapsed() < ADOPT_PATIENCE {
            anyhow::bail!(
                "the sale's current state is not in the redis this worker reaches (an old \
                 primary?): its stale or lost orders wait to be admitted again there"
            );
        }
        *since = None;
        tracing::warn!(
            "the sale's current state stayed out of reach for {ADOPT_PATIENCE:?}: its stale \
             or lost orders go unwritten"
        );
        Ok(())
    }
}
