//! The counters behind the snapshots: one producer for many pages, flushes lost, failed
//! or stalled, and recent rates over whole seconds.

use super::*;

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
        .bearer_auth(crate::common::admin_bearer())
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
            .bearer_auth(crate::common::admin_bearer())
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
    counter.add(voucher, Outcome::SoldOut, 1);
    counter.flush().await.unwrap();

    counter.add(voucher, admitted(), 5);
    let () = counter
        .cmd(redis::cmd("CLIENT").arg("PAUSE").arg(1500).arg("WRITE"))
        .await;
    let cut = tokio::time::timeout(Duration::from_millis(800), counter.flush()).await;
    assert!(cut.is_err(), "the flush must be cut off by its deadline");
    counter.add(voucher, admitted(), 1);
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
    let totals = read.unwrap()[0].totals;
    assert_eq!(
        (totals.outcome("admitted"), totals.outcome("sold_out")),
        (6, 1)
    );
    assert_eq!(totals.outcomes.iter().sum::<u64>(), 7, "{totals:?}");
    assert_eq!((totals.at_edge, totals.errors), (0, [0, 0]), "{totals:?}");
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
    counter.add(bad, admitted(), 3);
    for voucher in good.clone() {
        counter.add(voucher, admitted(), 2);
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

/// The grabs and errors a flush adds are read back summed over the last whole seconds,
/// by Redis's clock: from the second after the flush's, for the window's length, and
/// then they are gone; the totals stay.
#[tokio::test]
async fn recent_rates_are_read_over_the_last_whole_seconds_and_then_leave() {
    use seckill::admission::tally::{self, Answer};
    let counter = Counter::new(&crate::common::redis_url()).await;
    let voucher = 1;
    counter.tally.add_answers([
        (vid(voucher), Answer::Decided(admitted())),
        (vid(voucher), Answer::Decided(Outcome::SoldOut)),
        (vid(voucher), Answer::Failed { unknown: true }),
    ]);
    counter.flush().await.unwrap();
    let read = || async {
        tally::read(&counter.conn, &counter.keys, &[vid(voucher)])
            .await
            .unwrap()[0]
    };
    let live = read().await;
    let pair = |t: tally::SaleCounts| (t.outcome("admitted"), t.outcome("sold_out"));
    assert_eq!(pair(live.totals), (1, 1));
    assert_eq!(live.totals.errors, [0, 1]);

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

    tokio::time::sleep(Duration::from_secs(tally::WINDOW_SECS + 2)).await;
    let live = read().await;
    assert_eq!(live.recent, tally::Recent::default());
    assert_eq!(pair(live.totals), (1, 1), "the totals stay");
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
