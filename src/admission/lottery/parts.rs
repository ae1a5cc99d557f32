//! A segmented lottery sale's draw. Its entrants are marked in their home segments (other
//! hash slots, maybe other servers), so no one Redis call sees them all. Once every
//! segment's window is over by its own server's clock (from then on it makes no entry:
//! a press hears code 12, or 11 for an entrant), the draw is made here from every
//! segment's marks with the procedure a sale in one segment draws with in Redis
//! ([`pick`](super::pick)), and recorded in Postgres in ONE transaction: the draw, its
//! winners' orders (each in its home segment, under the epoch that segment's entries
//! were read from) and the segments' allotments shared out anew (each its winners' units
//! and its share of the rest; nothing is sold before a draw). Under the sale's lock the
//! record checks that every segment is still the state it read. Held presses are
//! answered from the record at once; meanwhile each segment still holding its window is
//! rebuilt from Postgres through the fence: its winners are its buyers, the other
//! entrants' marks go, the rest of its allotment is its stock, and it goes on first come.
//!
//! A crash between the record and the rebuilds leaves segments holding their window
//! (presses there wait, and answer `unavailable` after [`ANSWER_WITHIN`]): whoever reads
//! the draw next rebuilds them (a held press, a press that found its segment so, every
//! instance's `keep_drawing` for ten minutes after the draw). Two instances drawing at
//! once read the same entrants and draw the same winners; the record is one row.
//!
//! [`ANSWER_WITHIN`]: super::ANSWER_WITHIN

use std::collections::BTreeMap;
use std::time::Duration;

use futures_util::future::BoxFuture;
use sqlx::PgPool;

use super::{pick, recorded, Drawn};
use crate::admission::loader::{self, Mode};
use crate::domain::{Epoch, OrderId, UserId, VoucherId};
use crate::keys::{Keys, SaleSegment};
use crate::redis_conn::RedisConn;
use crate::scripts::{Call, Replicas};
use crate::store;
use crate::store::draws::{Draw, Recorded};
use crate::store::orders::NewOrder;

/// Where a segmented sale's draw is read from and written to.
#[derive(Clone)]
pub struct Stores {
    pub db: PgPool,
    pub redis: RedisConn,
    pub keys: Keys,
    /// For the segments' rebuilds (as every load of the process).
    pub retention: Duration,
    pub replicas: Replicas,
}

/// The draw of a sale in `segments` segments as Postgres records it, drawing and
/// recording it first when every segment's window is over. `None`: not drawn (a window
/// still open somewhere, a segment not loaded, a segment rebuilt while its entries were
/// read: asked again). The segments still holding their window are to be rebuilt after
/// it ([`rebuild_after`]); held presses need not wait for that: their answers are the
/// record's.
pub async fn draw(
    stores: &Stores,
    voucher_id: VoucherId,
    segments: u8,
) -> anyhow::Result<Option<Drawn>> {
    match recorded(&stores.db, voucher_id).await? {
        Some((_, drawn)) => Ok(Some(drawn)),
        None => draw_and_record(stores, voucher_id, segments).await,
    }
}

/// One segment's entries once its window is over.
enum Closed {
    /// Its epoch, and its entrants with the order each entered under.
    Entries(i64, Vec<(i64, OrderId)>),
    /// Its window is still open, or the sale has ended (then it is never drawn).
    Open,
    /// No window to draw: not loaded, not armed, of another term of its server (or
    /// rebuilt since a draw).
    NoWindow,
}

async fn draw_and_record(
    stores: &Stores,
    voucher_id: VoucherId,
    segments: u8,
) -> anyhow::Result<Option<Drawn>> {
    // Each entrant's order and home segment, by user id (increasing: the draw's order).
    let mut entries: BTreeMap<i64, (OrderId, u8)> = BTreeMap::new();
    let mut epochs = Vec::with_capacity(segments as usize);
    for segment in SaleSegment::all(voucher_id, segments) {
        match closed_entries(stores, segment).await? {
            Closed::Entries(epoch, marks) => {
                epochs.push(epoch);
                entries.extend(marks.into_iter().map(|(u, o)| (u, (o, segment.segment))));
            }
            Closed::Open => return Ok(None),
            Closed::NoWindow => {
                // Lost or stale before the draw: rebuilt (its window armed again, the
                // marks it still holds kept), and read on the next try.
                let mut conn = stores.redis.clone();
                loader::load_segment(
                    &stores.db,
                    &mut conn,
                    &stores.keys,
                    segment,
                    stores.retention,
                    Mode::Heal,
                    stores.replicas,
                )
                .await?;
                return Ok(None);
            }
        }
    }
    let Some((seed, stock)) = store::draws::seed_and_stock(&stores.db, voucher_id).await? else {
        return Ok(None);
    };
    let entrants: Vec<i64> = entries.keys().copied().collect();
    let winners = pick::winners(&seed, &entrants, stock.max(0) as usize);
    let draw = Draw {
        seed,
        entrants,
        winners,
        drawn_at: crate::clock::now(),
    };
    let orders = draw
        .winners
        .iter()
        .map(|&user| {
            let (id, segment) = entries[&user];
            Ok(NewOrder {
                id,
                user_id: UserId::new(user).ok_or_else(|| anyhow::anyhow!("entrant {user}"))?,
                voucher_id,
                admitted_at: draw.drawn_at,
                segment,
                segments,
                epoch: Epoch::new(epochs[segment as usize]),
            })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let allotments = allotments(&orders, stock, segments);
    let read_under: Vec<Option<Epoch>> = epochs.iter().map(|&e| Epoch::new(e)).collect();
    // Under the sale's row lock: every segment still holds the window it was read from.
    let still_held = || -> BoxFuture<'_, anyhow::Result<bool>> {
        Box::pin(async {
            for (segment, &epoch) in SaleSegment::all(voucher_id, segments).zip(&epochs) {
                let now: (Option<String>, Option<String>) = redis::cmd("HMGET")
                    .arg(stores.keys.segment(segment))
                    .arg(&["lottery_end", "epoch"])
                    .query_async(&mut stores.redis.clone())
                    .await?;
                if now.0.is_none() || now.1 != Some(epoch.to_string()) {
                    return Ok(false);
                }
            }
            Ok(true)
        })
    };
    let recorded = store::draws::record(
        &stores.db,
        voucher_id,
        &draw,
        &orders,
        &read_under,
        &allotments,
        &still_held,
    )
    .await?;
    Ok(match recorded {
        Recorded::Yes => Some(Drawn::new(
            &draw,
            orders.iter().map(|o| (o.user_id.get(), o.id)),
        )),
        Recorded::NotHeld => None,
        Recorded::Refused(why) => {
            tracing::error!(
                voucher_id = voucher_id.get(),
                why,
                "the segmented draw cannot be recorded"
            );
            None
        }
    })
}

/// A segment's entrants, read in the instant its server says the window is over.
async fn closed_entries(stores: &Stores, segment: SaleSegment) -> anyhow::Result<Closed> {
    let mut call = Call::function("seckill_entries");
    call.key(stores.keys.segment(segment))
        .key(stores.keys.segment_marker(segment));
    let reply: Vec<String> = call.invoke(&mut stores.redis.clone()).await?;
    match reply.first().map(String::as_str) {
        Some("0") => {}
        Some("2") | Some("3") => return Ok(Closed::Open),
        _ => return Ok(Closed::NoWindow),
    }
    let epoch = reply
        .get(1)
        .and_then(|e| e.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("seckill_entries named no epoch"))?;
    let marks = reply[2..]
        .chunks_exact(2)
        .map(|pair| {
            let user = crate::domain::parse_id(&pair[0]);
            let order = crate::domain::parse_id(&pair[1]).and_then(OrderId::new);
            user.zip(order)
                .ok_or_else(|| anyhow::anyhow!("an entrant mark that is not one: {pair:?}"))
        })
        .collect::<anyhow::Result<_>>()?;
    Ok(Closed::Entries(epoch, marks))
}

/// Each segment's allotment after the draw: its winners' units, and its share of the
/// units nobody won (shared out as a new sale's are).
fn allotments(winners: &[NewOrder], stock: i32, segments: u8) -> Vec<i32> {
    let left = stock - winners.len() as i32;
    let mut allotted = store::segments::first_allotments(left.max(0), segments);
    for order in winners {
        allotted[order.segment as usize] += 1;
    }
    allotted
}

/// Rebuilds, all at once, every segment of a drawn sale that still holds its window (each
/// logged when it fails: the next reader of the draw tries again).
pub async fn rebuild_after(stores: &Stores, voucher_id: VoucherId, segments: u8) {
    let rebuilds = SaleSegment::all(voucher_id, segments).map(|segment| async move {
        let mut conn = stores.redis.clone();
        let rebuilt = loader::load_segment(
            &stores.db,
            &mut conn,
            &stores.keys,
            segment,
            stores.retention,
            Mode::Drawn,
            stores.replicas,
        )
        .await;
        if let Err(e) = rebuilt {
            tracing::warn!(
                voucher_id = voucher_id.get(),
                segment = segment.segment,
                error = %e,
                "a segment of a drawn lottery was not rebuilt yet"
            );
        }
    });
    futures_util::future::join_all(rebuilds).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::VoucherId;

    fn won_in(segment: u8, id: i64) -> NewOrder {
        NewOrder {
            id: OrderId::new(id).unwrap(),
            user_id: UserId::new(id).unwrap(),
            voucher_id: VoucherId::new(1).unwrap(),
            admitted_at: chrono::Utc::now(),
            segment,
            segments: 3,
            epoch: None,
        }
    }

    #[test]
    fn each_segment_is_allotted_its_winners_and_a_share_of_the_rest() {
        // 10 units, 4 won, all in segment 2: the 6 left shared 2, 2, 2.
        let winners: Vec<NewOrder> = (1..=4).map(|i| won_in(2, i)).collect();
        assert_eq!(allotments(&winners, 10, 3), vec![2, 2, 6]);
        // Every unit won: nothing to share.
        let winners = vec![won_in(0, 1), won_in(1, 2), won_in(1, 3)];
        assert_eq!(allotments(&winners, 3, 3), vec![1, 2, 0]);
    }
}
