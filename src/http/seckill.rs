//! `POST /vouchers/{id}/seckill`: the hot path. Authenticate, let admission decide
//! (`admission::grab`), answer its outcome in the contract's terms.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::admission::grab::Shopper;
use crate::admission::{Answer, Outcome};
use crate::auth::AuthUser;
use crate::domain::{OrderId, OrderStatus, VoucherId};
use crate::http::error::{AppError, AppResult, ErrorBody};
use crate::http::extract::{PathId, PeerIp};
use crate::http::state::AppState;

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
    let shopper = Shopper {
        user_id: user.user_id,
        ip,
    };
    let order_id = answer(state.admission.grab(shopper, voucher_id).await?, voucher_id)?;
    Ok((
        StatusCode::ACCEPTED,
        Json(Admitted {
            order_id,
            status: OrderStatus::Pending,
        }),
    ))
}

/// The answer to a grab decided `outcome`: `Ok(order id)` is a 202.
pub fn answer(outcome: Outcome, voucher_id: VoucherId) -> AppResult<OrderId> {
    Err(match outcome.describe().answer {
        Answer::Admitted(order_id) => return Ok(order_id),
        Answer::AlreadyOrdered(order_id) => AppError::AlreadyOrdered { order_id },
        Answer::NotStarted => AppError::NotStarted,
        Answer::Ended => AppError::Ended,
        Answer::SoldOut => AppError::SoldOut,
        Answer::NoSale => AppError::no_sale(voucher_id),
        Answer::NoVoucher => AppError::no_voucher(voucher_id),
        Answer::RateLimited { retry_after_secs } => AppError::RateLimited { retry_after_secs },
        Answer::Unknown(order_id) => AppError::OutcomeUnknown { order_id },
        Answer::Unavailable(because) => AppError::Unavailable(because.into()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::Unavailable;
    use std::io;

    fn io_error(kind: io::ErrorKind) -> redis::RedisError {
        io::Error::new(kind, "test").into()
    }

    fn judged(decided: redis::RedisResult<Outcome>, minted: OrderId) -> AppResult<OrderId> {
        answer(Outcome::of(decided, minted), VoucherId::new(1).unwrap())
    }

    #[test]
    fn the_script_answering_with_this_requests_own_order_is_an_admission() {
        let mine = OrderId::new(117_514_385_399_746_560).unwrap();
        let seven = OrderId::new(7).unwrap();
        assert_eq!(
            judged(Ok(Outcome::AlreadyOrdered { order_id: mine }), mine).unwrap(),
            mine
        );
        let other = judged(Ok(Outcome::AlreadyOrdered { order_id: seven }), mine);
        assert!(matches!(
            other,
            Err(AppError::AlreadyOrdered { order_id }) if order_id == seven
        ));
        assert_eq!(
            judged(Ok(Outcome::Admitted { order_id: mine }), mine).unwrap(),
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
            let err = judged(Err(io_error(kind)), OrderId::new(1).unwrap()).unwrap_err();
            assert!(
                matches!(err, AppError::OutcomeUnknown { .. }),
                "{kind:?}: {err}"
            );
        }
        let refused = judged(
            Err(io_error(io::ErrorKind::ConnectionRefused)),
            OrderId::new(1).unwrap(),
        )
        .unwrap_err();
        assert!(matches!(refused, AppError::Unavailable(_)), "{refused}");
    }

    /// Every outcome has its own label, and every label its outcome.
    #[test]
    fn each_outcome_has_one_label_and_each_label_an_outcome() {
        let id = OrderId::new(1).unwrap();
        let all = [
            Outcome::RateLimited {
                retry_after_secs: 1,
            },
            Outcome::Admitted { order_id: id },
            Outcome::NotLoaded,
            Outcome::NotFound,
            Outcome::Stale,
            Outcome::Corrupt,
            Outcome::Held,
            Outcome::Fenced,
            Outcome::NotStarted,
            Outcome::Ended,
            Outcome::AlreadyOrdered { order_id: id },
            Outcome::SoldOut,
            Outcome::Unknown { order_id: id },
            Outcome::Unavailable(Unavailable::Recovering),
            Outcome::Entered { order_id: id },
            Outcome::Drawing,
            Outcome::Evicting,
        ];
        let labels: Vec<&str> = all.iter().map(|o| Outcome::LABELS[o.index()]).collect();
        assert_eq!(labels, Outcome::LABELS);
    }

    /// The edge's metric series are those of the outcomes described as answered there.
    #[test]
    fn the_edge_answers_exactly_the_outcomes_described_as_answered_there() {
        let id = OrderId::new(1).unwrap();
        let every = [
            Outcome::RateLimited {
                retry_after_secs: 1,
            },
            Outcome::Admitted { order_id: id },
            Outcome::NotLoaded,
            Outcome::Drained,
            Outcome::NotFound,
            Outcome::NoVoucher,
            Outcome::Stale,
            Outcome::Corrupt,
            Outcome::Held,
            Outcome::Fenced,
            Outcome::NotStarted,
            Outcome::Ended,
            Outcome::AlreadyOrdered { order_id: id },
            Outcome::SoldOut,
            Outcome::Unavailable(Unavailable::Redis),
            Outcome::Unknown { order_id: id },
            Outcome::Unavailable(Unavailable::Recovering),
            Outcome::Unavailable(Unavailable::IdsNotReady),
            Outcome::Entered { order_id: id },
            Outcome::Drawing,
            Outcome::Evicting,
        ];
        let edge = crate::admission::hot::HotPath::EDGE_OUTCOMES;
        for outcome in every {
            assert_eq!(
                outcome.describe().at_edge,
                edge.contains(&outcome),
                "{outcome:?}"
            );
        }
        assert_eq!(
            every.iter().filter(|o| o.describe().at_edge).count(),
            edge.len()
        );
    }
}
