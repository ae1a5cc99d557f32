//! Reading a server's term (and drawing a new one), with its identity: the run and
//! replication ids that tell a term that outlived a change of server.

use redis::aio::ConnectionLike;
use redis::{RedisResult, Value};
use std::time::Duration;

use crate::redis_conn::RedisConn;
use crate::scripts::Call;

/// A server's term and how long ago it was drawn, and, read in the same instant, the
/// entry of each stream asked about below which the workers are done (`None`: unknown).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Term {
    pub term: String,
    pub age: Duration,
    /// Whether its sales admit (see [`super::keepers`]).
    pub opened: bool,
    /// The terms of the server lives whose data this one took over.
    pub came_after: Vec<String>,
    pub done: Vec<Option<(u64, u64)>>,
}

impl Term {
    /// From `seckill_term`'s reply: the term, its age in ms, one id per stream, then
    /// the term it came after and whether it is opened (last: a process of the release
    /// before, which reads every item after the age as a stream's, reads those for none
    /// of its streams).
    fn parse(reply: Value) -> RedisResult<Self> {
        let mut items = redis::from_redis_value::<Vec<Value>>(reply)?;
        let (opened, came_after) = (items.pop(), items.pop());
        let mut items = items.into_iter();
        let (Some(term), Some(age_ms), Some(opened), Some(came_after)) =
            (items.next(), items.next(), opened, came_after)
        else {
            let short = std::io::Error::new(std::io::ErrorKind::InvalidData, "short term reply");
            return Err(short.into());
        };
        let term: String = redis::from_redis_value(term)?;
        // (A server clock stepped back reads as a term just drawn.)
        let age_ms = redis::from_redis_value::<i64>(age_ms)?.max(0) as u64;
        let opened = redis::from_redis_value::<i64>(opened)? == 1;
        let came_after = redis::from_redis_value::<String>(came_after)?
            .split_whitespace()
            .map(str::to_string)
            .collect();
        let mut done = Vec::new();
        for v in items {
            let id: String = redis::from_redis_value(v)?;
            done.push(crate::stream::parse_entry_id(&id));
        }
        Ok(Self {
            term,
            age: Duration::from_millis(age_ms),
            opened,
            came_after,
            done,
        })
    }
}

/// The term of the server holding `marker` (a slot's term marker, see
/// [`Keys::term_marker`]), drawn now if this is its first call, or if the slot's data
/// shows another life of a server wrote it since.
async fn of<C: ConnectionLike + Send>(conn: &mut C, marker: &str) -> RedisResult<Term> {
    ask(conn, "seckill_term", marker).await
}

/// Draws a new term on the server holding `marker`: every sale on it is stale.
pub(super) async fn draw_new<C: ConnectionLike + Send>(
    conn: &mut C,
    marker: &str,
) -> RedisResult<Term> {
    ask(conn, "seckill_new_term", marker).await
}

async fn ask<C: ConnectionLike + Send>(
    conn: &mut C,
    function: &'static str,
    marker: &str,
) -> RedisResult<Term> {
    Term::parse(Call::function(function).key(marker).invoke(conn).await?)
}

/// A server's run id and replication id: a restart changes the first, a promotion the
/// second.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Identity {
    run_id: String,
    replid: String,
}

/// What one look read of a server: its term, its identity, and its memory (`None`:
/// INFO not allowed, or the call failed there).
pub(super) struct Look {
    pub term: Term,
    pub identity: Option<Identity>,
    pub memory: Option<crate::admission::guard::Memory>,
}

/// The term of the server holding `marker` (with where the workers are done in
/// `streams`, all on that server), that server's identity and its memory settings,
/// and its clock (for [`crate::clock`]), from one round trip on one connection. An
/// INFO sent alone may describe ANOTHER server: while the connection to a slot's master
/// is down (a failover), the cluster client sends a command routed to that master to a
/// random node instead, and an identity recorded
/// from there makes the next look see a "change" under the same term (a needless new
/// term: every sale on the server rebuilt twice). Behind the term's call, which only
/// the slot's master runs (any other node redirects it, and the client then sends both
/// again to the node named), the INFO is that master's. The identity is `None` when INFO
/// is not allowed (some managed services rename it: the term alone then tells), when
/// the server says it is no master, or when the call failed there (then the term is
/// asked alone, which installs the library if missing).
pub(super) async fn term_and_identity(
    conn: &mut RedisConn,
    marker: &str,
    streams: &[&str],
) -> RedisResult<Look> {
    let mut pipe = redis::pipe();
    pipe.cmd("FCALL")
        .arg("seckill_term")
        .arg(1 + streams.len())
        .arg(marker)
        .arg(streams)
        .arg(crate::stream::GROUP)
        .cmd("INFO")
        .arg("server")
        .arg("replication")
        .arg("memory")
        .cmd("TIME");
    let sent = std::time::Instant::now();
    let replies: Vec<Value> = match &mut *conn {
        RedisConn::Cluster(c) => {
            use redis::cluster_routing::{Route, SingleNodeRoutingInfo, SlotAddr};
            let route = Route::new(crate::keys::slot(marker), SlotAddr::Master);
            c.route_pipeline(pipe, 0, 3, SingleNodeRoutingInfo::SpecificNode(route))
                .await?
        }
        other => pipe.ignore_errors().query_async(other).await?,
    };
    if let Some(Ok(time)) = replies
        .get(2)
        .map(redis::from_redis_value_ref::<(i64, i64)>)
    {
        // The one clock every process decides by (see `clock`).
        crate::clock::heard(sent, std::time::Instant::now(), crate::clock::of_time(time));
    }
    let mut replies = replies.into_iter();
    let alone = |term| Look {
        term,
        identity: None,
        memory: None,
    };
    let (Some(term), Some(info)) = (replies.next(), replies.next()) else {
        return Ok(alone(of(conn, marker).await?));
    };
    let Ok(term) = term.extract_error() else {
        return Ok(alone(of(conn, marker).await?));
    };
    let term = Term::parse(term)?;
    let text = info
        .extract_error()
        .ok()
        .and_then(|v| redis::from_redis_value::<String>(v).ok());
    Ok(Look {
        term,
        identity: text.as_deref().and_then(identity_in),
        memory: text
            .as_deref()
            .map(crate::admission::guard::Memory::of_info),
    })
}

/// A master's identity in its `INFO server replication` text.
fn identity_in(text: &str) -> Option<Identity> {
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(|v| v.trim().to_string())
    };
    if field("role")? != "master" {
        return None;
    }
    Some(Identity {
        run_id: field("run_id")?,
        replid: field("master_replid")?,
    })
}
