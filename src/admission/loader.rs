//! Loading flash-sale state from Postgres into Redis: at voucher creation, at start-up,
//! when admission finds a sale's state missing or stale (Redis restarted, failed over,
//! was restored from an older copy, or lost data), and on `reconcile --repair`; and
//! reconcile's read-only comparison ([`check`]) through the same fence.
//!
//! The fence, behind every move of a sale's state from Postgres into Redis and behind
//! the comparison, one segment of a sale at a time ([`fenced`]):
//!
//! 1. lock the sale's `seckill_vouchers` row and read stock and buyers: from now until
//!    the end no worker can commit or bury an order of this sale (both take the lock),
//!    so Postgres cannot move under the load;
//! 2. stage the buyers in Redis, a chunk at a time; page through the shard's stream
//!    (one bounded XRANGE at a time, Redis never stalls), staging this sale's orders of
//!    users Postgres does not know;
//! 3. one function call (`seckill_load`, or the read-only `seckill_check`) reads the
//!    short tail since the last page and the group's position, keeps the candidates
//!    still unacknowledged, and writes (or compares) the state;
//! 4. release the lock.
//!
//! An order committed before step 1 is in Postgres's buyers; one not committed by then
//! cannot be committed before step 4, so its entry is still unacknowledged in step 3
//! and counted in flight. Either way it is counted once: no unit is given out twice
//! and no buyer record is lost.
//!
//! A segmented sale is loaded a segment at a time, each under the same lock: a segment's
//! buyers are those whose home it is, its stock its allotment less their orders.

use std::time::Duration;

use redis::aio::ConnectionLike;
use serde::Serialize;
use sqlx::PgPool;

use crate::domain::{Epoch, OrderId, UserId, VoucherId};
use crate::keys::{Keys, SaleSegment};
use crate::scripts::{Call, Replicas};
use crate::store;
use fenced::{Counting, Fence};

/// How [`load_sale`] treats existing state and orders in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// A sale just created: load if missing; no order can be in flight yet.
    Create,
    /// Load if missing, or rebuild if built in an earlier term of the server (it may
    /// predate writes Redis lost), counting the orders in flight.
    Heal,
    /// Overwrite live state (`seckill reconcile --repair`, a corrupt state).
    Repair,
    /// A segmented lottery's draw is recorded: rebuild a segment that still holds its
    /// window (its entrants' marks), so it admits the winners Postgres holds and no
    /// one else before them.
    Drawn,
}

impl Mode {
    fn as_str(self) -> &'static str {
        match self {
            Mode::Create => "create",
            Mode::Heal => "heal",
            Mode::Repair => "repair",
            Mode::Drawn => "drawn",
        }
    }
}

/// What [`load_sale`] put into Redis.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Loaded {
    pub stock: i64,
    pub buyers: i64,
    pub in_flight: i64,
}

/// Stream entries paged per XRANGE, and the most the final step reads itself.
const PAGE: usize = 1000;
/// Buyer records or candidates staged per command, and commands per round trip: a
/// chunk costs Redis a millisecond or so, so other clients never wait long.
const STAGE_CHUNK: usize = 1000;
const STAGE_PIPELINE: usize = 16;
/// How long staged data outlives a loader that died before its last step.
const STAGE_TTL: Duration = Duration::from_secs(120);
/// How long after its send the last step may still run (below every Redis response
/// timeout the loader's connections use, so the lock is still held when it runs). Its
/// argument is small (the bulk is staged before), so sending it is quick.
const STEP_DEADLINE: Duration = Duration::from_millis(500);
/// Rounds of paging before giving up (the stream grew faster than it could be read).
const MAX_ROUNDS: usize = 100;

/// Loads one sale (see `lua/load_voucher.lua`), each of its segments in turn: buyers are
/// Postgres's buyers plus the orders in flight, stock is Postgres's minus those. `None`
/// when live state was left alone in every segment or the voucher has no flash sale; else
/// the sum over the segments written. A write waits for `replicas`.
pub async fn load_sale<C: ConnectionLike + Send>(
    db: &PgPool,
    conn: &mut C,
    keys: &Keys,
    voucher_id: VoucherId,
    retention: Duration,
    mode: Mode,
    replicas: Replicas,
) -> anyhow::Result<Option<Loaded>> {
    let Some(segments) = store::segments::segments_of(db, voucher_id).await? else {
        return Ok(None);
    };
    let mut sum: Option<Loaded> = None;
    for segment in SaleSegment::all(voucher_id, segments) {
        let loaded = load_segment(db, conn, keys, segment, retention, mode, replicas).await?;
        if let Some(l) = loaded {
            let s = sum.get_or_insert(Loaded::default());
            s.stock += l.stock;
            s.buyers += l.buyers;
            s.in_flight += l.in_flight;
        }
    }
    Ok(sum)
}

/// Loads one segment of a sale (as [`load_sale`] loads each): `None` when its state was
/// left alone.
pub async fn load_segment<C: ConnectionLike + Send>(
    db: &PgPool,
    conn: &mut C,
    keys: &Keys,
    segment: SaleSegment,
    retention: Duration,
    mode: Mode,
    replicas: Replicas,
) -> anyhow::Result<Option<Loaded>> {
    let load = SegmentLoad {
        segment,
        retention,
        mode,
        replicas,
    };
    load.run(db, conn, keys).await
}

/// Whether the segment's state is there, built in the server's current term, sound and
/// armed, with Postgres's epoch (or Postgres's epoch went to a newer server life: not
/// ours to take): then a heal leaves it alone (the last step checks again, atomically,
/// under the lock).
async fn current<C: ConnectionLike + Send>(
    db: &PgPool,
    conn: &mut C,
    keys: &Keys,
    segment: SaleSegment,
) -> anyhow::Result<bool> {
    let state = super::edge::StateKeys::of(keys, segment);
    let Some(state) = super::edge::peek(conn, &state).await? else {
        return Ok(false);
    };
    Ok(match store::epochs::built(db, segment).await? {
        None => true,
        Some(b) => {
            b.epoch.to_string() == state.epoch()
                || crate::scripts::term_drawn_before(state.term(), &b.term)
        }
    })
}

/// Whether `mode` leaves the sale's state as it is without asking Postgres: it is
/// there (create) or there and current (heal).
async fn leave_alone<C: ConnectionLike + Send>(
    db: &PgPool,
    conn: &mut C,
    keys: &Keys,
    segment: SaleSegment,
    mode: Mode,
) -> anyhow::Result<bool> {
    Ok(match mode {
        Mode::Create => {
            redis::cmd("EXISTS")
                .arg(keys.segment(segment))
                .query_async(conn)
                .await?
        }
        Mode::Heal => current(db, conn, keys, segment).await?,
        Mode::Repair => false,
        Mode::Drawn => {
            !redis::cmd("HEXISTS")
                .arg(keys.segment(segment))
                .arg("lottery_end")
                .query_async::<bool>(conn)
                .await?
        }
    })
}

/// One segment's load through the fence.
struct SegmentLoad {
    segment: SaleSegment,
    retention: Duration,
    mode: Mode,
    replicas: Replicas,
}

/// `seckill_load`'s own fields of its argument, beside the fence's (see
/// `lua/load_voucher.lua`).
#[derive(Serialize)]
struct LoadArgs<'a> {
    mode: &'static str,
    /// The epoch this build drew.
    epoch: String,
    /// The term of the server life Postgres's epoch was built into.
    #[serde(skip_serializing_if = "Option::is_none")]
    pg_term: Option<&'a str>,
    begin_ms: i64,
    end_ms: i64,
    expire_at_ms: i64,
    /// A lottery not drawn yet: the end of its entry window, and its seed.
    #[serde(skip_serializing_if = "Option::is_none")]
    lottery_end_ms: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    lottery_seed: Option<String>,
    /// Postgres records the sale's draw: a draw the state carries is answered from.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    draw_recorded: bool,
}

impl SegmentLoad {
    /// Writes the segment's state through the fence, draws its epoch, records it with the
    /// orders carried, and arms the state. `None`: the state was left alone.
    #[tracing::instrument(skip(self, db, conn, keys), fields(segment = ?self.segment, mode = ?self.mode))]
    async fn run<C: ConnectionLike + Send>(
        &self,
        db: &PgPool,
        conn: &mut C,
        keys: &Keys,
    ) -> anyhow::Result<Option<Loaded>> {
        let (segment, mode, voucher_id) = (self.segment, self.mode, self.segment.voucher_id);
        if leave_alone(db, conn, keys, segment, mode).await? {
            return Ok(None);
        }
        let counting = Counting {
            scan: mode != Mode::Create,
            unsettled_burials: false,
        };
        let Some(mut fence) = Fence::lock(db, conn, keys, segment, counting).await? else {
            return Ok(None);
        };
        // Drawn before the step (which writes it into the state, not armed yet); wasted
        // when the step leaves the state alone.
        let epoch = store::epochs::draw(&mut fence.tx).await?;
        let pg_term = fence.pg_built.as_ref().map(|b| b.term.clone());
        let args = self.args(&fence.sale, epoch, pg_term.as_deref());
        let reply = fence
            .step(conn, "seckill_load", &args, self.replicas)
            .await?;
        let built = reply.map(|r| Built::parse(&r)).transpose()?;
        // Announced as soon as the state may have changed, before anything else can fail.
        if built.is_some() {
            crate::sale_changes::announce(conn, keys, voucher_id).await;
        }
        if let Some(b) = &built {
            store::epochs::record(&mut fence.tx, segment, epoch, &b.term, &b.carried).await?;
        }
        fence.tx.commit().await?;
        let Some(built) = built else {
            return Ok(None);
        };
        arm(conn, keys, segment, epoch).await?;
        let expected = built.expected;
        tracing::info!(
            voucher_id = voucher_id.get(),
            ?expected,
            ?mode,
            "sale state loaded into redis"
        );
        Ok(Some(expected))
    }

    fn args<'a>(
        &self,
        sale: &store::vouchers::LockedSale,
        epoch: Epoch,
        pg_term: Option<&'a str>,
    ) -> LoadArgs<'a> {
        let end_ms = sale.end_time.timestamp_millis();
        LoadArgs {
            mode: self.mode.as_str(),
            epoch: epoch.to_string(),
            pg_term,
            begin_ms: sale.begin_time.timestamp_millis(),
            end_ms,
            expire_at_ms: end_ms.saturating_add(self.retention.as_millis() as i64),
            lottery_end_ms: sale
                .lottery_window_ms
                .filter(|_| !sale.drawn)
                .map(|w| sale.begin_time.timestamp_millis() + i64::from(w)),
            lottery_seed: sale.draw_seed.clone().filter(|_| !sale.drawn),
            draw_recorded: sale.drawn,
        }
    }
}

/// What `seckill_load` wrote: what Redis holds now, the term of the server life it ran
/// in, and the orders it counted in flight (and their users), carried into its epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Built {
    expected: Loaded,
    term: String,
    carried: Vec<(OrderId, UserId)>,
}

impl Built {
    fn parse(reply: &[redis::Value]) -> anyhow::Result<Self> {
        let unexpected = || anyhow::anyhow!("unexpected reply from the load step: {reply:?}");
        let number = |v: &redis::Value| redis::from_redis_value_ref::<i64>(v).ok();
        let [stock, buyers, in_flight, term, carried @ ..] = reply else {
            return Err(unexpected());
        };
        let (Some(stock), Some(buyers), Some(in_flight)) =
            (number(stock), number(buyers), number(in_flight))
        else {
            return Err(unexpected());
        };
        Ok(Built {
            expected: Loaded {
                stock,
                buyers,
                in_flight,
            },
            term: redis::from_redis_value_ref(term).map_err(|_| unexpected())?,
            // (An order or user id that is not one came from an entry the worker will
            // dead-letter: nothing to carry.)
            carried: carried
                .chunks(2)
                .filter_map(|pair| {
                    let order = OrderId::new(number(pair.first()?)?)?;
                    let user = UserId::new(number(pair.get(1)?)?)?;
                    Some((order, user))
                })
                .collect(),
        })
    }
}

/// Arms a state a load wrote once Postgres committed its epoch: from now on it admits.
/// If this fails (or the process dies first), the state stays unarmed, admits nothing,
/// and the next heal arms it (its epoch is Postgres's).
async fn arm<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    segment: SaleSegment,
    epoch: Epoch,
) -> anyhow::Result<()> {
    let armed: i64 = Call::function("seckill_arm")
        .key(keys.segment(segment))
        .key(keys.segment_marker(segment))
        .arg(epoch)
        .invoke(conn)
        .await?;
    if armed != 1 {
        // Another load wrote the state since (it arms its own), or it is gone.
        tracing::warn!(
            voucher_id = segment.voucher_id.get(),
            segment = segment.segment,
            epoch = epoch.get(),
            "a loaded sale state was replaced before it was armed"
        );
    }
    Ok(())
}

/// Ends a sale now, in both stores at once: under the fence (so no load can put the old
/// end back), Redis first (atomic with admission: grabs before it win, grabs after it
/// hear `ended`), then Postgres with the same instant. If Redis refuses, nothing
/// changed; if its answer is lost, or Postgres fails after it, Redis alone is closed
/// (a reload keeps the earlier end) and closing again finishes it. `Ok(false)` when the
/// voucher has no flash sale.
#[tracing::instrument(skip(db, conn, keys, replicas))]
pub async fn close_sale<C: ConnectionLike + Send>(
    db: &PgPool,
    conn: &mut C,
    keys: &Keys,
    voucher_id: VoucherId,
    replicas: Replicas,
) -> anyhow::Result<bool> {
    let mut tx = db.begin().await?;
    if store::vouchers::lock_sales(&mut tx, &[voucher_id]).await? == 0 {
        return Ok(false);
    }
    let segments = store::segments::segments_of(&mut *tx, voucher_id)
        .await?
        .unwrap_or(1);
    // Postgres commits only once the replicas hold the close: a failover cannot reopen
    // a sale Postgres says is closed (and if it loses the close before that, the
    // request fails and closing again finishes it). Every segment closes; Postgres's end
    // is the latest of theirs, so no admission lies after it.
    let mut end_ms = i64::MIN;
    for segment in SaleSegment::all(voucher_id, segments) {
        let epoch = store::epochs::of(&mut *tx, segment).await?;
        let ended: i64 = Call::function("seckill_close")
            .key(keys.segment(segment))
            .key(keys.segment_marker(segment))
            .arg(epoch.map(|e| e.to_string()).unwrap_or_default())
            .invoke_waiting(conn, replicas)
            .await?;
        // Not the sale's state (an old primary after a failover): closing it would
        // leave the sale's own state open. Nothing is committed; closing again, once
        // this process reaches the sale's Redis, finishes it (a 503, as for a Redis
        // that is away).
        if ended < 0 {
            let why = std::io::Error::other(format!(
                "voucher {voucher_id}: this redis holds a state of another epoch than \
                 postgres's (not the sale's current redis); nothing was closed in postgres"
            ));
            return Err(redis::RedisError::from(why).into());
        }
        end_ms = end_ms.max(ended);
    }
    crate::sale_changes::announce(conn, keys, voucher_id).await;
    store::vouchers::end_sale_at(&mut tx, voucher_id, end_ms).await?;
    tx.commit().await?;
    Ok(true)
}

pub(crate) mod check;
mod fenced;
mod staging;
#[cfg(test)]
mod tests;
