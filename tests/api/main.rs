//! The integration tests, one binary: the real app (started through
//! `seckill::startup::Application`, as `main` starts it) and the real `seckill` binary,
//! against real Redis and Postgres. Each test has its own database (`#[sqlx::test]`)
//! and its own Redis key prefix, so tests run in parallel and leave nothing behind.

mod common;

mod admin;
mod auth_and_validation;
mod binary;
mod client;
mod clock;
mod clumsy_input;
mod cluster;
mod demo;
mod dev_script;
mod docs;
mod edge;
mod fence;
mod flash_sale;
mod http_limits;
mod jwks;
mod lifecycle;
mod live;
mod load_tools;
mod lottery;
mod nemesis;
mod observability;
mod operations;
mod order_ids;
mod promises;
mod readme;
mod reconcile;
mod recovery;
mod segments;
mod sentinel;
mod startup;
mod tls;
mod worker;
