//! The order lifecycle: pay, cancel and expiry, each unit returned exactly once to both
//! stores, against the real app, Redis, Postgres and `seckill worker` processes.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{json, Value};
use sqlx::PgPool;

use crate::common::faults::{database_url, Process, Proxy};
use crate::common::{oid, uid, vid, TestApp};
use seckill::domain::OrderId;

mod crashes;
mod expiry;
mod pay_and_cancel;
mod payments;
mod redemption_and_refunds;

/// Grabs as `user` and returns the order id (the grab must succeed).
async fn grab_id(app: &TestApp, voucher: i64, user: i64) -> String {
    let (status, body) = app.grab(voucher, user).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    body["order_id"].as_str().unwrap().to_string()
}

/// Postgres's and Redis's stock of the sale.
async fn stocks(app: &TestApp, voucher: i64) -> (i64, Option<i64>) {
    (
        app.pg_stock(voucher).await as i64,
        app.redis_stock(voucher).await,
    )
}
