//! What the shoppers were answered: each press classified, the counts, and the progress
//! drawn while they press.

use super::*;

/// What one shopper's press was answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Reply {
    Admitted(String),
    SoldOut,
    AlreadyOrdered,
    RateLimited,
    /// Anything else (not_started, ended, 5xx, no answer): what happened, in short.
    Error(String),
}

/// Reads one answer of `POST /vouchers/{id}/seckill`.
pub(crate) fn classify(status: StatusCode, body: &Value) -> Reply {
    let code = body["error"]["code"].as_str();
    match (status, code) {
        (StatusCode::ACCEPTED, _) => match body["order_id"].as_str() {
            Some(id) => Reply::Admitted(id.to_string()),
            None => Reply::Error("202 without an order_id".into()),
        },
        (StatusCode::CONFLICT, Some("sold_out")) => Reply::SoldOut,
        (StatusCode::CONFLICT, Some("already_ordered")) => Reply::AlreadyOrdered,
        (StatusCode::TOO_MANY_REQUESTS, _) => Reply::RateLimited,
        (status, Some(code)) => Reply::Error(format!("{} {code}", status.as_u16())),
        (status, None) => Reply::Error(status.as_u16().to_string()),
    }
}

/// The outcomes so far.
#[derive(Debug, Default)]
pub(crate) struct Replies {
    pub admitted: Vec<String>,
    pub sold_out: u64,
    pub already_ordered: u64,
    pub rate_limited: u64,
    /// Errors by kind.
    pub errors: BTreeMap<String, u64>,
}

impl Replies {
    pub(crate) fn add(&mut self, outcome: Reply) {
        match outcome {
            Reply::Admitted(id) => self.admitted.push(id),
            Reply::SoldOut => self.sold_out += 1,
            Reply::AlreadyOrdered => self.already_ordered += 1,
            Reply::RateLimited => self.rate_limited += 1,
            Reply::Error(kind) => *self.errors.entry(kind).or_default() += 1,
        }
    }

    pub(crate) fn error_count(&self) -> u64 {
        self.errors.values().sum()
    }

    pub(crate) fn total(&self) -> u64 {
        self.admitted.len() as u64
            + self.sold_out
            + self.already_ordered
            + self.rate_limited
            + self.error_count()
    }

    /// The outcome table: one `name count` row per outcome, then the total.
    pub(crate) fn table(&self) -> String {
        let rows = [
            ("admitted", self.admitted.len() as u64),
            ("sold_out", self.sold_out),
            ("already_ordered", self.already_ordered),
            ("rate_limited", self.rate_limited),
            ("errors", self.error_count()),
            ("total", self.total()),
        ];
        let mut out = format!("{:<16} {:>9}\n", "outcome", "shoppers");
        for (name, n) in rows {
            out += &format!("{name:<16} {n:>9}\n");
        }
        let mut kinds: Vec<_> = self.errors.iter().collect();
        kinds.sort_by(|a, b| b.1.cmp(a.1));
        for (kind, n) in kinds.iter().take(ERROR_KINDS_SHOWN) {
            out += &format!("  error {kind}: {n}\n");
        }
        out
    }
}

/// Draws progress on standard error: a bar redrawn in place on a terminal, a plain line
/// a second otherwise (a log file or CI would fill with carriage returns).
pub(super) struct Progress {
    terminal: bool,
    total: u64,
    started: Instant,
    last: Option<Instant>,
}

impl Progress {
    pub(super) fn new(total: u64) -> Self {
        Self {
            terminal: std::io::stderr().is_terminal(),
            total,
            started: Instant::now(),
            last: None,
        }
    }

    pub(super) fn update(&mut self, tally: &Replies, done: bool) {
        let every = if self.terminal {
            Duration::from_millis(100)
        } else {
            Duration::from_secs(1)
        };
        if !done && self.last.is_some_and(|t| t.elapsed() < every) {
            return;
        }
        self.last = Some(Instant::now());
        let answered = tally.total();
        // Short enough for an 80-column terminal: a wrapped line cannot be redrawn.
        let mut counts = format!(
            "{answered}/{} answered, {} admitted, {} sold out",
            self.total,
            tally.admitted.len(),
            tally.sold_out
        );
        for (n, what) in [
            (tally.already_ordered, "already ordered"),
            (tally.rate_limited, "rate limited"),
            (tally.error_count(), "errors"),
        ] {
            if n > 0 {
                counts += &format!(", {n} {what}");
            }
        }
        counts += &format!(", {:.1} s", self.started.elapsed().as_secs_f64());
        let mut err = std::io::stderr().lock();
        let _ = if self.terminal {
            const WIDTH: u64 = 20;
            let filled = (answered * WIDTH / self.total.max(1)) as usize;
            let bar = format!(
                "{}{}",
                "#".repeat(filled),
                "-".repeat(WIDTH as usize - filled)
            );
            // \r and erase-line: redraw in place; the last draw ends the line.
            write!(
                err,
                "\r\x1b[2K[{bar}] {counts}{}",
                if done { "\n" } else { "" }
            )
        } else {
            writeln!(err, "demo: {counts}")
        };
        let _ = err.flush();
    }
}
