//! Request heads judged on their way in, before hyper parses them: a head over our
//! limits ([`MAX_URL_BYTES`], [`MAX_HEADERS`], [`MAX_HEADER_BYTES`], counted as the
//! `limit_headers` middleware counts them) or one that does not start like HTTP/1.1 is
//! refused here, so that our JSON answers it, not hyper's bare 400, 414 or 431.
//!
//! To find the next request's head on a keep-alive connection the scanner follows each
//! request's body as hyper frames it (`Transfer-Encoding: chunked`, `Content-Length`).
//! After an upgrade or a `CONNECT` it stops judging the connection: the middleware still
//! refuses what exceeds our limits, and hyper alone what exceeds its own.
//!
//! The syntax checked is httparse's, as hyper configures it, and no stricter: a request
//! line of a method token, one space, a target of visible bytes in UTF-8, one space,
//! `HTTP/1.0` or `HTTP/1.1`; header lines of a token, a colon and a value without
//! control bytes; lines ending in CRLF or LF; and the framing hyper refuses (a
//! `Content-Length` not all digits, two that differ, a `Transfer-Encoding` whose last
//! coding is not chunked or in HTTP/1.0). hyper alone refuses a target its URI parser
//! does not take (`<`, `>`, a bad authority): our check would have to copy that
//! parser's tables and could refuse what a newer one takes. That is its bare 400.

use axum::http::StatusCode;

use crate::http::error::AppError;
use crate::http::{MAX_HEADERS, MAX_HEADER_BYTES, MAX_URL_BYTES};

/// Why a request is refused before hyper reads its head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The bytes are not an HTTP/1.x request head.
    NotHttp,
    /// The target is over [`MAX_URL_BYTES`].
    UrlTooLong,
    /// Over [`MAX_HEADERS`] headers, or over [`MAX_HEADER_BYTES`] with the target.
    HeadTooLarge,
}

impl Refusal {
    pub(crate) fn error(self) -> AppError {
        match self {
            Refusal::NotHttp => AppError::Validation {
                status: StatusCode::BAD_REQUEST,
                message: "malformed request: not valid HTTP/1.1".to_string(),
            },
            Refusal::UrlTooLong => crate::http::url_too_long(),
            Refusal::HeadTooLarge => crate::http::head_too_large(),
        }
    }
}

/// Where a connection's incoming bytes stand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Before a request line, where empty lines are skipped (as httparse does).
    Idle,
    Method,
    /// The target; `true` once it has a byte.
    Target(bool),
    /// How many bytes of `HTTP/1.x` came.
    Version(usize),
    /// After a CR, where only an LF may come.
    Lf(Line),
    /// At the start of a header line, or of the empty line that ends the head.
    LineStart,
    Name,
    Value,
    /// Bytes of a body still to come.
    Body(u64),
    /// A chunk's size line: the size so far, and whether its extensions began.
    ChunkSize(u64, bool),
    ChunkData(u64),
    /// The line end after a chunk's data.
    ChunkEnd,
    /// The trailer lines after the last chunk; `true` at the start of one. As in hyper's
    /// decoder, only CRLF ends a line: a bare LF is a byte of a trailer line.
    Trailers(bool),
    /// After a CR in the trailers, where only an LF may come; `true`: the CR began a
    /// line (so the LF ends the body).
    TrailerLf(bool),
    /// Not followed any further.
    Blind,
}

/// The line a CR ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Line {
    Empty,
    Request,
    Header,
    HeadEnd,
}

/// The header names that decide where a body ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    ContentLength,
    TransferEncoding,
    Upgrade,
}

/// The start of a token (enough to tell `CONNECT`, or a [`Framing`] header's name),
/// lower-cased or not, and its whole length: no allocation per request.
#[derive(Debug, Default, Clone, Copy)]
struct Prefix {
    bytes: [u8; 17],
    len: usize,
}

impl Prefix {
    fn push(&mut self, b: u8) {
        if let Some(slot) = self.bytes.get_mut(self.len) {
            *slot = b;
        }
        self.len += 1;
    }

    fn is(&self, word: &[u8]) -> bool {
        self.bytes.get(..self.len) == Some(word)
    }
}
/// A framing header's value longer than this is not followed.
const LONGEST_VALUE: usize = 256;

/// What is known of the head being read.
#[derive(Debug, Default)]
struct Head {
    method: Prefix,
    http11: bool,
    target: usize,
    headers: usize,
    /// As the middleware counts: the target, and each header's name and value plus 4.
    bytes: usize,
    /// The current header's name (its start), lower-cased.
    name: Prefix,
    framing: Option<Framing>,
    /// A framing header's value so far.
    value: Vec<u8>,
    /// Whether the current value has a byte that is not whitespace.
    begun: bool,
    /// Whitespace inside a value, counted once more of the value follows.
    spaces: usize,
    length: Option<u64>,
    /// Whether a `Transfer-Encoding` came, and whether its last coding is chunked.
    chunked: Option<bool>,
    /// Continuation bytes the target's last UTF-8 character still needs, and the range
    /// of the next one.
    utf8_left: u8,
    utf8_next: (u8, u8),
    /// Framing hyper refuses (a bad `Content-Length`, a body not chunked last).
    malformed: bool,
    /// Whether the body cannot be followed.
    blind: bool,
}

/// Follows the requests on one connection (see the module comment).
#[derive(Debug)]
pub(super) struct Heads {
    state: State,
    head: Head,
}

impl Heads {
    pub(super) fn new() -> Self {
        Self {
            state: State::Idle,
            head: Head::default(),
        }
    }

    /// Reads `bytes`, the next ones from the client; a head to refuse is `Err`, with the
    /// offset of the byte that decided it (those before it may go to hyper).
    pub(super) fn feed(&mut self, bytes: &[u8]) -> Result<(), (usize, Refusal)> {
        let mut at = 0;
        while at < bytes.len() {
            let rest = (bytes.len() - at) as u64;
            match self.state {
                State::Blind => return Ok(()),
                State::Body(left) => {
                    let taken = left.min(rest);
                    at += taken as usize;
                    self.state = if taken < left {
                        State::Body(left - taken)
                    } else {
                        State::Idle
                    };
                }
                State::ChunkData(left) => {
                    let taken = left.min(rest);
                    at += taken as usize;
                    self.state = if taken < left {
                        State::ChunkData(left - taken)
                    } else {
                        State::ChunkEnd
                    };
                }
                State::ChunkSize(..)
                | State::ChunkEnd
                | State::Trailers(_)
                | State::TrailerLf(_) => {
                    self.state = chunked(self.state, bytes[at]);
                    at += 1;
                }
                _ => {
                    self.state = self.head_byte(bytes[at]).map_err(|r| (at, r))?;
                    at += 1;
                }
            }
        }
        Ok(())
    }

    /// The state after `b`, a byte of a head (or of the empty lines before one).
    fn head_byte(&mut self, b: u8) -> Result<State, Refusal> {
        let head = &mut self.head;
        Ok(match (self.state, b) {
            (State::Lf(line), b'\n') => return self.line_end(line),
            (State::Lf(_), _) => return Err(Refusal::NotHttp),
            (State::Idle, b'\r') => State::Lf(Line::Empty),
            (State::Idle, b'\n') => State::Idle,
            (State::Idle | State::Method, b) if is_token(b) => {
                head.method.push(b);
                State::Method
            }
            (State::Method, b' ') => State::Target(false),
            (State::Target(true), b' ') if head.utf8_left == 0 => State::Version(0),
            (State::Target(_), b) if is_target(b) => head.target_byte(b)?,
            (State::Version(n), b) if n < 8 => {
                let version: &[u8] = if n == 7 { b"01" } else { &b"HTTP/1."[n..=n] };
                if !version.contains(&b) {
                    return Err(Refusal::NotHttp);
                }
                head.http11 = n == 7 && b == b'1';
                State::Version(n + 1)
            }
            (State::Version(_), b'\r') => State::Lf(Line::Request),
            (State::Version(_), b'\n') => return self.line_end(Line::Request),
            (State::LineStart, b'\r') => State::Lf(Line::HeadEnd),
            (State::LineStart, b'\n') => return self.line_end(Line::HeadEnd),
            (State::LineStart, b) if is_token(b) => head.header(b)?,
            (State::Name, b) if is_token(b) => head.name_byte(b)?,
            (State::Name, b':') => head.name_end(),
            (State::Value, b'\r') => State::Lf(Line::Header),
            (State::Value, b'\n') => return self.line_end(Line::Header),
            (State::Value, b) if is_value(b) => head.value_byte(b)?,
            _ => return Err(Refusal::NotHttp),
        })
    }

    /// The state after a line's end.
    fn line_end(&mut self, line: Line) -> Result<State, Refusal> {
        Ok(match line {
            Line::Empty => State::Idle,
            Line::Request => State::LineStart,
            Line::Header => {
                self.head.header_end();
                State::LineStart
            }
            Line::HeadEnd => std::mem::take(&mut self.head).body()?,
        })
    }
}

impl Head {
    /// Counts `n` more bytes of the head.
    fn count(&mut self, n: usize) -> Result<(), Refusal> {
        self.bytes += n;
        if self.bytes > MAX_HEADER_BYTES {
            return Err(Refusal::HeadTooLarge);
        }
        Ok(())
    }

    fn target_byte(&mut self, b: u8) -> Result<State, Refusal> {
        if !self.utf8(b) {
            return Err(Refusal::NotHttp);
        }
        self.target += 1;
        if self.target > MAX_URL_BYTES {
            return Err(Refusal::UrlTooLong); // before the head's count, as a 414
        }
        self.count(1)?;
        Ok(State::Target(true))
    }

    /// Whether `b` continues the target as UTF-8 (httparse takes it as a `str`).
    fn utf8(&mut self, b: u8) -> bool {
        if self.utf8_left > 0 {
            let (low, high) = self.utf8_next;
            self.utf8_left -= 1;
            self.utf8_next = (0x80, 0xBF);
            return (low..=high).contains(&b);
        }
        let (left, next) = match b {
            0x00..=0x7F => return true,
            0xC2..=0xDF => (1, (0x80, 0xBF)),
            0xE0 => (2, (0xA0, 0xBF)),
            0xED => (2, (0x80, 0x9F)),
            0xE1..=0xEF => (2, (0x80, 0xBF)),
            0xF0 => (3, (0x90, 0xBF)),
            0xF1..=0xF3 => (3, (0x80, 0xBF)),
            0xF4 => (3, (0x80, 0x8F)),
            _ => return false,
        };
        (self.utf8_left, self.utf8_next) = (left, next);
        true
    }

    /// A header line begins with `b`.
    fn header(&mut self, b: u8) -> Result<State, Refusal> {
        self.headers += 1;
        if self.headers > MAX_HEADERS {
            return Err(Refusal::HeadTooLarge);
        }
        self.count(4)?;
        self.name = Prefix::default();
        self.name_byte(b)
    }

    fn name_byte(&mut self, b: u8) -> Result<State, Refusal> {
        self.count(1)?;
        self.name.push(b.to_ascii_lowercase());
        Ok(State::Name)
    }

    fn name_end(&mut self) -> State {
        self.framing = [
            (&b"content-length"[..], Framing::ContentLength),
            (b"transfer-encoding", Framing::TransferEncoding),
            (b"upgrade", Framing::Upgrade),
        ]
        .into_iter()
        .find_map(|(name, framing)| self.name.is(name).then_some(framing));
        self.value.clear();
        self.begun = false;
        self.spaces = 0;
        State::Value
    }

    /// A byte of a value. httparse trims the whitespace around a value, so whitespace
    /// counts only once more of the value follows it.
    fn value_byte(&mut self, b: u8) -> Result<State, Refusal> {
        if b == b' ' || b == b'\t' {
            self.spaces += usize::from(self.begun);
            return Ok(State::Value);
        }
        self.count(self.spaces + 1)?;
        if self.framing.is_some() {
            if self.value.len() + self.spaces >= LONGEST_VALUE {
                self.blind = true;
                self.framing = None;
            } else {
                self.value.extend(std::iter::repeat_n(b' ', self.spaces));
                self.value.push(b);
            }
        }
        self.begun = true;
        self.spaces = 0;
        Ok(State::Value)
    }

    /// A header line ended: a framing header's value is taken as hyper takes it.
    fn header_end(&mut self) {
        let value = std::mem::take(&mut self.value);
        match self.framing.take() {
            // After a `Transfer-Encoding`, hyper ignores a `Content-Length`.
            Some(Framing::ContentLength) if self.chunked.is_none() => {
                let digits = !value.is_empty() && value.iter().all(u8::is_ascii_digit);
                let length = std::str::from_utf8(&value)
                    .ok()
                    .and_then(|v| v.parse().ok());
                match length.filter(|_| digits) {
                    Some(n) => {
                        self.malformed |= self.length.is_some_and(|before| before != n);
                        self.length = Some(n);
                    }
                    None => self.malformed = true,
                }
            }
            Some(Framing::TransferEncoding) => {
                // Chunked must be the last coding, and HTTP/1.0 has none.
                self.malformed |= !self.http11;
                let last = value.rsplit(|&b| b == b',').next().unwrap_or(&[]);
                self.chunked = Some(last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
                self.length = None;
            }
            Some(Framing::Upgrade) => self.blind |= self.http11,
            _ => {}
        }
    }

    /// Where the head, just ended, leaves the connection; framing hyper refuses is
    /// refused here.
    fn body(self) -> Result<State, Refusal> {
        if self.malformed || self.chunked == Some(false) {
            return Err(Refusal::NotHttp);
        }
        if self.blind || self.method.is(b"CONNECT") {
            return Ok(State::Blind);
        }
        Ok(match (self.chunked, self.length) {
            (Some(_), _) => State::ChunkSize(0, false),
            (None, Some(n)) if n > 0 => State::Body(n),
            (None, _) => State::Idle,
        })
    }
}

/// The state after `b`, a byte of a chunked body's framing. Lenient where hyper is
/// strict: what hyper refuses ends the connection anyway.
fn chunked(state: State, b: u8) -> State {
    match (state, b) {
        (State::ChunkSize(0, _), b'\n') => State::Trailers(true),
        (State::ChunkSize(size, _), b'\n') => State::ChunkData(size),
        (State::ChunkSize(size, false), b) if b.is_ascii_hexdigit() => {
            let digit = (b as char).to_digit(16).unwrap_or(0) as u64;
            match size.checked_mul(16).and_then(|s| s.checked_add(digit)) {
                Some(size) => State::ChunkSize(size, false),
                None => State::Blind,
            }
        }
        (State::ChunkSize(size, _), _) => State::ChunkSize(size, true),
        (State::ChunkEnd, b'\n') => State::ChunkSize(0, false),
        (State::Trailers(line_start), b'\r') => State::TrailerLf(line_start),
        (State::Trailers(_), _) => State::Trailers(false),
        (State::TrailerLf(true), b'\n') => State::Idle,
        (State::TrailerLf(false), b'\n') => State::Trailers(true),
        // hyper refuses the body here, and the connection with it: nothing to follow.
        (State::TrailerLf(_), _) => State::Blind,
        (other, _) => other,
    }
}

/// A byte of a token (a method, a header's name), as httparse takes it.
fn is_token(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// A byte of a request target, as httparse takes it.
fn is_target(b: u8) -> bool {
    (b'!'..=b'~').contains(&b) || b >= 0x80
}

/// A byte of a header's value, as httparse takes it.
fn is_value(b: u8) -> bool {
    b == b'\t' || (b' '..=b'~').contains(&b) || b >= 0x80
}
