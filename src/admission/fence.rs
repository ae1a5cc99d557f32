//! The fence at the door: what this instance knows of each sale segment's current epoch
//! (Postgres's `sale_epochs`), handed to every admission call so that a Redis state
//! older than the build Postgres names takes no unit and answers no 202.
//!
//! The worker already writes only orders of the current epoch. That keeps the stock,
//! but not the promise: an old primary that still answers as master after a failover,
//! and keeps a replica (so WAIT succeeds), would go on admitting from the state it held,
//! and each of its 202s would be dead-lettered. With the floor the call refuses such a
//! state (`fenced`), before it takes anything: a `503` with nothing reserved.
//!
//! Every build announces its epoch (`NOTIFY` in its transaction, delivered at commit),
//! and its state admits only once armed, after that commit. Each instance listens, and
//! reads the whole table again whenever it (re)connects, so what it knows is never
//! above Postgres and lags it only by the notification's way here: milliseconds, or as
//! long as this instance's connection to Postgres is down (admission never waits for
//! Postgres). A starting instance waits up to [`FIRST_READ_WAIT`] for its first read
//! before it serves; one that has not read the table yet (Postgres down) passes no floor.

use sqlx::postgres::PgListener;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use std::collections::HashMap;
use std::sync::RwLock;
use std::time::Duration;

use crate::backoff::Backoff;
use crate::domain::{Epoch, VoucherId};
use crate::keys::SaleSegment;
use crate::store::epochs;

/// How often the whole table is read again though nothing was missed (it also forgets
/// the sales that ended).
const REREAD_EVERY: Duration = Duration::from_secs(300);
/// How long after its end a sale's epochs are still kept (a grab of an ended sale is
/// refused by its times anyway).
const KEEP_AFTER_END: Duration = Duration::from_secs(3600);

/// How long a starting instance waits for its first read of the table before it serves
/// anyway (Postgres down: admission does not wait for it).
pub(crate) const FIRST_READ_WAIT: Duration = Duration::from_secs(2);

/// The current epoch of each sale segment, as this instance last heard from Postgres.
#[derive(Debug)]
pub struct Fence {
    known: RwLock<HashMap<(VoucherId, u8), Epoch>>,
    /// Whether the table was read once.
    read: tokio::sync::watch::Sender<bool>,
}

impl Default for Fence {
    fn default() -> Self {
        Self {
            known: RwLock::default(),
            read: tokio::sync::watch::Sender::new(false),
        }
    }
}

impl Fence {
    /// Returns once the table was read (a starting instance waits for it, up to
    /// [`FIRST_READ_WAIT`], before it serves).
    pub(crate) async fn first_read(&self) {
        let mut read = self.read.subscribe();
        let _ = read.wait_for(|done| *done).await;
    }

    /// The epoch below which a state of `segment` may not admit (`None`: none known).
    pub fn floor(&self, segment: SaleSegment) -> Option<Epoch> {
        self.known
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&(segment.voucher_id, segment.segment))
            .copied()
    }

    /// Postgres named `epoch` for the segment: kept unless a later one is known (a read of
    /// the table may cross a notification).
    pub(crate) fn learn(&self, voucher_id: VoucherId, segment: u8, epoch: Epoch) {
        let mut known = self.known.write().unwrap_or_else(|e| e.into_inner());
        let at = known.entry((voucher_id, segment)).or_insert(epoch);
        *at = (*at).max(epoch);
    }

    /// Replaces what is known with a whole read of the table (later epochs heard
    /// meanwhile are kept).
    fn replace(&self, rows: Vec<(VoucherId, i16, Epoch)>) {
        let mut known = self.known.write().unwrap_or_else(|e| e.into_inner());
        *known = rows
            .into_iter()
            .map(|(v, segment, read)| {
                let key = (v, segment as u8);
                (key, known.get(&key).map_or(read, |&heard| read.max(heard)))
            })
            .collect();
        drop(known);
        self.read.send_replace(true);
    }

    /// Listens to the builds' announcements until `cancel`, reading the whole table after
    /// every (re)connection and every [`REREAD_EVERY`].
    pub(crate) async fn watch(self: std::sync::Arc<Self>, db: PgPool, cancel: CancellationToken) {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        let mut failing = false;
        while !cancel.is_cancelled() {
            let result = tokio::select! {
                _ = cancel.cancelled() => break,
                r = self.listen(&db, &mut backoff) => r,
            };
            match result {
                Err(e) if !failing => {
                    tracing::warn!(error = %e, "listening for sale epochs failed, retrying");
                    failing = true;
                }
                Err(_) => {}
                // (A connection that was lost after it worked.)
                Ok(()) => failing = false,
            }
            tokio::select! {
                _ = cancel.cancelled() => break,
                _ = tokio::time::sleep(backoff.next_delay()) => {}
            }
        }
    }

    /// One connection's life: listen, read the table, then learn each announcement.
    /// Returns when the connection is lost.
    async fn listen(&self, db: &PgPool, backoff: &mut Backoff) -> Result<(), sqlx::Error> {
        let mut listener = PgListener::connect_with(db).await?;
        listener.listen(epochs::CHANNEL).await?;
        loop {
            let since =
                crate::clock::now() - chrono::Duration::seconds(KEEP_AFTER_END.as_secs() as i64);
            self.replace(epochs::of_sales_ending_after(db, since).await?);
            backoff.reset();
            let reread = tokio::time::sleep(REREAD_EVERY);
            tokio::pin!(reread);
            loop {
                let heard = tokio::select! {
                    _ = &mut reread => break,
                    heard = listener.try_recv() => heard?,
                };
                // (`None`: the connection was lost; what was sent meanwhile is not.)
                let Some(heard) = heard else {
                    return Ok(());
                };
                match parse(heard.payload()) {
                    Some((voucher_id, segment, epoch)) => self.learn(voucher_id, segment, epoch),
                    None => tracing::warn!(
                        payload = heard.payload(),
                        "an epoch announcement not understood"
                    ),
                }
            }
        }
    }
}

/// `<voucher_id> <segment> <epoch>`, as `store::epochs::record` announces it.
fn parse(payload: &str) -> Option<(VoucherId, u8, Epoch)> {
    let mut words = payload.split(' ');
    let voucher_id = VoucherId::new(words.next()?.parse().ok()?)?;
    let segment = words.next()?.parse().ok()?;
    let epoch = Epoch::new(words.next()?.parse().ok()?)?;
    words
        .next()
        .is_none()
        .then_some((voucher_id, segment, epoch))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(id: i64) -> VoucherId {
        VoucherId::new(id).unwrap()
    }

    fn e(n: i64) -> Epoch {
        Epoch::new(n).unwrap()
    }

    #[test]
    fn an_announcement_names_the_sale_segment_and_epoch() {
        assert_eq!(parse("12 0 345"), Some((v(12), 0, e(345))));
        assert_eq!(parse("12 3 9"), Some((v(12), 3, e(9))));
        for bad in ["", "12", "12 0", "12 0 x", "0 0 1", "12 0 1 2", "12 -1 5"] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn what_is_known_of_a_segment_never_goes_back() {
        let fence = Fence::default();
        let segment = SaleSegment::new(v(7), 0, 1);
        assert_eq!(fence.floor(segment), None);
        fence.learn(v(7), 0, e(5));
        fence.learn(v(7), 0, e(3));
        assert_eq!(fence.floor(segment), Some(e(5)));
        // A read of the table that crossed a later announcement keeps the later one,
        // and forgets the sales it no longer lists.
        fence.learn(v(8), 0, e(2));
        fence.replace(vec![(v(7), 0, e(4))]);
        assert_eq!(fence.floor(segment), Some(e(5)));
        assert_eq!(fence.floor(SaleSegment::new(v(8), 0, 1)), None);
        fence.replace(vec![(v(7), 0, e(6))]);
        assert_eq!(fence.floor(segment), Some(e(6)));
    }
}
