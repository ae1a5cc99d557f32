//! The campaign's history: every request the workload sent and what came back, with
//! its times. The checker reads nothing else of the run's requests, so everything it
//! judges by is here (and is written out, one JSON object a line, for reading later).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// What a request asked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    Grab,
    Pay,
    Cancel,
    CreateSale,
    CloseSale,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Grab => "grab",
            Kind::Pay => "pay",
            Kind::Cancel => "cancel",
            Kind::CreateSale => "create sale",
            Kind::CloseSale => "close sale",
        }
    }
}

/// Which part of the run sent it: the campaign itself, or the presses after the last
/// heal that time how soon each sale admits again.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Campaign,
    Probe,
}

/// One request and its answer. Times are milliseconds since the campaign's start.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Record {
    pub kind: Kind,
    pub phase: Phase,
    /// The API instance it went to.
    pub api: u8,
    pub user: i64,
    pub voucher: i64,
    /// The order a pay or cancel named.
    pub order: Option<i64>,
    pub sent_ms: f64,
    /// `None`: no answer (timeout, connection lost or refused).
    pub recv_ms: Option<f64>,
    pub status: Option<u16>,
    /// `error.code` of an error answer.
    pub code: Option<String>,
    /// The order id the answer carried: a 202's, `already_ordered`'s, or an unknown's.
    pub order_id: Option<i64>,
    /// `error.outcome` (`"unknown"` for a grab whose fate Redis alone knows).
    pub outcome: Option<String>,
    /// Why no answer came: `refused` (never reached the server), `timeout`, `other`.
    pub failure: Option<String>,
}

impl Record {
    pub fn is_202(&self) -> bool {
        self.kind == Kind::Grab && self.status == Some(202)
    }

    /// An answer that says which order the user holds: a 202, or `already_ordered`.
    pub fn promised_order(&self) -> Option<i64> {
        match (self.kind, self.status, self.code.as_deref()) {
            (Kind::Grab, Some(202), _) | (Kind::Grab, Some(409), Some("already_ordered")) => {
                self.order_id
            }
            _ => None,
        }
    }

    /// A grab whose outcome only the stores can tell: `503` with `"outcome":
    /// "unknown"`, or no answer at all although the request may have reached a server.
    pub fn is_unknown_grab(&self) -> bool {
        self.kind == Kind::Grab
            && (self.outcome.as_deref() == Some("unknown")
                || (self.status.is_none() && self.failure.as_deref() != Some("refused")))
    }

    /// A definite answer to a grab: 202 or any 409.
    pub fn is_definite_grab(&self) -> bool {
        self.kind == Kind::Grab && matches!(self.status, Some(202) | Some(409))
    }

    /// How the answer is counted in the figures: `202`, `409 sold_out`, `no answer
    /// (timeout)`, ...
    pub fn answer_label(&self) -> String {
        match (self.status, &self.code, &self.failure) {
            (None, _, failure) => format!("no answer ({})", failure.as_deref().unwrap_or("?")),
            (Some(s), Some(code), _) if self.outcome.is_some() => {
                format!("{s} {code} ({})", self.outcome.as_deref().unwrap_or(""))
            }
            (Some(s), Some(code), _) => format!("{s} {code}"),
            (Some(s), None, _) => s.to_string(),
        }
    }
}

/// Reads the fields the checker needs from an answer's JSON body.
pub fn answer_fields(body: &Value) -> (Option<String>, Option<i64>, Option<String>) {
    let id = |v: &Value| match v {
        Value::String(s) => s.parse().ok(),
        Value::Number(n) => n.as_i64(),
        _ => None,
    };
    let error = &body["error"];
    let code = error["code"].as_str().map(str::to_string);
    let order_id = id(&body["order_id"]).or_else(|| id(&error["order_id"]));
    let outcome = error["outcome"].as_str().map(str::to_string);
    (code, order_id, outcome)
}

/// The history as it is written: shared by every task of the workload.
pub struct Recorder {
    start: Instant,
    /// The campaign's start on the wall clock (Unix ms), to place Postgres's and the
    /// order ids' times on the history's axis.
    pub start_unix_ms: f64,
    records: Mutex<Vec<Record>>,
}

impl Recorder {
    pub fn new() -> Self {
        let unix = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap();
        Self {
            start: Instant::now(),
            start_unix_ms: unix.as_secs_f64() * 1000.0,
            records: Mutex::new(Vec::new()),
        }
    }

    /// Milliseconds since the start.
    pub fn now_ms(&self) -> f64 {
        self.start.elapsed().as_secs_f64() * 1000.0
    }

    pub fn since_start(&self) -> Duration {
        self.start.elapsed()
    }

    pub fn push(&self, record: Record) {
        self.records.lock().unwrap().push(record);
    }

    pub fn snapshot(&self) -> Vec<Record> {
        let mut all = self.records.lock().unwrap().clone();
        all.sort_by(|a, b| a.sent_ms.total_cmp(&b.sent_ms));
        all
    }
}

/// One JSON object a line.
pub fn to_json_lines(records: &[Record]) -> String {
    records
        .iter()
        .map(|r| serde_json::to_string(r).unwrap() + "\n")
        .collect()
}
