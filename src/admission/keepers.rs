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

/// A server whose term is not opened yet: the term, and the shards it holds.
#[derive(Debug, Clone)]
pub(crate) struct Held {
    pub term: String,
    pub shards: Vec<Shard>,
}

/// After a look: this instance (when it keeps promises) beats and vouches for
/// `vouched`; then each of `held` whose every live instance has vouched is opened.
/// Returns the terms opened.
pub(crate) async fn settle<C: ConnectionLike + Send>(
    db: &PgPool,
    conn: &mut C,
    keys: &Keys,
    keeper: Option<&str>,
    vouched: &[String],
    held: &[Held],
) -> anyhow::Result<Vec<String>> {
    if let Some(keeper) = keeper {
        keepers::beat(db, keeper, vouched).await?;
    }
    let mut opened = Vec::new();
    for h in held {
        if !keepers::all_vouched(db, &h.term, LEASE).await? {
            continue;
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
    Ok(opened)
}

/// This instance stops keeping promises.
pub(crate) async fn leave(db: &PgPool, keeper: &str) {
    if let Err(e) = keepers::leave(db, keeper).await {
        tracing::warn!(error = %e, "could not tell postgres this instance stops: new terms \
            wait for its lease to end");
    }
}
