//! `promise_keepers` and `promise_vouches`: which API instances keep 202s that Redis
//! may lose, and the terms each has admitted them again in (see
//! `src/admission/keepers.rs`).

use std::time::Duration;

use sqlx::PgPool;

/// An instance beats (it is alive and keeps promises), on the terms `on`, and vouches
/// for `terms`: its promises that a server in those terms lost are admitted again.
pub(crate) async fn beat(
    db: &PgPool,
    keeper: &str,
    on: &[String],
    terms: &[String],
) -> Result<(), sqlx::Error> {
    let mut tx = db.begin().await?;
    sqlx::query(
        "INSERT INTO promise_keepers (keeper, terms) VALUES ($1, $2) \
         ON CONFLICT (keeper) DO UPDATE SET beat_at = now(), terms = $2",
    )
    .bind(keeper)
    .bind(on)
    .execute(&mut *tx)
    .await?;
    if !terms.is_empty() {
        sqlx::query(
            "INSERT INTO promise_vouches (keeper, term) SELECT $1, unnest($2::text[]) \
             ON CONFLICT DO NOTHING",
        )
        .bind(keeper)
        .bind(terms)
        .execute(&mut *tx)
        .await?;
        // (Rarely: a new term is rare.)
        sqlx::query("DELETE FROM promise_keepers WHERE beat_at < now() - interval '1 day'")
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await
}

/// Whether a held term may open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Opening {
    No,
    /// Every instance that beat within the lease, of those on `term`, on a term in
    /// `came_after`, or on a term some sale was last built into or built into before
    /// that, has vouched for it (an instance on another Redis altogether holds nothing
    /// back).
    AllVouched,
    /// Some instance vouched for it longer than the hold ago.
    HeldLongEnough,
}

/// Whether `term` may open (times by Postgres's clock).
pub(crate) async fn may_open(
    db: &PgPool,
    term: &str,
    came_after: &[String],
    lease: Duration,
    hold: Duration,
) -> Result<Opening, sqlx::Error> {
    let (all, long): (bool, bool) = sqlx::query_as(
        "SELECT NOT EXISTS (SELECT 1 FROM promise_keepers k \
           WHERE k.beat_at > now() - make_interval(secs => $3) \
             AND ($1 = ANY (k.terms) OR k.terms && $2::text[] \
                  OR EXISTS (SELECT 1 FROM sale_epochs e WHERE e.term = ANY (k.terms)) \
                  OR EXISTS (SELECT 1 FROM sale_epochs e WHERE e.term_before = ANY (k.terms))) \
             AND NOT EXISTS (SELECT 1 FROM promise_vouches v \
                              WHERE v.keeper = k.keeper AND v.term = $1)), \
         EXISTS (SELECT 1 FROM promise_vouches \
                  WHERE term = $1 AND vouched_at < now() - make_interval(secs => $4))",
    )
    .bind(term)
    .bind(came_after)
    .bind(lease.as_secs_f64())
    .bind(hold.as_secs_f64())
    .fetch_one(db)
    .await?;
    Ok(match (all, long) {
        (true, _) => Opening::AllVouched,
        (false, true) => Opening::HeldLongEnough,
        (false, false) => Opening::No,
    })
}

/// An instance that stops (its promises are all written, or kept in its file for its
/// next life, which vouches anew): it holds no term back any more.
pub(crate) async fn leave(db: &PgPool, keeper: &str) -> Result<(), sqlx::Error> {
    sqlx::query("DELETE FROM promise_keepers WHERE keeper = $1")
        .bind(keeper)
        .execute(db)
        .await
        .map(|_| ())
}
