//! A new term's sales are held until every instance has kept its promises there.
//!
//! A server that lost writes (a failover to a replica that lagged, a restart from an
//! older copy) may have lost 202s that only the instance that answered them still knows
//! ([`super::promises`]). That instance admits them again once it sees the new term,
//! but the other instances see it at their own moment: a shopper whose 202 was lost
//! could meanwhile win a second time through another instance, and the first 202 could
//! then never be kept. So the server holds every grab of a new term (`seckill_admit`
//! answers "held", a 503 to the shopper, nothing reserved) until it is opened: each
//! API instance, once it has admitted its own promises again, vouches for the term in
//! Postgres, and the first watcher (of any process) that finds every live instance that
//! may hold its lost 202s vouched (or one vouched [`HOLD`] ago) opens it
//! (`seckill_open_term`).
//!
//! An instance is live while it beats, at every look of its watcher that reached Redis;
//! one silent for longer than [`LEASE`] (killed, paused, cut off) holds nothing back,
//! and the promises it kept may then break. A stopping instance leaves at once.

use std::time::Duration;

use redis::aio::ConnectionLike;
use sqlx::PgPool;

use crate::keys::{Keys, Shard};
use crate::scripts::Call;
use crate::store::keepers;

/// How long a silent instance still holds a new term back.
pub(crate) const LEASE: Duration = Duration::from_secs(10);

/// How long a new term is held at most once one instance has vouched for it (so its
/// server takes writes and its sales are rebuilt): an instance that does not come to it
/// by then (it stays on an old primary, say) holds it back no longer.
pub(crate) const HOLD: Duration = Duration::from_secs(10);

/// A server whose term is not opened yet.
#[derive(Debug, Clone)]
pub(crate) struct Held {
    pub term: String,
    /// The terms of the lives whose data it took over: the instances on them may hold
    /// 202s this one lost (as may those on a term some sale was built into, when the
    /// server came back empty).
    pub came_after: Vec<String>,
    /// The shards it holds.
    pub shards: Vec<Shard>,
}

/// This instance's beat: the terms it is on now, and those it vouches for since its
/// last beat.
pub(crate) struct Beat<'a> {
    pub keeper: &'a str,
    pub on: &'a [String],
    pub vouching: &'a [String],
}

/// After a look: this instance beats (when it keeps promises); then each of `held`
/// whose every live instance that may hold its lost 202s has vouched, or that one
/// instance vouched for [`HOLD`] ago, is opened. Returns the terms opened.
pub(crate) async fn settle<C: ConnectionLike + Send>(
    db: &PgPool,
    conn: &mut C,
    keys: &Keys,
    beat: Option<Beat<'_>>,
    held: &[Held],
) -> anyhow::Result<Vec<String>> {
    if let Some(b) = beat {
        keepers::beat(db, b.keeper, b.on, b.vouching).await?;
    }
    // Each term on its own: a master out of reach does not keep the others held.
    let mut failed: Option<anyhow::Error> = None;
    let mut opened = Vec::new();
    for h in held {
        match open(db, conn, keys, h).await {
            Ok(true) => opened.push(h.term.clone()),
            Ok(false) => {}
            Err(e) => {
                failed.get_or_insert(e);
            }
        }
    }
    failed.map_or(Ok(opened), Err)
}

/// Opens `h` if its time has come; whether it did.
async fn open<C: ConnectionLike + Send>(
    db: &PgPool,
    conn: &mut C,
    keys: &Keys,
    h: &Held,
) -> anyhow::Result<bool> {
    match keepers::may_open(db, &h.term, &h.came_after, LEASE, HOLD).await? {
        keepers::Opening::No => return Ok(false),
        keepers::Opening::AllVouched => {}
        keepers::Opening::HeldLongEnough => tracing::warn!(
            term = %h.term,
            "a new redis term opened before every instance vouched for it: some instance \
             did not come to it in time"
        ),
    }
    let mut call = Call::function("seckill_open_term");
    for shard in &h.shards {
        call.key(keys.term_marker(*shard));
    }
    let done: i64 = call.arg(&h.term).invoke(conn).await?;
    Ok(done == 1)
}

/// This instance stops keeping promises.
pub(crate) async fn leave(db: &PgPool, keeper: &str) {
    if let Err(e) = keepers::leave(db, keeper).await {
        tracing::warn!(
            error = %e,
            "could not tell postgres this instance stops: new terms wait for its lease to end"
        );
    }
}
