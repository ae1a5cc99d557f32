//! `seckill demo`: a small sale against a running server, through its public API only,
//! so that a newcomer sees `/live` move and the outcome add up.
//!
//! It opens a sale as an admin (or uses `--voucher`), lets N distinct shoppers press
//! "grab" once each, spread evenly over a few seconds, prints what they were answered,
//! and waits until every admitted order is in Postgres (read back through the admin
//! listing of the sale's orders: a 202 is a promise, and this shows it kept).

use std::collections::{BTreeMap, HashSet};
use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::bail;
use futures_util::StreamExt;
use reqwest::{Client, StatusCode};
use serde_json::Value;

use crate::auth::{Expected, JwtKeys};
use crate::config::DemoArgs;
use crate::domain::{OrderId, VoucherId};
use crate::secret::Secret;

mod api;
use api::{read, Api};

mod replies;
use replies::Progress;
pub(crate) use replies::{classify, Replies, Reply};

const DEFAULT_URL: &str = "http://127.0.0.1:8080";
/// The admin the demo acts as (as `seckill token --user 1 --admin` would).
const ADMIN_USER: i64 = 1;
/// Most distinct error kinds listed under the table.
const ERROR_KINDS_SHOWN: usize = 5;

/// The API's base URL: `--url`, else `http://<BIND>` (a wildcard address reached on
/// loopback), else the default.
pub(crate) fn base_url(url: Option<&str>, bind: Option<&str>) -> anyhow::Result<String> {
    let raw = match (url, bind) {
        (Some(url), _) => url.to_string(),
        (None, Some(bind)) if !bind.is_empty() => {
            let addr: std::net::SocketAddr = bind
                .parse()
                .map_err(|_| anyhow::anyhow!("BIND {bind:?} is not an address; pass --url"))?;
            let ip = match addr.ip() {
                ip if ip.is_unspecified() => std::net::Ipv4Addr::LOCALHOST.into(),
                ip => ip,
            };
            format!("http://{}", std::net::SocketAddr::new(ip, addr.port()))
        }
        _ => DEFAULT_URL.to_string(),
    };
    let parsed = reqwest::Url::parse(&raw)
        .map_err(|e| anyhow::anyhow!("--url {raw:?} is not a URL ({e})"))?;
    if !matches!(parsed.scheme(), "http" | "https") || parsed.host().is_none() {
        bail!("--url {raw:?} must be an http:// or https:// URL of the API");
    }
    if parsed.query().is_some() || parsed.fragment().is_some() {
        bail!("--url {raw:?} must not have a query or fragment");
    }
    Ok(raw.trim_end_matches('/').to_string())
}

/// Runs the demo; exit 0 when every grab had an expected answer and every admitted order
/// reached Postgres, 1 otherwise.
pub(crate) async fn run(args: DemoArgs) -> anyhow::Result<ExitCode> {
    let base = base_url(args.url.as_deref(), args.bind.as_deref())?;
    let expected = Expected::new(args.jwt_issuer.as_deref(), args.jwt_audience.as_deref());
    // Checked here, not by clap, to say where the secret comes from.
    let secret = args
        .jwt_secret
        .as_ref()
        .map(Secret::expose)
        .ok_or_else(|| {
            anyhow::anyhow!(
            "the demo mints its tokens with the server's secret: set JWT_SECRET (or --jwt-secret)"
        )
        })?;
    let jwt = JwtKeys::with_expected(secret, expected)?;
    let last_user = args
        .first_user
        .checked_add(args.shoppers as i64 - 1)
        .ok_or_else(|| anyhow::anyhow!("--first-user plus --shoppers overflows a user id"))?;
    let api = Api {
        http: Client::builder()
            .timeout(Duration::from_secs(10))
            .pool_max_idle_per_host(args.concurrency as usize)
            .build()?,
        jwt: &jwt,
        base,
    };
    api.reachable().await?;
    let (voucher, stock) = sale(&api, &args).await?;
    let stock_text = stock.map_or("unknown".to_string(), |s| s.to_string());
    println!(
        "voucher {voucher}: stock {stock_text}, {} shoppers (users {}..={last_user}) over {:.1} s",
        args.shoppers, args.first_user, args.seconds
    );
    eprintln!("demo: watch it at /live on the server's internal listener (ADMIN_BIND, 127.0.0.1:9090 by default)");

    let replies = press(&api, voucher, &args).await;
    let grabbed_at = Instant::now();
    println!();
    print!("{}", replies.table());

    let ids: HashSet<OrderId> = replies
        .admitted
        .iter()
        .filter_map(|id| id.parse().ok())
        .collect();
    let persisted = persisted(&api, voucher, &ids, &args, grabbed_at).await;
    match api.sale_stock(voucher).await {
        Ok(Some(left)) => println!("{:<16} {left:>9}", "stock_left"),
        Ok(None) => {}
        Err(e) => println!("{:<16} {:>9}   ({e:#})", "stock_left", "unknown"),
    }
    let mut ok = verdict(&replies, &ids, &persisted, args.persist_timeout);
    match args
        .payment_webhook_secrets
        .iter()
        .find(|s| !s.expose().is_empty())
    {
        Some(secret) if persisted.found == ids.len() => {
            let paying = paying_share(&ids, args.paying);
            let paid = pay(&api, voucher, &paying, secret).await;
            println!("{:<16} {:>9}", "paid", paid.as_ref().map_or(0, |n| *n));
            match paid {
                Ok(n) if n == paying.len() => {}
                Ok(n) => {
                    eprintln!(
                        "demo: the provider paid {} orders, {n} were paid",
                        paying.len()
                    );
                    ok = false;
                }
                Err(e) => {
                    eprintln!("demo: paying: {e:#}");
                    ok = false;
                }
            }
        }
        Some(_) => eprintln!("demo: not every order was written: nobody pays"),
        None => eprintln!("demo: PAYMENT_WEBHOOK_SECRETS unset: nobody pays"),
    }
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// The first `percent` of the admitted orders, in id order.
fn paying_share(ids: &HashSet<OrderId>, percent: u64) -> Vec<OrderId> {
    let mut ids: Vec<OrderId> = ids.iter().copied().collect();
    ids.sort_unstable();
    ids.truncate((ids.len() as u64 * percent / 100) as usize);
    ids
}

/// The payment provider's notification for each order (the voucher's price, signed as
/// `seckill notify` signs); how many the API answered `paid`.
async fn pay(
    api: &Api<'_>,
    voucher: VoucherId,
    orders: &[OrderId],
    secret: &Secret,
) -> anyhow::Result<usize> {
    let resp = api
        .http
        .get(format!("{}/vouchers/{voucher}", api.base))
        .send()
        .await?;
    let (_, body) = read(resp).await;
    let price = body["pay_value"]
        .as_i64()
        .ok_or_else(|| anyhow::anyhow!("voucher {voucher} has no price"))?;
    let mut paid = 0;
    for order in orders {
        let body = serde_json::to_vec(&serde_json::json!({
            "id": format!("evt_demo_{order}"),
            "type": "payment.succeeded",
            "order_id": order,
            "amount": price,
            "currency": crate::domain::CURRENCY,
            "transaction_id": format!("tx_demo_{order}"),
        }))?;
        let t = chrono::Utc::now().timestamp();
        let resp = api
            .http
            .post(format!("{}/payments/notifications", api.base))
            .header(
                crate::lifecycle::signature::HEADER,
                crate::lifecycle::signature::sign(secret, t, &body),
            )
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body)
            .send()
            .await?;
        let (status, answer) = read(resp).await;
        if status == StatusCode::OK && answer["outcome"] == "paid" {
            paid += 1;
        }
    }
    Ok(paid)
}

/// The sale to grab: `--voucher`'s, or a new one open well past the demo (so that
/// `/live` shows it as a running sale); its voucher id and stock.
async fn sale(api: &Api<'_>, args: &DemoArgs) -> anyhow::Result<(VoucherId, Option<i64>)> {
    // Positive, as clap checked.
    Ok(match args.voucher.map(VoucherId::try_from).transpose()? {
        Some(voucher) => (voucher, api.sale_stock(voucher).await?),
        None => {
            let lasts = Duration::from_secs_f64(args.seconds) + Duration::from_secs(600);
            let voucher = api.open_sale(args.stock, lasts).await?;
            (voucher, Some(args.stock as i64))
        }
    })
}

/// Every shopper presses once: shopper i at start + i/N of the spread, at most
/// `--concurrency` in flight, each with a token minted just before (it outlives the
/// press's wait). Progress is shown as answers come.
async fn press(api: &Api<'_>, voucher: VoucherId, args: &DemoArgs) -> Replies {
    let shoppers = args.shoppers;
    let started = tokio::time::Instant::now();
    let step = Duration::from_secs_f64(args.seconds).div_f64(shoppers as f64);
    let first_user = args.first_user;
    let mut pressed = futures_util::stream::iter(0..shoppers)
        .map(|i| async move {
            tokio::time::sleep_until(started + step.mul_f64(i as f64)).await;
            match api.jwt.mint(first_user + i as i64, false, 600) {
                Ok(token) => api.grab(voucher, token).await,
                Err(e) => Reply::Error(format!("minting a token: {e}")),
            }
        })
        .buffer_unordered(args.concurrency as usize);
    let mut replies = Replies::default();
    let mut progress = Progress::new(shoppers);
    while let Some(answer) = pressed.next().await {
        replies.add(answer);
        progress.update(&replies, false);
    }
    progress.update(&replies, true);
    replies
}

/// How many admitted orders were read back from Postgres (through the admin listing),
/// and the last listing's error if it failed.
struct Landed {
    found: usize,
    last_error: Option<String>,
}

/// Reads the admitted orders back until all are there or `--persist-timeout` has passed
/// since the last answer, and prints the count. The listing is retried until the
/// deadline (a 503 while the server is busy, a timeout, a restart): the grabs are over,
/// so a failure here is the demo's outcome (exit 1, with what is known), not bad input.
async fn persisted(
    api: &Api<'_>,
    voucher: VoucherId,
    ids: &HashSet<OrderId>,
    args: &DemoArgs,
    grabbed_at: Instant,
) -> Landed {
    if !ids.is_empty() {
        eprintln!(
            "demo: waiting up to {} s for the {} admitted orders to reach Postgres",
            args.persist_timeout,
            ids.len()
        );
    }
    let deadline = grabbed_at + Duration::from_secs(args.persist_timeout);
    let mut seen = Landed {
        found: 0,
        last_error: None,
    };
    while !ids.is_empty() {
        match api.persisted(voucher, ids).await {
            Ok(found) => {
                seen.found = found;
                seen.last_error = None;
            }
            Err(e) => seen.last_error = Some(format!("{e:#}")),
        }
        if seen.found == ids.len() || Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!();
    println!(
        "{:<16} {:>9}   of {} admitted, in Postgres {:.1} s after the last answer{}",
        "persisted",
        seen.found,
        ids.len(),
        grabbed_at.elapsed().as_secs_f64(),
        if seen.last_error.is_some() {
            " (at least: the last listing failed)"
        } else {
            ""
        }
    );
    seen
}

/// Whether the demo showed what it should: every admitted order in Postgres, every
/// press answered as expected, not every press refused by a limit. Says why not.
fn verdict(
    answers: &Replies,
    ids: &HashSet<OrderId>,
    persisted: &Landed,
    persist_timeout: u64,
) -> bool {
    let mut ok = true;
    if let Some(e) = &persisted.last_error {
        eprintln!(
            "demo: cannot read the sale's orders back after {persist_timeout} s (the last try: {e}): is the server still running?"
        );
        ok = false;
    } else if persisted.found < ids.len() {
        eprintln!(
            "demo: {} admitted orders are not in Postgres after {persist_timeout} s: is a worker running?",
            ids.len() - persisted.found,
        );
        ok = false;
    }
    if answers.error_count() > 0 {
        eprintln!(
            "demo: {} grabs had no expected answer (see the errors above)",
            answers.error_count()
        );
        ok = false;
    }
    if answers.rate_limited == answers.total() {
        eprintln!(
            "demo: every press was rate_limited: the server's per-IP limit (RATE_LIMIT_PER_IP) \
             or its per-user limit (an earlier run's shoppers: try another --first-user) \
             refused them all, so this demo showed nothing of the sale"
        );
        ok = false;
    }
    ok
}

#[cfg(test)]
mod tests;
