//! Reading the stores at the end: whether everything in flight has settled, every
//! order and tombstone in Postgres, each sale's stock in both stores, each lottery's
//! draw (checked with `scripts/verify-draw`), and what `seckill reconcile` (without
//! `--repair`) says.

use std::time::Duration;

use redis::streams::{StreamInfoGroupsReply, StreamInfoStreamReply};
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgPool, Row};

use super::checker::{DeadOrder, Lottery, PgOrder, SaleBooks};
use super::services::{run_bounded, PREFIX};
use super::topology::query;
use super::world::World;
use seckill::domain::VoucherId;
use seckill::keys::{Keys, SaleSegment, Shard};

/// The consumer group of the workers.
const GROUP: &str = "seckill-workers";

pub async fn pool(url: &str) -> PgPool {
    PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(5))
        .connect(url)
        .await
        .expect("the campaign's postgres")
}

/// Every entry of the order stream delivered and acknowledged on the primary `m`.
async fn stream_drained(world: &World, m: u8) -> bool {
    let keys = Keys::new(PREFIX).unwrap();
    let stream = keys.stream(Shard(0));
    let port = world.redis.nodes[m as usize].port;
    let exists: i64 = query(port, redis::cmd("EXISTS").arg(stream))
        .await
        .unwrap_or(-1);
    if exists == 0 {
        return true;
    }
    let groups: Result<StreamInfoGroupsReply, _> =
        query(port, redis::cmd("XINFO").arg("GROUPS").arg(stream)).await;
    let info: Result<StreamInfoStreamReply, _> =
        query(port, redis::cmd("XINFO").arg("STREAM").arg(stream)).await;
    let (Ok(groups), Ok(info)) = (groups, info) else {
        return false;
    };
    groups
        .groups
        .iter()
        .find(|g| g.name == GROUP)
        .is_some_and(|g| {
            g.pending == 0 && (g.lag == Some(0) || g.last_delivered_id == info.last_generated_id)
        })
}

async fn releases_owed(db: &PgPool) -> Option<i64> {
    sqlx::query_scalar("SELECT count(*) FROM stock_releases")
        .fetch_one(db)
        .await
        .ok()
}

/// Waits (bounded) until the stream is drained and no release is owed: nothing is in
/// flight between the stores any more. Whether that came.
pub async fn wait_settled(world: &World, db: &PgPool, limit: Duration) -> bool {
    let began = std::time::Instant::now();
    while began.elapsed() < limit {
        if let Some(m) = world.redis.master().await {
            if stream_drained(world, m).await && releases_owed(db).await == Some(0) {
                return true;
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    false
}

/// The sales not ended.
pub async fn open_sales(db: &PgPool) -> Vec<i64> {
    sqlx::query_scalar(
        "SELECT voucher_id FROM seckill_vouchers WHERE end_time > now() ORDER BY voucher_id",
    )
    .fetch_all(db)
    .await
    .unwrap_or_default()
}

/// Postgres's books, read in one snapshot: each sale's stock, every order and every
/// tombstone. (Read apart, an order the sweeper closes between two reads would count
/// as live in one and its returned unit in the other.)
pub struct PgBooks {
    sales: Vec<PgSale>,
    pub orders: Vec<PgOrder>,
    pub dead: Vec<DeadOrder>,
}

struct PgSale {
    voucher: i64,
    segments: u8,
    initial: i64,
    stock: i64,
    open: bool,
}

/// Orders' times are on the history's axis (`start_unix_ms` is its zero).
pub async fn pg_books(db: &PgPool, start_unix_ms: f64) -> PgBooks {
    let mut tx = db.begin().await.expect("a transaction");
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
        .execute(&mut *tx)
        .await
        .expect("one snapshot");
    let sales = sqlx::query(
        "SELECT voucher_id, initial_stock, stock, segments, end_time > now() AS open
         FROM seckill_vouchers ORDER BY voucher_id",
    )
    .fetch_all(&mut *tx)
    .await
    .expect("sales")
    .iter()
    .map(|r| PgSale {
        voucher: r.get("voucher_id"),
        segments: r.get::<i16, _>("segments") as u8,
        initial: r.get::<i32, _>("initial_stock") as i64,
        stock: r.get::<i32, _>("stock") as i64,
        open: r.get("open"),
    })
    .collect();
    let orders = sqlx::query(
        "SELECT id, user_id, voucher_id, status, refund_reason,
                extract(epoch FROM created_at)::float8 * 1000 AS created,
                extract(epoch FROM pay_before)::float8 * 1000 AS pay_before,
                extract(epoch FROM closed_at)::float8 * 1000 AS closed,
                (SELECT extract(epoch FROM min(e.received_at))::float8 * 1000
                 FROM payment_events e
                 WHERE e.order_id = o.id AND e.kind = 'payment.succeeded'
                   AND e.outcome NOT IN ('amount_mismatch', 'id_conflict')) AS first_paid
         FROM voucher_orders o",
    )
    .fetch_all(&mut *tx)
    .await
    .expect("orders")
    .iter()
    .map(|r| PgOrder {
        id: r.get("id"),
        user: r.get("user_id"),
        voucher: r.get("voucher_id"),
        status: r.get("status"),
        created_ms: r.get::<f64, _>("created") - start_unix_ms,
        pay_before_ms: r.get::<f64, _>("pay_before") - start_unix_ms,
        closed_ms: r.get::<Option<f64>, _>("closed").map(|c| c - start_unix_ms),
        refund_reason: r.get("refund_reason"),
        first_paid_ms: r
            .get::<Option<f64>, _>("first_paid")
            .map(|p| p - start_unix_ms),
    })
    .collect();
    let dead = sqlx::query("SELECT id, user_id, voucher_id, reason, returns_unit FROM dead_orders")
        .fetch_all(&mut *tx)
        .await
        .expect("dead orders")
        .iter()
        .map(|r| DeadOrder {
            id: r.get("id"),
            user: r.get("user_id"),
            voucher: r.get("voucher_id"),
            reason: r.get("reason"),
            returns_unit: r.get("returns_unit"),
        })
        .collect();
    tx.commit().await.expect("a read-only commit");
    PgBooks {
        sales,
        orders,
        dead,
    }
}

/// Each sale's books: Postgres's stock from `books`, and Redis's summed over its segments
/// on the primary (`None` if a segment has no state).
pub async fn sales(world: &World, books: &PgBooks) -> Vec<SaleBooks> {
    let keys = Keys::new(PREFIX).unwrap();
    let primary = world
        .redis
        .master()
        .await
        .map(|m| world.redis.nodes[m as usize].port);
    let mut out = Vec::new();
    for s in &books.sales {
        let mut redis_stock = Some(0);
        for segment in SaleSegment::all(VoucherId::new(s.voucher).unwrap(), s.segments) {
            let stock = match primary {
                Some(port) => query::<Option<i64>>(
                    port,
                    redis::cmd("HGET").arg(keys.segment(segment)).arg("stock"),
                )
                .await
                .ok()
                .flatten(),
                None => None,
            };
            redis_stock = redis_stock.zip(stock).map(|(a, b)| a + b);
        }
        out.push(SaleBooks {
            voucher: s.voucher,
            segments: s.segments,
            initial: s.initial,
            pg_stock: s.stock,
            redis_stock,
            open: s.open,
        });
    }
    out
}

/// Every lottery sale: its window on the history's axis (`start_unix_ms` is its
/// zero) and its draw as Postgres records it, each published draw put to
/// `scripts/verify-draw` as `GET /vouchers/{id}/draw` would publish it.
pub async fn lotteries(db: &PgPool, start_unix_ms: f64) -> Vec<Lottery> {
    let rows = sqlx::query(
        "SELECT v.voucher_id, v.initial_stock, v.draw_commitment, d.seed, d.entrants, d.winners,
                extract(epoch FROM v.begin_time)::float8 * 1000 AS window_begin, v.lottery_window_ms
         FROM seckill_vouchers v LEFT JOIN sale_draws d USING (voucher_id)
         WHERE v.opening_mode = 'lottery' ORDER BY v.voucher_id",
    )
    .fetch_all(db)
    .await
    .expect("lottery sales");
    let mut out = Vec::new();
    for r in rows {
        let voucher: i64 = r.get("voucher_id");
        let winners: Option<Vec<i64>> = r.get("winners");
        let entrants: Option<Vec<i64>> = r.get("entrants");
        let unverified = match &winners {
            Some(winners) => {
                let draw = serde_json::json!({
                    "commitment": r.get::<String, _>("draw_commitment"),
                    "seed": r.get::<Option<String>, _>("seed"),
                    "entrants": entrants,
                    "winners": winners,
                });
                verify_draw(voucher, &draw, r.get::<i32, _>("initial_stock")).await
            }
            None => None,
        };
        out.push(Lottery {
            voucher,
            window_ms: {
                let begin = r.get::<f64, _>("window_begin") - start_unix_ms;
                (begin, begin + r.get::<i32, _>("lottery_window_ms") as f64)
            },
            winners,
            entrants: entrants.map_or(0, |e| e.len()),
            unverified,
        });
    }
    out
}

/// `scripts/verify-draw --file` of `draw`: `None` if it verified, else what it said.
async fn verify_draw(voucher: i64, draw: &serde_json::Value, stock: i32) -> Option<String> {
    let file = std::env::temp_dir().join(format!(
        "nemesis-draw-{voucher}-{}-{:08x}.json",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::write(&file, draw.to_string()).expect("a draw's file");
    let mut command = std::process::Command::new("scripts/verify-draw");
    command
        .arg("--file")
        .arg(&file)
        .arg("--stock")
        .arg(stock.to_string());
    let (code, said) = run_bounded(command, Duration::from_secs(60)).await;
    let _ = std::fs::remove_file(&file);
    (code != Some(0)).then(|| format!("scripts/verify-draw exited {code:?}: {said}"))
}

/// `seckill reconcile` (no `--repair`), bounded: its exit code and output.
pub async fn reconcile(world: &World) -> (Option<i32>, String) {
    run_bounded(world.env.command("reconcile"), Duration::from_secs(120)).await
}

/// What Redis holds at the end, for reading a failed run: each node's role and
/// replication, whom each sentinel names, and per sale segment its fields and the buyer
/// records that differ from Postgres's live orders (with what Postgres says of them).
pub async fn describe_redis(world: &World, sales: &[SaleBooks], orders: &[PgOrder]) -> String {
    let mut out = String::new();
    for node in &world.redis.nodes {
        let info: String = query(node.port, redis::cmd("INFO").arg("replication"))
            .await
            .unwrap_or_else(|e| e);
        let fields: Vec<&str> = info
            .lines()
            .filter(|l| {
                [
                    "role:",
                    "connected_slaves:",
                    "master_link_status:",
                    "master_repl_offset:",
                    "master_replid:",
                    "slave",
                ]
                .iter()
                .any(|p| l.starts_with(p))
            })
            .collect();
        out += &format!(
            "redis {} (port {}, proxy {}): {}\n",
            node.index,
            node.port,
            node.proxy.port,
            fields.join(" ")
        );
    }
    out += &format!("the sentinels name: {:?}\n", world.redis.named().await);
    let Some(m) = world.redis.master().await else {
        return out;
    };
    let keys = Keys::new(PREFIX).unwrap();
    let port = world.redis.nodes[m as usize].port;
    for sale in sales {
        out += &describe_sale(&keys, port, sale, orders).await;
    }
    out
}

async fn describe_sale(keys: &Keys, port: u16, sale: &SaleBooks, orders: &[PgOrder]) -> String {
    let mut out = String::new();
    let segments = sale.segments;
    for segment in SaleSegment::all(VoucherId::new(sale.voucher).unwrap(), segments) {
        let hash: std::collections::HashMap<String, String> =
            query(port, redis::cmd("HGETALL").arg(keys.segment(segment)))
                .await
                .unwrap_or_default();
        let mut state: Vec<String> = hash
            .iter()
            .filter(|(k, _)| !k.starts_with("u:"))
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        state.sort();
        let buyers: std::collections::HashMap<i64, i64> = hash
            .iter()
            .filter_map(|(k, v)| Some((k.strip_prefix("u:")?.parse().ok()?, v.parse().ok()?)))
            .collect();
        let live: std::collections::HashMap<i64, &PgOrder> = orders
            .iter()
            .filter(|o| o.voucher == sale.voucher && o.is_active())
            .filter(|o| {
                seckill::keys::home_segment(seckill::domain::UserId::new(o.user).unwrap(), segments)
                    == segment.segment
            })
            .map(|o| (o.user, o))
            .collect();
        out += &format!(
            "voucher {} segment {}/{segments}: {} buyers in Redis, {} live orders in Postgres; {}\n",
            sale.voucher,
            segment.segment,
            buyers.len(),
            live.len(),
            state.join(" ")
        );
        out += &buyer_differences(&buyers, &live, orders);
    }
    out
}

/// Buyer records Redis holds that Postgres does not (and the reverse), 20 of each.
fn buyer_differences(
    buyers: &std::collections::HashMap<i64, i64>,
    live: &std::collections::HashMap<i64, &PgOrder>,
    orders: &[PgOrder],
) -> String {
    let by_id: std::collections::HashMap<i64, &PgOrder> =
        orders.iter().map(|o| (o.id, o)).collect();
    let mut out = String::new();
    let extra = buyers
        .iter()
        .filter(|(u, id)| live.get(u).is_none_or(|o| o.id != **id));
    for (user, id) in extra.take(20) {
        let pg = by_id.get(id).map_or("not in postgres".to_string(), |o| {
            format!(
                "{} (admitted {:.1} s, closed {:?})",
                o.status,
                o.created_ms / 1000.0,
                o.closed_ms.map(|c| (c / 100.0).round() / 10.0)
            )
        });
        out += &format!("    redis buyer u:{user} -> {id}: postgres {pg}\n");
    }
    let missing = live.iter().filter(|(u, o)| buyers.get(u) != Some(&o.id));
    for (user, o) in missing.take(20) {
        out += &format!(
            "    postgres live order {} of user {user} ({}, admitted {:.1} s): redis buyer {:?}\n",
            o.id,
            o.status,
            o.created_ms / 1000.0,
            buyers.get(user)
        );
    }
    out
}
