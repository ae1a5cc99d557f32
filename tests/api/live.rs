//! The live view: `/live/events` snapshots while a sale sells, the same numbers from
//! every instance, one producer however many pages watch, and the page itself in a real
//! (headless) Chromium.

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::Value;
use sqlx::PgPool;

use crate::common::browser::Browser;
use crate::common::{vid, TestApp};

/// An open `/live/events` stream, read event by event.
pub(crate) struct Events {
    response: reqwest::Response,
    buffer: String,
}

impl Events {
    pub(crate) async fn open(client: &reqwest::Client, base: &str) -> Self {
        let response = client
            .get(format!("{base}/live/events"))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(
            response.headers()["content-type"],
            "text/event-stream",
            "an event stream"
        );
        Self {
            response,
            buffer: String::new(),
        }
    }

    /// The next snapshot (at most `limit` away).
    async fn next(&mut self, limit: Duration) -> Value {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            if let Some(end) = self.buffer.find("\n\n") {
                let event: String = self.buffer.drain(..end + 2).collect();
                let data: Vec<&str> = event
                    .lines()
                    .filter_map(|l| l.strip_prefix("data: "))
                    .collect();
                if event.lines().any(|l| l == "event: snapshot") {
                    return serde_json::from_str(&data.join("\n")).unwrap();
                }
                continue;
            }
            let chunk = tokio::time::timeout_at(deadline, self.response.chunk())
                .await
                .unwrap_or_else(|_| panic!("no snapshot within {limit:?}"))
                .unwrap()
                .expect("the stream stays open");
            self.buffer.push_str(std::str::from_utf8(&chunk).unwrap());
        }
    }

    /// Snapshots until `sale`'s view satisfies `done` (at most `limit`); that view.
    pub(crate) async fn until(
        &mut self,
        sale: i64,
        limit: Duration,
        done: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = Instant::now() + limit;
        let mut last = Value::Null;
        while Instant::now() < deadline {
            let snapshot = self.next(limit).await;
            if let Some(view) = sale_in(&snapshot, sale) {
                if done(view) {
                    return view.clone();
                }
                last = view.clone();
            }
        }
        panic!("sale {sale} never reached the expected figures within {limit:?}; last {last}");
    }
}

fn sale_in(snapshot: &Value, id: i64) -> Option<&Value> {
    snapshot["sales"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["id"] == id)
}

const WAIT: Duration = Duration::from_secs(20);

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn the_live_stream_shows_a_sales_stock_outcomes_and_orders_as_they_change(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(3).await;
    let mut events = Events::open(&app.client, &app.base).await;

    let first = events.next(WAIT).await;
    let view = sale_in(&first, voucher).expect("an open sale is shown");
    assert_eq!(view["state"], "open");
    assert_eq!(view["initial_stock"], 3);
    assert_eq!(view["title"], "50 off 100");
    for field in ["length", "pending", "lag", "dead_letters"] {
        assert!(first["worker"][field].is_u64(), "worker.{field}: {first}");
    }

    // Five shoppers for three units, and one of the winners again.
    let mut orders = Vec::new();
    for user in 1..=5 {
        let (status, body) = app.grab(voucher, user).await;
        if status == StatusCode::ACCEPTED {
            orders.push((user, body["order_id"].as_str().unwrap().to_string()));
        }
    }
    assert_eq!(orders.len(), 3);
    let (status, _) = app.grab(voucher, orders[0].0).await;
    assert_eq!(status, StatusCode::CONFLICT);

    // Admitted, not yet written (no worker runs in this app).
    let view = events
        .until(voucher, WAIT, |v| v["outcomes"]["admitted"] == 3)
        .await;
    assert_eq!(view["outcomes"]["sold_out"], 2, "{view}");
    assert_eq!(view["outcomes"]["already_ordered"], 1, "{view}");
    assert_eq!(view["remaining"], 0, "{view}");
    assert_eq!(view["orders"]["in_flight"], 3, "{view}");
    assert_eq!(view["orders"]["persisted"], 0, "{view}");

    // Written by the worker.
    app.drain().await;
    let view = events
        .until(voucher, WAIT, |v| v["orders"]["persisted"] == 3)
        .await;
    assert_eq!(view["orders"]["in_flight"], 0, "{view}");
    assert_eq!(view["orders"]["created"], 3, "{view}");

    // Paid and cancelled: the cancelled unit is back on sale.
    let (status, _) = app.pay(&orders[1].1, orders[1].0).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = app.cancel(&orders[2].1, orders[2].0).await;
    assert_eq!(status, StatusCode::OK);
    let view = events
        .until(voucher, WAIT, |v| v["orders"]["cancelled"] == 1)
        .await;
    assert_eq!(view["orders"]["paid"], 1, "{view}");
    assert_eq!(view["orders"]["created"], 1, "{view}");
    assert_eq!(view["remaining"], 1, "{view}");
    assert_eq!(view["orders"]["persisted"], 3, "{view}");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn the_live_stream_counts_the_grabs_answered_at_the_edge(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(1).await;
    let (status, _) = app.grab(voucher, 1).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    // Fresh shoppers press the sold-out sale for a second: after the first answers
    // from Redis, the instance answers most of them itself. (The metrics are this test
    // process's, shared with other tests: the live view's count is this sale's own.)
    let presses = 40;
    for user in 100..100 + presses {
        let (status, body) = app.grab(voucher, user).await;
        assert_eq!(status, StatusCode::CONFLICT, "{body}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let mut events = Events::open(&app.client, &app.base).await;
    let view = events
        .until(voucher, WAIT, |v| v["outcomes"]["sold_out"] == presses)
        .await;
    // Most of them answered at the edge: a subset of the sold-out answers, never more.
    let at_edge = view["outcomes"]["answered_at_edge"].as_i64().unwrap();
    assert!((3..=presses).contains(&at_edge), "{view}");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn every_api_instance_shows_the_same_numbers(db: PgPool) {
    let app = TestApp::spawn(db).await;
    // A second instance (the binary) in the same stores, limiting each shopper to one
    // grab a second.
    let limits = [
        ("RATE_LIMIT_PER_USER", "1".to_string()),
        ("RATE_LIMIT_PER_USER_BURST", "1".to_string()),
    ];
    let (_other, other) = app.spawn_server("api", &limits).await;
    let voucher = app.open_sale(4).await;

    // Grabs through both: three here, three there, and one shopper twice at once there.
    for user in 1..=3 {
        app.grab(voucher, user).await;
    }
    let grab_there = |user: i64| {
        app.client
            .post(format!("{other}/vouchers/{voucher}/seckill"))
            .bearer_auth(app.token(user))
            .send()
    };
    let mut statuses = Vec::new();
    for user in 4..=6 {
        statuses.push(grab_there(user).await.unwrap().status());
    }
    statuses.push(grab_there(6).await.unwrap().status());
    assert_eq!(
        statuses.last(),
        Some(&StatusCode::TOO_MANY_REQUESTS),
        "{statuses:?}"
    );
    app.drain().await;

    let settled = |v: &Value| {
        v["outcomes"]["admitted"] == 4
            && v["outcomes"]["sold_out"] == 2
            && v["outcomes"]["rate_limited"] == 1
            && v["orders"]["persisted"] == 4
    };
    let mut here = Events::open(&app.client, &app.base).await;
    let mut there = Events::open(&app.client, &other).await;
    let a = here.until(voucher, WAIT, settled).await;
    let b = there.until(voucher, WAIT, settled).await;
    for field in [
        "outcomes",
        "orders",
        "remaining",
        "initial_stock",
        "dead_letters",
    ] {
        assert_eq!(a[field], b[field], "{field}: here {a}, there {b}");
    }
    println!(
        "both instances: {} admitted, {} sold out, {} rate limited, {} persisted",
        a["outcomes"]["admitted"],
        a["outcomes"]["sold_out"],
        a["outcomes"]["rate_limited"],
        a["orders"]["persisted"]
    );
}

/// `name`'s value in a Prometheus text exposition (no labels); 0 when absent.
fn metric(text: &str, name: &str) -> f64 {
    crate::common::metric_value(text, name).unwrap_or(0.0)
}

/// The grab counts a process has not flushed yet reach Redis when it stops (its last
/// flush follows its last answer), and grabs refused by rate limiting at voucher ids no
/// sale has make no keys.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_stopping_instance_writes_its_last_counts_and_made_up_vouchers_cost_no_keys(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let limits = [
        ("RATE_LIMIT_PER_USER", "1".to_string()),
        ("RATE_LIMIT_PER_USER_BURST", "1".to_string()),
    ];
    let (mut other, base) = app.spawn_server("api", &limits).await;
    let voucher = crate::common::open_sale_at(&app.client, &base, 5).await;
    let grab = |voucher: i64, user: i64| {
        app.client
            .post(format!("{base}/vouchers/{voucher}/seckill"))
            .bearer_auth(app.token(user))
            .send()
    };
    let mut statuses = Vec::new();
    for user in 1..=8 {
        statuses.push(grab(voucher, user).await.unwrap().status().as_u16());
    }
    // Shopper 8 again at once: refused by the limiter, counted (the sale is known).
    statuses.push(grab(voucher, 8).await.unwrap().status().as_u16());
    // Shopper 9 at 50 vouchers that do not exist: one 404, then refused by the limiter.
    for made_up in 900_001..=900_050 {
        statuses.push(grab(made_up, 9).await.unwrap().status().as_u16());
    }
    let count = |code: u16| statuses.iter().filter(|&&s| s == code).count();
    assert_eq!(
        (count(202), count(409), count(429), count(404)),
        (5, 3, 50, 1)
    );

    // Straight away, well within the second between flushes.
    other.sigterm();
    let status = other
        .wait_exit(Duration::from_secs(20))
        .await
        .expect("stopped");
    assert!(status.success(), "{status}");
    let key = format!("{}seckill:live:{voucher}", app.keys.prefix());
    let counts: std::collections::HashMap<String, u64> =
        app.redis_cmd(redis::cmd("HGETALL").arg(&key)).await;
    assert_eq!(counts.get("admitted"), Some(&5), "{counts:?}");
    assert_eq!(counts.get("sold_out"), Some(&3), "{counts:?}");
    assert_eq!(counts.get("rate_limited"), Some(&1), "{counts:?}");
    let keys: Vec<String> = app
        .redis_cmd(redis::cmd("KEYS").arg(format!("{}seckill:live:*", app.keys.prefix())))
        .await;
    assert_eq!(keys, vec![key], "only the real sale has counts");
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn many_open_pages_cost_one_snapshot_a_second_and_pages_beyond_the_limit_get_503(db: PgPool) {
    const PAGES: usize = 300;
    let app = TestApp::spawn(db).await;
    // Its own process, so that its metrics count only its own producer.
    let (_api, base) = app
        .spawn_server("api", &[("LIVE_MAX_VIEWERS", PAGES.to_string())])
        .await;
    app.open_sale(10).await;
    let client = reqwest::Client::new();
    let scrape = || crate::common::metrics_at(&client, &base);
    // Snapshots made since `before`, and whether that is at most about two a second
    // (one per tick, and one when the first page of an idle spell opens).
    let bounded = |before: &str, after: &str, seconds: f64| {
        let made = metric(after, "seckill_live_snapshots_total")
            - metric(before, "seckill_live_snapshots_total");
        (made, made <= 2.0 * seconds.ceil() + 2.0)
    };

    // A page that opens, reads its first snapshot and closes, 50 times, costs no
    // snapshot each.
    let before = scrape().await;
    let started = Instant::now();
    for _ in 0..50 {
        Events::open(&client, &base).await.next(WAIT).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    let (made, ok) = bounded(&before, &scrape().await, seconds);
    assert!(
        ok,
        "{made} snapshots while a page reopened 50 times in {seconds:.1} s"
    );
    println!("a page reopened 50 times: {made} snapshots in {seconds:.1} s");

    // Nor do pages opening (each gets a first snapshot).
    // (The closed pages are noticed at the next snapshot, which frees their places.)
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let before = scrape().await;
    let started = Instant::now();
    let mut pages = Vec::new();
    for _ in 0..PAGES {
        pages.push(Events::open(&client, &base).await);
    }
    for page in &mut pages {
        page.next(WAIT).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    let (made, ok) = bounded(&before, &scrape().await, seconds);
    assert!(
        ok,
        "{made} snapshots while {PAGES} pages opened in {seconds:.1} s"
    );
    println!("{PAGES} pages opening: {made} snapshots in {seconds:.1} s");

    let before = scrape().await;
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    // Every page still gets every snapshot.
    for page in &mut pages {
        page.next(WAIT).await;
    }
    let after = scrape().await;
    let seconds = started.elapsed().as_secs_f64();
    let snapshots = metric(&after, "seckill_live_snapshots_total")
        - metric(&before, "seckill_live_snapshots_total");
    assert_eq!(metric(&after, "seckill_live_viewers"), PAGES as f64);
    assert!(
        snapshots >= 1.0 && snapshots <= seconds.ceil() + 2.0,
        "{snapshots} snapshots in {seconds:.1} s for {PAGES} pages"
    );
    println!("{PAGES} pages watching: {snapshots} snapshots in {seconds:.1} s");

    // One more is refused, in our error format.
    let resp = client
        .get(format!("{base}/live/events"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["code"], "unavailable", "{body}");

    // Pages that close free their places.
    pages.truncate(PAGES - 10);
    let deadline = Instant::now() + WAIT;
    loop {
        let resp = client
            .get(format!("{base}/live/events"))
            .send()
            .await
            .unwrap();
        if resp.status() == StatusCode::OK {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "closed pages never freed a place"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn the_live_page_in_a_real_browser_updates_after_grabs_without_a_reload(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(5).await;
    let browser = Browser::start().await;
    browser.goto(&app.url("/live")).await;

    let field = |name: &str| {
        format!(
            "const el = document.querySelector('[data-sale-id=\"{voucher}\"] [data-field=\"{name}\"]'); \
             return el ? el.textContent : null;"
        )
    };
    let text_is = |want: &'static str| move |v: &Value| v == want;
    browser
        .wait_for(&field("remaining"), WAIT, text_is("5"))
        .await;
    browser
        .wait_for(
            "return document.getElementById('status').textContent;",
            WAIT,
            text_is("live"),
        )
        .await;
    // A mark that a reload would erase.
    browser
        .eval("window.seckillMark = 'same page'; return true;")
        .await;

    for user in 1..=2 {
        let (status, body) = app.grab(voucher, user).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    }
    browser
        .wait_for(&field("remaining"), WAIT, text_is("3"))
        .await;
    browser
        .wait_for(&field("admitted"), WAIT, text_is("2"))
        .await;
    let bar = browser
        .eval(&format!(
            "return document.querySelector('[data-sale-id=\"{voucher}\"] .bar').getAttribute('aria-valuenow');"
        ))
        .await;
    assert_eq!(bar, "3");
    app.drain().await;
    browser
        .wait_for(&field("persisted"), WAIT, text_is("2"))
        .await;
    assert_eq!(
        browser.eval("return window.seckillMark || null;").await,
        "same page",
        "the numbers changed without a reload"
    );

    // A phone's width: nothing wider than the screen.
    browser.resize(390, 844).await;
    let overflow = browser
        .wait_for(
            "return document.documentElement.scrollWidth - window.innerWidth;",
            WAIT,
            |v| v.as_i64().is_some_and(|px| px <= 0),
        )
        .await;
    assert!(overflow.as_i64().unwrap() <= 0);

    browser.resize(1280, 900).await;
    let png = browser.screenshot().await;
    assert!(png.starts_with(b"\x89PNG"), "a PNG");
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("live.png");
    std::fs::write(&path, png).unwrap();
    println!("screenshot of /live mid-sale: {}", path.display());

    let errors: Vec<Value> = browser
        .console()
        .await
        .into_iter()
        .filter(|e| e["level"] == "SEVERE" || e["level"] == "WARNING")
        .collect();
    assert!(errors.is_empty(), "console: {errors:?}");
}

/// One process's grab counts and their flushes, under a key prefix of the test's own.
struct Counter {
    tally: seckill::admission::tally::Tally,
    conn: seckill::redis_conn::RedisConn,
    keys: seckill::keys::Keys,
    /// A connection of its own, for what the test does to Redis and reads back.
    admin: redis::aio::MultiplexedConnection,
    url: String,
}

impl Counter {
    async fn new(url: &str) -> Self {
        let conn = seckill::redis_conn::connect(url, seckill::redis_conn::COMMAND_TIMEOUT).unwrap();
        let prefix = format!("test{:016x}:", rand::random::<u64>());
        let admin = redis::Client::open(url)
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        Self {
            tally: Default::default(),
            conn,
            keys: seckill::keys::Keys::new(prefix).unwrap(),
            admin,
            url: url.to_string(),
        }
    }

    fn add(&self, voucher: i64, outcome: &str, n: usize) {
        let index = seckill::admission::tally::OUTCOMES
            .iter()
            .position(|o| *o == outcome)
            .unwrap();
        for _ in 0..n {
            self.tally.add(vid(voucher), index);
        }
    }

    async fn flush(&self) -> redis::RedisResult<()> {
        self.tally.flush(&self.conn, &self.keys).await
    }

    async fn cmd<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> T {
        cmd.query_async(&mut self.admin.clone()).await.unwrap()
    }

    /// `voucher`'s count of `outcome` in Redis.
    async fn count(&self, voucher: i64, outcome: &str) -> Option<u64> {
        self.cmd(
            redis::cmd("HGET")
                .arg(self.keys.live_counts(vid(voucher)))
                .arg(outcome),
        )
        .await
    }
}

impl Drop for Counter {
    /// Leaves nothing behind in Redis: every key under the test's prefix goes.
    fn drop(&mut self) {
        let Ok(mut conn) = redis::Client::open(self.url.as_str()).and_then(|c| c.get_connection())
        else {
            return;
        };
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{}*", self.keys.prefix()))
            .query(&mut conn)
            .unwrap_or_default();
        if !keys.is_empty() {
            let _: redis::RedisResult<()> = redis::cmd("DEL").arg(keys).query(&mut conn);
        }
    }
}

/// Redis stalls past a flush's deadline and then adds the batch the flush had sent: the
/// answer is lost, not the write. The next flush sends that batch again, which Redis
/// recognises, so the 5 admissions read 5, not 10 (counts made meanwhile go after it).
#[tokio::test]
async fn a_flush_whose_answer_is_lost_is_not_counted_twice() {
    // A Redis of its own: the pause would stall every other test's Redis calls.
    let redis = crate::common::faults::PrivateRedis::start();
    let counter = Counter::new(&redis.url).await;
    let voucher = 1;
    // One flush answered first, as in a running process (the script is loaded).
    counter.add(voucher, "sold_out", 1);
    counter.flush().await.unwrap();

    counter.add(voucher, "admitted", 5);
    let () = counter
        .cmd(redis::cmd("CLIENT").arg("PAUSE").arg(1500).arg("WRITE"))
        .await;
    let cut = tokio::time::timeout(Duration::from_millis(800), counter.flush()).await;
    assert!(cut.is_err(), "the flush must be cut off by its deadline");
    counter.add(voucher, "admitted", 1);
    // The stalled write lands once the pause ends: only its answer was lost.
    let deadline = Instant::now() + Duration::from_secs(5);
    while counter.count(voucher, "admitted").await != Some(5) {
        assert!(Instant::now() < deadline, "the stalled batch never landed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    counter.flush().await.unwrap();
    assert_eq!(counter.count(voucher, "admitted").await, Some(5));
    counter.flush().await.unwrap();
    // What the live view reads (the hash's `seq:*` field is no outcome).
    let read = seckill::admission::tally::read(&counter.conn, &counter.keys, &[vid(voucher)]).await;
    assert_eq!(read.unwrap(), vec![[6, 1, 0, 0, 0, 0, 0]]);
}

/// A sale whose key Redis refuses (a string there: WRONGTYPE, as a sale on a cluster
/// node that is down fails) holds back no other sale's counts; its own are kept and
/// land, once, when Redis takes them.
#[tokio::test]
async fn one_sale_whose_flush_fails_does_not_hold_back_the_others() {
    let counter = Counter::new(&crate::common::redis_url()).await;
    // The failing sale first: batches go in sale order.
    let (bad, good) = (1, 2..=20);
    let () = counter
        .cmd(
            redis::cmd("SET")
                .arg(counter.keys.live_counts(vid(bad)))
                .arg("x"),
        )
        .await;
    counter.add(bad, "admitted", 3);
    for voucher in good.clone() {
        counter.add(voucher, "admitted", 2);
    }

    let err = counter.flush().await.expect_err("the bad sale fails");
    assert!(err.to_string().contains("WRONGTYPE"), "{err}");
    for voucher in good.clone() {
        assert_eq!(
            counter.count(voucher, "admitted").await,
            Some(2),
            "{voucher}"
        );
    }

    let () = counter
        .cmd(redis::cmd("DEL").arg(counter.keys.live_counts(vid(bad))))
        .await;
    counter.flush().await.unwrap();
    assert_eq!(counter.count(bad, "admitted").await, Some(3));
    for voucher in good {
        assert_eq!(
            counter.count(voucher, "admitted").await,
            Some(2),
            "{voucher}"
        );
    }
}

/// The recent figures a flush adds (grabs, errors, admission waits) are read back
/// summed over the last whole seconds, by Redis's clock: from the second after the
/// flush's, for the window's length, and then they are gone; the totals stay.
#[tokio::test]
async fn recent_figures_are_read_over_the_last_whole_seconds_and_then_leave() {
    use seckill::admission::tally::{self, Answer};
    let counter = Counter::new(&crate::common::redis_url()).await;
    let voucher = 1;
    let waited = Duration::from_millis(3);
    counter.tally.add_answers([
        (vid(voucher), Answer::Outcome(0), waited),
        (vid(voucher), Answer::Outcome(1), waited),
        (vid(voucher), Answer::Failed(tally::UNKNOWN), waited),
    ]);
    counter.flush().await.unwrap();
    let read = || async {
        tally::read_live(&counter.conn, &counter.keys, &[vid(voucher)])
            .await
            .unwrap()[0]
    };
    let live = read().await;
    assert_eq!(live.outcomes[..2], [1, 1]);
    assert_eq!(live.errors, [0, 1]);

    let deadline = Instant::now() + Duration::from_secs(3);
    let recent = loop {
        let recent = read().await.recent;
        if recent.grabs > 0 {
            break recent;
        }
        assert!(Instant::now() < deadline, "never in the window");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!((recent.grabs, recent.errors), (3, 1));
    let p50 = recent.latency_quantile(0.5).unwrap();
    assert!(p50 > 0.002 && p50 <= 0.005, "{p50}");

    tokio::time::sleep(Duration::from_secs(tally::WINDOW_SECS + 2)).await;
    let live = read().await;
    assert_eq!(live.recent, tally::Recent::default());
    assert_eq!(live.outcomes[..2], [1, 1], "the totals stay");
}

/// Redis stalls (every command, reads too) while grab counts wait to be flushed: the
/// flush waits out its deadline each second, and the snapshots, whose Redis reads wait
/// out theirs, still come a second apart (flush and snapshot one after the other made
/// it 1.6 s). The count lands once when Redis answers again, though every stalled
/// flush sent it.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_stalled_flush_delays_no_snapshot(db: PgPool) {
    // A Redis of its own: the pause would stall every other test's Redis calls.
    let redis = crate::common::faults::PrivateRedis::start();
    let app = TestApp::spawn_with(db, redis.url.clone(), false).await;
    let voucher = app.open_sale(5).await;
    let mut events = Events::open(&app.client, &app.base).await;
    events.next(WAIT).await;

    app.grab(voucher, 1).await;
    let mut admin = redis::Client::open(redis.url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(6000)
        .arg("ALL")
        .query_async(&mut admin)
        .await
        .unwrap();
    // The snapshots whose Redis reads the pause cut off, as they arrive: a second
    // apart. (The first comes up to a second after the pause, plus its reads.)
    let paused = Instant::now();
    let mut stalled = Vec::new();
    while paused.elapsed() < Duration::from_secs(6) {
        let snapshot = events.next(WAIT).await;
        if snapshot["unavailable"].to_string().contains("redis") {
            stalled.push(Instant::now());
        }
    }
    assert!(stalled.len() >= 2, "the pause must stall the reads too");
    // The median gap: one slow Postgres read on a busy machine may stretch one gap; a
    // flush back inline in the producer stretches every one (to about 1.6 s).
    let mut gaps: Vec<Duration> = stalled.windows(2).map(|w| w[1] - w[0]).collect();
    gaps.sort();
    assert!(
        gaps[gaps.len() / 2] < Duration::from_millis(1400),
        "{gaps:?}"
    );

    let key = app.keys.live_counts(vid(voucher));
    let deadline = Instant::now() + WAIT;
    loop {
        let admitted: Option<u64> = app
            .redis_cmd(redis::cmd("HGET").arg(&key).arg("admitted"))
            .await;
        if admitted == Some(1) {
            break;
        }
        assert!(Instant::now() < deadline, "never flushed: {admitted:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
/// `seckill api` on a spare port with `env`, its standard error captured (read on a
/// thread, so that a chatty log never blocks it): the process, its base URL, and the
/// log, complete once the process has exited.
async fn spawn_logged(
    app: &TestApp,
    env: &[(&str, String)],
) -> (
    crate::common::faults::Process,
    String,
    std::thread::JoinHandle<String>,
) {
    use crate::common::faults;
    use std::io::Read;
    let port = faults::free_port();
    let mut child = std::process::Command::new(faults::BIN)
        .arg("api")
        .env("DATABASE_URL", faults::database_url(&app.db, None))
        .env("REDIS_URL", &app.redis_url)
        .env("REDIS_KEY_PREFIX", app.keys.prefix())
        .env("JWT_SECRET", crate::common::SECRET)
        .env("BIND", format!("127.0.0.1:{port}"))
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let log = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let base = format!("http://127.0.0.1:{port}");
    faults::wait_ready(&base).await;
    (faults::Process { child }, base, log)
}

/// Refusing a page for too many viewers is expected back-pressure (thousands of
/// refused pages retrying must not read like an outage): a debug line each, no warning
/// and no error (tower_http's trace layer logs its 5xx at debug too).
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn pages_refused_for_too_many_viewers_are_logged_at_debug_not_as_warnings(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let (mut server, base, log) = spawn_logged(
        &app,
        &[
            ("LIVE_MAX_VIEWERS", "1".to_string()),
            ("RUST_LOG", "warn,seckill::http=debug".to_string()),
        ],
    )
    .await;
    let client = reqwest::Client::new();
    let _watching = Events::open(&client, &base).await;
    for _ in 0..20 {
        let resp = client
            .get(format!("{base}/live/events"))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            resp.headers()["retry-after"],
            "3",
            "as long as the page first waits"
        );
        let body: Value = resp.json().await.unwrap();
        assert_eq!(body["error"]["code"], "unavailable", "{body}");
    }
    server.sigterm();
    server.wait_exit(WAIT).await.expect("stopped");
    let log = log.join().unwrap();
    let refusals: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("too many pages"))
        .collect();
    assert_eq!(refusals.len(), 20, "one line per refusal:\n{log}");
    assert!(
        refusals.iter().all(|l| l.contains("DEBUG")),
        "refusals logged above debug:\n{log}"
    );
    assert!(
        !log.lines()
            .any(|l| l.contains("WARN") && l.contains("request failed")),
        "{log}"
    );
    assert!(
        !log.lines().any(|l| l.contains("ERROR")),
        "an error logged for a refusal:\n{log}"
    );
}

/// The page shows at most `LIVE_MAX_SALES` sales, and says so: every snapshot counts
/// the sales that qualify and marks itself truncated when some were left out.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn sales_beyond_the_limit_are_counted_and_the_snapshot_says_it_is_truncated(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let (_api, base) = app
        .spawn_server("api", &[("LIVE_MAX_SALES", "2".to_string())])
        .await;
    let now = chrono::Utc::now();
    let mut open = Vec::new();
    for _ in 0..3 {
        open.push(app.open_sale(5).await);
    }
    let upcoming = app
        .create_sale(
            5,
            now + chrono::Duration::hours(1),
            now + chrono::Duration::hours(2),
        )
        .await;
    let client = reqwest::Client::new();
    let mut events = Events::open(&client, &base).await;
    let snapshot = events.next(WAIT).await;
    assert_eq!(snapshot["open_total"], 4, "{snapshot}");
    assert_eq!(snapshot["truncated"], true, "{snapshot}");
    let shown: Vec<i64> = snapshot["sales"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_i64().unwrap())
        .collect();
    assert_eq!(shown.len(), 2, "{snapshot}");
    assert!(
        !shown.contains(&upcoming),
        "open sales come first: {snapshot}"
    );

    // Within the limit: everything shown, not truncated.
    let mut events = Events::open(&app.client, &app.base).await;
    let snapshot = events.next(WAIT).await;
    assert_eq!(snapshot["open_total"], 4, "{snapshot}");
    assert_eq!(snapshot["truncated"], false, "{snapshot}");
    assert_eq!(snapshot["sales"].as_array().unwrap().len(), 4, "{snapshot}");

    // Out of range: refused at start-up, naming the setting.
    let out = std::process::Command::new(crate::common::faults::BIN)
        .arg("api")
        .env("LIVE_MAX_SALES", "0")
        .env("DATABASE_URL", "postgres://unused")
        .env("JWT_SECRET", "x")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("live-max-sales"), "{stderr}");
}

/// Whether a sale is upcoming, open or ended is Postgres's answer (`now()`), one clock
/// for every instance: an instance whose clock is an hour behind still shows a sale
/// that began half an hour ago as open. (Postgres's clock is moved here by a `now()` of
/// the test database's own, found first on its search path.)
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_sales_state_follows_the_database_clock_not_the_instances(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let now = chrono::Utc::now();
    let sale = app
        .create_sale(
            5,
            now + chrono::Duration::minutes(30),
            now + chrono::Duration::hours(2),
        )
        .await;
    let name: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&app.db)
        .await
        .unwrap();
    for statement in [
        "CREATE SCHEMA skew".to_string(),
        "CREATE FUNCTION skew.now() RETURNS timestamptz LANGUAGE sql STABLE \
         AS $$ SELECT pg_catalog.now() + interval '1 hour' $$"
            .to_string(),
        format!("ALTER DATABASE \"{name}\" SET search_path = public, skew, pg_catalog"),
    ] {
        sqlx::query(&statement).execute(&app.db).await.unwrap();
    }
    // A new process, so new connections: they see the database an hour ahead. (`public`
    // stays first on the path: tables, and the migrations' own, are created there.)
    let (_api, base) = app.spawn_server("api", &[]).await;
    let mut events = Events::open(&app.client, &base).await;
    let snapshot = events.next(WAIT).await;
    let view = sale_in(&snapshot, sale).expect("shown");
    assert_eq!(view["state"], "open", "{view}");
    // And the snapshot's time is the database's, so countdowns agree too.
    let at: chrono::DateTime<chrono::Utc> = snapshot["at"].as_str().unwrap().parse().unwrap();
    let ahead = (at - chrono::Utc::now()).num_seconds();
    assert!((3590..=3610).contains(&ahead), "at {at}: {ahead} s ahead");
}

/// A lag Redis cannot tell (its group's `lag` is NULL once an entry past the group's
/// last delivery is deleted) is sent as null, shown as unknown, never as 0 (which reads
/// as "every order delivered").
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_lag_redis_cannot_tell_is_null_not_zero(db: PgPool) {
    let app = TestApp::spawn(db).await;
    app.worker().ensure_groups().await.unwrap();
    let voucher = app.open_sale(3).await;
    for user in 1..=3 {
        let (status, body) = app.grab(voucher, user).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    }
    let mut events = Events::open(&app.client, &app.base).await;
    let known = |s: &Value| s["worker"]["lag"] == 3;
    let deadline = Instant::now() + WAIT;
    loop {
        let snapshot = events.next(WAIT).await;
        if known(&snapshot) {
            break;
        }
        assert!(Instant::now() < deadline, "lag never 3: {snapshot}");
    }

    let stream = app.keys.stream(seckill::keys::Shard(0));
    let entries: Vec<(String, Vec<(String, String)>)> = app
        .redis_cmd(redis::cmd("XRANGE").arg(stream).arg("-").arg("+"))
        .await;
    assert_eq!(entries.len(), 3);
    let _: i64 = app
        .redis_cmd(redis::cmd("XDEL").arg(stream).arg(&entries[1].0))
        .await;
    let deadline = Instant::now() + WAIT;
    loop {
        let snapshot = events.next(WAIT).await;
        if snapshot["worker"]["lag"].is_null() {
            assert_eq!(snapshot["worker"]["length"], 2, "{snapshot}");
            break;
        }
        assert!(Instant::now() < deadline, "lag never null: {snapshot}");
    }
}

/// With no worker ever started there is no consumer group: every entry is still to be
/// delivered, so the lag is the stream's length, on the page and on `/metrics` (0 would
/// read as "all delivered" exactly when no worker runs).
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn with_no_worker_ever_started_the_lag_is_the_whole_stream(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(3).await;
    for user in 1..=3 {
        let (status, body) = app.grab(voucher, user).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    }
    let groups: Vec<redis::Value> = app
        .redis_cmd(
            redis::cmd("XINFO")
                .arg("GROUPS")
                .arg(app.keys.stream(app.keys.shard_of(vid(voucher)))),
        )
        .await;
    assert!(groups.is_empty(), "no group yet: {groups:?}");
    let mut events = Events::open(&app.client, &app.base).await;
    let deadline = Instant::now() + WAIT;
    loop {
        let snapshot = events.next(WAIT).await;
        if snapshot["worker"]["length"] == 3 {
            assert_eq!(snapshot["worker"]["lag"], 3, "{snapshot}");
            break;
        }
        assert!(Instant::now() < deadline, "never 3 entries: {snapshot}");
    }
    // A process of its own: this test binary's recorder is shared by parallel tests.
    let (_api, base) = app.spawn_server("api", &[]).await;
    let text = crate::common::metrics_at(&app.client, &base).await;
    assert_eq!(
        crate::common::metric_value(&text, "seckill_stream_lag{shard=\"0\"}"),
        Some(3.0),
        "{text}"
    );
}

/// A page whose phone vanished without a FIN must not hold its viewer slot for minutes:
/// the server's side of a `/live/events` connection runs TCP keep-alive (and, not
/// visible to `ss`, TCP_USER_TIMEOUT; see `http::server::detect_dead_peers`).
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn the_servers_side_of_a_live_stream_probes_for_a_vanished_peer(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let port = app.base.rsplit(':').next().unwrap().to_string();
    let client = reqwest::Client::new();
    let mut events = Events::open(&client, &app.base).await;
    events.next(WAIT).await;
    let out = std::process::Command::new("ss")
        .args(["-tnoH", "state", "established"])
        .arg(format!("( sport = :{port} )"))
        .output()
        .expect("ss (iproute2)");
    let sockets = String::from_utf8_lossy(&out.stdout);
    assert!(!sockets.trim().is_empty(), "no server socket found");
    assert!(
        sockets.lines().all(|l| l.contains("timer:(keepalive")),
        "{sockets}"
    );
}

/// Pages watching can never take every connection: `LIVE_MAX_VIEWERS` is lowered to half
/// the connection cap at start-up, with a warning saying so.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn viewers_are_capped_at_half_the_connections_with_a_warning(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let (mut server, base, log) = spawn_logged(
        &app,
        &[
            ("LIVE_MAX_VIEWERS", "100".to_string()),
            ("HTTP_MAX_CONNECTIONS", "6".to_string()),
            ("RUST_LOG", "warn".to_string()),
        ],
    )
    .await;
    let client = reqwest::Client::new();
    let mut pages = Vec::new();
    for _ in 0..3 {
        pages.push(Events::open(&client, &base).await);
    }
    let resp = client
        .get(format!("{base}/live/events"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    // Shoppers still get in.
    let (status, _) = app.send(client.get(format!("{base}/vouchers/1"))).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    drop(resp);
    drop(pages);
    server.sigterm();
    server.wait_exit(WAIT).await.expect("stopped");
    let log = log.join().unwrap();
    assert!(
        log.lines().any(|l| l.contains("WARN")
            && l.contains("LIVE_MAX_VIEWERS exceeds half the connection cap")
            && l.contains("using=3")),
        "{log}"
    );
}

/// A corrupt stock in Redis (the most negative integer) is shown as it is, with no
/// overflow in the in-flight arithmetic (it panicked the producer in debug builds and
/// wrapped in release), and the stream carries on; once the stock is right again, so
/// is the page. (Were the producer to panic anyway, it is restarted: see
/// `startup::tests`.)
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_corrupt_stock_in_redis_neither_stops_the_stream_nor_overflows(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(5).await;
    let (status, body) = app.grab(voucher, 1).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let mut events = Events::open(&app.client, &app.base).await;
    events.until(voucher, WAIT, |v| v["remaining"] == 4).await;

    let key = app.keys.voucher(vid(voucher));
    let _: i64 = app
        .redis_cmd(redis::cmd("HSET").arg(&key).arg("stock").arg(i64::MIN))
        .await;
    let corrupt = events
        .until(voucher, WAIT, |v| v["remaining"] == i64::MIN)
        .await;
    let in_flight = corrupt["orders"]["in_flight"].as_i64();
    assert!(in_flight.is_none_or(|n| n >= 0), "{corrupt}");
    // Snapshots keep coming while it is corrupt.
    for _ in 0..2 {
        let snapshot = events.next(WAIT).await;
        assert_eq!(sale_in(&snapshot, voucher).unwrap()["remaining"], i64::MIN);
    }
    let _: i64 = app
        .redis_cmd(redis::cmd("HSET").arg(&key).arg("stock").arg(4))
        .await;
    events.until(voucher, WAIT, |v| v["remaining"] == 4).await;
}

/// The page, its assets and the stream carry the headers that keep them safe and live:
/// a strict CSP and nosniff on the page's files; on the stream no caching and no proxy
/// buffering (nginx holds a response back unless told `X-Accel-Buffering: no`).
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn the_page_and_its_stream_carry_csp_nosniff_and_no_buffering_headers(db: PgPool) {
    let app = TestApp::spawn(db).await;
    for path in ["/live", "/live/app.js", "/live/app.css"] {
        let resp = app.client.get(app.url(path)).send().await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK, "{path}");
        let h = resp.headers();
        let csp = h["content-security-policy"].to_str().unwrap();
        assert!(csp.contains("default-src 'none'"), "{path}: {csp}");
        assert!(csp.contains("script-src 'self'"), "{path}: {csp}");
        assert_eq!(h["x-content-type-options"], "nosniff", "{path}");
    }
    let resp = app
        .client
        .get(app.url("/live/events"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let h = resp.headers();
    assert_eq!(h["content-type"], "text/event-stream");
    assert_eq!(h["x-accel-buffering"], "no");
    assert_eq!(h["cache-control"], "no-cache");
    assert_eq!(h["x-content-type-options"], "nosniff");
}

/// A sale titled with markup is shown as its literal text in a real browser: nothing in
/// it runs. The title is isolated for bidirectional text (a right-to-left title does not
/// reorder the id beside it), and a sale not loaded in Redis gives screen readers the
/// units the bar shows, not 0.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_hostile_title_is_shown_as_text_in_a_real_browser_and_runs_nothing(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let hostile = r#"<img src=x onerror="window.pwned=1">"#;
    let now = chrono::Utc::now();
    let (status, voucher) = app
        .post_json(
            "/vouchers",
            Some(&app.admin_token()),
            &serde_json::json!({
                "shop_id": 1, "title": hostile, "pay_value": 5000, "actual_value": 10000,
                "seckill": {"stock": 5, "begin_time": now - chrono::Duration::minutes(1),
                            "end_time": now + chrono::Duration::hours(1)},
            }),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{voucher}");
    let voucher = voucher["id"].as_i64().unwrap();

    let browser = Browser::start().await;
    browser.goto(&app.url("/live")).await;
    let card = format!("document.querySelector('[data-sale-id=\"{voucher}\"]')");
    let title = browser
        .wait_for(
            &format!("const c = {card}; return c ? c.querySelector('[data-field=\"title\"]').textContent : null;"),
            WAIT,
            |v| !v.is_null(),
        )
        .await;
    assert_eq!(title, hostile);
    let inside = browser
        .eval(&format!(
            "const t = {card}.querySelector('[data-field=\"title\"]'); \
             return [t.children.length, document.querySelectorAll('img').length, \
                     getComputedStyle(t).unicodeBidi];"
        ))
        .await;
    assert_eq!(inside, serde_json::json!([0, 0, "isolate"]));
    // Give an error handler every chance to run.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        browser.eval("return typeof window.pwned;").await,
        "undefined"
    );
    // Not loaded in Redis: no remaining figure. (Deleted only now: the process's
    // start-up load of open sales, racing the test's start, would put it back.)
    let _: i64 = app
        .redis_cmd(redis::cmd("DEL").arg(app.keys.voucher(vid(voucher))))
        .await;
    let bar = browser
        .wait_for(
            &format!(
                "return [{card}.querySelector('[data-field=\"remaining\"]').textContent, \
                         {card}.querySelector('.bar').getAttribute('aria-valuenow')];"
            ),
            WAIT,
            |v| v[0] == "–",
        )
        .await;
    assert_eq!(bar, serde_json::json!(["–", "5"]));
}

/// The server restarts (the same address, a new process): the open page reconnects by
/// itself and shows "live" again, without a reload.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn the_page_shows_live_again_after_the_server_restarts_without_a_reload(db: PgPool) {
    use crate::common::faults;
    let app = TestApp::spawn(db).await;
    let (mut first, base) = app.spawn_server("api", &[]).await;
    let port = base.rsplit(':').next().unwrap().to_string();
    let voucher = app.open_sale(5).await;
    let browser = Browser::start().await;
    browser.goto(&format!("{base}/live")).await;
    let status = "return document.getElementById('status').textContent;";
    browser.wait_for(status, WAIT, |v| v == "live").await;
    browser
        .eval("window.seckillMark = 'same page'; return true;")
        .await;

    first.kill9();
    browser.wait_for(status, WAIT, |v| v != "live").await;
    let _second = faults::Process::spawn(
        "api",
        &app.redis_url,
        app.keys.prefix(),
        &faults::database_url(&app.db, None),
        &[("BIND", format!("127.0.0.1:{port}"))],
    );
    faults::wait_ready(&base).await;
    browser
        .wait_for(status, Duration::from_secs(30), |v| v == "live")
        .await;
    let remaining = format!(
        "const el = document.querySelector('[data-sale-id=\"{voucher}\"] [data-field=\"remaining\"]'); \
         return el ? el.textContent : null;"
    );
    browser.wait_for(&remaining, WAIT, |v| v == "5").await;
    assert_eq!(
        browser.eval("return window.seckillMark || null;").await,
        "same page",
        "no reload"
    );
}

/// A page refused because too many watch retries by itself, after a few seconds (not at
/// once, not never), and once in it says how many sales it leaves out.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_refused_page_retries_after_a_backoff_and_says_how_many_sales_it_leaves_out(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let (_api, base) = app
        .spawn_server(
            "api",
            &[
                ("LIVE_MAX_VIEWERS", "1".to_string()),
                ("LIVE_MAX_SALES", "1".to_string()),
            ],
        )
        .await;
    app.open_sale(5).await;
    app.open_sale(5).await;
    let client = reqwest::Client::new();
    let held = Events::open(&client, &base).await;

    let browser = Browser::start().await;
    browser.goto(&format!("{base}/live")).await;
    let status = "return document.getElementById('status').textContent;";
    let busy = browser
        .wait_for(status, WAIT, |v| {
            v.as_str().is_some_and(|s| s.starts_with("busy"))
        })
        .await;
    // The first wait is 3 s ± 50%.
    let secs: u64 = busy
        .as_str()
        .unwrap()
        .trim_start_matches("busy; retrying in ")
        .trim_end_matches('s')
        .parse()
        .unwrap();
    assert!((2..=5).contains(&secs), "{busy}");
    // Then doubling to a minute, each ±50%: (refusals so far, least, most) in ms.
    for (n, least, most) in [(1, 3_000, 9_000), (2, 6_000, 18_000), (9, 30_000, 90_000)] {
        for _ in 0..20 {
            let ms = browser
                .eval(&format!("return retryDelay({n});"))
                .await
                .as_u64()
                .unwrap();
            assert!((least..=most).contains(&ms), "after {n} refusals: {ms} ms");
        }
    }

    drop(held);
    // The page may be well into a doubled wait by now (its second is up to 9 s, its
    // third up to 18 s on a slow machine): give it a minute.
    browser
        .wait_for(status, Duration::from_secs(60), |v| v == "live")
        .await;
    let note = browser
        .wait_for(
            "const t = document.getElementById('truncated'); return t.hidden ? null : t.textContent;",
            WAIT,
            |v| !v.is_null(),
        )
        .await;
    assert!(
        note.as_str().unwrap().starts_with("Showing 1 of 2 sales"),
        "{note}"
    );
    let errors: Vec<Value> = browser
        .console()
        .await
        .into_iter()
        .filter(|e| e["level"] == "SEVERE" && !e["message"].to_string().contains("503"))
        .collect();
    assert!(errors.is_empty(), "console: {errors:?}");
}

/// Snapshots that keep arriving with the same `at` (a producer that stopped while
/// something keeps sending its last snapshot) mark the page stale, as no snapshot at all
/// does; once `at` moves again the page is live. (The stream is closed and `render`
/// fed by hand: the server always sends a new `at`.)
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn the_page_says_stale_when_the_snapshots_time_stops_advancing(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let browser = Browser::start().await;
    browser.goto(&app.url("/live")).await;
    let status = "return document.getElementById('status').textContent;";
    browser.wait_for(status, WAIT, |v| v == "live").await;
    browser
        .eval(
            "source.close(); \
             const snap = {at: new Date().toISOString(), open_total: 0, truncated: false, \
                           worker: {length: 0, pending: 0, lag: 0, dead_letters: 0}, \
                           sales: [], unavailable: []}; \
             window.feed = setInterval(() => render(snap), 300); return true;",
        )
        .await;
    browser
        .wait_for(status, WAIT, |v| {
            v.as_str().is_some_and(|s| s.starts_with("no update for"))
        })
        .await;
    browser
        .eval(
            "clearInterval(window.feed); \
             window.feed = setInterval(() => render({at: new Date().toISOString(), \
                 open_total: 0, truncated: false, \
                 worker: {length: 0, pending: 0, lag: 0, dead_letters: 0}, \
                 sales: [], unavailable: []}), 300); return true;",
        )
        .await;
    browser.wait_for(status, WAIT, |v| v == "live").await;
}

/// `sale`'s id, whether it is sold out, and its state, of each sale in `snapshot`.
fn order_of(snapshot: &Value) -> Vec<(i64, bool, String)> {
    snapshot["sales"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["id"].as_i64().unwrap(),
                s["sold_out"]
                    .as_bool()
                    .unwrap_or_else(|| panic!("no sold_out: {s}")),
                s["state"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// Sales of one unit sold (the orders written, or one still in flight), a sale still
/// selling that ends last, an upcoming one and one just ended: `(sold and written, sold
/// in flight, selling, upcoming, ended)`.
async fn sales_mid_sale(app: &TestApp) -> (Vec<i64>, i64, i64, i64, i64) {
    use chrono::Duration as Minutes;
    let now = chrono::Utc::now();
    let mut sold = Vec::new();
    for i in 0..3 {
        let voucher = app
            .create_sale(1, now - Minutes::minutes(1), now + Minutes::minutes(10 + i))
            .await;
        let (status, body) = app.grab(voucher, 100 + i).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{body}");
        sold.push(voucher);
    }
    let ended = app
        .create_sale(5, now - Minutes::minutes(1), now + Minutes::minutes(30))
        .await;
    app.drain().await;
    sqlx::query(
        "UPDATE seckill_vouchers SET begin_time = now() - interval '10 minutes', \
         end_time = now() - interval '1 minute' WHERE voucher_id = $1",
    )
    .bind(ended)
    .execute(&app.db)
    .await
    .unwrap();
    // Sold out in Redis, its order not yet in Postgres (whose stock still counts it).
    let in_flight = app
        .create_sale(1, now - Minutes::minutes(1), now + Minutes::minutes(20))
        .await;
    let (status, body) = app.grab(in_flight, 200).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let selling = app
        .create_sale(50, now - Minutes::minutes(1), now + Minutes::hours(2))
        .await;
    let (status, body) = app.grab(selling, 300).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let upcoming = app
        .create_sale(5, now + Minutes::hours(1), now + Minutes::hours(3))
        .await;
    (sold, in_flight, selling, upcoming, ended)
}

/// Mid-sale the page lists the sale still selling first, then the upcoming one, then
/// the open ones with nothing left (sold out, by Redis's stock: one whose order is still
/// in flight too), then the ended one, the soonest ending first within each; and when it
/// cannot show every sale the selling one is never the one left out, not even for a
/// sale Postgres still counts units of.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn the_selling_sale_comes_first_and_the_limit_never_leaves_it_out_for_a_sold_out_one(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let (sold, in_flight, selling, upcoming, ended) = sales_mid_sale(&app).await;
    let mut events = Events::open(&app.client, &app.base).await;
    let snapshot = events.next(WAIT).await;
    let open = |id| (id, true, "open".to_string());
    assert_eq!(
        order_of(&snapshot),
        vec![
            (selling, false, "open".to_string()),
            (upcoming, false, "upcoming".to_string()),
            open(sold[0]),
            open(sold[1]),
            open(sold[2]),
            open(in_flight),
            (ended, false, "ended".to_string()),
        ],
        "{snapshot}"
    );

    // One sale shown: the selling one, although Postgres still counts a unit of the
    // sale whose order is in flight, and that sale ends sooner.
    for limit in ["1", "2"] {
        let (_api, base) = app
            .spawn_server("api", &[("LIVE_MAX_SALES", limit.to_string())])
            .await;
        let mut events = Events::open(&app.client, &base).await;
        let snapshot = events.next(WAIT).await;
        let shown: Vec<i64> = order_of(&snapshot).iter().map(|s| s.0).collect();
        assert_eq!(shown[0], selling, "LIVE_MAX_SALES={limit}: {snapshot}");
        assert_eq!(snapshot["truncated"], true, "{snapshot}");
        assert_eq!(snapshot["open_total"], 7, "{snapshot}");
        if limit == "2" {
            assert_eq!(shown, [selling, upcoming], "{snapshot}");
        }
    }
}

/// A page opening while grabs flow gets the real grab rate and admission time in its
/// very first snapshot (never a 0 while the producer builds up a history): they are
/// the last seconds' figures Redis keeps, the same on every instance.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_new_pages_first_snapshot_carries_the_real_grab_rate_and_admission_time(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(100_000).await;
    let stop = std::sync::atomic::AtomicBool::new(false);
    let grabbing = async {
        let mut user = 1;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let (status, body) = app.grab(voucher, user).await;
            assert_eq!(status, StatusCode::ACCEPTED, "{body}");
            user += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        user - 1
    };
    let watching = async {
        // No page has watched yet: the process has no history of this sale's counts.
        tokio::time::sleep(Duration::from_secs(4)).await;
        let mut first = Events::open(&app.client, &app.base).await;
        let snapshot = first.next(WAIT).await;
        let (_api, other) = app.spawn_server("api", &[]).await;
        let there = Events::open(&app.client, &other).await.next(WAIT).await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        (snapshot, there)
    };
    let (grabs, (snapshot, there)) = tokio::join!(grabbing, watching);
    let view = sale_in(&snapshot, voucher).unwrap();
    let rate = view["grabs_per_sec"].as_f64().unwrap_or(0.0);
    // About 40 a second on an idle machine; a busy one grabs fewer.
    assert!(rate >= 5.0, "grabs/s {rate} in the first snapshot: {view}");
    let p99 = view["admission_p99_ms"].as_f64();
    assert!(p99.is_some_and(|ms| ms > 0.0), "{view}");
    assert_eq!(view["errors_per_sec"], 0.0, "{view}");
    // A new instance's first snapshot too: no history there at all.
    let view = sale_in(&there, voucher).unwrap();
    let rate = view["grabs_per_sec"].as_f64().unwrap_or(0.0);
    assert!(rate >= 5.0, "grabs/s {rate} on another instance: {view}");
    println!("{grabs} grabs; first snapshots: {view}");
}

/// The figures of a sale's orders add up, in every snapshot: admitted = persisted + in
/// flight + dead letters, and persisted = awaiting payment + paid + cancelled +
/// expired; once the grab counts are in, admitted is the count of 202s.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_sales_orders_add_up_admitted_is_persisted_plus_in_flight_plus_dead_letters(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(10).await;
    let mut orders = Vec::new();
    for user in 1..=5 {
        let (status, body) = app.grab(voucher, user).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{body}");
        orders.push((user, body["order_id"].as_str().unwrap().to_string()));
        if user == 3 {
            // Three written; two left in flight.
            app.drain().await;
        }
    }
    let adds_up = |v: &Value| {
        let o = &v["orders"];
        let n = |f: &str| o[f].as_i64().unwrap_or_else(|| panic!("orders.{f}: {v}"));
        assert_eq!(
            n("persisted"),
            n("created") + n("paid") + n("cancelled") + n("expired"),
            "{v}"
        );
        if let Some(in_flight) = o["in_flight"].as_i64() {
            assert_eq!(
                n("admitted"),
                n("persisted") + in_flight + v["dead_letters"].as_i64().unwrap(),
                "{v}"
            );
        } else {
            assert!(o["admitted"].is_null(), "{v}");
        }
    };
    let mut events = Events::open(&app.client, &app.base).await;
    let view = events
        .until(voucher, WAIT, |v| {
            adds_up(v);
            v["outcomes"]["admitted"] == 5
        })
        .await;
    assert_eq!(view["orders"]["admitted"], 5, "{view}");
    assert_eq!(view["orders"]["persisted"], 3, "{view}");
    assert_eq!(view["orders"]["in_flight"], 2, "{view}");

    // Paid, cancelled (its unit back on sale and sold again), all written.
    let (status, _) = app.pay(&orders[0].1, orders[0].0).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = app.cancel(&orders[1].1, orders[1].0).await;
    assert_eq!(status, StatusCode::OK);
    let (status, body) = app.grab(voucher, 6).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    app.drain().await;
    let view = events
        .until(voucher, WAIT, |v| {
            adds_up(v);
            v["outcomes"]["admitted"] == 6 && v["orders"]["in_flight"] == 0
        })
        .await;
    assert_eq!(view["orders"]["admitted"], 6, "{view}");
    assert_eq!(view["orders"]["persisted"], 6, "{view}");
    assert_eq!(view["orders"]["created"], 4, "{view}");
    assert_eq!(view["orders"]["paid"], 1, "{view}");
    assert_eq!(view["orders"]["cancelled"], 1, "{view}");
    // 10 units, 6 taken, 1 given back.
    assert_eq!(view["remaining"], 5, "{view}");
}

/// Grabs answered 503 are counted as their sale's errors, by kind (nothing reserved: a
/// sale whose Redis state is being repaired; outcome unknown: a call Redis answered
/// too late), with their rate over the last seconds.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn grabs_answered_503_are_counted_as_their_sales_errors_with_their_rate(db: PgPool) {
    // A Redis of its own: it is blocked below.
    let redis = crate::common::faults::PrivateRedis::start();
    let app = TestApp::spawn_with(db, redis.url.clone(), false).await;
    let voucher = app.open_sale(5).await;
    let (status, body) = app.grab(voucher, 1).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");

    // A corrupt stock: refused, nothing reserved, while the sale is repaired.
    let _: i64 = app
        .redis_cmd(
            redis::cmd("HSET")
                .arg(app.keys.voucher(vid(voucher)))
                .arg("stock")
                .arg("x"),
        )
        .await;
    let (status, body) = app.grab(voucher, 2).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(body["error"]["outcome"].is_null(), "{body}");
    let deadline = Instant::now() + WAIT;
    while app.grab(voucher, 3).await.0 != StatusCode::ACCEPTED {
        assert!(Instant::now() < deadline, "never repaired");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Redis answers after the API gave up: the outcome is unknown.
    let blocked = crate::http_limits::block_redis(&redis.url, 3_500).await;
    let (status, body) = app.grab(voucher, 4).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(body["error"]["outcome"], "unknown", "{body}");
    blocked.await.unwrap();

    let mut events = Events::open(&app.client, &app.base).await;
    let view = events
        .until(voucher, WAIT, |v| {
            v["outcomes"]["unknown"] == 1 && v["errors_per_sec"].as_f64() > Some(0.0)
        })
        .await;
    assert!(
        view["outcomes"]["unavailable"].as_u64() >= Some(1),
        "{view}"
    );
    assert_eq!(view["outcomes"]["admitted"], 2, "{view}");
    // The grab whose answer was lost did go through: an order in flight, not a 202.
    assert_eq!(view["orders"]["admitted"], 3, "{view}");
}

/// In a real browser, mid-sale: the selling sale's card comes first, a sold-out open
/// sale is badged "sold out", the orders read as sums that add up, the rates and the
/// admission time are shown, and it all fits a phone.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn the_page_puts_the_selling_sale_first_badges_sold_out_and_shows_sums_rates_and_errors(
    db: PgPool,
) {
    let app = TestApp::spawn(db).await;
    let (sold, in_flight, selling, upcoming, ended) = sales_mid_sale(&app).await;
    let browser = Browser::start().await;
    browser.goto(&app.url("/live")).await;
    let cards = "return [...document.querySelectorAll('[data-sale-id]')].map(c => \
                 [Number(c.dataset.saleId), c.querySelector('[data-field=\"state\"]').textContent]);";
    let shown = browser
        .wait_for(cards, WAIT, |v| v.as_array().is_some_and(|a| a.len() == 7))
        .await;
    let sold_out = |id: i64| serde_json::json!([id, "sold out"]);
    assert_eq!(
        shown,
        serde_json::json!([
            [selling, "open"],
            [upcoming, "upcoming"],
            sold_out(sold[0]),
            sold_out(sold[1]),
            sold_out(sold[2]),
            sold_out(in_flight),
            [ended, "ended"],
        ])
    );

    let card = |id: i64| format!("document.querySelector('[data-sale-id=\"{id}\"]')");
    // The selling sale: one admitted, in flight; read as the sum it is.
    let sums = format!(
        "return [...{}.querySelectorAll('.sum')].map(dl => dl.innerText.replace(/\\s+/g, ' ').trim());",
        card(selling)
    );
    let sums = browser
        .wait_for(&sums, WAIT, |v| {
            v[0].as_str().is_some_and(|s| s.contains("in flight 1"))
        })
        .await;
    assert_eq!(
        sums,
        serde_json::json!([
            "admitted 1 = persisted 0 + in flight 1 + dead letters 0",
            "persisted 0 = to pay 0 + paid 0 + cancelled 0 + expired 0"
        ])
    );
    // A written sale's sums.
    let written = format!(
        "return {}.querySelector('.sum').innerText.replace(/\\s+/g, ' ').trim();",
        card(sold[0])
    );
    assert_eq!(
        browser.eval(&written).await,
        "admitted 1 = persisted 1 + in flight 0 + dead letters 0"
    );
    let rates = format!(
        "const c = {}; return ['grabs_per_sec', 'errors_per_sec', 'admission_p99']\
         .map(f => c.querySelector('[data-field=\"' + f + '\"]').textContent);",
        card(selling)
    );
    let rates = browser
        .wait_for(&rates, WAIT, |v| {
            v[2].as_str().is_some_and(|s| s.ends_with(" ms"))
        })
        .await;
    assert_ne!(rates[0], "–", "{rates}");
    assert_eq!(rates[1], "0", "{rates}");

    // A phone's width: nothing wider than the screen.
    browser.resize(390, 844).await;
    browser
        .wait_for(
            "return document.documentElement.scrollWidth - window.innerWidth;",
            WAIT,
            |v| v.as_i64().is_some_and(|px| px <= 0),
        )
        .await;
    let errors: Vec<Value> = browser
        .console()
        .await
        .into_iter()
        .filter(|e| e["level"] == "SEVERE" || e["level"] == "WARNING")
        .collect();
    assert!(errors.is_empty(), "console: {errors:?}");
}
