//! The live page in a real (headless) Chromium: updates, hostile titles, restarts,
//! backoff, staleness and the order of the sales it shows.

use super::*;

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn the_live_page_in_a_real_browser_updates_after_grabs_without_a_reload(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let voucher = app.open_sale(5).await;
    let browser = Browser::start().await;
    browser.goto(&format!("{}/live", app.admin_base)).await;

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
    browser.goto(&format!("{}/live", app.admin_base)).await;
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
    // The page is served by the internal listener, which comes back at the same address.
    let admin_port = faults::free_port();
    let admin_bind = ("ADMIN_BIND", format!("127.0.0.1:{admin_port}"));
    let (mut first, base) = app
        .spawn_server("api", std::slice::from_ref(&admin_bind))
        .await;
    let port = base.rsplit(':').next().unwrap().to_string();
    let voucher = app.open_sale(5).await;
    let browser = Browser::start().await;
    browser
        .goto(&format!("http://127.0.0.1:{admin_port}/live"))
        .await;
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
        &[("BIND", format!("127.0.0.1:{port}")), admin_bind],
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
    let admin_port = crate::common::faults::free_port();
    let (_api, base) = app
        .spawn_server(
            "api",
            &[
                ("LIVE_MAX_VIEWERS", "1".to_string()),
                ("LIVE_MAX_SALES", "1".to_string()),
                ("ADMIN_BIND", format!("127.0.0.1:{admin_port}")),
            ],
        )
        .await;
    app.open_sale(5).await;
    app.open_sale(5).await;
    let client = reqwest::Client::new();
    let held = Events::open(&client, &base).await;

    let browser = Browser::start().await;
    browser
        .goto(&format!("http://127.0.0.1:{admin_port}/live"))
        .await;
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
    browser.goto(&format!("{}/live", app.admin_base)).await;
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
    browser.goto(&format!("{}/live", app.admin_base)).await;
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
            "persisted 0 = to pay 0 + paid 0 + used 0 + refunding 0 + refunded 0 + cancelled 0 + expired 0"
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

/// A lottery sale's card says when its entries close and how many shoppers entered so
/// far, then how many won among how many.
#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_lottery_sales_card_shows_its_entries_closing_its_entrants_and_then_its_draw(db: PgPool) {
    let app = TestApp::spawn(db).await;
    let begin = chrono::Utc::now() + chrono::Duration::milliseconds(2_000);
    let (status, voucher) = app
        .post_json(
            "/vouchers",
            Some(&app.admin_token()),
            &serde_json::json!({
                "shop_id": 1, "title": "drawn", "pay_value": 5000, "actual_value": 10000,
                "seckill": {"stock": 2, "begin_time": begin, "end_time": begin + chrono::Duration::hours(1),
                            "opening": {"mode": "lottery", "window_ms": 3000}},
            }),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{voucher}");
    let voucher = voucher["id"].as_i64().unwrap();

    let browser = Browser::start().await;
    browser.goto(&format!("{}/live", app.admin_base)).await;
    let line = format!(
        "const c = document.querySelector('[data-sale-id=\"{voucher}\"]'); \
         const l = c && c.querySelector('[data-field=\"lottery\"]'); \
         return l && !l.hidden ? l.textContent : null;"
    );
    let before = browser
        .wait_for(&line, WAIT, |v| {
            v.as_str().is_some_and(|t| t.contains("entries close in"))
        })
        .await;
    assert!(
        before
            .as_str()
            .unwrap()
            .starts_with("Lottery: entries close in"),
        "{before}"
    );

    tokio::time::sleep(
        (begin - chrono::Utc::now()).to_std().unwrap_or_default() + Duration::from_millis(100),
    )
    .await;
    let presses = futures::future::join_all((1..=3).map(|user| app.grab(voucher, user)));
    let entered = browser.wait_for(&line, WAIT, |v| {
        v.as_str().is_some_and(|t| t.ends_with("3 entrants so far"))
    });
    let (answers, entered) = tokio::join!(presses, entered);
    assert!(
        entered.as_str().unwrap().contains("entries close in"),
        "{entered}"
    );
    let won = answers
        .iter()
        .filter(|(s, _)| *s == StatusCode::ACCEPTED)
        .count();
    assert_eq!(won, 2);
    let drawn = browser
        .wait_for(&line, WAIT, |v| {
            v.as_str().is_some_and(|t| t.starts_with("Lottery drawn"))
        })
        .await;
    assert_eq!(drawn, "Lottery drawn: 2 winners among 3 entrants");
}
