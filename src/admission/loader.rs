//! Loading flash-sale state from Postgres into Redis: at voucher creation, at start-up,
//! when admission finds a sale's state missing or stale (Redis restarted, failed over,
//! was restored from an older copy, or lost data), and on `reconcile --repair`.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use redis::aio::ConnectionLike;
use sqlx::PgPool;

use crate::domain::{Epoch, OrderId, UserId, VoucherId};
use crate::keys::{Keys, SalePart};
use crate::scripts::{Call, Replicas};
use crate::store;
use staging::{page_on, Candidate, PartMoves, Stage};

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
    /// Write nothing: compare live state with what a load would write
    /// (`seckill reconcile`).
    Check,
}

impl Mode {
    fn as_str(self) -> &'static str {
        match self {
            Mode::Create => "create",
            Mode::Heal => "heal",
            Mode::Repair => "repair",
            Mode::Check => "check",
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

/// One sale (one part of it) seen from both stores at one moment: Postgres under the
/// sale's row lock, Redis (the part's state and stream position) in one script.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Fenced {
    pub initial_stock: i64,
    /// Postgres's stock (of a part: its allotment less its buyers' active orders).
    pub pg_stock: i64,
    pub pg_orders: i64,
    /// The whole sale's stock and active orders in Postgres, read under the same lock
    /// (the sums of a segmented sale's parts, each read under a lock of its own, may
    /// straddle a move).
    pub sale_stock: i64,
    pub sale_orders: i64,
    pub end_time: chrono::DateTime<chrono::Utc>,
    /// What Redis must hold: stock, buyer records, and how many of those are orders in
    /// flight (admitted, not yet written).
    pub expected: Loaded,
    /// Redis's stock before the step (`None`: the sale's state was missing).
    pub actual_stock: Option<i64>,
    pub actual_buyers: i64,
    /// Expected buyer records Redis lacks or names another order in (`Check` only).
    pub mismatched_buyers: i64,
    /// Closed orders whose release to Redis is owed and whose buyer record still holds
    /// their unit (`Check` only): counted in `expected`.
    pub owed_held: i64,
    /// The part's epoch in Postgres (after the step: the one it drew, when it wrote),
    /// and the one Redis's state was armed with before the step (`None`: none, or not
    /// armed).
    pub pg_epoch: Option<Epoch>,
    pub actual_epoch: Option<Epoch>,
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
/// arguments are small (the bulk is staged before), so sending it is quick.
const STEP_DEADLINE: Duration = Duration::from_millis(500);
/// Rounds of paging before giving up (the stream grew faster than it could be read).
const MAX_ROUNDS: usize = 100;

/// Loads one sale (see `lua/load_voucher.lua`), each of its parts in turn: buyers are
/// Postgres's buyers plus the orders in flight, stock is Postgres's minus those. `None`
/// when live state was left alone in every part or the voucher has no flash sale; else
/// the sum over the parts written. A write waits for `replicas`.
pub async fn load_sale<C: ConnectionLike + Send>(
    db: &PgPool,
    conn: &mut C,
    keys: &Keys,
    voucher_id: VoucherId,
    retention: Duration,
    mode: Mode,
    replicas: Replicas,
) -> anyhow::Result<Option<Loaded>> {
    let Some(parts) = store::parts::parts_of(db, voucher_id).await? else {
        return Ok(None);
    };
    let mut sum: Option<Loaded> = None;
    for part in SalePart::all(voucher_id, parts) {
        let done = fenced(db, conn, keys, part, retention, mode, replicas).await?;
        if let Some(f) = done {
            let s = sum.get_or_insert(Loaded::default());
            s.stock += f.expected.stock;
            s.buyers += f.expected.buyers;
            s.in_flight += f.expected.in_flight;
        }
    }
    Ok(sum)
}

/// Whether the part's state is there, built in the server's current term, sound and
/// armed, with Postgres's epoch (or Postgres's epoch went to a newer server life: not
/// ours to take): then a heal leaves it alone (the last step checks again, atomically,
/// under the lock).
async fn current<C: ConnectionLike + Send>(
    db: &PgPool,
    conn: &mut C,
    keys: &Keys,
    part: SalePart,
) -> anyhow::Result<bool> {
    let state = super::edge::StateKeys::of(keys, part);
    let Some(state) = super::edge::peek(conn, &state).await? else {
        return Ok(false);
    };
    Ok(match store::epochs::built(db, part).await? {
        None => true,
        Some(b) => {
            b.epoch.to_string() == state.epoch()
                || crate::scripts::term_drawn_before(state.term(), &b.term)
        }
    })
}

/// Drops the candidates Postgres has buried: settled in Redis (record and unit) though
/// their entry may stay unacknowledged until the rest of its batch is settled (an entry
/// holds the orders of one call). Burial takes the sale's lock, held here, so the
/// answer stands until the load is done; the final step's tail holds only entries
/// added after the lock, none of them buried yet.
async fn drop_buried(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    candidates: &mut Vec<staging::Candidate>,
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

/// The fenced step behind every move of a sale's state from Postgres into Redis, and
/// behind reconcile's comparison:
///
/// 1. lock the sale's `seckill_vouchers` row and read stock and buyers: from now until
///    the end no worker can commit or bury an order of this sale (both take the lock),
///    so Postgres cannot move under the load;
/// 2. stage the buyers in Redis, a chunk at a time; page through the shard's stream
///    (one bounded XRANGE at a time, Redis never stalls), staging this sale's orders of
///    users Postgres does not know;
/// 3. one function call reads the short tail since the last page and the group's
///    position, keeps the candidates still unacknowledged, and writes (or compares) the
///    state;
/// 4. release the lock.
///
/// An order committed before step 1 is in Postgres's buyers; one not committed by then
/// cannot be committed before step 4, so its entry is still unacknowledged in step 3
/// and counted in flight. Either way it is counted once: no unit is given out twice
/// and no buyer record is lost.
///
/// A segmented sale is loaded a part at a time, each under the same lock: a part's
/// buyers are those whose home it is, its stock its allotment less their orders.
#[tracing::instrument(skip(db, conn, keys, replicas))]
pub(crate) async fn fenced<C: ConnectionLike + Send>(
    db: &PgPool,
    conn: &mut C,
    keys: &Keys,
    part: SalePart,
    retention: Duration,
    mode: Mode,
    replicas: Replicas,
) -> anyhow::Result<Option<Fenced>> {
    let voucher_id = part.voucher_id;
    if leave_alone(db, conn, keys, part, mode).await? {
        return Ok(None);
    }
    let mine = |user: UserId| part.is_home_of(user);
    let mut paging = Paging::before_lock(db, conn, keys, part, mode).await?;

    let mut tx = db.begin().await?;
    let Some((sale, mut buyers)) = store::vouchers::lock_sale(&mut tx, voucher_id).await? else {
        return Ok(None);
    };
    anyhow::ensure!(
        sale.segments as u8 == part.parts,
        "voucher {voucher_id} is in {} parts, not {}",
        sale.segments,
        part.parts
    );
    let sale_orders = buyers.len() as i64;
    buyers.retain(|(u, _)| mine(*u));
    let pg_built = store::epochs::built(&mut *tx, part).await?;
    let pg_epoch = pg_built.as_ref().map(|b| b.epoch);
    // Drawn before the step (which writes it into the state, not armed yet); wasted
    // when the step leaves the state alone.
    let epoch = match mode {
        Mode::Check => None,
        _ => Some(store::epochs::draw(&mut tx).await?),
    };
    let moves = PartMoves::read(&mut tx, conn, keys, part, mode).await?;
    let pg_stock = part_stock(&mut tx, &sale, part, buyers.len()).await?;
    let stage = Stage::new(&keys.part(part));
    stage.buyers(conn, &buyers).await?;
    let known: HashMap<UserId, OrderId> = buyers.iter().copied().collect();
    paging
        .candidates
        .retain(|c| known.get(&c.user_id) != Some(&c.order_id));
    drop_buried(&mut tx, &mut paging.candidates, voucher_id).await?;
    // Releases owed to Redis explain a difference only to the comparison; a write
    // rebuilds the records without them (and the release then finds nothing to do).
    let mut owed = match mode {
        Mode::Check => store::lifecycle::owed_for(&mut tx, voucher_id).await?,
        _ => Vec::new(),
    };
    owed.retain(|(u, _)| mine(*u));
    let step = Step {
        keys,
        part,
        mode,
        sale: &sale,
        pg_stock,
        moves: &moves,
        buyers: buyers.len(),
        owed: &owed,
        stage: &stage,
        retention,
        epoch,
        pg_built: pg_built.as_ref(),
    };
    let figures = run_steps(&step, &mut tx, conn, &mut paging, &known, replicas).await?;
    // Announced as soon as the state may have changed, before anything else can fail.
    if mode != Mode::Check && figures.is_some() {
        crate::sale_changes::announce(conn, keys, voucher_id).await;
    }
    let built = match (&figures, epoch) {
        (Some(f), Some(epoch)) => {
            store::epochs::record(&mut tx, part, epoch, &f.term, &f.carried).await?;
            Some(epoch)
        }
        _ => None,
    };
    tx.commit().await?;
    if let Some(epoch) = built {
        arm(conn, keys, part, epoch).await?;
    }
    let Some(figures) = figures else {
        return Ok(None);
    };
    if mode != Mode::Check {
        let expected = figures.expected;
        tracing::info!(
            voucher_id = voucher_id.get(),
            ?expected,
            ?mode,
            "sale state loaded into redis"
        );
    }
    Ok(Some(Fenced {
        initial_stock: sale.initial_stock as i64,
        pg_stock,
        pg_orders: buyers.len() as i64,
        sale_stock: sale.stock as i64,
        sale_orders,
        end_time: sale.end_time,
        expected: figures.expected,
        actual_stock: figures.actual_stock,
        actual_buyers: figures.actual_buyers,
        mismatched_buyers: figures.mismatched_buyers,
        owed_held: figures.owed_held,
        pg_epoch: built.or(pg_epoch),
        actual_epoch: figures.actual_epoch,
    }))
}

/// Arms a state a load wrote once Postgres committed its epoch: from now on it admits.
/// If this fails (or the process dies first), the state stays unarmed, admits nothing,
/// and the next heal arms it (its epoch is Postgres's).
async fn arm<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    part: SalePart,
    epoch: Epoch,
) -> anyhow::Result<()> {
    let armed: i64 = Call::function("seckill_arm")
        .key(keys.part(part))
        .key(keys.part_marker(part))
        .arg(epoch)
        .invoke(conn)
        .await?;
    if armed != 1 {
        // Another load wrote the state since (it arms its own), or it is gone.
        tracing::warn!(
            voucher_id = part.voucher_id.get(),
            part = part.part,
            epoch = epoch.get(),
            "a loaded sale state was replaced before it was armed"
        );
    }
    Ok(())
}

/// Postgres's stock for one part: the sale's for a sale in one part; else the part's
/// allotment less its buyers' active orders.
async fn part_stock(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    sale: &store::vouchers::LockedSale,
    part: SalePart,
    buyers: usize,
) -> anyhow::Result<i64> {
    if part.parts == 1 {
        return Ok(sale.stock as i64);
    }
    let stock = store::parts::allotted(tx, part).await? as i64 - buyers as i64;
    if stock < 0 {
        tracing::error!(
            voucher_id = part.voucher_id.get(),
            part = part.part,
            stock,
            "a part's buyers hold more units than its allotment: loaded with none left"
        );
    }
    Ok(stock)
}

/// Runs the load's step under the sale's lock until the script says it is done (or left
/// the state alone), paging on through what the stream gained meanwhile.
async fn run_steps<C: ConnectionLike + Send>(
    step: &Step<'_>,
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    conn: &mut C,
    paging: &mut Paging,
    known: &HashMap<UserId, OrderId>,
    replicas: Replicas,
) -> anyhow::Result<Option<StepFigures>> {
    let mut rounds = 0;
    loop {
        rounds += 1;
        anyhow::ensure!(
            rounds <= MAX_ROUNDS,
            "the order stream grows faster than voucher {} can be loaded",
            step.part.voucher_id
        );
        if paging.scan {
            // Under the lock: only what was added since the last page.
            paging.page_on(conn, step.keys, step.part, known).await?;
            paging
                .stage_unsettled(tx, conn, step.stage, step.mode)
                .await?;
        }
        // The script may write only while the lock is surely held: the session answers
        // now (so it holds the lock for at least the idle-in-transaction timeout), and
        // the script refuses to run later than STEP_DEADLINE after this (a step queued
        // in Redis behind a client that gave up and released the lock does nothing).
        sqlx::query("SELECT 1").execute(&mut **tx).await?;
        let waits = match step.mode {
            Mode::Check => Replicas::NONE,
            _ => replicas,
        };
        match step.run(conn, paging.last.as_deref(), waits).await? {
            StepReply::TailTooLong => continue,
            StepReply::TooLate => anyhow::bail!(
                "loading voucher {} reached Redis too late; nothing was written",
                step.part.voucher_id
            ),
            StepReply::LivesElsewhere => anyhow::bail!(
                "voucher {} (part {}) was last built into a newer redis server life than \
                 this one (term {}): not built here; is this an old primary after a failover?",
                step.part.voucher_id,
                step.part.part,
                step.pg_built.map(|b| b.term.as_str()).unwrap_or_default()
            ),
            StepReply::LeftAlone => return Ok(None),
            StepReply::Done(figures) => return Ok(Some(figures)),
        }
    }
}

/// Whether `mode` leaves the sale's state as it is without asking Postgres: it is
/// there (create) or there and current (heal).
async fn leave_alone<C: ConnectionLike + Send>(
    db: &PgPool,
    conn: &mut C,
    keys: &Keys,
    part: SalePart,
    mode: Mode,
) -> anyhow::Result<bool> {
    Ok(match mode {
        Mode::Create => {
            redis::cmd("EXISTS")
                .arg(keys.part(part))
                .query_async(conn)
                .await?
        }
        Mode::Heal => current(db, conn, keys, part).await?,
        Mode::Repair | Mode::Check => false,
    })
}

/// The stream paged so far for one load: the entries of the sale whose order
/// Postgres does not hold, and how many of them are staged in Redis.
struct Paging {
    /// Whether the stream is read at all (a new sale has nothing in flight).
    scan: bool,
    /// The id of the last entry paged.
    last: Option<String>,
    candidates: Vec<Candidate>,
    /// Candidates checked under the lock and staged.
    staged: usize,
}

impl Paging {
    /// The long part, before the lock: pages through the stream as it is now. Orders
    /// Postgres already holds are skipped (an order once written stays written); the
    /// rest are re-checked under the lock and in the script. Entries of users Postgres
    /// knows under another order are kept: the script must see such a phantom, whose
    /// buyer record may still name it until it is buried.
    async fn before_lock<C: ConnectionLike + Send>(
        db: &PgPool,
        conn: &mut C,
        keys: &Keys,
        part: SalePart,
        mode: Mode,
    ) -> anyhow::Result<Self> {
        let mut paging = Paging {
            scan: mode != Mode::Create,
            last: None,
            candidates: Vec::new(),
            staged: 0,
        };
        if paging.scan {
            let early: HashMap<UserId, OrderId> = store::vouchers::buyers(db, part.voucher_id)
                .await?
                .into_iter()
                .filter(|(u, _)| part.is_home_of(*u))
                .collect();
            paging.page_on(conn, keys, part, &early).await?;
        }
        Ok(paging)
    }

    /// Pages on from `last` (see [`page_on`]).
    async fn page_on<C: ConnectionLike + Send>(
        &mut self,
        conn: &mut C,
        keys: &Keys,
        part: SalePart,
        known: &HashMap<UserId, OrderId>,
    ) -> anyhow::Result<()> {
        page_on(
            conn,
            keys,
            part,
            known,
            &mut self.last,
            &mut self.candidates,
        )
        .await
    }

    /// Drops the candidates paged since the last call whose order was written
    /// (whatever its status now: an active one is among Postgres's buyers already; a
    /// closed one gave its unit back to Postgres's stock, and its release finds no
    /// record) or buried, then stages the rest. Once checked under the lock, a
    /// candidate stays as it is.
    async fn stage_unsettled<C: ConnectionLike + Send>(
        &mut self,
        tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
        conn: &mut C,
        stage: &Stage,
        mode: Mode,
    ) -> anyhow::Result<()> {
        let ids: Vec<OrderId> = self.candidates[self.staged..]
            .iter()
            .map(|c| c.order_id)
            .collect();
        let mut settled: HashSet<OrderId> = store::orders::written_among(tx, &ids)
            .await?
            .into_iter()
            .collect();
        if mode != Mode::Check {
            // Buried (tombstoned) but not yet settled in Redis: not in flight. Its
            // settle script will find no record naming it and return nothing.
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

/// The last, atomic step of a load (`seckill_load` in the function library), for one
/// sale read under its lock.
struct Step<'a> {
    keys: &'a Keys,
    part: SalePart,
    mode: Mode,
    sale: &'a store::vouchers::LockedSale,
    /// Postgres's stock for this part.
    pg_stock: i64,
    moves: &'a PartMoves,
    /// Postgres's buyers, as staged.
    buyers: usize,
    /// Closed orders whose release is owed (user, order), for a check.
    owed: &'a [(UserId, OrderId)],
    stage: &'a Stage,
    retention: Duration,
    /// The epoch this build drew (`None`: a check writes nothing).
    epoch: Option<Epoch>,
    /// The part's build in Postgres before this one.
    pg_built: Option<&'a store::epochs::Built>,
}

/// What the last step of a load answered.
#[derive(Debug, Clone, PartialEq, Eq)]
enum StepReply {
    /// The state was there (and current, for a heal): left alone.
    LeftAlone,
    /// More stream entries since the last page than the step reads itself: page on.
    TailTooLong,
    /// It reached Redis after its deadline: nothing written.
    TooLate,
    /// Postgres's epoch went to a newer server life than this one's: not built here (an
    /// old primary must not take a sale from the new one).
    LivesElsewhere,
    Done(StepFigures),
}

/// A step's figures: what Redis must hold, and what it held before.
#[derive(Debug, Clone, PartialEq, Eq)]
struct StepFigures {
    expected: Loaded,
    actual_stock: Option<i64>,
    actual_buyers: i64,
    mismatched_buyers: i64,
    owed_held: i64,
    actual_epoch: Option<Epoch>,
    /// The term of the server life the step ran in.
    term: String,
    /// The orders counted in flight (and their users): carried into the epoch the step
    /// wrote.
    carried: Vec<(OrderId, UserId)>,
}

impl StepReply {
    fn parse(reply: &[redis::Value]) -> anyhow::Result<Self> {
        let unexpected = || anyhow::anyhow!("unexpected reply from the load step: {reply:?}");
        let number = |v: &redis::Value| redis::from_redis_value_ref::<i64>(v).ok();
        if let [code] = reply {
            return Ok(match number(code) {
                Some(-1) => StepReply::LeftAlone,
                Some(-2) => StepReply::TailTooLong,
                Some(-3) => StepReply::TooLate,
                Some(-4) => StepReply::LivesElsewhere,
                _ => return Err(unexpected()),
            });
        }
        let (figures, rest) = reply.split_at_checked(8).ok_or_else(unexpected)?;
        let figures: Vec<i64> = figures
            .iter()
            .map(number)
            .collect::<Option<_>>()
            .ok_or_else(unexpected)?;
        let (term, carried) = rest.split_first().ok_or_else(unexpected)?;
        let term: String = redis::from_redis_value_ref(term).map_err(|_| unexpected())?;
        let &[stock, buyers, in_flight, actual_stock, actual_buyers, mismatched_buyers, owed_held, actual_epoch] =
            figures.as_slice()
        else {
            return Err(unexpected());
        };
        Ok(StepReply::Done(StepFigures {
            expected: Loaded {
                stock,
                buyers,
                in_flight,
            },
            actual_stock: (actual_stock >= 0).then_some(actual_stock),
            actual_buyers,
            mismatched_buyers,
            owed_held,
            actual_epoch: Epoch::new(actual_epoch),
            term,
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
        }))
    }
}

impl Step<'_> {
    async fn run<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        last: Option<&str>,
        waits: Replicas,
    ) -> anyhow::Result<StepReply> {
        let (secs, micros): (i64, i64) = redis::cmd("TIME").query_async(conn).await?;
        let deadline_ms = secs * 1000 + micros / 1000 + STEP_DEADLINE.as_millis() as i64;
        let end_ms = self.sale.end_time.timestamp_millis();
        let mut call = Call::function("seckill_load");
        call.key(self.keys.part(self.part))
            .key(self.keys.stream(self.keys.shard_of_part(self.part)))
            .key(&self.stage.buyers)
            .key(&self.stage.candidates)
            .key(self.keys.moves_out(self.part))
            .key(self.keys.moves_in(self.part))
            .key(self.keys.part_marker(self.part))
            .arg(self.mode.as_str())
            .arg(self.part.voucher_id)
            .arg(self.pg_stock)
            .arg(self.sale.begin_time.timestamp_millis())
            .arg(end_ms)
            .arg(end_ms.saturating_add(self.retention.as_millis() as i64))
            .arg(crate::stream::GROUP)
            .arg(last.unwrap_or(""))
            .arg(PAGE)
            .arg(if self.mode != Mode::Create { "1" } else { "0" })
            .arg(deadline_ms)
            .arg(self.buyers)
            .arg(self.epoch.map(|e| e.to_string()).unwrap_or_default())
            .arg(
                self.pg_built
                    .map(|b| b.epoch.to_string())
                    .unwrap_or_default(),
            )
            .arg(self.pg_built.map(|b| b.term.as_str()).unwrap_or_default())
            .arg(self.owed.len());
        for (user_id, order_id) in self.owed {
            call.arg(user_id).arg(order_id);
        }
        self.moves.args(&mut call);
        let reply: Vec<redis::Value> = call.invoke_waiting(conn, waits).await?;
        StepReply::parse(&reply)
    }
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
    let parts = store::parts::parts_of(&mut *tx, voucher_id)
        .await?
        .unwrap_or(1);
    // Postgres commits only once the replicas hold the close: a failover cannot reopen
    // a sale Postgres says is closed (and if it loses the close before that, the
    // request fails and closing again finishes it). Every part closes; Postgres's end
    // is the latest of theirs, so no admission lies after it.
    let mut end_ms = i64::MIN;
    for part in SalePart::all(voucher_id, parts) {
        let epoch = store::epochs::of(&mut *tx, part).await?;
        let ended: i64 = Call::function("seckill_close")
            .key(keys.part(part))
            .key(keys.part_marker(part))
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

mod staging;
#[cfg(test)]
mod tests;
