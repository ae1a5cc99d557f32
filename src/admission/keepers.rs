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
//! Postgres, and the first watcher (of any process) that finds every live instance
//! vouched opens it (`seckill_open_term`).
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

/// How long a new term is held at most: an instance that does not come to it by then
/// (it stays on an old primary, say) holds it back no longer.
pub(crate) const HOLD: Duration = Duration::from_secs(10);

/// A server whose term is not opened yet.
#[derive(Debug, Clone)]
pub(crate) struct Held {
    pub term: String,
    /// The term of the life whose data it took over, if it saw one: the instances on
    /// it may hold 202s this one lost (as may those on a term some sale was built into,
    /// when the server came back empty).
    pub came_after: Option<String>,
    /// How old the term was when last looked at.
    pub age: Duration,
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
/// whose every live instance that may hold its lost 202s has vouched, or that is held
/// for [`HOLD`] already, is opened. Returns the terms opened.
pub(crate) async fn settle<C: ConnectionLike + Send>(
    db: &PgPool,
    conn: &mut C,
    keys: &Keys,
    beat: Option<Beat<'_>>,
    held: &[Held],
) -> anyhow::Result<Vec<String>> {
    // (Postgres away: a term held for [`HOLD`] is opened all the same.)
    let mut failed = None;
    if let Some(b) = beat {
        failed = keepers::beat(db, b.keeper, b.on, b.vouching).await.err();
    }
    let mut opened = Vec::new();
    for h in held {
        if h.age < HOLD {
            let after = h.came_after.as_deref();
            match keepers::all_vouched(db, &h.term, after, LEASE).await {
                Ok(true) => {}
                Ok(false) => continue,
                Err(e) => {
                    failed.get_or_insert(e);
                    continue;
                }
            }
        } else {
            tracing::warn!(
                term = %h.term,
                "a new redis term opened before every instance vouched for it: some \
                 instance did not come to it in time"
            );
        }
        let mut call = Call::function("seckill_open_term");
        for shard in &h.shards {
            call.key(keys.term_marker(*shard));
        }
        let done: i64 = call.arg(&h.term).invoke(conn).await?;
        if done == 1 {
            opened.push(h.term.clone());
        }
    }
    failed.map_or(Ok(opened), |e| Err(e.into()))
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
