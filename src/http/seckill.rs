//! `POST /vouchers/{id}/seckill`: the hot path. Authenticate, mint an order id, run the
//! admission script, answer. Postgres is touched only when the sale is not in Redis.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use chrono::Utc;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use std::time::Instant;

use crate::admission::edge::EdgeAnswer;
use crate::admission::{self, loader, Outcome};
use crate::auth::AuthUser;
use crate::domain::{OrderId, OrderStatus, VoucherId};
use crate::http::error::{AppError, AppResult, ErrorBody};
use crate::http::extract::PathId;
use crate::http::state::AppState;
use crate::store::vouchers::{self, SaleLookup};

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub(crate) struct Admitted {
    /// 64-bit, as a string (JavaScript loses precision above 2^53).
    #[schema(value_type = String, pattern = "^[1-9][0-9]{0,18}$", example = "117514385399746560")]
    pub order_id: OrderId,
    /// Always `pending`: the order is written to Postgres moments later.
    #[schema(schema_with = pending_only)]
    pub status: OrderStatus,
}

/// [`Admitted::status`]'s schema: an enum of the one status a 202 carries.
fn pending_only() -> utoipa::openapi::Object {
    utoipa::openapi::ObjectBuilder::new()
        .schema_type(utoipa::openapi::schema::Type::String)
        .enum_values(Some([OrderStatus::Pending.as_str()]))
        .description(Some(
            "Always `pending`: the order is written to Postgres moments later.",
        ))
        .build()
}

/// The client's address, when the server was started with connect info.
pub(crate) struct PeerIp(pub Option<std::net::IpAddr>);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for PeerIp {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _: &S,
    ) -> Result<Self, Self::Rejection> {
        Ok(PeerIp(
            parts
                .extensions
                .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
                .map(|c| c.0.ip()),
        ))
    }
}

fn limited(state: &AppState, voucher_id: VoucherId, wait: std::time::Duration) -> AppError {
    crate::metrics::HotPath::get()
        .outcome("rate_limited")
        .increment(1);
    state
        .admissions
        .tally()
        .add(voucher_id, admission::tally::RATE_LIMITED);
    AppError::RateLimited {
        retry_after_secs: wait.as_secs_f64().ceil() as u64,
    }
}

#[utoipa::path(post, path = "/vouchers/{id}/seckill", operation_id = "grabVoucher", tag = "seckill", security(("bearer" = [])),
    params(("id" = i64, Path, description = "voucher id", minimum = 1)),
    responses(
        (status = 202, description = "admitted: the order id, written to Postgres moments later", body = Admitted),
        (status = 400, description = "not a valid id (`validation`)", body = ErrorBody),
        (status = 401, description = "no or bad token (`unauthorized`)", body = ErrorBody),
        (status = 404, description = "no such flash-sale voucher (`not_found`)", body = ErrorBody),
        (status = 409, description = "`not_started`, `ended`, `sold_out`, or `already_ordered` (with the caller's `order_id`)", body = ErrorBody),
        (status = 429, description = "too many grabs (`rate_limited`); see `Retry-After`", body = ErrorBody,
            headers(("Retry-After" = u64, description = "seconds to wait"))),
        (status = 503, description = "`unavailable`. The sale is being loaded or Redis cannot be reached: nothing was reserved. \
            Or Redis took the grab but its answer did not come (timeout, connection lost): the error carries `\"outcome\": \"unknown\"`, \
            the order may exist, and a retry tells (202, or `already_ordered` with its `order_id`)", body = ErrorBody,
            headers(("Retry-After" = u64, description = "seconds to wait"))),
    ))]
pub(crate) async fn grab(
    State(state): State<AppState>,
    PeerIp(ip): PeerIp,
    user: AuthUser,
    PathId(voucher_id): PathId<VoucherId>,
) -> AppResult<(StatusCode, Json<Admitted>)> {
    if let (Some(limiter), Some(ip)) = (&state.per_ip, ip) {
        limiter
            .check(&ip)
            .map_err(|wait| limited(&state, voucher_id, wait))?;
    }
    if let Some(limiter) = &state.per_user {
        limiter
            .check(&user.user_id)
            .map_err(|wait| limited(&state, voucher_id, wait))?;
    }
    // Most presses of a flash sale can win nothing: this instance answers those itself
    // when Redis told it lately (sold out, not open yet, ended, no such sale).
    if let Some(known) = state.edge.answer(voucher_id, user.user_id, Instant::now()) {
        return Err(at_edge(&state, voucher_id, known));
    }
    // A 202 this instance gave that user there, which Redis may have lost and which is
    // not admitted again yet: a fresh admission would take its place.
    if state
        .admissions
        .promises()
        .at_risk(user.user_id, voucher_id)
    {
        return Err(AppError::Unavailable(
            "your earlier order for this sale is being recovered; try again shortly; \
             nothing was reserved"
                .into(),
        ));
    }
    let order_id = state.ids.next().ok_or_else(|| {
        AppError::Unavailable("order ids are not ready yet (waiting for redis)".into())
    })?;
    let started = Instant::now();
    let outcome = state
        .parts
        .admit(&state.admissions, voucher_id, user.user_id, order_id)
        .await;
    let hot = crate::metrics::HotPath::get();
    hot.admission_seconds
        .record(started.elapsed().as_secs_f64());
    let label = match &outcome {
        Ok(Outcome::AlreadyOrdered { order_id: held }) if *held == order_id => "admitted",
        Ok(o) => o.label(),
        Err(_) => "redis_error",
    };
    hot.outcome(label).increment(1);
    match outcome {
        Ok(Outcome::NotStarted | Outcome::Ended | Outcome::SoldOut) => {
            // (Known by now: the grab was routed by it.)
            let parts = state.parts.of(voucher_id).await.unwrap_or(1);
            state
                .edge
                .learn_in_background(&state.redis, &state.keys, voucher_id, parts);
        }
        Ok(Outcome::NotLoaded) => return Err(not_loaded(&state, voucher_id).await),
        Ok(Outcome::Stale) => {
            // Redis came back in a new term: the watcher heals every sale on it, and
            // keeps this instance's promises there again (meanwhile, their users' fresh
            // grabs wait).
            state.admissions.promises().alarm(state.keys.shards());
            state.heal.notify_one();
            reload_in_background(&state, voucher_id, loader::Mode::Heal);
        }
        // Every instance is admitting again the 202s the server may have lost: the
        // watcher looks soon (this instance's part, and the opening).
        Ok(Outcome::Held) => state.look_soon.notify_one(),
        // Nothing to heal here: the sale lives on another server, and this one (an old
        // primary) is on its way out (the term watch sees the change of server).
        Ok(Outcome::Fenced) => tracing::warn!(
            voucher_id = voucher_id.get(),
            "redis holds an older build of the sale than postgres names: refused"
        ),
        Ok(Outcome::Corrupt) => {
            tracing::error!(
                voucher_id = voucher_id.get(),
                "the sale's redis state is corrupt: repairing it"
            );
            reload_in_background(&state, voucher_id, loader::Mode::Repair);
        }
        _ => {}
    }
    let admitted = answer(outcome, order_id)?;
    Ok((
        StatusCode::ACCEPTED,
        Json(Admitted {
            order_id: admitted,
            status: OrderStatus::Pending,
        }),
    ))
}

/// A grab answered from the instance's memory of the sale: counted, and the same error
/// Redis's verdict would have given.
fn at_edge(state: &AppState, voucher_id: VoucherId, known: EdgeAnswer) -> AppError {
    crate::metrics::HotPath::get().at_edge(known.label());
    let counted = admission::tally::OUTCOMES
        .iter()
        .position(|o| *o == known.label());
    if let Some(i) = counted {
        state.admissions.tally().add_at_edge(voucher_id, i);
    }
    match known {
        EdgeAnswer::NotStarted => AppError::NotStarted,
        EdgeAnswer::Ended => AppError::Ended,
        EdgeAnswer::SoldOut => AppError::SoldOut,
        EdgeAnswer::NotFound => AppError::no_sale(voucher_id),
        EdgeAnswer::NoVoucher => AppError::no_voucher(voucher_id),
    }
}

/// The answer to a grab, from the script's verdict and the order id minted for this
/// request: `Ok(order id)` is a 202.
pub fn answer(outcome: redis::RedisResult<Outcome>, minted: OrderId) -> AppResult<OrderId> {
    match outcome {
        Ok(Outcome::Admitted { order_id }) => Ok(order_id),
        // The script ran twice for this request (the cluster client re-sends a command
        // after a dropped connection): the order it names is this request's own.
        Ok(Outcome::AlreadyOrdered { order_id }) if order_id == minted => Ok(order_id),
        Ok(Outcome::AlreadyOrdered { order_id }) => Err(AppError::AlreadyOrdered { order_id }),
        Ok(Outcome::NotStarted) => Err(AppError::NotStarted),
        Ok(Outcome::Ended) => Err(AppError::Ended),
        Ok(Outcome::SoldOut) => Err(AppError::SoldOut),
        Ok(Outcome::NotLoaded) => Err(AppError::Unavailable(
            "the sale is being loaded, try again shortly; nothing was reserved".into(),
        )),
        // (Never leaves admission::parts: a drained part is refilled or sold out.)
        Ok(Outcome::Drained) => Err(AppError::SoldOut),
        Ok(Outcome::Stale | Outcome::Corrupt) => Err(AppError::Unavailable(
            "the sale is being rebuilt from the database, try again shortly; nothing was \
             reserved"
                .into(),
        )),
        Ok(Outcome::Fenced) => Err(AppError::Unavailable(
            "the sale has moved to another admission server, try again shortly; nothing \
             was reserved"
                .into(),
        )),
        Ok(Outcome::Held) => Err(AppError::Unavailable(
            "the sale is paused while orders the admission store may have lost are \
             recovered, try again shortly; nothing was reserved"
                .into(),
        )),
        Err(e) if crate::scripts::surely_not_run(&e) => Err(AppError::Unavailable(
            "the admission store is unavailable, try again; nothing was reserved".into(),
        )),
        Err(error) => Err(AppError::OutcomeUnknown {
            error,
            order_id: minted,
        }),
    }
}

/// The sale is not in Redis: an unknown voucher, an ended sale whose state expired, or
/// state lost with Redis. Only the last is worth a reload; until it is done, fail closed.
async fn not_loaded(state: &AppState, voucher_id: VoucherId) -> AppError {
    // A reload is already under way: a storm of presses must not become a storm of
    // Postgres queries.
    if state
        .reloading
        .lock()
        .expect("poisoned")
        .contains(&voucher_id)
    {
        return AppError::Unavailable(
            "the sale is being loaded, try again shortly; nothing was reserved".into(),
        );
    }
    // Begun before Postgres is asked: a sale created meanwhile is announced, and then
    // its absence is not remembered.
    let lookup = state.edge.lookup(voucher_id);
    let asked_at = Instant::now();
    let sale = vouchers::sale(&state.db, voucher_id).await;
    if let Some(lookup) = lookup {
        match &sale {
            Ok(SaleLookup::NoSale) => lookup.not_found(asked_at),
            Ok(SaleLookup::NoVoucher) => lookup.no_voucher(asked_at),
            _ => lookup.nothing(),
        }
    }
    match sale {
        Ok(SaleLookup::NoVoucher) => AppError::no_voucher(voucher_id),
        Ok(SaleLookup::NoSale) => AppError::no_sale(voucher_id),
        Ok(SaleLookup::Sale(sale)) if sale.end_time <= Utc::now() => AppError::Ended,
        Ok(SaleLookup::Sale(_)) => {
            reload_in_background(state, voucher_id, loader::Mode::Heal);
            AppError::Unavailable(
                "the sale is being loaded, try again shortly; nothing was reserved".into(),
            )
        }
        Err(e) => e.into(),
    }
}

/// Starts a reload of one sale in the background unless one is already running.
fn reload_in_background(state: &AppState, voucher_id: VoucherId, mode: loader::Mode) {
    if !state.reloading.lock().expect("poisoned").insert(voucher_id) {
        return;
    }
    let state = state.clone();
    tokio::spawn(async move {
        let mut conn = state.redis.clone();
        let result = loader::load_sale(
            &state.db,
            &mut conn,
            &state.keys,
            voucher_id,
            state.settings.sale_state_retention,
            mode,
            state.settings.replicas,
        )
        .await;
        if let Err(e) = result {
            tracing::warn!(voucher_id = voucher_id.get(), error = %e, "reloading sale state failed");
        }
        state
            .reloading
            .lock()
            .expect("poisoned")
            .remove(&voucher_id);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io;

    fn io_error(kind: io::ErrorKind) -> redis::RedisError {
        io::Error::new(kind, "test").into()
    }

    #[test]
    fn the_script_answering_with_this_requests_own_order_is_an_admission() {
        let mine = OrderId::new(117_514_385_399_746_560).unwrap();
        let seven = OrderId::new(7).unwrap();
        assert_eq!(
            answer(Ok(Outcome::AlreadyOrdered { order_id: mine }), mine).unwrap(),
            mine
        );
        let other = answer(Ok(Outcome::AlreadyOrdered { order_id: seven }), mine);
        assert!(matches!(
            other,
            Err(AppError::AlreadyOrdered { order_id }) if order_id == seven
        ));
        assert_eq!(
            answer(Ok(Outcome::Admitted { order_id: mine }), mine).unwrap(),
            mine
        );
    }

    #[test]
    fn a_timeout_or_lost_connection_leaves_the_outcome_unknown() {
        for kind in [
            io::ErrorKind::TimedOut,
            io::ErrorKind::ConnectionReset,
            io::ErrorKind::UnexpectedEof,
            io::ErrorKind::BrokenPipe,
        ] {
            let err = answer(Err(io_error(kind)), OrderId::new(1).unwrap()).unwrap_err();
            assert!(
                matches!(err, AppError::OutcomeUnknown { .. }),
                "{kind:?}: {err}"
            );
        }
        let refused = answer(
            Err(io_error(io::ErrorKind::ConnectionRefused)),
            OrderId::new(1).unwrap(),
        )
        .unwrap_err();
        assert!(matches!(refused, AppError::Unavailable(_)), "{refused}");
    }
}
