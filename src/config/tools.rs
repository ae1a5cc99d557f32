//! The settings of the operator's tools (`token`, `notify`, `demo`): clients of a
//! running service, apart from the settings of the processes that are the service.

use clap::{Args, ValueEnum};

use crate::secret::Secret;

#[derive(Debug, Clone, Args)]
pub(crate) struct TokenArgs {
    /// HS256 secret for bearer tokens.
    #[arg(long, env = "JWT_SECRET", hide_env_values = true)]
    pub jwt_secret: Secret,
    /// Written as the tokens' `iss` (the API checks it when set).
    #[arg(long, env = "JWT_ISSUER")]
    pub jwt_issuer: Option<String>,
    /// Written as the tokens' `aud` (the API checks it when set).
    #[arg(long, env = "JWT_AUDIENCE")]
    pub jwt_audience: Option<String>,
    /// The user id (`sub`), a positive integer.
    #[arg(long, value_parser = clap::value_parser!(i64).range(1..))]
    pub user: i64,
    /// Mint an administrator token.
    #[arg(long, conflicts_with = "shop")]
    pub admin: bool,
    /// Mint a token of this shop's staff (`role: "shop"`, `shop_id`).
    #[arg(long, value_parser = clap::value_parser!(i64).range(1..))]
    pub shop: Option<i64>,
    /// Print this many tokens, one per line, for users `user`, `user + 1`, ... (load tests).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    pub count: u64,
    /// Lifetime in seconds.
    #[arg(long, default_value_t = 3600, value_parser = clap::value_parser!(u64).range(1..=31_536_000))]
    pub ttl: u64,
}

/// What the provider tells (`type` of the notification).
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub(crate) enum NotifyKind {
    /// `payment.succeeded`.
    Payment,
    /// `refund.succeeded`.
    Refund,
}

#[derive(Debug, Clone, Args)]
pub(crate) struct NotifyArgs {
    /// Base URL of the running API (default: http://<BIND> when BIND is set, else
    /// http://127.0.0.1:8080).
    #[arg(long)]
    pub url: Option<String>,
    #[arg(long, env = "BIND", hide = true)]
    pub bind: Option<String>,
    /// The secret to sign with: the first of PAYMENT_WEBHOOK_SECRETS.
    #[arg(
        long,
        env = "PAYMENT_WEBHOOK_SECRETS",
        hide_env_values = true,
        value_delimiter = ','
    )]
    pub secret: Vec<Secret>,
    #[arg(long, value_enum, default_value_t = NotifyKind::Payment)]
    pub kind: NotifyKind,
    /// The order paid (or refunded).
    #[arg(long)]
    pub order: String,
    /// Cents paid (or refunded): the voucher's `pay_value`.
    #[arg(long)]
    pub amount: i64,
    #[arg(long, default_value = crate::domain::CURRENCY)]
    pub currency: String,
    /// The provider's transaction id (default: a new one).
    #[arg(long)]
    pub transaction: Option<String>,
    /// The event id (default: a new one; the same id again is a replay).
    #[arg(long)]
    pub event: Option<String>,
    /// Sign as of this unix time (default: now).
    #[arg(long)]
    pub at: Option<i64>,
}

#[derive(Debug, Clone, Args)]
pub(crate) struct DemoArgs {
    /// Base URL of the running API (default: http://<BIND> when BIND is set, else
    /// http://127.0.0.1:8080).
    #[arg(long)]
    pub url: Option<String>,
    /// The server's listen address, the default of --url (as `seckill serve` reads it).
    #[arg(long, env = "BIND", hide = true)]
    pub bind: Option<String>,
    /// Shoppers, each a distinct user pressing "grab" once.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub shoppers: u64,
    /// Seconds over which the grabs are spread (0: all at once).
    #[arg(long, default_value_t = 5.0, value_parser = demo_seconds)]
    pub seconds: f64,
    /// Units on sale in the voucher the demo creates.
    #[arg(long, default_value_t = 100, conflicts_with = "voucher",
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub stock: u64,
    /// Grab from this existing flash-sale voucher instead of creating one.
    #[arg(long, value_parser = clap::value_parser!(i64).range(1..))]
    pub voucher: Option<i64>,
    /// Grabs in flight at most (when the server is slower, the grabs fall behind the
    /// schedule rather than pile up).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    pub concurrency: u64,
    /// User id of the first shopper; the others follow it (`first`, `first + 1`, ...).
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(i64).range(1..))]
    pub first_user: i64,
    /// Seconds to wait for the admitted orders to reach Postgres (0: look once).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(0..=3600))]
    pub persist_timeout: u64,
    /// The server's HS256 secret: the demo mints an admin token and one token per shopper.
    /// The payment provider's secret (the first of PAYMENT_WEBHOOK_SECRETS): with it,
    /// the provider pays for `--paying` percent of the admitted orders once they are
    /// written, as it would after their owners' checkouts. Unset: nobody pays.
    #[arg(
        long = "payment-secret",
        env = "PAYMENT_WEBHOOK_SECRETS",
        hide_env_values = true,
        value_delimiter = ','
    )]
    pub payment_webhook_secrets: Vec<Secret>,
    /// Percent of the admitted orders the provider pays for (0-100).
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u64).range(0..=100))]
    pub paying: u64,
    #[arg(long, env = "JWT_SECRET", hide_env_values = true)]
    pub jwt_secret: Option<Secret>,
    /// Written as the tokens' `iss` (when the server checks it).
    #[arg(long, env = "JWT_ISSUER")]
    pub jwt_issuer: Option<String>,
    /// Written as the tokens' `aud` (when the server checks it).
    #[arg(long, env = "JWT_AUDIENCE")]
    pub jwt_audience: Option<String>,
}

/// A duration in seconds for `demo --seconds`: 0 to 3600, fractions allowed.
fn demo_seconds(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    if !(0.0..=3600.0).contains(&v) {
        return Err("must be 0 to 3600 seconds".into());
    }
    Ok(v)
}
