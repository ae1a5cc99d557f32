//! Admission: the one atomic Redis step that decides who gets an order.

pub mod batcher;
pub mod edge;
pub mod fence;
pub mod grab;
pub mod guard;
pub(crate) mod hot;
pub(crate) mod keepers;
pub mod limits;
pub mod loader;
pub mod lottery;
pub mod order_id;
pub mod promises;
pub mod segments;
pub mod tally;
pub mod term;
pub mod upkeep;

use redis::aio::ConnectionLike;
use redis::RedisResult;

use crate::domain::{OrderId, UserId, VoucherId};
use crate::keys::{self, Keys, SaleSegment};
use crate::scripts::{Call, Replicas};

/// How a grab ended: the one vocabulary of its answers. The admission script decides
/// most (codes 0 to 13); the rest are decided before or around the call. Everything
/// else about one (its metric label, whether the live view counts it, whether the edge
/// answers it, what the shopper hears) is in one table, [`Outcome::describe`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// A 202: the order, written to Postgres moments later.
    Admitted {
        order_id: OrderId,
    },
    /// The voucher's state is not in Redis: fail closed.
    NotLoaded,
    NotStarted,
    Ended,
    AlreadyOrdered {
        order_id: OrderId,
    },
    SoldOut,
    /// The sale's state was built in an earlier term of the server (Redis restarted,
    /// failed over or was restored since, and may have lost writes): refused until it
    /// is rebuilt from Postgres.
    Stale,
    /// The sale's state holds a field that is not a number: refused until repaired.
    Corrupt,
    /// The server is in a new term not opened yet: every instance is admitting again
    /// the 202s it may have lost (see [`keepers`]).
    Held,
    /// The sale's state is of an older build than the one Postgres names (see
    /// [`fence`]): the sale lives on another Redis server now, and this one (an old
    /// primary still taking writes) took nothing.
    Fenced,
    /// The grab's segment of a segmented sale has no unit left: units are moved to it from
    /// the other segments (see [`segments`]), or, when none has any, the sale is sold out.
    /// Never an answer to a shopper.
    Drained,
    /// The server's `maxmemory-policy` may evict keys (any but `noeviction`): no answer
    /// could be a promise (an evicted sale, stream or lease forgets it), so no grab is
    /// decided there and nothing is taken, until it is `noeviction` again.
    Evicting,
    /// A lottery's window is open: the shopper is an entrant, and this is the order they
    /// get if drawn. Never an answer to a shopper: the press is held until the draw (see
    /// [`lottery`]).
    Entered {
        order_id: OrderId,
    },
    /// The grab's segment of a segmented lottery sale is past its window and the draw has
    /// not rebuilt it yet: nothing was taken. The press waits for the draw, then grabs
    /// again (see [`lottery`]); still so after [`lottery::ANSWER_WITHIN`], or when the
    /// draw's order of an entrant pressing after the window may have closed since, it is
    /// answered `unavailable` (nothing reserved) and the segment rebuilt.
    Drawing,
    /// Refused by an abuse limit before anything else: try again after this long.
    RateLimited {
        retry_after_secs: u64,
    },
    /// The voucher has no flash sale.
    NotFound,
    /// No voucher has this id (said apart from [`Outcome::NotFound`]: the two send a
    /// caller looking in different places).
    NoVoucher,
    /// Not tried, or refused before Redis ran anything: nothing was reserved.
    Unavailable(Unavailable),
    /// The call was sent and its answer did not come (timeout, connection lost): it may
    /// have run, and the order, minted with this id, may exist.
    Unknown {
        order_id: OrderId,
    },
}

/// Why a grab could not be tried (nothing reserved).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unavailable {
    /// Redis could not be reached, or refused the call.
    Redis,
    /// This shopper's earlier 202, which Redis may have lost, is being admitted again.
    Recovering,
    /// No order-id node is leased yet (waiting for Redis).
    IdsNotReady,
}

/// One outcome, as [`Outcome::describe`] tells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Description {
    /// Its metric label (`seckill_admissions_total{outcome}`, and the live view's).
    pub label: &'static str,
    /// Its place in [`Outcome::LABELS`] (counters are arrays in that order).
    pub index: usize,
    /// Whether the live view counts it (a drained segment's grab is decided again once
    /// units moved: counted then).
    pub counted: bool,
    /// Whether an instance answers it at the edge, without Redis.
    pub at_edge: bool,
    /// What the shopper is answered (the HTTP layer words it).
    pub answer: Answer,
}

/// What a grab's shopper is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// A 202: the order.
    Admitted(OrderId),
    AlreadyOrdered(OrderId),
    NotStarted,
    Ended,
    SoldOut,
    /// The voucher has no flash sale.
    NoSale,
    NoVoucher,
    RateLimited {
        retry_after_secs: u64,
    },
    /// The order minted for the grab may exist.
    Unknown(OrderId),
    /// Refused with nothing reserved, for this reason (in words for the shopper).
    Unavailable(&'static str),
}

const LOADING: &str = "the sale is being loaded, try again shortly; nothing was reserved";
const REBUILDING: &str =
    "the sale is being rebuilt from the database, try again shortly; nothing was reserved";
const HELD: &str = "the sale is paused while orders the admission store may have lost are \
                    recovered, try again shortly; nothing was reserved";
const DRAWING: &str = "the sale's lottery is being drawn, try again shortly; nothing was reserved";
const FENCED: &str = "the sale has moved to another admission server, try again shortly; \
                      nothing was reserved";
const EVICTING: &str = "the admission store may evict keys (its maxmemory-policy is not \
                        noeviction), so no order can be promised; nothing was reserved";
const RECOVERING: &str = "your earlier order for this sale is being recovered; try again \
                          shortly; nothing was reserved";
const IDS_NOT_READY: &str = "order ids are not ready yet (waiting for redis)";
const REDIS: &str = "the admission store is unavailable, try again; nothing was reserved";

impl Outcome {
    /// The metric labels, in the order of [`Outcome::index`].
    pub(crate) const LABELS: [&'static str; 17] = [
        "rate_limited",
        "admitted",
        "not_loaded",
        "not_found",
        "stale",
        "corrupt",
        "held",
        "fenced",
        "not_started",
        "ended",
        "already_ordered",
        "sold_out",
        "redis_error",
        "not_ready",
        "entered",
        "drawing",
        "evicting",
    ];

    /// Everything this outcome is, in the one exhaustive table of outcomes: adding one
    /// makes the compiler ask for its row here, and every other place reads it from here.
    pub const fn describe(&self) -> Description {
        use Answer as A;
        let (index, counted, at_edge, answer) = match *self {
            Outcome::RateLimited { retry_after_secs } => {
                (0, true, false, A::RateLimited { retry_after_secs })
            }
            Outcome::Admitted { order_id } => (1, true, false, A::Admitted(order_id)),
            Outcome::NotLoaded => (2, false, false, A::Unavailable(LOADING)),
            // (Never leaves `segments`: a drained segment is refilled or sold out.)
            Outcome::Drained => (2, false, false, A::SoldOut),
            Outcome::NotFound => (3, false, true, A::NoSale),
            Outcome::NoVoucher => (3, false, false, A::NoVoucher),
            Outcome::Stale => (4, false, false, A::Unavailable(REBUILDING)),
            Outcome::Corrupt => (5, false, false, A::Unavailable(REBUILDING)),
            Outcome::Held => (6, false, false, A::Unavailable(HELD)),
            Outcome::Fenced => (7, false, false, A::Unavailable(FENCED)),
            Outcome::NotStarted => (8, true, true, A::NotStarted),
            Outcome::Ended => (9, true, true, A::Ended),
            Outcome::AlreadyOrdered { order_id } => (10, true, false, A::AlreadyOrdered(order_id)),
            Outcome::SoldOut => (11, true, true, A::SoldOut),
            Outcome::Unavailable(Unavailable::Redis) => (12, false, false, A::Unavailable(REDIS)),
            Outcome::Unknown { order_id } => (12, false, false, A::Unknown(order_id)),
            Outcome::Unavailable(Unavailable::Recovering) => {
                (13, false, false, A::Unavailable(RECOVERING))
            }
            Outcome::Unavailable(Unavailable::IdsNotReady) => {
                (13, false, false, A::Unavailable(IDS_NOT_READY))
            }
            // (Never an answer: the press is held until the draw.)
            Outcome::Entered { .. } => (14, false, false, A::Unavailable(LOADING)),
            Outcome::Drawing => (15, false, false, A::Unavailable(DRAWING)),
            Outcome::Evicting => (16, false, false, A::Unavailable(EVICTING)),
        };
        Description {
            label: Self::LABELS[index],
            index,
            counted,
            at_edge,
            answer,
        }
    }

    /// Its place in [`Outcome::LABELS`] (counters are arrays in that order).
    pub(crate) const fn index(&self) -> usize {
        self.describe().index
    }

    /// A refusal that took nothing and that a segmented lottery's draw, or a segment's
    /// rebuild after it, may cause: such a press waits for the draw and grabs again
    /// (`Admission::after_draw`).
    pub(crate) fn may_await_a_draw(&self) -> bool {
        matches!(
            self,
            Outcome::Drawing | Outcome::NotLoaded | Outcome::Unavailable(Unavailable::Redis)
        )
    }

    /// The outcome of the admission call made for the grab that minted `minted`.
    pub fn of(decided: RedisResult<Outcome>, minted: OrderId) -> Outcome {
        match decided {
            // The script ran twice for this grab (the cluster client re-sends a command
            // after a dropped connection): the order it names is this grab's own.
            Ok(Outcome::AlreadyOrdered { order_id }) if order_id == minted => {
                Outcome::Admitted { order_id }
            }
            // (Never leaves `segments`: a drained segment is refilled or sold out.)
            Ok(Outcome::Drained) => Outcome::SoldOut,
            Ok(outcome) => outcome,
            Err(e) if crate::scripts::surely_not_run(&e) => {
                tracing::debug!(error = %e, "admission refused unsent or by redis: nothing reserved");
                Outcome::Unavailable(Unavailable::Redis)
            }
            Err(e) => {
                tracing::warn!(error = %e, order_id = %minted, "admission outcome unknown");
                Outcome::Unknown { order_id: minted }
            }
        }
    }
}

/// One grab to decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grab {
    pub voucher_id: VoucherId,
    pub user_id: UserId,
    /// Minted by the API before the call.
    pub order_id: OrderId,
    /// The user's home segment of the sale, and the sale's segments (0 and 1 for a sale in
    /// one segment).
    pub segment: u8,
    pub segments: u8,
}

impl Grab {
    pub fn sale_segment(&self) -> SaleSegment {
        SaleSegment::new(self.voucher_id, self.segment, self.segments)
    }
}

/// Runs the admission script for one grab.
#[tracing::instrument(level = "debug", skip(conn, keys))]
pub async fn admit<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    voucher_id: VoucherId,
    user_id: UserId,
    order_id: OrderId,
) -> RedisResult<Outcome> {
    let grab = Grab {
        voucher_id,
        user_id,
        order_id,
        segment: 0,
        segments: 1,
    };
    let shard = keys.shard_of(voucher_id);
    let none = fence::Fence::default();
    let mut outcomes = admit_many(conn, keys, shard, &[grab], Replicas::NONE, &none).await?;
    Ok(outcomes.remove(0))
}

/// Runs the admission function once for grabs of one shard, deciding them in order: one
/// FCALL (and, when `replicas` says so, one WAIT in the same round trip: an answer
/// that names an order only once that many replicas hold it), refusing states older
/// than `fence` knows. One outcome per grab.
pub async fn admit_many<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    shard: keys::Shard,
    grabs: &[Grab],
    replicas: Replicas,
    fence: &fence::Fence,
) -> RedisResult<Vec<Outcome>> {
    Ok(decide(conn, keys, shard, grabs, replicas, fence)
        .await?
        .outcomes)
}

/// What one admission call decided: an outcome per grab, and the id of the stream entry
/// that holds the orders it admitted (`None`: it admitted none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decided {
    pub outcomes: Vec<Outcome>,
    pub entry: Option<String>,
}

/// [`admit_many`], with the id of the call's stream entry.
pub async fn decide<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    shard: keys::Shard,
    grabs: &[Grab],
    replicas: Replicas,
    fence: &fence::Fence,
) -> RedisResult<Decided> {
    let call = admission_call(keys, shard, grabs, replicas, fence);
    let reply: Vec<redis::Value> = call.invoke_waiting(conn, replicas).await?;
    Decided::parse(reply, grabs.len()).ok_or_else(|| {
        redis::RedisError::from((
            redis::ErrorKind::UnexpectedReturnType,
            "unexpected reply from the admission script",
        ))
    })
}

/// The call deciding `grabs` (see `seckill_admit` in `lua/seckill.lua`).
fn admission_call(
    keys: &Keys,
    shard: keys::Shard,
    grabs: &[Grab],
    replicas: Replicas,
    fence: &fence::Fence,
) -> Call {
    let mut call = Call::function("seckill_admit");
    call.key(keys.stream(shard))
        .key(keys.term_marker(shard))
        .arg(if replicas.waits() { "1" } else { "0" });
    let mut sales: Vec<SaleSegment> = Vec::new();
    // The grabs in order, as runs of one sale (segment): its hash's index in KEYS, its
    // voucher_id, its label, the epoch Postgres names for it (0: none known) and how
    // many grabs, then each grab's user_id and order_id (the sale's fields once per run
    // rather than once per grab: fewer arguments for Redis to parse and hand to Lua).
    for run in grabs.chunk_by(|a, b| a.sale_segment() == b.sale_segment()) {
        let segment = run[0].sale_segment();
        debug_assert_eq!(keys.shard_of_segment(segment), shard);
        let index = match sales.iter().position(|&p| p == segment) {
            Some(i) => i,
            None => {
                sales.push(segment);
                call.key(keys.segment(segment));
                sales.len() - 1
            }
        };
        // KEYS[1] is the stream, KEYS[2] its term marker; sale hashes from KEYS[3] (Lua
        // counts from 1).
        call.arg(index + 3)
            .arg(segment.voucher_id)
            .arg(segment.label().unwrap_or_default())
            .arg(fence.floor(segment).map_or(0, |e| e.get()))
            .arg(run.len());
        for g in run {
            call.arg(g.user_id).arg(g.order_id);
        }
    }
    call
}

impl Decided {
    /// The script's reply for `grabs` grabs: a code and an order id (0: none) per grab,
    /// then the entry's id when it admitted any. `None`: not such a reply.
    fn parse(mut reply: Vec<redis::Value>, grabs: usize) -> Option<Self> {
        let entry = match reply.len() {
            n if n == 2 * grabs => None,
            n if n == 2 * grabs + 1 => Some(redis::from_redis_value(reply.pop()?).ok()?),
            _ => return None,
        };
        let outcomes = reply
            .chunks(2)
            .map(|pair| {
                let code = redis::from_redis_value_ref::<i64>(&pair[0]).ok()?;
                let id = redis::from_redis_value_ref::<i64>(&pair[1]).unwrap_or(0);
                Outcome::of_code(code, OrderId::new(id))
            })
            .collect::<Option<Vec<Outcome>>>()?;
        Some(Decided { outcomes, entry })
    }
}

impl Outcome {
    /// The script's verdict for one grab (its codes are listed above `admit` in
    /// `lua/seckill.lua`); `None`: no such code, or no order id where one belongs.
    fn of_code(code: i64, order_id: Option<OrderId>) -> Option<Self> {
        Some(match code {
            0 => Outcome::Admitted {
                order_id: order_id?,
            },
            1 => Outcome::NotLoaded,
            2 => Outcome::NotStarted,
            3 => Outcome::Ended,
            4 => Outcome::AlreadyOrdered {
                order_id: order_id?,
            },
            5 => Outcome::SoldOut,
            6 => Outcome::Stale,
            7 => Outcome::Corrupt,
            8 => Outcome::Drained,
            9 => Outcome::Held,
            10 => Outcome::Fenced,
            11 => Outcome::Entered {
                order_id: order_id?,
            },
            12 => Outcome::Drawing,
            13 => Outcome::Evicting,
            _ => return None,
        })
    }
}

/// Remaining stock as Redis sees it, summed over the sale's segments (`None`: some segment is
/// not loaded). Units on their way between segments are not counted.
pub async fn redis_stock<C: ConnectionLike + Send + Clone>(
    conn: &mut C,
    keys: &Keys,
    voucher_id: VoucherId,
    segments: u8,
) -> RedisResult<Option<i64>> {
    // One command per segment, all in flight at once (the segments may live on different
    // cluster nodes, so no pipeline).
    let lookups = SaleSegment::all(voucher_id, segments).map(|segment| {
        let mut conn = conn.clone();
        let cmd = redis::cmd("HGET")
            .arg(keys.segment(segment))
            .arg("stock")
            .clone();
        async move { cmd.query_async::<Option<i64>>(&mut conn).await }
    });
    let stocks = futures_util::future::try_join_all(lookups).await?;
    Ok(stocks.into_iter().sum())
}

/// An order admitted in Redis and not (yet) in Postgres.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PendingOrder {
    pub order_id: OrderId,
    pub voucher_id: VoucherId,
    pub user_id: UserId,
    pub admitted_ms: i64,
}

impl PendingOrder {
    fn new(order_id: OrderId, voucher_id: VoucherId, user_id: UserId) -> Self {
        Self {
            order_id,
            voucher_id,
            user_id,
            // The id carries its minting time, within a millisecond of admission.
            admitted_ms: order_id::timestamp_ms(order_id) as i64,
        }
    }
}

/// The user's orders in the given sales (voucher, segments), as their buyer records in
/// Redis say (in the user's home segment): the orders admitted there, whether or not the
/// worker has written them yet. A lottery entrant's mark names no order yet, nor does a
/// draw Postgres does not record yet (a Redis that loses it may draw otherwise).
pub async fn orders_of<C: ConnectionLike + Send + Clone>(
    conn: &mut C,
    keys: &Keys,
    user_id: UserId,
    sales: &[(VoucherId, u8)],
) -> RedisResult<Vec<PendingOrder>> {
    if sales.is_empty() {
        return Ok(Vec::new());
    }
    let field = keys::buyer_field(user_id);
    // One command per sale, all in flight at once: the sales may live on different
    // cluster nodes, so no pipeline.
    let lookups = sales.iter().map(|&(voucher_id, segments)| {
        let mut conn = conn.clone();
        let home = SaleSegment::home_of(voucher_id, user_id, segments);
        let cmd = redis::cmd("HMGET")
            .arg(keys.segment(home))
            .arg(&field)
            .arg("unrecorded")
            .clone();
        async move {
            cmd.query_async::<(Option<String>, Option<String>)>(&mut conn)
                .await
        }
    });
    let held = futures_util::future::try_join_all(lookups).await?;
    Ok(sales
        .iter()
        .zip(held)
        .filter_map(|(&(voucher_id, _), (record, unrecorded))| {
            let order = record.as_deref().and_then(crate::domain::parse_id);
            let order = OrderId::new(order.filter(|_| unrecorded.is_none())?)?;
            Some(PendingOrder::new(order, voucher_id, user_id))
        })
        .collect())
}

/// Looks an order up among the stream entries not yet trimmed (for administrators, who
/// do not know whose order it is): a scan of at most `limit` entries per shard.
pub(crate) async fn find_in_stream<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &Keys,
    order_id: OrderId,
    limit: usize,
) -> RedisResult<Option<PendingOrder>> {
    for shard in keys.shards() {
        let found = crate::stream::entries(conn, keys, shard, limit)
            .await?
            .iter()
            .filter_map(|e| e.order())
            .find(|o| o.id == order_id)
            .map(|o| PendingOrder::new(o.id, o.voucher_id, o.user_id));
        if found.is_some() {
            return Ok(found);
        }
    }
    Ok(None)
}
