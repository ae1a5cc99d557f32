//! Talking to the app under test over HTTP: tokens, URLs, JSON requests, sales,
//! grabs, payments, cancellations and the metrics page.

use super::*;

impl TestApp {
    pub fn token(&self, user_id: i64) -> String {
        self.jwt.mint(user_id, false, 3600).unwrap()
    }

    pub fn admin_token(&self) -> String {
        self.jwt.mint(1, true, 3600).unwrap()
    }

    /// A token of `shop`'s staff member `user_id`.
    pub fn staff_token(&self, user_id: i64, shop: i64) -> String {
        let shop = seckill::domain::ShopId::new(shop).unwrap();
        (self.jwt)
            .mint_as(user_id, seckill::auth::Role::Shop(shop), 3600)
            .unwrap()
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    /// Sends a request and returns the status and the JSON body (`Null` if none).
    pub async fn send(&self, req: reqwest::RequestBuilder) -> (StatusCode, Value) {
        let resp = req.send().await.expect("request failed");
        let status = resp.status();
        let text = resp.text().await.unwrap();
        let body = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}"))
        };
        (status, body)
    }

    pub async fn get(&self, path: &str, token: Option<&str>) -> (StatusCode, Value) {
        let mut req = self.client.get(self.url(path));
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        self.send(req).await
    }

    pub async fn post_json(
        &self,
        path: &str,
        token: Option<&str>,
        body: &Value,
    ) -> (StatusCode, Value) {
        let mut req = self.client.post(self.url(path)).json(body);
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        self.send(req).await
    }

    /// Creates a flash-sale voucher through the API and returns its id.
    pub async fn create_sale(&self, stock: i64, begin: DateTime<Utc>, end: DateTime<Utc>) -> i64 {
        let body = sale_body(stock, begin, end);
        let (status, voucher) = self
            .post_json("/vouchers", Some(&self.admin_token()), &body)
            .await;
        assert_eq!(status, StatusCode::CREATED, "{voucher}");
        voucher["id"].as_i64().unwrap()
    }

    /// A sale open now and for the next hour, whose orders must be paid within
    /// `pay_within_secs` of admission.
    pub async fn open_sale_paying(&self, stock: i64, pay_within_secs: i64) -> i64 {
        let now = Utc::now();
        let body = json!({
            "shop_id": 1, "title": "50 off 100", "pay_value": 5000, "actual_value": 10000,
            "seckill": {"stock": stock, "begin_time": now - chrono::Duration::minutes(1),
                        "end_time": now + chrono::Duration::hours(1),
                        "pay_within_secs": pay_within_secs},
        });
        let (status, voucher) = self
            .post_json("/vouchers", Some(&self.admin_token()), &body)
            .await;
        assert_eq!(status, StatusCode::CREATED, "{voucher}");
        assert_eq!(voucher["seckill"]["pay_within_secs"], pay_within_secs);
        voucher["id"].as_i64().unwrap()
    }

    /// `POST /orders/{id}/{action}` (`pay` or `cancel`) as `token`, with an optional
    /// JSON body; returns the status, the `Retry-After` header and the JSON body.
    pub async fn order_action(
        &self,
        order_id: &str,
        action: &str,
        token: &str,
        body: Option<&Value>,
    ) -> (StatusCode, Option<String>, Value) {
        let mut req = self
            .client
            .post(self.url(&format!("/orders/{order_id}/{action}")))
            .bearer_auth(token);
        if let Some(body) = body {
            req = req.json(body);
        }
        let resp = req.send().await.expect("request failed");
        let status = resp.status();
        let retry_after = resp
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap().to_string());
        let text = resp.text().await.unwrap();
        let body = serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}"));
        (status, retry_after, body)
    }

    /// Pays the order as its owner `user_id` would: checkout, then the payment
    /// provider's signed notification of the amount checkout named. Returns checkout's
    /// refusal, or the notification's answer when it is not 200, or else the order as
    /// its owner then sees it.
    pub async fn pay(&self, order_id: &str, user_id: i64) -> (StatusCode, Value) {
        let (status, _, checkout) = self
            .order_action(order_id, "checkout", &self.token(user_id), None)
            .await;
        if status != StatusCode::OK {
            return (status, checkout);
        }
        let amount = checkout["amount"].as_i64().unwrap();
        let (status, notified) = self.provider_pays(order_id, amount).await;
        if status != StatusCode::OK {
            return (status, notified);
        }
        self.send(
            self.client
                .get(self.url(&format!("/orders/{order_id}")))
                .bearer_auth(self.token(user_id)),
        )
        .await
    }

    /// The payment provider's notification that `order_id` was paid `amount` cents
    /// (a new event and transaction each call).
    pub async fn provider_pays(&self, order_id: &str, amount: i64) -> (StatusCode, Value) {
        self.notify(&notification("payment.succeeded", order_id, amount))
            .await
    }

    /// Sends `body` to `/payments/notifications`, signed now with the test secret.
    pub async fn notify(&self, body: &Value) -> (StatusCode, Value) {
        let raw = serde_json::to_vec(body).unwrap();
        let now = chrono::Utc::now().timestamp();
        let signature =
            seckill::lifecycle::signature::sign(&super::PAYMENT_SECRET.into(), now, &raw);
        self.send(
            self.client
                .post(self.url("/payments/notifications"))
                .header("seckill-signature", signature)
                .header("content-type", "application/json")
                .body(raw),
        )
        .await
    }

    /// Cancels the order as user `user_id`.
    pub async fn cancel(&self, order_id: &str, user_id: i64) -> (StatusCode, Value) {
        let (status, _, body) = self
            .order_action(order_id, "cancel", &self.token(user_id), None)
            .await;
        (status, body)
    }

    /// The `/metrics` page, from the internal listener (no token there).
    pub async fn metrics_text(&self) -> String {
        let resp = self
            .client
            .get(format!("{}/metrics", self.admin_base))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        resp.text().await.unwrap()
    }

    /// A sale that is open now and for the next hour.
    pub async fn open_sale(&self, stock: i64) -> i64 {
        let now = Utc::now();
        self.create_sale(
            stock,
            now - chrono::Duration::minutes(1),
            now + chrono::Duration::hours(1),
        )
        .await
    }

    pub async fn grab(&self, voucher_id: i64, user_id: i64) -> (StatusCode, Value) {
        self.grab_as(voucher_id, &self.token(user_id)).await
    }

    /// A grab with `token` as it is (another issuer's, a forged one, ...).
    pub async fn grab_as(&self, voucher_id: i64, token: &str) -> (StatusCode, Value) {
        let req = self
            .client
            .post(self.url(&format!("/vouchers/{voucher_id}/seckill")))
            .bearer_auth(token);
        self.send(req).await
    }
}

/// A notification of the payment provider, with a new event id and transaction id.
pub fn notification(kind: &str, order_id: &str, amount: i64) -> Value {
    let fresh = || format!("{:016x}", rand::random::<u64>());
    serde_json::json!({
        "id": format!("evt_{}", fresh()),
        "type": kind,
        "order_id": order_id,
        "amount": amount,
        "currency": "CNY",
        "transaction_id": format!("tx_{}", fresh()),
    })
}
