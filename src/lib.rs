//! `seckill`: a flash-sale voucher service.
//!
//! The request flow is the module tree: [`http`] authenticates and validates, then
//! [`admission`] runs one Redis Lua script that reserves stock and appends the order to a
//! [`stream`]; the [`worker`] reads that stream and writes orders through [`store`] into
//! Postgres, the source of truth.

pub mod admission;
pub mod auth;
pub mod backoff;
pub mod cli;
pub mod clock;
pub mod config;
pub mod demo;
pub mod domain;
pub mod http;
pub mod keys;
pub mod lifecycle;
pub mod live;
pub mod metrics;
pub mod reconcile;
pub mod redis_conn;
pub mod sale_changes;
pub mod scripts;
pub mod secret;
pub mod startup;
pub mod store;
pub mod stream;
pub mod telemetry;
pub mod tls;
pub mod worker;

pub use http::build_app;
pub use http::error::AppError;
pub use http::state::AppState;
pub use store::MIGRATOR;
