//! The demo's client of the service: every call it makes, through the public API only.

use anyhow::{bail, Context};
use reqwest::{Client, StatusCode};
use serde_json::{json, Value};

use super::*;

/// The server's answer as JSON (`Null` when it is not JSON).
pub(super) async fn read(resp: reqwest::Response) -> (StatusCode, Value) {
    let status = resp.status();
    let body = resp.json::<Value>().await.unwrap_or(Value::Null);
    (status, body)
}

/// The error message of an error answer, for humans.
fn message(status: StatusCode, body: &Value) -> String {
    match (
        body["error"]["code"].as_str(),
        body["error"]["message"].as_str(),
    ) {
        (Some(code), Some(msg)) => format!("{} {code}: {msg}", status.as_u16()),
        _ => format!("{status}"),
    }
}

/// How long each admin token the demo mints lives: one is minted for every admin call,
/// so a long run (or a long wait for Postgres) never meets an expired one.
const ADMIN_TOKEN_TTL: u64 = 600;

pub(super) struct Api<'k> {
    pub(super) http: Client,
    pub(super) base: String,
    pub(super) jwt: &'k JwtKeys,
}

impl Api<'_> {
    /// A fresh admin token.
    pub(super) fn admin(&self) -> anyhow::Result<String> {
        self.jwt
            .mint(ADMIN_USER, true, ADMIN_TOKEN_TTL)
            .context("minting the admin token")
    }

    /// Whether the API answers at all (a clear error when it does not, naming --url).
    pub(super) async fn reachable(&self) -> anyhow::Result<()> {
        match self.http.get(format!("{}/healthz", self.base)).send().await {
            Ok(r) if r.status().is_success() => Ok(()),
            Ok(r) => bail!(
                "{} answered /healthz with {}: is it the seckill API? (--url)",
                self.base,
                r.status()
            ),
            Err(e) => bail!(
                "cannot reach the API at {} ({e}): is `seckill serve` running there? (--url)",
                self.base
            ),
        }
    }

    /// Opens a sale of `stock` now, lasting past the demo, and returns its voucher id.
    pub(super) async fn open_sale(&self, stock: u64, lasts: Duration) -> anyhow::Result<VoucherId> {
        let now = chrono::Utc::now();
        // A little in the past: the server's clock judges `begin_time`.
        let begin = now - chrono::Duration::seconds(5);
        let end = now + chrono::Duration::from_std(lasts)?;
        let body = json!({
            "shop_id": 1, "title": "seckill demo", "sub_title": "50 off 100",
            "rules": "one per person", "pay_value": 5000, "actual_value": 10000,
            "seckill": {"stock": stock, "begin_time": begin, "end_time": end},
        });
        let resp = self
            .http
            .post(format!("{}/vouchers", self.base))
            .bearer_auth(self.admin()?)
            .json(&body)
            .send()
            .await
            .context("creating the voucher")?;
        let (status, body) = read(resp).await;
        match status {
            StatusCode::CREATED => body["id"]
                .as_i64()
                .and_then(VoucherId::new)
                .ok_or_else(|| anyhow::anyhow!("the new voucher has no id: {body}")),
            StatusCode::UNAUTHORIZED => bail!(
                "the server refused the demo's admin token ({}): is JWT_SECRET the server's \
                 (and JWT_ISSUER / JWT_AUDIENCE as it checks them)?",
                message(status, &body)
            ),
            _ => bail!("creating the voucher failed: {}", message(status, &body)),
        }
    }

    /// An existing flash-sale voucher's live stock.
    pub(super) async fn sale_stock(&self, voucher: VoucherId) -> anyhow::Result<Option<i64>> {
        let resp = self
            .http
            .get(format!("{}/vouchers/{voucher}", self.base))
            .send()
            .await
            .with_context(|| format!("reading voucher {voucher}"))?;
        let (status, body) = read(resp).await;
        match status {
            StatusCode::OK if body["seckill"].is_object() => Ok(body["stock"].as_i64()),
            StatusCode::OK => bail!("voucher {voucher} is not a flash sale: nothing to grab"),
            StatusCode::NOT_FOUND => bail!("voucher {voucher} does not exist"),
            _ => bail!("reading voucher {voucher}: {}", message(status, &body)),
        }
    }

    pub(super) async fn grab(&self, voucher: VoucherId, token: String) -> Reply {
        let sent = self
            .http
            .post(format!("{}/vouchers/{voucher}/seckill", self.base))
            .bearer_auth(token)
            .send()
            .await;
        match sent {
            Ok(resp) => {
                let (status, body) = read(resp).await;
                classify(status, &body)
            }
            Err(e) if e.is_timeout() => Reply::Error("timed out".into()),
            Err(_) => Reply::Error("no answer".into()),
        }
    }

    /// How many of `ids` the sale's order listing (orders written to Postgres) holds.
    pub(super) async fn persisted(
        &self,
        voucher: VoucherId,
        ids: &HashSet<OrderId>,
    ) -> anyhow::Result<usize> {
        let mut found = 0;
        let mut after: Option<String> = None;
        loop {
            let mut url = format!("{}/vouchers/{voucher}/orders?limit=1000", self.base);
            if let Some(cursor) = &after {
                url += &format!("&after={cursor}");
            }
            let resp = self
                .http
                .get(url)
                .bearer_auth(self.admin()?)
                .send()
                .await
                .context("listing the sale's orders")?;
            let (status, page) = read(resp).await;
            if status != StatusCode::OK {
                bail!("listing the sale's orders: {}", message(status, &page));
            }
            found += page["items"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|o| o["order_id"].as_str()?.parse::<OrderId>().ok())
                .filter(|id| ids.contains(id))
                .count();
            match page["next"].as_str() {
                Some(next) if found < ids.len() => after = Some(next.to_string()),
                _ => return Ok(found),
            }
        }
    }
}
