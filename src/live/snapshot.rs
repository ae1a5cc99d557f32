//! What a page is shown: the snapshot's JSON, and how a sale's row in Postgres and its
//! figures in Redis become its view. Apart from the producer, which decides when to read.

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::admission::tally;
use crate::domain::VoucherId;
use crate::store::live::SaleRow;
use crate::stream::StreamStats;

/// What every page receives.
#[derive(Debug, Clone, Serialize)]
pub struct Snapshot {
    /// When it was made, by Postgres's clock (see `Producer::clock_offset`).
    pub at: DateTime<Utc>,
    /// The order streams, all shards together (`lag` null when Redis cannot tell it).
    pub worker: StreamStats,
    pub sales: Vec<SaleView>,
    /// Sales qualifying for the page (open, upcoming, ended in the last minutes), of
    /// which `sales` holds at most `LIVE_MAX_SALES`.
    pub open_total: i64,
    /// Some qualifying sales were left out of `sales` (more than `LIVE_MAX_SALES`).
    pub truncated: bool,
    /// Stores that did not answer this time (their figures are the last known).
    pub unavailable: Vec<&'static str>,
}

#[derive(Debug, Clone, Serialize)]
pub struct SaleView {
    pub id: VoucherId,
    pub title: String,
    /// `upcoming`, `open` or `ended`, by Postgres's clock (one for every instance).
    pub state: &'static str,
    /// No unit left to grab now: `remaining` is 0, or, while the sale is not loaded in
    /// Redis, Postgres has none left. (Units come back when orders are cancelled or
    /// expire, so an open sale may sell again.)
    pub sold_out: bool,
    pub begin_time: DateTime<Utc>,
    pub end_time: DateTime<Utc>,
    pub initial_stock: i64,
    /// Units left to grab, as admission sees them (Redis); `None` when the sale is
    /// not loaded there (it loads on its first grab).
    pub remaining: Option<i64>,
    /// Grabs a second, every answer, over the last [`RATE_WINDOW`](super::RATE_WINDOW),
    /// every instance's; `None` until Redis has answered for the sale.
    pub grabs_per_sec: Option<f64>,
    /// Grabs answered 503 (`outcomes.unavailable` and `unknown`) a second, over the same
    /// window; `None` as `grabs_per_sec`.
    pub errors_per_sec: Option<f64>,
    /// The 99th percentile of how long grabs waited for their admission call over the
    /// same window, in milliseconds: this instance's grabs, every sale's together (its
    /// `seckill_admission_duration_seconds`, estimated from the buckets as Prometheus
    /// does). `None` for a sale without grabs then, or when this instance made no
    /// admission call then.
    pub admission_p99_ms: Option<f64>,
    pub outcomes: Outcomes,
    pub orders: Orders,
    /// Orders that could never be written (see `seckill dead-letters`).
    pub dead_letters: i64,
    /// Of those, the orders admitted by a Redis state that was no longer the sale's (an
    /// old primary after a failover): refused by the fence, no unit taken.
    pub stale_epoch: i64,
    /// Units returned in Postgres whose return to Redis is still to be made.
    pub releases_owed: i64,
    /// A lottery opening (`None`: first come).
    pub lottery: Option<LotteryView>,
}

/// A lottery sale's window, its entrants, and its draw.
#[derive(Debug, Clone, Serialize)]
pub struct LotteryView {
    pub window_ms: i64,
    /// When entries stop and the draw is due (`begin_time` + `window_ms`).
    pub window_end: DateTime<Utc>,
    /// Shoppers entered: so far, as the sale's Redis state holds them, until the draw is
    /// recorded, then the draw's; `None` while neither can tell (not loaded yet).
    pub entrants: Option<i64>,
    /// The draw, once recorded in Postgres: when, and how many won (`None` before).
    pub drawn_at: Option<DateTime<Utc>>,
    pub winners: Option<i64>,
}

/// Grabs by outcome, since the sale's first grab.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Outcomes {
    pub admitted: u64,
    pub sold_out: u64,
    pub already_ordered: u64,
    pub rate_limited: u64,
    pub not_started: u64,
    pub ended: u64,
    /// Of the above, the grabs an API instance answered by itself (sold out, not yet
    /// open, ended), without asking Redis.
    pub answered_at_edge: u64,
    /// Answered 503, nothing reserved: Redis refused the admission call or could not be
    /// reached, or the sale was being rebuilt from Postgres.
    pub unavailable: u64,
    /// Answered 503 with `"outcome": "unknown"`: the call's answer did not come (the
    /// order may exist).
    pub unknown: u64,
}

impl From<tally::SaleCounts> for Outcomes {
    /// Each field is the count of the outcome of that label.
    fn from(c: tally::SaleCounts) -> Self {
        let [unavailable, unknown] = c.errors;
        Self {
            admitted: c.outcome("admitted"),
            sold_out: c.outcome("sold_out"),
            already_ordered: c.outcome("already_ordered"),
            rate_limited: c.outcome("rate_limited"),
            not_started: c.outcome("not_started"),
            ended: c.outcome("ended"),
            answered_at_edge: c.at_edge,
            unavailable,
            unknown,
        }
    }
}

impl Outcomes {
    pub(super) fn total(&self) -> u64 {
        self.admitted
            + self.sold_out
            + self.already_ordered
            + self.rate_limited
            + self.not_started
            + self.ended
            + self.unavailable
            + self.unknown
    }
}

/// A sale's figures from Redis.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Figures {
    pub(super) remaining: Option<i64>,
    pub(super) outcomes: Outcomes,
    pub(super) recent: tally::Recent,
    /// A lottery's entrants so far, before its draw.
    pub(super) entrants: Option<i64>,
}

impl From<(Option<i64>, tally::Shown, Option<i64>)> for Figures {
    fn from((remaining, live, entrants): (Option<i64>, tally::Shown, Option<i64>)) -> Self {
        Self {
            remaining,
            outcomes: live.totals.into(),
            recent: live.recent,
            entrants,
        }
    }
}

/// The orders the sale's admitted grabs became, so that they add up:
/// `admitted = persisted + in_flight + dead_letters` (the sale's), and
/// `persisted = created + paid + used + refunding + refunded + cancelled + expired`.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Orders {
    /// Orders admitted, as the stores account for them this second: persisted, in
    /// flight, and dead-lettered. Once the grab counts are in (each instance adds its
    /// own once a second), it is `outcomes.admitted`. `None` with `in_flight`.
    pub admitted: Option<i64>,
    /// Written to Postgres, whatever became of them since.
    pub persisted: i64,
    /// Admitted, not yet written; `None` unless both stores answered this time (one
    /// store's last figures beside the other's new ones would make it up).
    pub in_flight: Option<i64>,
    /// Persisted, waiting to be paid.
    pub created: i64,
    pub paid: i64,
    /// Redeemed at the shop.
    pub used: i64,
    /// Money to go back (asked for, or paid too late), and gone back.
    pub refunding: i64,
    pub refunded: i64,
    pub cancelled: i64,
    pub expired: i64,
    /// Of the persisted, those that gave their unit back on sale.
    pub units_back: i64,
    /// Payments that came after their order had closed (among `refunding`/`refunded`).
    pub late_payments: i64,
}

/// Where a sale goes on the page: selling, upcoming, sold out (open, nothing left),
/// ended.
pub(super) fn rank(sale: &SaleView) -> u8 {
    match (sale.state, sale.sold_out) {
        ("open", false) => 0,
        ("upcoming", _) => 1,
        ("open", true) => 2,
        _ => 3,
    }
}

/// `grabs_per_sec`: `None` when Redis has not answered for the sale yet;
/// `admission_p99_ms`: this instance's, shown for a sale with grabs in the window.
pub(super) fn view(
    s: &SaleRow,
    figures: Figures,
    grabs_per_sec: Option<f64>,
    admission_p99_ms: Option<f64>,
    fresh: bool,
) -> SaleView {
    let Figures {
        remaining,
        outcomes,
        recent,
        entrants,
    } = figures;
    let state = match s.state.as_str() {
        "upcoming" => "upcoming",
        "ended" => "ended",
        _ => "open",
    };
    // Not loaded in Redis (it loads on the first grab): Postgres's units not taken.
    let sold_out = remaining.unwrap_or(s.stock as i64) <= 0;
    let persisted =
        s.created + s.paid + s.used + s.refunding + s.refunded + s.cancelled + s.expired;
    // Redis's stock = Postgres's - orders in flight - units whose return to Redis is
    // owed (see `reconcile`).
    let in_flight = remaining
        .filter(|_| fresh)
        // Saturating: a corrupt stock in Redis must show as such, not overflow.
        .map(|r| {
            (s.stock as i64)
                .saturating_sub(r)
                .saturating_sub(s.releases_owed)
                .max(0)
        });
    SaleView {
        id: s.voucher_id,
        title: s.title.clone(),
        state,
        sold_out,
        begin_time: s.begin_time,
        end_time: s.end_time,
        initial_stock: s.initial_stock as i64,
        remaining,
        grabs_per_sec,
        errors_per_sec: grabs_per_sec.map(|_| recent.errors_per_sec()),
        admission_p99_ms: admission_p99_ms.filter(|_| grabs_per_sec > Some(0.0)),
        outcomes,
        orders: Orders {
            admitted: in_flight.map(|f| persisted + f + s.dead_letters),
            persisted,
            in_flight,
            created: s.created,
            paid: s.paid,
            used: s.used,
            refunding: s.refunding,
            refunded: s.refunded,
            cancelled: s.cancelled,
            expired: s.expired,
            units_back: s.units_back,
            late_payments: s.late_payments,
        },
        dead_letters: s.dead_letters,
        stale_epoch: s.stale_epoch,
        releases_owed: s.releases_owed,
        lottery: lottery_view(s, entrants),
    }
}

fn lottery_view(s: &SaleRow, entrants: Option<i64>) -> Option<LotteryView> {
    let window_ms = s.lottery_window_ms?;
    Some(LotteryView {
        window_ms: window_ms.into(),
        window_end: s.begin_time + chrono::Duration::milliseconds(window_ms.into()),
        entrants: s.draw_entrants.map(i64::from).or(entrants),
        drawn_at: s.drawn_at,
        winners: s.draw_winners.map(i64::from),
    })
}
