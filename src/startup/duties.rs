//! An API process's background duties, started once it is built, and the restart of
//! one that panics: apart from the building, which only connects and binds.

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admission::{term, upkeep};
use crate::http::state::AppState;
use crate::redis_conn;

/// Starts an API process's background duties: the order-id lease (claimed now if Redis
/// answers, so the first grab can be served), the live view's producer, the term
/// watcher (its first look before serving: a sale left stale or missing while no
/// process ran is rebuilt before the first grab can meet it), the sales' epochs heard
/// from Postgres (read once before serving, when Postgres answers), the rate limiters'
/// cleanup, the lottery draws due and the edge's subscription.
pub(super) async fn start_duties(
    state: &AppState,
    tasks: &TaskTracker,
    served: &CancellationToken,
    subscriber: redis_conn::Subscriber,
    cancel: &CancellationToken,
) {
    let lease_keeping = upkeep::Upkeep {
        redis: state.redis.clone(),
        keys: state.keys.clone(),
        ids: state.admission.ids.clone(),
        replicas: state.settings.replicas,
        redis_lost_data: state.admission.heal.clone(),
        claims: Default::default(),
    };
    // Otherwise the upkeep keeps trying (the process starts, and reports not ready).
    let lease = match upkeep::claim(&lease_keeping).await {
        Ok(lease) => Some(lease),
        Err(e) => {
            tracing::warn!(error = %e, "no order-id node leased yet");
            None
        }
    };
    tasks.spawn(upkeep::run(lease_keeping, lease, cancel.clone()));
    tasks.spawn(produce_live_view(state, served, cancel));
    let fence = state.admission.fence.clone();
    tasks.spawn(fence.clone().watch(state.db.clone(), cancel.clone()));
    let mut watcher = term::Watcher::new(term::Watch {
        db: state.db.clone(),
        redis: state.redis.clone(),
        keys: state.keys.clone(),
        retention: state.settings.sale_state_retention,
        replicas: state.settings.replicas,
        wake: state.admission.heal.clone(),
        look_soon: state.admission.look_soon.clone(),
        promises: Some(state.admission.batcher.promises().clone()),
    });
    watcher.look().await;
    // Before serving: the sales' epochs read, so that an old primary's states are
    // refused from the first grab (unless Postgres cannot be reached: then not waited).
    let waited =
        tokio::time::timeout(crate::admission::fence::FIRST_READ_WAIT, fence.first_read()).await;
    if waited.is_err() {
        tracing::warn!(
            "serving before the sales' epochs could be read from postgres: until they are, \
             grabs are not checked against a rebuild on another redis server"
        );
    }
    tasks.spawn(watcher.run(cancel.clone()));
    tasks.spawn(state.clone().forget_idle_rate_limits(cancel.clone()));
    // A lottery's draw when no held press is left to make it.
    tasks.spawn(state.admission.clone().keep_drawing(cancel.clone()));
    // Moves between the segments of a segmented sale that a dead mover left half done.
    if let Some(every) = state.settings.finish_moves_every {
        tasks.spawn(
            state
                .admission
                .segments
                .clone()
                .keep_finishing(every, cancel.clone()),
        );
    }
    if state.admission.edge.enabled() {
        let channel = state.keys.sale_changes();
        tasks.spawn(
            state
                .admission
                .edge
                .clone()
                .listen(subscriber, channel, cancel.clone()),
        );
    }
}

/// The live view's producer, which also adds this process's grab counts to Redis each
/// second (every instance's page shows them), the last time once the last request has
/// been answered (`served`). Restarted if it panics: every page would freeze, and grab
/// counts stop reaching Redis.
fn produce_live_view(
    state: &AppState,
    served: &CancellationToken,
    cancel: &CancellationToken,
) -> impl std::future::Future<Output = ()> {
    let (live, db, redis, keys) = (
        state.live.clone(),
        state.db.clone(),
        state.redis.clone(),
        state.keys.clone(),
    );
    let (tally, served) = (state.admission.batcher.tally().clone(), served.clone());
    restart_after_panic("the live view's producer", cancel.clone(), move || {
        live.clone().run(
            db.clone(),
            redis.clone(),
            keys.clone(),
            tally.clone(),
            served.clone(),
        )
    })
}

/// First wait before restarting a task that panicked; doubled after each panic that
/// comes soon after a restart, up to [`RESTART_MAX`].
pub(super) const RESTART_FIRST: Duration = Duration::from_secs(1);
const RESTART_MAX: Duration = Duration::from_secs(30);

/// Runs the task `start` makes until it returns, starting a new one (with an error
/// log, after a growing wait) each time one panics, so that a bug hit by some data
/// does not stop the task for good, nor restart it in a tight loop. Once `cancel` has
/// fired it restarts at once: the task's shutdown work (the live view's last flush of
/// grab counts) must not wait out a backoff past the process's grace period.
pub(super) async fn restart_after_panic<F, T>(
    name: &'static str,
    cancel: CancellationToken,
    mut start: F,
) where
    F: FnMut() -> T,
    T: std::future::Future<Output = ()> + Send + 'static,
{
    let mut wait = RESTART_FIRST;
    loop {
        let started = tokio::time::Instant::now();
        match tokio::spawn(start()).await {
            Err(e) if e.is_panic() => {
                // A task that ran a good while before its panic starts over from the
                // first wait.
                if started.elapsed() > 10 * RESTART_MAX {
                    wait = RESTART_FIRST;
                }
                tracing::error!(task = name, error = %e, "task panicked; restarting in {wait:?}");
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = cancel.cancelled() => {}
                }
                wait = (wait * 2).min(RESTART_MAX);
            }
            // Returned (it was cancelled), or the runtime is shutting down.
            _ => return,
        }
    }
}
