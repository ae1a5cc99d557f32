//! The workload: an administrator opening and closing sales on a seeded plan, and
//! shoppers spread over both API instances who grab, press again, pay, cancel and let
//! orders expire. Modest on purpose (tens of requests a second on a two-core machine):
//! the faults, not the CPU, should decide what happens. Every request goes into the
//! history with its answer.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::Utc;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use super::history::{answer_fields, Kind, Phase, Record, Recorder};
use super::schedule::Rng;
use seckill::auth::JwtKeys;

/// How long a request may take before it counts as unanswered.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// A sale the administrator opened.
#[derive(Clone, Debug)]
pub struct Sale {
    pub id: i64,
    pub closed: bool,
}

/// A lottery sale opens this long after it is created (a lottery cannot be set on a
/// sale already begun) ...
pub const LOTTERY_LEAD: Duration = Duration::from_secs(3);
/// ... with a window this long: its held presses are answered within the window and
/// 500 ms, well inside [`REQUEST_TIMEOUT`].
pub const LOTTERY_WINDOW: Duration = Duration::from_secs(3);

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SaleAction {
    Create {
        stock: u64,
        segments: u64,
        pay_within: u64,
        /// Opening as a lottery ([`LOTTERY_LEAD`], [`LOTTERY_WINDOW`]), not first come.
        lottery: bool,
    },
    /// Close the n-th sale created.
    Close { nth: usize },
}

/// The administrator's plan: five sales at the start (one in three segments, two with
/// short payment windows, so expiries return units, and a lottery of a few units whose
/// window opens as the faults begin), a new sale every 45 s (a quarter of them
/// lotteries), and a close at 40 % of the run and every 150 s after, of the oldest sale
/// open for 30 s at least (never the first segmented sale: its segments' moves should
/// see faults too).
pub fn plan_sales(seed: u64, duration_ms: u64) -> Vec<(u64, SaleAction)> {
    let mut rng = Rng::new(seed ^ 0x5A1E_5A1E);
    // (Its own sequence: adding lotteries left every other sale of a seed as it was.)
    let mut lotteries = Rng::new(seed ^ 0x1077_E111);
    // Stocks of 30-150 sell out within a minute (returns then matter); a sale in segments
    // gets 150-300, so its segments have units to move.
    let create = |rng: &mut Rng, segments: u64, short_pay: bool| SaleAction::Create {
        stock: if segments > 1 {
            rng.range(150, 300)
        } else {
            rng.range(30, 150)
        },
        segments,
        pay_within: if short_pay { rng.range(5, 10) } else { 900 },
        lottery: false,
    };
    let mut plan = vec![
        (0, create(&mut rng, 1, true)),
        (0, create(&mut rng, 3, false)),
        (0, create(&mut rng, 1, false)),
        (0, create(&mut rng, 1, true)),
        // Fewer units than the shoppers who may press in its window (8 tasks, one press
        // in flight each, so at most 8 entrants): most often a draw with losers.
        (
            0,
            SaleAction::Create {
                stock: lotteries.range(2, 5),
                segments: 1,
                pay_within: 900,
                lottery: true,
            },
        ),
    ];
    for at in (45_000..duration_ms).step_by(45_000) {
        let segments = if rng.chance(0.25) { 3 } else { 1 };
        let short = rng.chance(0.5);
        let mut sale = create(&mut rng, segments, short);
        if let SaleAction::Create { lottery, .. } = &mut sale {
            *lottery = lotteries.chance(0.25);
        }
        plan.push((at, sale));
    }
    let created: Vec<u64> = plan.iter().map(|(at, _)| *at).collect();
    let mut closed = vec![false; created.len()];
    closed[1] = true;
    for at in (duration_ms * 2 / 5..duration_ms).step_by(150_000) {
        let oldest = (0..created.len()).find(|&n| !closed[n] && created[n] + 30_000 <= at);
        if let Some(nth) = oldest {
            closed[nth] = true;
            plan.push((at, SaleAction::Close { nth }));
        }
    }
    plan.sort_by_key(|(at, _)| *at);
    plan
}

pub struct Workload {
    http: reqwest::Client,
    pub bases: Vec<String>,
    jwt: JwtKeys,
    pub recorder: Arc<Recorder>,
    pub sales: Mutex<Vec<Sale>>,
    /// How long the sales run (they end an hour after the campaign).
    sale_hours: i64,
}

/// What a shopper believes they hold in one sale.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Hold {
    Order {
        id: i64,
        paid: bool,
    },
    /// A grab whose outcome was unknown: the next press there tells.
    Unknown,
}

impl Workload {
    pub fn new(bases: Vec<String>, recorder: Arc<Recorder>, duration: Duration) -> Self {
        Self {
            http: reqwest::Client::builder()
                .pool_max_idle_per_host(16)
                .build()
                .unwrap(),
            bases,
            jwt: JwtKeys::new(super::services::SECRET).unwrap(),
            recorder,
            sales: Mutex::new(Vec::new()),
            sale_hours: 1 + duration.as_secs() as i64 / 3600,
        }
    }

    fn token(&self, user: i64, admin: bool) -> String {
        self.jwt.mint(user, admin, 4 * 3600).unwrap()
    }

    /// Sends one request to API instance `api` and records it with its answer.
    #[allow(clippy::too_many_arguments)]
    async fn send(
        &self,
        kind: Kind,
        phase: Phase,
        api: u8,
        user: i64,
        voucher: i64,
        order: Option<i64>,
        path: &str,
        body: Option<Value>,
    ) -> Record {
        let admin = matches!(kind, Kind::CreateSale | Kind::CloseSale);
        let mut req = self
            .http
            .post(format!("{}{path}", self.bases[api as usize]))
            .timeout(REQUEST_TIMEOUT);
        req = match (kind, body) {
            // The payment provider's notification: signed, no bearer token.
            (Kind::Pay, Some(body)) => {
                let raw = serde_json::to_vec(&body).unwrap();
                let now = chrono::Utc::now().timestamp();
                let secret = crate::common::PAYMENT_SECRET.into();
                req.header(
                    "seckill-signature",
                    seckill::lifecycle::signature::sign(&secret, now, &raw),
                )
                .header("content-type", "application/json")
                .body(raw)
            }
            (_, Some(body)) => req.bearer_auth(self.token(user, admin)).json(&body),
            (_, None) => req.bearer_auth(self.token(user, admin)),
        };
        let sent_ms = self.recorder.now_ms();
        let mut record = Record {
            kind,
            phase,
            api,
            user,
            voucher,
            order,
            sent_ms,
            recv_ms: None,
            status: None,
            code: None,
            order_id: None,
            outcome: None,
            failure: None,
        };
        let answer = async {
            let resp = req.send().await?;
            let status = resp.status().as_u16();
            let body: Value = resp.json().await.unwrap_or(Value::Null);
            Ok::<_, reqwest::Error>((status, body))
        };
        match answer.await {
            Ok((status, body)) => {
                let (code, order_id, outcome) = answer_fields(&body);
                record.recv_ms = Some(self.recorder.now_ms());
                record.status = Some(status);
                // A notification's 200 says what it did (`paid`, `late_payment`, ...).
                record.code = code.or_else(|| {
                    (kind == Kind::Pay)
                        .then(|| body["outcome"].as_str().map(str::to_string))
                        .flatten()
                });
                record.outcome = outcome;
                record.order_id = order_id.filter(|_| kind == Kind::Grab);
                if kind == Kind::CreateSale && status == 201 {
                    record.voucher = body["id"].as_i64().unwrap_or(0);
                }
            }
            Err(e) => {
                record.failure = Some(
                    if e.is_connect() {
                        "refused"
                    } else if e.is_timeout() {
                        "timeout"
                    } else {
                        "other"
                    }
                    .to_string(),
                );
            }
        }
        self.recorder.push(record.clone());
        record
    }

    /// Presses "grab" for `user` on `voucher`.
    pub async fn grab(&self, phase: Phase, api: u8, user: i64, voucher: i64) -> Record {
        let path = format!("/vouchers/{voucher}/seckill");
        self.send(Kind::Grab, phase, api, user, voucher, None, &path, None)
            .await
    }

    /// Opens a sale; its id once an API instance answered 201 (tried for up to 60 s). A
    /// lottery opens [`LOTTERY_LEAD`] after the attempt that created it.
    pub async fn create_sale(
        &self,
        stock: u64,
        segments: u64,
        pay_within: u64,
        lottery: bool,
    ) -> Option<i64> {
        let end = Utc::now() + chrono::Duration::hours(self.sale_hours);
        for attempt in 0..120u32 {
            let now = Utc::now();
            let (begin, opening) = match lottery {
                true => (
                    now + LOTTERY_LEAD,
                    json!({"mode": "lottery", "window_ms": LOTTERY_WINDOW.as_millis() as u64}),
                ),
                false => (
                    now - chrono::Duration::minutes(1),
                    json!({"mode": "first_come"}),
                ),
            };
            let body = json!({
                "shop_id": 1, "title": "nemesis", "pay_value": 100, "actual_value": 200,
                "seckill": {
                    "stock": stock, "segments": segments, "pay_within_secs": pay_within,
                    "begin_time": begin, "end_time": end, "opening": opening,
                },
            });
            let api = (attempt % 2) as u8;
            let r = self
                .send(
                    Kind::CreateSale,
                    Phase::Campaign,
                    api,
                    1,
                    0,
                    None,
                    "/vouchers",
                    Some(body),
                )
                .await;
            if r.status == Some(201) {
                self.sales.lock().unwrap().push(Sale {
                    id: r.voucher,
                    closed: false,
                });
                return Some(r.voucher);
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        // A place in the plan's numbering all the same (its close is skipped).
        self.sales.lock().unwrap().push(Sale {
            id: 0,
            closed: true,
        });
        None
    }

    /// Closes a sale; tried until an API instance answers 200 (a 503 may or may not
    /// have closed it: closing again finishes it), for up to 60 s.
    pub async fn close_sale(&self, voucher: i64) {
        if let Some(s) = self
            .sales
            .lock()
            .unwrap()
            .iter_mut()
            .find(|s| s.id == voucher)
        {
            s.closed = true;
        }
        let path = format!("/vouchers/{voucher}/close");
        for attempt in 0..120u32 {
            let api = (attempt % 2) as u8;
            let r = self
                .send(
                    Kind::CloseSale,
                    Phase::Campaign,
                    api,
                    1,
                    voucher,
                    None,
                    &path,
                    None,
                )
                .await;
            if r.status == Some(200) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Runs the administrator's plan until `stop`.
    pub async fn administer(&self, plan: Vec<(u64, SaleAction)>, stop: CancellationToken) {
        for (at, action) in plan {
            let wait = Duration::from_millis(at).saturating_sub(self.recorder.since_start());
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = stop.cancelled() => return,
            }
            match action {
                SaleAction::Create {
                    stock,
                    segments,
                    pay_within,
                    lottery,
                } => {
                    self.create_sale(stock, segments, pay_within, lottery).await;
                }
                SaleAction::Close { nth } => {
                    let id = self
                        .sales
                        .lock()
                        .unwrap()
                        .get(nth)
                        .map(|s| s.id)
                        .filter(|id| *id > 0);
                    if let Some(id) = id {
                        self.close_sale(id).await;
                    }
                }
            }
        }
    }

    fn open_sales(&self) -> Vec<i64> {
        self.sales
            .lock()
            .unwrap()
            .iter()
            .filter(|s| !s.closed)
            .map(|s| s.id)
            .collect()
    }

    /// One shopper task: its own users (one request at a time per user, so that an
    /// unknown grab's order can only be minted while that grab was in flight), each
    /// turn one of them acting on what they believe they hold.
    pub async fn shop(&self, seed: u64, users: Vec<i64>, stop: CancellationToken) {
        let mut rng = Rng::new(seed);
        let mut holds: HashMap<(i64, i64), Hold> = HashMap::new();
        while !stop.is_cancelled() {
            let user = rng.pick(&users);
            self.act(&mut rng, &mut holds, user).await;
            let think = Duration::from_millis(rng.range(50, 250));
            tokio::select! {
                _ = tokio::time::sleep(think) => {}
                _ = stop.cancelled() => return,
            }
        }
    }

    async fn act(&self, rng: &mut Rng, holds: &mut HashMap<(i64, i64), Hold>, user: i64) {
        let api = rng.range(0, 1) as u8;
        let mine: Vec<(i64, Hold)> = holds
            .iter()
            .filter(|((u, _), _)| *u == user)
            .map(|((_, v), h)| (*v, *h))
            .collect();
        if let Some((voucher, _)) = mine.iter().find(|(_, h)| *h == Hold::Unknown) {
            let r = self.grab(Phase::Campaign, api, user, *voucher).await;
            return learn_grab(holds, &r);
        }
        let live: Vec<(i64, i64)> = mine
            .iter()
            .filter_map(|(v, h)| match h {
                Hold::Order { id, paid: false } => Some((*v, *id)),
                _ => None,
            })
            .collect();
        if !live.is_empty() && rng.chance(0.6) {
            let (voucher, id) = rng.pick(&live);
            let dice = rng.range(0, 99);
            let r = if dice < 45 {
                // The provider confirms the shopper's payment (the sale's price, 100).
                let body = crate::common::notification("payment.succeeded", &id.to_string(), 100);
                let path = "/payments/notifications".to_string();
                self.send(
                    Kind::Pay,
                    Phase::Campaign,
                    api,
                    user,
                    voucher,
                    Some(id),
                    &path,
                    Some(body),
                )
                .await
            } else if dice < 70 {
                let path = format!("/orders/{id}/cancel");
                self.send(
                    Kind::Cancel,
                    Phase::Campaign,
                    api,
                    user,
                    voucher,
                    Some(id),
                    &path,
                    None,
                )
                .await
            } else {
                self.grab(Phase::Campaign, api, user, voucher).await
            };
            return learn(holds, &r);
        }
        let open = self.open_sales();
        if !open.is_empty() {
            let r = self.grab(Phase::Campaign, api, user, rng.pick(&open)).await;
            learn_grab(holds, &r);
        }
    }

    /// After the last heal: presses each sale with fresh shoppers until it answers a
    /// definite answer (202 or 409); the seconds since `began` (the heal's start) that
    /// took, per sale (`None`: not within `limit`).
    pub async fn admit_again(
        &self,
        sales: &[i64],
        began: f64,
        limit: Duration,
    ) -> Vec<(i64, Option<f64>)> {
        let probes = sales.iter().enumerate().map(|(i, &voucher)| async move {
            let mut press = 0i64;
            while self.recorder.now_ms() - began < limit.as_millis() as f64 {
                let user = 900_000 + i as i64 * 10_000 + press;
                let r = self
                    .grab(Phase::Probe, (press % 2) as u8, user, voucher)
                    .await;
                if r.is_definite_grab() {
                    return (voucher, Some((r.recv_ms.unwrap() - began) / 1000.0));
                }
                press += 1;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            (voucher, None)
        });
        futures::future::join_all(probes).await
    }
}

/// What a shopper learns from an answer to a pay or cancel (or a grab).
fn learn(holds: &mut HashMap<(i64, i64), Hold>, r: &Record) {
    let key = (r.user, r.voucher);
    match (r.kind, r.status, r.code.as_deref()) {
        (Kind::Grab, ..) => learn_grab(holds, r),
        (Kind::Pay, Some(200), Some("paid" | "already_paid"))
        | (Kind::Cancel, Some(409), Some("order_paid")) => {
            if let Some(Hold::Order { paid, .. }) = holds.get_mut(&key) {
                *paid = true;
            }
        }
        // Paid after it closed: the money goes back, the order holds nothing.
        (Kind::Pay, Some(200), Some("late_payment"))
        | (Kind::Cancel, Some(200), _)
        | (_, Some(409), Some("order_closed"))
        | (_, Some(404), _) => {
            holds.remove(&key);
        }
        _ => {}
    }
}

fn learn_grab(holds: &mut HashMap<(i64, i64), Hold>, r: &Record) {
    let key = (r.user, r.voucher);
    let held = holds.get(&key).copied();
    match (r.status, r.code.as_deref(), r.promised_order()) {
        (_, _, Some(id)) => {
            let paid = matches!(held, Some(Hold::Order { id: h, paid: true }) if h == id);
            holds.insert(key, Hold::Order { id, paid });
        }
        // A refusal ends the shopper's doubt (the checker tells from the stores).
        (Some(409), ..) if held == Some(Hold::Unknown) => {
            holds.remove(&key);
        }
        _ if r.is_unknown_grab() && held.is_none() => {
            holds.insert(key, Hold::Unknown);
        }
        _ => {}
    }
}
