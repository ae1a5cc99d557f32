//! The checker: the service's promises, judged from the history and from what the
//! stores hold at the end. Pure: no I/O, so each check can be shown failing on a small
//! fabricated history (see `checker/tests.rs`): a check that cannot fail proves nothing.

use std::collections::{BTreeMap, HashMap, HashSet};

use super::history::{Kind, Record};
use unknowns::{check_phantoms, check_unknowns};

mod unknowns;

/// An order as Postgres holds it at the end. Times are ms on the history's axis.
#[derive(Clone, Debug)]
pub struct PgOrder {
    pub id: i64,
    pub user: i64,
    pub voucher: i64,
    pub status: String,
    /// Its writing (Postgres's clock).
    pub created_ms: f64,
    /// Its payment deadline (Postgres's clock).
    pub pay_before_ms: f64,
    pub closed_ms: Option<f64>,
    pub refund_reason: Option<String>,
    /// When the provider's first payment of it (with its price) was received.
    pub first_paid_ms: Option<f64>,
}

impl PgOrder {
    /// Holds its unit: not given back (cancelled, expired, or refunded while its sale
    /// was open; a late payment's `refunding` order gave it back when it closed).
    pub fn is_active(&self) -> bool {
        self.closed_ms.is_none()
    }
}

/// A tombstone of `dead_orders`: an order the worker buried instead of writing.
#[derive(Clone, Debug)]
pub struct DeadOrder {
    pub id: i64,
    pub user: i64,
    pub voucher: i64,
    pub reason: String,
    pub returns_unit: bool,
}

/// One sale's books at the end, in both stores.
#[derive(Clone, Debug)]
pub struct SaleBooks {
    pub voucher: i64,
    /// Its number of segments (`segments`).
    pub segments: u8,
    pub initial: i64,
    pub pg_stock: i64,
    /// Its stock summed over its segments in Redis; `None`: no state there.
    pub redis_stock: Option<i64>,
    pub open: bool,
}

/// A lottery sale at the end: its window, and its draw as Postgres records it.
#[derive(Clone, Debug)]
pub struct Lottery {
    pub voucher: i64,
    /// Its window's begin and end, on the history's axis.
    pub window_ms: (f64, f64),
    /// The draw's winners (user ids); `None`: no draw recorded.
    pub winners: Option<Vec<i64>>,
    /// How many entered the draw.
    pub entrants: usize,
    /// What `scripts/verify-draw` said of the published draw, when it did not verify it.
    pub unverified: Option<String>,
}

/// A lottery sale's recorded draw, as the report shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct Drawn {
    pub voucher: i64,
    pub window_ms: (f64, f64),
    pub winners: usize,
    pub entrants: usize,
}

/// Everything the checker reads.
#[derive(Clone, Debug, Default)]
pub struct Evidence {
    pub history: Vec<Record>,
    pub orders: Vec<PgOrder>,
    pub dead: Vec<DeadOrder>,
    pub sales: Vec<SaleBooks>,
    pub lotteries: Vec<Lottery>,
    /// The campaign's start on the wall clock (Unix ms): order ids carry their minting
    /// time, which this places on the history's axis.
    pub start_unix_ms: f64,
    /// Every stream entry acknowledged and no release owed when the stores were read.
    pub settled: bool,
    /// `seckill reconcile`'s exit code (`None`: it did not finish).
    pub reconcile_exit: Option<i32>,
    /// Per open sale, seconds from the last heal to its first definite answer.
    pub admit_again: Vec<(i64, Option<f64>)>,
    pub admit_bound_secs: f64,
    /// When the primary's policy could evict keys: from the switch to the switch back,
    /// on the history's axis.
    pub evicting: Vec<(f64, f64)>,
    /// When each API instance was stopped (killed until started again, or paused):
    /// (instance, from, to) on the history's axis.
    pub api_stopped: Vec<(u8, f64, f64)>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Violation {
    pub check: &'static str,
    pub detail: String,
    /// When it happened on the history's axis, if that is known.
    pub at_ms: Option<f64>,
}

/// How each unknown grab turned out.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Unknowns {
    pub total: usize,
    pub order: usize,
    pub none: usize,
    pub dead: usize,
    pub ambiguous: usize,
    /// Of those, how many the answer named by `order_id`.
    pub by_id: usize,
}

#[derive(Clone, Debug, Default)]
pub struct Verdict {
    pub admitted: usize,
    pub promised: usize,
    pub lost: usize,
    pub unknowns: Unknowns,
    pub oversold_units: i64,
    pub duplicates: usize,
    pub two_live: usize,
    pub phantoms: usize,
    /// The lottery sales whose draw Postgres records.
    pub draws: Vec<Drawn>,
    pub dead_by_reason: BTreeMap<String, usize>,
    pub violations: Vec<Violation>,
}

impl Verdict {
    fn violate(&mut self, check: &'static str, at_ms: Option<f64>, detail: String) {
        self.violations.push(Violation {
            check,
            detail,
            at_ms,
        });
    }
}

/// When an order id was minted, on the history's axis.
pub fn minted_ms(id: i64, start_unix_ms: f64) -> f64 {
    let id = seckill::domain::OrderId::new(id).expect("an order id");
    seckill::admission::order_id::timestamp_ms(id) as f64 - start_unix_ms
}

/// Judges every promise; each check adds its figures and violations.
pub fn check(e: &Evidence) -> Verdict {
    let mut v = Verdict::default();
    for d in &e.dead {
        *v.dead_by_reason.entry(reason_kind(&d.reason)).or_default() += 1;
    }
    check_promises(e, &mut v);
    check_sales(e, &mut v);
    check_two_live(e, &mut v);
    check_unknowns(e, &mut v);
    check_phantoms(e, &mut v);
    check_closes(e, &mut v);
    check_lotteries(e, &mut v);
    check_evicting(e, &mut v);
    check_deadlines(e, &mut v);
    check_internal(e, &mut v);
    check_ending(e, &mut v);
    v
}

/// How long after a switch to an evicting policy a grab may still be decided: the
/// admission function looks at its server's policy every 100 ms.
pub const EVICTING_NOTICED_MS: f64 = 200.0;

/// No 202 for a grab sent while the primary could evict keys (once the admission
/// function had looked) and answered before it stopped: no answer there is a promise.
fn check_evicting(e: &Evidence, v: &mut Verdict) {
    for &(from, to) in &e.evicting {
        for r in e.history.iter().filter(|r| r.is_202()) {
            let answered = r.recv_ms.unwrap_or(f64::INFINITY);
            if r.sent_ms >= from + EVICTING_NOTICED_MS && answered <= to {
                v.violate(
                    "202 while redis may evict",
                    r.recv_ms,
                    format!(
                        "user {} on voucher {} got 202 (order {:?}) at {:.1} s by api {}, while the primary could evict keys ({:.1} s to {:.1} s)",
                        r.user,
                        r.voucher,
                        r.order_id,
                        answered / 1000.0,
                        r.api,
                        from / 1000.0,
                        to / 1000.0
                    ),
                );
            }
        }
    }
}

/// Every order's deadline lies ahead when it is written (Postgres's clock decides both),
/// and no payment received before it, while the order was live, ends refunding as a
/// late one (a payment for an order its owner had cancelled is rightly given back).
fn check_deadlines(e: &Evidence, v: &mut Verdict) {
    for o in e.orders.iter().filter(|o| o.pay_before_ms <= o.created_ms) {
        v.violate(
            "a deadline past at creation",
            Some(o.created_ms),
            format!(
                "order {} of user {} was written at {:.3} s to be paid before {:.3} s",
                o.id,
                o.user,
                o.created_ms / 1000.0,
                o.pay_before_ms / 1000.0
            ),
        );
    }
    let refunded_in_time = e.orders.iter().filter(|o| {
        o.refund_reason.as_deref() == Some("late_payment")
            && o.first_paid_ms.is_some_and(|paid| {
                paid < o.pay_before_ms && o.closed_ms.is_none_or(|closed| closed > paid)
            })
    });
    for o in refunded_in_time {
        v.violate(
            "an in-time payment refunded",
            o.first_paid_ms,
            format!(
                "order {} of user {}: paid at {:.3} s, before its deadline {:.3} s, yet closed at {:.3} s and refunded as late",
                o.id,
                o.user,
                o.first_paid_ms.unwrap_or_default() / 1000.0,
                o.pay_before_ms / 1000.0,
                o.closed_ms.unwrap_or_default() / 1000.0
            ),
        );
    }
}

/// A dead letter's reason without its particulars (`poison: ...` is `poison`).
fn reason_kind(reason: &str) -> String {
    reason
        .split([':', ' '])
        .next()
        .unwrap_or(reason)
        .to_string()
}

/// Every 202 and every `already_ordered` id is an order of that user and voucher in
/// Postgres, and no id was handed to two orders.
fn check_promises(e: &Evidence, v: &mut Verdict) {
    let orders: HashMap<i64, &PgOrder> = e.orders.iter().map(|o| (o.id, o)).collect();
    let dead: HashMap<i64, &DeadOrder> = e.dead.iter().map(|d| (d.id, d)).collect();
    let mut first: BTreeMap<i64, &Record> = BTreeMap::new();
    let mut owners: HashMap<i64, HashSet<(i64, i64)>> = HashMap::new();
    let mut twice_202: HashMap<i64, usize> = HashMap::new();
    for r in &e.history {
        let Some(id) = r.promised_order() else {
            continue;
        };
        first.entry(id).or_insert(r);
        owners.entry(id).or_default().insert((r.user, r.voucher));
        if r.is_202() {
            *twice_202.entry(id).or_default() += 1;
        }
    }
    v.admitted = twice_202.len();
    v.promised = first.len();
    for (id, r) in &first {
        match orders.get(id) {
            None => {
                v.lost += 1;
                let where_ = dead.get(id).map_or("nowhere in Postgres".to_string(), |d| {
                    format!("dead-lettered ({})", d.reason)
                });
                let what = if r.is_202() { "202" } else { "already_ordered" };
                v.violate(
                    "lost",
                    r.recv_ms,
                    format!(
                        "{what} order {id} (user {}, voucher {}, answered at {:.1} s by api {}) is {where_}",
                        r.user,
                        r.voucher,
                        r.recv_ms.unwrap_or(r.sent_ms) / 1000.0,
                        r.api
                    ),
                );
            }
            Some(o) if (o.user, o.voucher) != (r.user, r.voucher) => v.violate(
                "order of another",
                r.recv_ms,
                format!(
                    "order {id} was promised to user {} on voucher {}, Postgres has it for user {} on voucher {}",
                    r.user, r.voucher, o.user, o.voucher
                ),
            ),
            Some(_) => {}
        }
    }
    for (id, owners) in owners.iter().filter(|(_, o)| o.len() > 1) {
        v.duplicates += 1;
        v.violate(
            "order id twice",
            None,
            format!("order id {id} was answered to {owners:?}"),
        );
    }
    for (id, n) in twice_202.iter().filter(|(_, n)| **n > 1) {
        v.duplicates += 1;
        v.violate(
            "order id twice",
            None,
            format!("order id {id} came with {n} answers 202"),
        );
    }
}

/// No sale sells beyond its stock, and each store's stock is the initial stock less the
/// units out: every returned unit came back exactly once, in both stores.
fn check_sales(e: &Evidence, v: &mut Verdict) {
    for s in &e.sales {
        let of_sale = |o: &&PgOrder| o.voucher == s.voucher;
        let active = e
            .orders
            .iter()
            .filter(of_sale)
            .filter(|o| o.is_active())
            .count() as i64;
        let closed = e
            .orders
            .iter()
            .filter(of_sale)
            .filter(|o| !o.is_active())
            .count() as i64;
        if active > s.initial {
            v.oversold_units += active - s.initial;
            v.violate(
                "oversold",
                None,
                format!(
                    "voucher {}: {active} live orders for {} units",
                    s.voucher, s.initial
                ),
            );
        }
        if s.pg_stock != s.initial - active {
            v.violate(
                "stock arithmetic (postgres)",
                None,
                format!(
                    "voucher {}: stock {} but {} initial - {active} live orders = {}",
                    s.voucher,
                    s.pg_stock,
                    s.initial,
                    s.initial - active
                ),
            );
        }
        check_taken(e, v, s, closed);
        match (s.redis_stock, e.settled) {
            (Some(r), true) if r != s.pg_stock => v.violate(
                "stock arithmetic (redis)",
                None,
                format!(
                    "voucher {}: Redis stock {r} (all segments), Postgres stock {} with nothing in flight",
                    s.voucher, s.pg_stock
                ),
            ),
            (None, _) if s.open => v.violate(
                "stock arithmetic (redis)",
                None,
                format!("voucher {}: open, but no state in Redis", s.voucher),
            ),
            _ => {}
        }
    }
}

/// No more units go out than the sale has: neither 202s nor orders that reached the
/// workers (written, or buried keeping their unit: Postgres refused one for want of
/// stock) exceed the initial stock plus the units that came back (closed orders,
/// burials that returned theirs).
fn check_taken(e: &Evidence, v: &mut Verdict, s: &SaleBooks, closed: i64) {
    let dead: Vec<&DeadOrder> = e.dead.iter().filter(|d| d.voucher == s.voucher).collect();
    let returned = dead.iter().filter(|d| d.returns_unit).count() as i64;
    let allowed = s.initial + closed + returned;
    let answered: HashSet<i64> = e
        .history
        .iter()
        .filter(|r| r.is_202() && r.voucher == s.voucher)
        .filter_map(|r| r.order_id)
        .collect();
    if answered.len() as i64 > allowed {
        v.violate(
            "more 202s than stock",
            None,
            format!(
                "voucher {}: {} order ids answered 202 but {} initial + {closed} closed + {returned} returned by burials = {allowed}",
                s.voucher,
                answered.len(),
                s.initial
            ),
        );
    }
    let mut reached: HashSet<i64> = e
        .orders
        .iter()
        .filter(|o| o.voucher == s.voucher)
        .map(|o| o.id)
        .collect();
    // An order fenced off as admitted by a Redis no longer the sale's took no unit.
    reached.extend(
        dead.iter()
            .filter(|d| !d.reason.starts_with("stale_epoch"))
            .map(|d| d.id),
    );
    if reached.len() as i64 > allowed {
        v.oversold_units += reached.len() as i64 - allowed;
        v.violate(
            "admitted beyond stock",
            None,
            format!(
                "voucher {}: {} orders reached the workers (written, or buried keeping their unit) but {} initial + {closed} closed + {returned} returned by burials = {allowed}",
                s.voucher,
                reached.len(),
                s.initial
            ),
        );
    }
}

/// At most one live (pending, created or paid) order per user and voucher at any time:
/// an order admitted while an earlier one of the same user and voucher was still open.
/// The later one is any order Postgres holds, or any 202 (it was pending when
/// answered, wherever it went after); the earlier one an order Postgres holds.
fn check_two_live(e: &Evidence, v: &mut Verdict) {
    let mut by_pair: HashMap<(i64, i64), Vec<&PgOrder>> = HashMap::new();
    for o in &e.orders {
        by_pair.entry((o.user, o.voucher)).or_default().push(o);
    }
    // (user, voucher, id, admitted at) of every order that was live at some time: live
    // from its admission (its id's minting, by Redis's clock; the row is stamped later,
    // at its writing, by Postgres's).
    let written: HashSet<i64> = e.orders.iter().map(|o| o.id).collect();
    let admitted_ms = |id| minted_ms(id, e.start_unix_ms);
    let mut admitted: Vec<(i64, i64, i64, f64)> = e
        .orders
        .iter()
        .map(|o| (o.user, o.voucher, o.id, admitted_ms(o.id)))
        .collect();
    let mut answered: HashSet<i64> = HashSet::new();
    for r in e.history.iter().filter(|r| r.is_202()) {
        if let Some(id) = r
            .order_id
            .filter(|id| !written.contains(id) && answered.insert(*id))
        {
            admitted.push((r.user, r.voucher, id, admitted_ms(id)));
        }
    }
    for (user, voucher, id, at) in admitted {
        let earlier = by_pair.get(&(user, voucher)).and_then(|orders| {
            orders.iter().find(|a| {
                a.id != id && admitted_ms(a.id) < at && a.closed_ms.is_none_or(|c| c > at)
            })
        });
        if let Some(a) = earlier {
            v.two_live += 1;
            let fate = if written.contains(&id) {
                ""
            } else {
                " (answered 202, never written)"
            };
            v.violate(
                "two live orders",
                Some(at),
                format!(
                    "user {user}, voucher {voucher}: order {id}{fate} admitted at {:.1} s while order {} ({}, closed {}) was live",
                    at / 1000.0,
                    a.id,
                    a.status,
                    a.closed_ms.map_or("never".into(), |c| format!("at {:.1} s", c / 1000.0))
                ),
            );
        }
    }
}

/// No 202 for a grab sent after its sale's close was answered 200.
fn check_closes(e: &Evidence, v: &mut Verdict) {
    let mut closed_at: HashMap<i64, f64> = HashMap::new();
    for r in e.history.iter().filter(|r| r.kind == Kind::CloseSale) {
        if let (Some(200), Some(at)) = (r.status, r.recv_ms) {
            let t = closed_at.entry(r.voucher).or_insert(at);
            *t = t.min(at);
        }
    }
    for r in e.history.iter().filter(|r| r.is_202()) {
        if let Some(&at) = closed_at.get(&r.voucher).filter(|at| r.sent_ms > **at) {
            v.violate(
                "202 after close",
                Some(r.sent_ms),
                format!(
                    "voucher {} closed at {:.1} s; order {:?} of user {} admitted for a grab sent at {:.1} s",
                    r.voucher,
                    at / 1000.0,
                    r.order_id,
                    r.user,
                    r.sent_ms / 1000.0
                ),
            );
        }
    }
}

/// A lottery admits nothing before its window is over (its draw comes first, by Redis's
/// clock, which is the history's: one machine); one a press was decided at after its
/// window has drawn; its draw verifies, and its winners hold their orders and were told
/// of no other answer than their order.
fn check_lotteries(e: &Evidence, v: &mut Verdict) {
    for l in &e.lotteries {
        check_lottery_window(e, v, l);
        check_held_presses(e, v, l);
        match &l.winners {
            Some(winners) => check_draw(e, v, l, winners),
            None => check_undrawn(e, v, l),
        }
    }
}

/// No answer names an order, and no order was admitted, before the window's end.
fn check_lottery_window(e: &Evidence, v: &mut Verdict, l: &Lottery) {
    let end = l.window_ms.1;
    let told = e.history.iter().filter(|r| {
        r.voucher == l.voucher
            && r.promised_order().is_some()
            && r.recv_ms.is_some_and(|at| at < end)
    });
    for r in told {
        v.violate(
            "admitted in a lottery's window",
            r.recv_ms,
            format!(
                "voucher {}: user {} was told of order {:?} at {:.3} s, its window ends at {:.3} s",
                l.voucher,
                r.user,
                r.promised_order(),
                r.recv_ms.unwrap_or_default() / 1000.0,
                end / 1000.0
            ),
        );
    }
    // (Written with the draw or after it, by Postgres's clock: up to 1 ms below the
    // window's end, Redis's.)
    let admitted = e
        .orders
        .iter()
        .filter(|o| o.voucher == l.voucher && o.created_ms < end - 1.0);
    for o in admitted {
        v.violate(
            "admitted in a lottery's window",
            Some(o.created_ms),
            format!(
                "voucher {}: order {} of user {} written at {:.3} s, its window ends at {:.3} s",
                l.voucher,
                o.id,
                o.user,
                o.created_ms / 1000.0,
                end / 1000.0
            ),
        );
    }
}

/// How late after a lottery's window + 500 ms a held press's answer may reach the
/// client (its own scheduling on a loaded machine).
pub const HELD_SLACK_MS: f64 = 500.0;

/// Every press sent in a lottery's window is answered by the window's end + 500 ms (a
/// draw's result, or `unknown` naming its order), unless the instance holding it was
/// stopped (killed or paused) meanwhile: an instance's clock, whatever it says, does
/// not hold a press longer.
fn check_held_presses(e: &Evidence, v: &mut Verdict, l: &Lottery) {
    let (begin, end) = l.window_ms;
    let by = end + 500.0 + HELD_SLACK_MS;
    let held = e.history.iter().filter(|r| {
        r.kind == Kind::Grab
            && r.voucher == l.voucher
            && (begin..end).contains(&r.sent_ms)
            && r.recv_ms.is_none_or(|at| at > by)
            && r.failure.as_deref() != Some("refused")
    });
    for r in held {
        let answered = r.recv_ms.unwrap_or(f64::INFINITY);
        let stopped = e
            .api_stopped
            .iter()
            .any(|&(api, from, to)| api == r.api && from < answered && to > r.sent_ms);
        if !stopped {
            v.violate(
                "a held press answered late",
                r.recv_ms.or(Some(by)),
                format!(
                    "voucher {}: user {} pressed at {:.3} s through api {}, answered {} ({}); its window ended at {:.3} s",
                    l.voucher,
                    r.user,
                    r.sent_ms / 1000.0,
                    r.api,
                    r.recv_ms.map_or("never".into(), |at| format!("at {:.3} s", at / 1000.0)),
                    r.answer_label(),
                    end / 1000.0
                ),
            );
        }
    }
}

/// The recorded draw verifies; each winner holds an order in Postgres (written with the
/// draw) and no press of theirs in the window was answered `sold_out`.
fn check_draw(e: &Evidence, v: &mut Verdict, l: &Lottery, winners: &[i64]) {
    v.draws.push(Drawn {
        voucher: l.voucher,
        window_ms: l.window_ms,
        winners: winners.len(),
        entrants: l.entrants,
    });
    if let Some(why) = &l.unverified {
        v.violate(
            "a draw that does not verify",
            None,
            format!("voucher {}: {why}", l.voucher),
        );
    }
    let (begin, end) = l.window_ms;
    for w in winners {
        if !e
            .orders
            .iter()
            .any(|o| o.voucher == l.voucher && o.user == *w)
        {
            v.violate(
                "a winner without its order",
                None,
                format!(
                    "voucher {}: user {w} won the draw, Postgres holds no order of theirs",
                    l.voucher
                ),
            );
        }
        let refused = e.history.iter().filter(|r| {
            r.kind == Kind::Grab
                && (r.voucher, r.user) == (l.voucher, *w)
                && (begin..end).contains(&r.sent_ms)
                && r.code.as_deref() == Some("sold_out")
        });
        for r in refused {
            v.violate(
                "a winner told sold out",
                r.recv_ms,
                format!(
                    "voucher {}: user {w} won the draw, its press sent at {:.3} s in the window was answered sold_out",
                    l.voucher,
                    r.sent_ms / 1000.0
                ),
            );
        }
    }
}

/// A press decided after the window (a 202, `sold_out`, `already_ordered`) came after
/// the draw: a lottery without a recorded draw has none.
fn check_undrawn(e: &Evidence, v: &mut Verdict, l: &Lottery) {
    let decided = e.history.iter().find(|r| {
        r.kind == Kind::Grab
            && r.voucher == l.voucher
            && r.sent_ms >= l.window_ms.1
            && (r.status == Some(202)
                || matches!(r.code.as_deref(), Some("sold_out" | "already_ordered")))
    });
    if let Some(r) = decided {
        v.violate(
            "a lottery never drawn",
            r.recv_ms,
            format!(
                "voucher {}: no draw recorded, yet user {}'s press sent at {:.3} s after the window was answered {}",
                l.voucher,
                r.user,
                r.sent_ms / 1000.0,
                r.answer_label()
            ),
        );
    }
}

/// No answer `500 internal`: the contract keeps it for bugs, never for a dependency
/// that is down (that is a 503).
fn check_internal(e: &Evidence, v: &mut Verdict) {
    for r in e.history.iter().filter(|r| r.status == Some(500)) {
        v.violate(
            "500 internal",
            Some(r.sent_ms),
            format!(
                "{} of user {} (voucher {}, order {:?}) sent at {:.1} s to api {}",
                r.kind.name(),
                r.user,
                r.voucher,
                r.order,
                r.sent_ms / 1000.0,
                r.api
            ),
        );
    }
}

/// After the last heal: the stores settle, `reconcile` (no `--repair`) finds no drift,
/// and every open sale admits again within the bound.
fn check_ending(e: &Evidence, v: &mut Verdict) {
    if !e.settled {
        v.violate(
            "not settled",
            None,
            "stream entries still pending or releases still owed when the wait ended".into(),
        );
    }
    if e.reconcile_exit != Some(0) {
        v.violate(
            "reconcile",
            None,
            format!("seckill reconcile exited {:?}", e.reconcile_exit),
        );
    }
    for (voucher, secs) in &e.admit_again {
        if secs.is_none_or(|s| s > e.admit_bound_secs) {
            v.violate(
                "admitting again",
                None,
                format!(
                    "voucher {voucher}: first definite answer {} after the last heal (bound {} s)",
                    secs.map_or("never".into(), |s| format!("{s:.1} s")),
                    e.admit_bound_secs
                ),
            );
        }
    }
}

mod tests;
