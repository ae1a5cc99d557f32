//! The fence a load and reconcile's comparison both go through (see [`super`]): the
//! sale's row locked and read, the segment's buyers and the stream's candidates staged in
//! Redis, and the last step (a function of the library) run while the lock is surely
//! held, paging on through what the stream gained meanwhile.

use std::collections::{HashMap, HashSet};

use redis::aio::ConnectionLike;
use serde::Serialize;
use sqlx::PgPool;

use super::staging::{page_on, Candidate, Stage};
use super::{MAX_ROUNDS, PAGE, STEP_DEADLINE};
use crate::domain::{OrderId, UserId, VoucherId};
use crate::keys::{Keys, SaleSegment};
use crate::scripts::{Call, Replicas};
use crate::store;

/// What the fence counts in flight.
#[derive(Debug, Clone, Copy)]
pub(super) struct Counting {
    /// Whether the stream is read at all (a new sale has nothing in flight).
    pub scan: bool,
    /// Whether an order buried in Postgres but not yet settled in Redis still counts:
    /// until its settle, Redis holds its record with the unit out (what a comparison
    /// sees); a state built without it is settled already (the settle finds no record).
    pub unsettled_burials: bool,
}

/// A move into a segment that Postgres recorded and has not seen credited: its units are
/// in the segment's allotment.
#[derive(Debug, Serialize)]
pub(super) struct Move {
    id: String,
    units: i32,
}

/// One segment read under its sale's row lock (held until `tx` ends), its buyers staged.
pub(super) struct Fence<'k> {
    pub(super) tx: sqlx::Transaction<'static, sqlx::Postgres>,
    keys: &'k Keys,
    pub(super) segment: SaleSegment,
    pub(super) sale: store::vouchers::LockedSale,
    /// The segment's buyers in Postgres (user → order), as staged, and how many orders.
    known: HashMap<UserId, OrderId>,
    pub(super) pg_orders: i64,
    /// The whole sale's active orders, read under the same lock.
    pub(super) sale_orders: i64,
    /// Postgres's stock for this segment, and its build before this step.
    pub(super) pg_stock: i64,
    pub(super) pg_built: Option<store::epochs::Built>,
    moved_in: Vec<Move>,
    pub(super) stage: Stage,
    paging: Paging,
}

/// The step's argument both functions read (see `lua/load_voucher.lua`), beside the
/// fields of each (`extra`). Ids are strings: an order id does not fit a Lua number.
#[derive(Serialize)]
struct StepArgs<'a, E: Serialize> {
    voucher: String,
    /// The segment's label; `lua/load_voucher.lua` reads it as `part`.
    #[serde(rename = "part", skip_serializing_if = "Option::is_none")]
    segment: Option<String>,
    pg_stock: i64,
    pg_buyers: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pg_epoch: Option<String>,
    moved_in: &'a [Move],
    group: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    after: Option<&'a str>,
    page: usize,
    scan: bool,
    deadline_ms: i64,
    #[serde(flatten)]
    extra: &'a E,
}

/// What the last step answered.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum StepReply {
    /// The state was there (and current, for a heal): left alone.
    LeftAlone,
    /// More stream entries since the last page than the step reads itself: page on.
    TailTooLong,
    /// It reached Redis after its deadline: nothing written.
    TooLate,
    /// Postgres's epoch went to a newer server life than this one's: not built here (an
    /// old primary must not take a sale from the new one).
    LivesElsewhere,
    /// The step's figures, read by its caller.
    Done(Vec<redis::Value>),
}

impl StepReply {
    pub(super) fn parse(reply: Vec<redis::Value>) -> anyhow::Result<Self> {
        let [code] = reply.as_slice() else {
            return Ok(StepReply::Done(reply));
        };
        Ok(match redis::from_redis_value_ref::<i64>(code).ok() {
            Some(-1) => StepReply::LeftAlone,
            Some(-2) => StepReply::TailTooLong,
            Some(-3) => StepReply::TooLate,
            Some(-4) => StepReply::LivesElsewhere,
            _ => anyhow::bail!("unexpected reply from the load step: {reply:?}"),
        })
    }
}

impl<'k> Fence<'k> {
    /// Locks the sale's `seckill_vouchers` row and reads the segment's stock, buyers and
    /// moves under it, stages the buyers, and keeps the candidates paged before the
    /// lock that Postgres neither holds nor buried. `None`: no flash sale.
    pub(super) async fn lock<C: ConnectionLike + Send>(
        db: &PgPool,
        conn: &mut C,
        keys: &'k Keys,
        segment: SaleSegment,
        counting: Counting,
    ) -> anyhow::Result<Option<Self>> {
        let voucher_id = segment.voucher_id;
        let mut paging = Paging::before_lock(db, conn, keys, segment, counting).await?;
        let mut tx = db.begin().await?;
        let Some((sale, mut buyers)) = store::vouchers::lock_sale(&mut tx, voucher_id).await?
        else {
            return Ok(None);
        };
        anyhow::ensure!(
            sale.segments as u8 == segment.segments,
            "voucher {voucher_id} is in {} segments, not {}",
            sale.segments,
            segment.segments
        );
        let sale_orders = buyers.len() as i64;
        buyers.retain(|(u, _)| segment.is_home_of(*u));
        let pg_built = store::epochs::built(&mut *tx, segment).await?;
        let moved_in = moved_in(&mut tx, segment).await?;
        let pg_stock = segment_stock(&mut tx, &sale, segment, buyers.len()).await?;
        let stage = Stage::new(&keys.segment(segment));
        stage.buyers(conn, &buyers).await?;
        let known: HashMap<UserId, OrderId> = buyers.iter().copied().collect();
        paging
            .candidates
            .retain(|c| known.get(&c.user_id) != Some(&c.order_id));
        drop_buried(&mut tx, &mut paging.candidates, voucher_id).await?;
        Ok(Some(Self {
            tx,
            keys,
            segment,
            sale,
            known,
            pg_orders: buyers.len() as i64,
            sale_orders,
            pg_stock,
            pg_built,
            moved_in,
            stage,
            paging,
        }))
    }

    /// Runs `function` until it is done (`None`: it left the state alone), paging on
    /// through what the stream gained meanwhile; a write waits for `replicas`.
    pub(super) async fn step<C: ConnectionLike + Send>(
        &mut self,
        conn: &mut C,
        function: &'static str,
        extra: &impl Serialize,
        replicas: Replicas,
    ) -> anyhow::Result<Option<Vec<redis::Value>>> {
        for _ in 0..MAX_ROUNDS {
            if self.paging.counting.scan {
                // Under the lock: only what was added since the last page.
                self.paging
                    .page_on(conn, self.keys, self.segment, &self.known)
                    .await?;
                self.paging
                    .stage_unsettled(&mut self.tx, conn, &self.stage)
                    .await?;
            }
            // The step may run only while the lock is surely held: the session answers
            // now (so it holds the lock for at least the idle-in-transaction timeout),
            // and the step refuses to run later than STEP_DEADLINE after this (a step
            // queued in Redis behind a client that gave up and released the lock does
            // nothing).
            sqlx::query("SELECT 1").execute(&mut *self.tx).await?;
            let (secs, micros): (i64, i64) = redis::cmd("TIME").query_async(conn).await?;
            let deadline_ms = secs * 1000 + micros / 1000 + STEP_DEADLINE.as_millis() as i64;
            let reply = self
                .call(function, deadline_ms, extra)?
                .invoke_waiting(conn, replicas)
                .await?;
            match StepReply::parse(reply)? {
                StepReply::TailTooLong => continue,
                StepReply::TooLate => anyhow::bail!(
                    "loading voucher {} reached Redis too late; nothing was written",
                    self.segment.voucher_id
                ),
                StepReply::LivesElsewhere => anyhow::bail!(
                    "voucher {} (segment {}) was last built into a newer redis server life than \
                     this one (term {}): not built here; is this an old primary after a failover?",
                    self.segment.voucher_id,
                    self.segment.segment,
                    self.pg_built
                        .as_ref()
                        .map(|b| b.term.as_str())
                        .unwrap_or_default()
                ),
                StepReply::LeftAlone => return Ok(None),
                StepReply::Done(figures) => return Ok(Some(figures)),
            }
        }
        anyhow::bail!(
            "the order stream grows faster than voucher {} can be loaded",
            self.segment.voucher_id
        )
    }

    /// The step's call: the segment's keys, and one JSON argument.
    fn call(
        &self,
        function: &'static str,
        deadline_ms: i64,
        extra: &impl Serialize,
    ) -> anyhow::Result<Call> {
        let (keys, segment) = (self.keys, self.segment);
        let args = StepArgs {
            voucher: segment.voucher_id.to_string(),
            segment: segment.label(),
            pg_stock: self.pg_stock,
            pg_buyers: self.pg_orders,
            pg_epoch: self.pg_built.as_ref().map(|b| b.epoch.to_string()),
            moved_in: &self.moved_in,
            group: crate::stream::GROUP,
            after: self.paging.last.as_deref(),
            page: PAGE,
            scan: self.paging.counting.scan,
            deadline_ms,
            extra,
        };
        let mut call = Call::function(function);
        call.key(keys.segment(segment))
            .key(keys.stream(keys.shard_of_segment(segment)))
            .key(&self.stage.buyers)
            .key(&self.stage.candidates)
            .key(keys.moves_out(segment))
            .key(keys.moves_in(segment))
            .key(keys.segment_marker(segment))
            .arg(serde_json::to_string(&args)?);
        Ok(call)
    }
}

/// The moves into `segment` Postgres recorded and has not seen credited (a segmented
/// sale's only).
async fn moved_in(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    segment: SaleSegment,
) -> anyhow::Result<Vec<Move>> {
    if segment.label().is_none() {
        return Ok(Vec::new());
    }
    Ok(store::segments::uncredited(&mut **tx, segment.voucher_id)
        .await?
        .into_iter()
        .filter(|m| m.to == segment.segment)
        .map(|m| Move {
            id: m.id.to_string(),
            units: m.units,
        })
        .collect())
}

/// Postgres's stock for one segment: the sale's for a sale in one segment; else the segment's
/// allotment less its buyers' active orders.
async fn segment_stock(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    sale: &store::vouchers::LockedSale,
    segment: SaleSegment,
    buyers: usize,
) -> anyhow::Result<i64> {
    if segment.segments == 1 {
        return Ok(sale.stock as i64);
    }
    let stock = store::segments::allotted(tx, segment).await? as i64 - buyers as i64;
    if stock < 0 {
        tracing::error!(
            voucher_id = segment.voucher_id.get(),
            segment = segment.segment,
            stock,
            "a segment's buyers hold more units than its allotment: loaded with none left"
        );
    }
    Ok(stock)
}

/// Drops the candidates Postgres has buried: settled in Redis (record and unit) though
/// their entry may stay unacknowledged until the rest of its batch is settled (an entry
/// holds the orders of one call). Burial takes the sale's lock, held here, so the
/// answer stands until the step is done; the step's tail holds only entries added
/// after the lock, none of them buried yet.
async fn drop_buried(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    candidates: &mut Vec<Candidate>,
    voucher_id: VoucherId,
) -> anyhow::Result<()> {
    let ids: Vec<OrderId> = candidates.iter().map(|c| c.order_id).collect();
    let buried: HashSet<(OrderId, UserId)> = store::dead_orders::orders_among(tx, &ids)
        .await?
        .into_iter()
        .filter(|(_, _, v)| *v == voucher_id)
        .map(|(o, u, _)| (o, u))
        .collect();
    candidates.retain(|c| !buried.contains(&(c.order_id, c.user_id)));
    Ok(())
}

/// The stream paged so far for one step: the entries of the sale whose order
/// Postgres does not hold, and how many of them are staged in Redis.
struct Paging {
    counting: Counting,
    /// The id of the last entry paged.
    last: Option<String>,
    candidates: Vec<Candidate>,
    /// Candidates checked under the lock and staged.
    staged: usize,
}

impl Paging {
    /// The long segment, before the lock: pages through the stream as it is now. Orders
    /// Postgres already holds are skipped (an order once written stays written); the
    /// rest are re-checked under the lock and in the step. Entries of users Postgres
    /// knows under another order are kept: the step must see such a phantom, whose
    /// buyer record may still name it until it is buried.
    async fn before_lock<C: ConnectionLike + Send>(
        db: &PgPool,
        conn: &mut C,
        keys: &Keys,
        segment: SaleSegment,
        counting: Counting,
    ) -> anyhow::Result<Self> {
        let mut paging = Paging {
            counting,
            last: None,
            candidates: Vec::new(),
            staged: 0,
        };
        if counting.scan {
            let early: HashMap<UserId, OrderId> = store::vouchers::buyers(db, segment.voucher_id)
                .await?
                .into_iter()
                .filter(|(u, _)| segment.is_home_of(*u))
                .collect();
            paging.page_on(conn, keys, segment, &early).await?;
        }
        Ok(paging)
    }

    /// Pages on from `last` (see [`page_on`]).
    async fn page_on<C: ConnectionLike + Send>(
        &mut self,
        conn: &mut C,
        keys: &Keys,
        segment: SaleSegment,
        known: &HashMap<UserId, OrderId>,
    ) -> anyhow::Result<()> {
        page_on(
            conn,
            keys,
            segment,
            known,
            &mut self.last,
            &mut self.candidates,
        )
        .await
    }

    /// Drops the candidates paged since the last call whose order was written
    /// (whatever its status now: an active one is among Postgres's buyers already; a
    /// closed one gave its unit back to Postgres's stock, and its release finds no
    /// record) or, unless they count, buried; then stages the rest. Once checked under
    /// the lock, a candidate stays as it is.
    async fn stage_unsettled<C: ConnectionLike + Send>(
        &mut self,
        tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
        conn: &mut C,
        stage: &Stage,
    ) -> anyhow::Result<()> {
        let ids: Vec<OrderId> = self.candidates[self.staged..]
            .iter()
            .map(|c| c.order_id)
            .collect();
        let mut settled: HashSet<OrderId> = store::orders::written_among(tx, &ids)
            .await?
            .into_iter()
            .collect();
        if !self.counting.unsettled_burials {
            settled.extend(store::dead_orders::buried_among(tx, &ids).await?);
        }
        let mut kept = self.candidates.split_off(self.staged);
        kept.retain(|c| !settled.contains(&c.order_id));
        stage.candidates(conn, &kept).await?;
        self.candidates.extend(kept);
        self.staged = self.candidates.len();
        Ok(())
    }
}
