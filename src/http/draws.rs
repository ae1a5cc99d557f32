//! `GET /vouchers/{id}/draw`: a lottery sale's draw, for anyone to check against the
//! commitment its voucher published (`scripts/verify-draw` recomputes the winners).

use axum::extract::State;
use axum::Json;
use serde::Serialize;
use utoipa::ToSchema;

use crate::domain::VoucherId;
use crate::http::error::{AppError, AppResult, ErrorBody};
use crate::http::extract::PathId;
use crate::http::state::AppState;
use crate::store::draws;

/// A lottery's draw: the commitment published with the sale, and once drawn, the seed,
/// every entrant in the order the draw consumed them (increasing user id) and the
/// winners in the order they were drawn.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct DrawResponse {
    /// Hex SHA-256 of the seed's bytes, published when the sale was created.
    pub commitment: String,
    /// The draw's secret seed, hex; `null` until the draw.
    pub seed: Option<String>,
    /// Every entrant's user id, in increasing order (empty until the draw).
    pub entrants: Vec<i64>,
    /// The winners' user ids, in the order drawn (empty until the draw).
    pub winners: Vec<i64>,
}

#[utoipa::path(get, path = "/vouchers/{id}/draw", operation_id = "getDraw", tag = "vouchers",
    params(("id" = i64, Path, description = "voucher id", minimum = 1)),
    responses(
        (status = 200, description = "the lottery's commitment, and its draw once done", body = DrawResponse),
        (status = 400, description = "not a valid id (`validation`)", body = ErrorBody),
        (status = 404, description = "no such voucher, or its sale is not a lottery (`not_found`)", body = ErrorBody),
        (status = 503, description = "a dependency is down (`unavailable`)", body = ErrorBody),
    ))]
pub(crate) async fn get(
    State(state): State<AppState>,
    PathId(id): PathId<VoucherId>,
) -> AppResult<Json<DrawResponse>> {
    // As Postgres records it (every instance records a due draw within a second).
    let (commitment, draw) = draws::get(&state.db, id)
        .await?
        .ok_or_else(|| no_lottery(id))?;
    Ok(Json(match draw {
        Some(d) => DrawResponse {
            commitment,
            seed: Some(d.seed),
            entrants: d.entrants,
            winners: d.winners,
        },
        None => DrawResponse {
            commitment,
            seed: None,
            entrants: Vec::new(),
            winners: Vec::new(),
        },
    }))
}

fn no_lottery(id: VoucherId) -> AppError {
    AppError::NotFound(format!("voucher {id} has no lottery sale"))
}
