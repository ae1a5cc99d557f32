//! A lottery sale's held presses. In its window a press makes its shopper an entrant
//! (one entry per shopper, under the order id minted for the first press) and is held;
//! the first admission call after the window draws (`lua/seckill.lua`, draw_lottery).
//! Then one held press per instance grabs again, which draws if nobody has yet, and
//! reads the draw's record from the sale's Redis state; every other held press of the
//! instance is answered from that record (its shopper drawn: the 202 of the order it
//! entered under; not: `sold_out`), so thousands of held presses cost Redis one call
//! and one read per instance. A held press is answered only once the draw is recorded
//! in Postgres (`sale_draws`, with its winners' orders, in one transaction): a Redis
//! that loses the draw afterwards is rebuilt with the winners as buyers, never to draw
//! again. Till then the state answers every other press `drawing` too (it marks its
//! draw `unrecorded`), and the recorder lifts the mark. A segmented sale draws
//! otherwise, over its segments ([`parts`]); its held presses are answered the same way.

mod held;
pub mod parts;
mod pick;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::DateTime;
use futures_util::future::BoxFuture;
use sqlx::PgPool;
use tokio::sync::OnceCell;

use crate::domain::{Epoch, OrderId, UserId, VoucherId};
use crate::keys::{Keys, SaleSegment};
use crate::redis_conn::RedisConn;
use crate::scripts::Call;
use crate::store;
pub use crate::store::draws::Window;
use crate::store::draws::{Draw, Recorded};
use crate::store::orders::NewOrder;

/// How long after its window a held press may wait for the draw's answer.
pub const ANSWER_WITHIN: Duration = Duration::from_millis(500);

/// How often an instance looks for lottery sales whose draw is due with no press to make it.
pub const DUE_LOOK: Duration = Duration::from_secs(1);

/// A draw as the held presses are answered from it: who entered, who won under which
/// order (user ids), as Postgres records it.
#[derive(Debug, Default)]
pub struct Drawn {
    pub entrants: HashSet<i64>,
    pub winners: HashMap<i64, OrderId>,
}

impl Drawn {
    fn new(draw: &Draw, orders: impl IntoIterator<Item = (i64, OrderId)>) -> Self {
        Self {
            entrants: draw.entrants.iter().copied().collect(),
            winners: orders.into_iter().collect(),
        }
    }
}

/// The lottery sales this instance holds presses for: their windows, and their draws
/// once read.
#[derive(Default)]
pub struct Lottery {
    windows: Mutex<HashMap<VoucherId, Arc<OnceCell<Option<Window>>>>>,
    drawn: Mutex<HashMap<VoucherId, Arc<OnceCell<Arc<Drawn>>>>>,
}

impl Lottery {
    /// The sale's entry window (`None`: not a lottery), asked of Postgres once (one
    /// question at a time: a storm of presses asks once).
    pub async fn window(
        &self,
        db: &PgPool,
        voucher_id: VoucherId,
    ) -> Result<Option<Window>, sqlx::Error> {
        let cell = lock(&self.windows).entry(voucher_id).or_default().clone();
        cell.get_or_try_init(|| store::draws::window(db, voucher_id))
            .await
            .copied()
    }

    /// The sale's draw, once some held press of this instance has read it; `None`: it
    /// may still be read (the one reading now failed, or the draw is not done).
    pub fn draw_of(&self, voucher_id: VoucherId) -> Arc<OnceCell<Arc<Drawn>>> {
        lock(&self.drawn).entry(voucher_id).or_default().clone()
    }
}

/// The sale's draw as Postgres records it (`None`: not recorded).
async fn recorded(db: &PgPool, voucher_id: VoucherId) -> anyhow::Result<Option<(Draw, Drawn)>> {
    let Some((_, Some(draw))) = store::draws::get(db, voucher_id).await? else {
        return Ok(None);
    };
    let orders = store::draws::winners_orders(db, voucher_id, &draw.winners).await?;
    let drawn = Drawn::new(&draw, orders);
    Ok(Some((draw, drawn)))
}

/// The draw of a sale in one segment as Postgres records it, recording it first from
/// the sale's Redis state (with its winners' orders, see [`store::draws::record`]) when
/// Redis holds one Postgres does not; `None`: not drawn, or not recordable now (Postgres
/// away, the state rebuilt meanwhile), so not to be answered from yet. Either way a
/// recorded draw the state holds is marked recorded there.
pub async fn record_draw(
    db: &PgPool,
    redis: &RedisConn,
    keys: &Keys,
    voucher_id: VoucherId,
) -> anyhow::Result<Option<Drawn>> {
    if let Some((draw, drawn)) = recorded(db, voucher_id).await? {
        mark_recorded(redis, keys, voucher_id, &draw).await;
        return Ok(Some(drawn));
    }
    let key = state_key(keys, voucher_id);
    let mut conn = redis.clone();
    let [seed, drawn_ms, entrants, winners, epoch]: [Option<String>; 5] = redis::cmd("HMGET")
        .arg(&key)
        .arg(&[
            "lottery_seed",
            "drawn_ms",
            "draw_entrants",
            "draw_winners",
            "epoch",
        ])
        .query_async::<Vec<Option<String>>>(&mut conn)
        .await?
        .try_into()
        .map_err(|_| anyhow::anyhow!("HMGET of five fields answered otherwise"))?;
    let (Some(seed), Some(drawn_ms)) = (seed, drawn_ms) else {
        return Ok(None);
    };
    let draw = Draw {
        seed,
        entrants: ids(entrants.as_deref())?,
        winners: ids(winners.as_deref())?,
        drawn_at: DateTime::from_timestamp_millis(drawn_ms.parse()?)
            .ok_or_else(|| anyhow::anyhow!("drawn_ms out of range"))?,
    };
    let orders = winners_orders(&mut conn, &key, voucher_id, &draw, epoch.as_deref()).await?;
    // Under the sale's row lock: the state that drew is still the one read.
    let read = (Some(drawn_ms), epoch);
    let still_held = || -> BoxFuture<'_, anyhow::Result<bool>> {
        Box::pin(async {
            let now: (Option<String>, Option<String>) = redis::cmd("HMGET")
                .arg(&key)
                .arg(&["drawn_ms", "epoch"])
                .query_async(&mut redis.clone())
                .await?;
            Ok(now == read)
        })
    };
    let read_under = [epoch_of(read.1.as_deref())];
    match store::draws::record(
        db,
        voucher_id,
        &draw,
        &orders,
        &read_under,
        &[],
        &still_held,
    )
    .await?
    {
        Recorded::Yes => {
            mark_recorded(redis, keys, voucher_id, &draw).await;
            Ok(Some(Drawn::new(
                &draw,
                orders.iter().map(|o| (o.user_id.get(), o.id)),
            )))
        }
        Recorded::NotHeld => Ok(None),
        Recorded::Refused(why) => {
            tracing::error!(
                voucher_id = voucher_id.get(),
                why,
                "the draw cannot be recorded"
            );
            Ok(None)
        }
    }
}

/// Lifts the sale state's `unrecorded` mark when it holds `draw`, Postgres's: its
/// presses are answered from it again. A mark left (Redis away) keeps them waiting, and
/// the next press that waits for it too long asks again.
async fn mark_recorded(redis: &RedisConn, keys: &Keys, voucher_id: VoucherId, draw: &Draw) {
    let winners = draw.winners.iter().map(i64::to_string).collect::<Vec<_>>();
    let segment = SaleSegment::new(voucher_id, 0, 1);
    let marked = Call::function("seckill_recorded")
        .key(keys.segment(segment))
        .key(keys.segment_marker(segment))
        .arg(draw.drawn_at.timestamp_millis())
        .arg(winners.join(","))
        .invoke::<i64, _>(&mut redis.clone())
        .await;
    if let Err(e) = marked {
        tracing::warn!(voucher_id = voucher_id.get(), error = %e, "marking the lottery's draw recorded in redis failed");
    }
}

/// The winners' orders as the draw admitted them: each winner's buyer record names its
/// order (the id it entered under).
async fn winners_orders(
    conn: &mut RedisConn,
    key: &str,
    voucher_id: VoucherId,
    draw: &Draw,
    epoch: Option<&str>,
) -> anyhow::Result<Vec<NewOrder>> {
    if draw.winners.is_empty() {
        return Ok(Vec::new());
    }
    let fields: Vec<String> = draw.winners.iter().map(|u| format!("u:{u}")).collect();
    let named: Vec<Option<String>> = redis::cmd("HMGET")
        .arg(key)
        .arg(&fields)
        .query_async(conn)
        .await?;
    let epoch = epoch_of(epoch);
    draw.winners
        .iter()
        .zip(named)
        .map(|(&user, order)| {
            let id = order
                .as_deref()
                .and_then(crate::domain::parse_id)
                .and_then(OrderId::new)
                .ok_or_else(|| anyhow::anyhow!("winner {user}'s buyer record names no order"))?;
            Ok(NewOrder {
                id,
                user_id: UserId::new(user).ok_or_else(|| anyhow::anyhow!("winner {user}"))?,
                voucher_id,
                admitted_at: draw.drawn_at,
                segment: 0,
                segments: 1,
                epoch,
            })
        })
        .collect()
}

/// The sale state's fields that are not buyer records (`SALE_FIELDS` in
/// lua/seckill.lua).
const STATE_FIELDS: [&str; 14] = [
    "stock",
    "begin_ms",
    "end_ms",
    "term",
    "gen",
    "part",
    "epoch",
    "next_epoch",
    "lottery_end",
    "lottery_seed",
    "drawn_ms",
    "draw_entrants",
    "draw_winners",
    "unrecorded",
];

/// Shoppers entered so far in a lottery sale not drawn yet, as its Redis state holds
/// them (summed over its segments): before the draw its only buyer records are
/// entrants' marks. `None`: some segment is not loaded, or is drawn already (the draw's
/// record counts them).
pub async fn entrants_so_far(
    conn: &mut RedisConn,
    keys: &Keys,
    voucher_id: VoucherId,
    segments: u8,
) -> redis::RedisResult<Option<i64>> {
    let mut sum = 0;
    // One segment at a time: they may live on different cluster nodes.
    for segment in SaleSegment::all(voucher_id, segments) {
        let key = keys.segment(segment);
        let (len, fields): (i64, Vec<Option<String>>) = redis::pipe()
            .cmd("HLEN")
            .arg(&key)
            .cmd("HMGET")
            .arg(&key)
            .arg(&STATE_FIELDS)
            .query_async(conn)
            .await?;
        let window = fields[8].is_some();
        if len == 0 || !window {
            return Ok(None);
        }
        sum += len - fields.iter().flatten().count() as i64;
    }
    Ok(Some(sum))
}

/// One of a lottery sale's entrants not drawn yet, and the order id it entered under;
/// `None`: no entrant (or no such state). Twenty distinct fields hold one: the state has
/// fewer fields of its own, and before the draw its buyer records are entrants' marks.
pub async fn an_entrant(
    conn: &mut RedisConn,
    keys: &Keys,
    voucher_id: VoucherId,
) -> redis::RedisResult<Option<(UserId, OrderId)>> {
    let key = state_key(keys, voucher_id);
    let some: Vec<String> = redis::cmd("HRANDFIELD")
        .arg(&key)
        .arg(20)
        .arg("WITHVALUES")
        .query_async(conn)
        .await?;
    Ok(some.chunks_exact(2).find_map(|pair| {
        let user = pair[0]
            .strip_prefix("u:")
            .and_then(crate::domain::parse_id)?;
        let order = pair[1]
            .strip_prefix('e')
            .and_then(crate::domain::parse_id)?;
        Some((UserId::new(user)?, OrderId::new(order)?))
    }))
}

/// Whether a lottery sale's state (in one segment) holds a draw not marked recorded.
pub async fn marked_unrecorded(
    conn: &mut RedisConn,
    keys: &Keys,
    voucher_id: VoucherId,
) -> redis::RedisResult<bool> {
    redis::cmd("HEXISTS")
        .arg(state_key(keys, voucher_id))
        .arg("unrecorded")
        .query_async(conn)
        .await
}

/// A lottery sale's Redis state (it has one segment).
fn state_key(keys: &Keys, voucher_id: VoucherId) -> String {
    keys.segment(SaleSegment::new(voucher_id, 0, 1))
}

/// A state's `epoch` field as read (`None`: none, or not one).
fn epoch_of(field: Option<&str>) -> Option<Epoch> {
    field.and_then(|e| e.parse().ok()).and_then(Epoch::new)
}

fn ids(joined: Option<&str>) -> anyhow::Result<Vec<i64>> {
    match joined {
        None | Some("") => Ok(Vec::new()),
        Some(s) => Ok(s.split(',').map(str::parse).collect::<Result<_, _>>()?),
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
