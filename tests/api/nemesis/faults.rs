//! Runs the schedule: each fault a task of its own that strikes at its time, holds,
//! and heals (at once when the campaign ends). Roles are resolved when a fault strikes
//! ("the primary" is whichever node the sentinels name then) and the log says which
//! process it was.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::history::Recorder;
use super::proxy::{Owner, Target};
use super::schedule::{Fault, From, Planned, To, Who};
use super::topology::{self, signal};
use super::world::World;

/// What a fault task needs.
#[derive(Clone)]
struct Ctx {
    world: Arc<World>,
    clock: Arc<Recorder>,
    stop: CancellationToken,
}

impl Ctx {
    fn now(&self) -> f64 {
        self.clock.now_ms()
    }

    /// Waits `ms`, or less if the campaign ends meanwhile.
    async fn hold(&self, ms: u64) {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(ms)) => {}
            _ = self.stop.cancelled() => {}
        }
    }

    /// Waits until `at_ms` on the campaign's clock; false if it ends first.
    async fn wait_until(&self, at_ms: u64) -> bool {
        let wait = Duration::from_millis(at_ms).saturating_sub(self.clock.since_start());
        tokio::select! {
            _ = tokio::time::sleep(wait) => true,
            _ = self.stop.cancelled() => false,
        }
    }

    fn struck(&self, fault: &Fault, detail: String) -> usize {
        self.world.log.struck(self.now(), *fault, detail)
    }

    fn healed(&self, n: usize, text: String) {
        self.world.log.healed(n, self.now(), text);
    }

    fn note(&self, text: String) {
        self.world.log.note(self.now(), text);
    }
}

/// Starts every fault's task; they end (healed) once `stop` is cancelled.
pub fn launch(
    world: Arc<World>,
    clock: Arc<Recorder>,
    plan: &[Planned],
    stop: CancellationToken,
) -> Vec<tokio::task::JoinHandle<()>> {
    let ctx = Ctx { world, clock, stop };
    plan.iter()
        .map(|p| tokio::spawn(run(ctx.clone(), *p)))
        .collect()
}

async fn run(ctx: Ctx, p: Planned) {
    if !ctx.wait_until(p.begins_ms()).await {
        return;
    }
    // One change of the deployment at a time: a failback or a failover that took
    // longer than planned delays the next one rather than overlapping it.
    let world = ctx.world.clone();
    let turn = if p.fault.touches_topology() {
        let began = ctx.now();
        let turn = tokio::select! {
            turn = world.topology.lock() => turn,
            _ = ctx.stop.cancelled() => return,
        };
        if ctx.now() - began > 500.0 {
            ctx.note(format!(
                "{}: waited {:.1} s for the previous change of the deployment",
                p.fault.kind(),
                (ctx.now() - began) / 1000.0
            ));
        }
        Some(turn)
    } else {
        None
    };
    match p.fault {
        Fault::Kill {
            who: Who::Api(k),
            down_ms,
        } => kill_service(&ctx, &p.fault, k as usize, down_ms).await,
        Fault::Kill {
            who: Who::Worker(k),
            down_ms,
        } => kill_service(&ctx, &p.fault, 2 + k as usize, down_ms).await,
        Fault::Kill {
            who: Who::Primary, ..
        } => kill_primary(&ctx, &p.fault).await,
        Fault::Kill {
            who: Who::Replica(k),
            down_ms,
        } => kill_replica(&ctx, &p.fault, k, down_ms).await,
        Fault::Kill {
            who: Who::Sentinel(k),
            down_ms,
        } => {
            let n = ctx.struck(&p.fault, format!("kill -9 sentinel {k}"));
            ctx.world.redis.kill_sentinel(k);
            ctx.hold(down_ms).await;
            ctx.world.redis.restart_sentinel(k).await;
            ctx.healed(n, format!("sentinel {k} started again"));
        }
        Fault::Pause { who, ms } => pause(&ctx, &p.fault, who, ms).await,
        Fault::Link {
            from,
            to,
            freeze,
            ms,
        } => link(&ctx, &p.fault, from, to, freeze, ms).await,
        Fault::Partition {
            keep_api,
            keep_worker,
            replicas_too,
            ms,
        } => partition(&ctx, &p.fault, keep_api, keep_worker, replicas_too, ms).await,
        Fault::FailoverFailback {
            back_after_ms,
            hasty,
        } => failover_failback(&ctx, &p.fault, back_after_ms, hasty).await,
        Fault::Rollback { snapshot_age_ms } => rollback(&ctx, &p.fault, snapshot_age_ms).await,
        Fault::RestartPostgres { immediate, down_ms } => {
            restart_postgres(&ctx, &p.fault, immediate, down_ms).await
        }
        Fault::Evict { ms } => evict(&ctx, &p.fault, ms).await,
        Fault::Skew {
            api,
            worker,
            secs,
            ms,
        } => skew(&ctx, &p.fault, api, worker, secs, ms).await,
    }
    // The deployment settles before the next change: Sentinel may still be acting on
    // this one (a primary paused past its down-after, a partition just healed).
    if let Some(turn) = turn {
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        ctx.world.redis.settle(Duration::from_secs(10)).await;
        drop(turn);
    }
}

async fn kill_service(ctx: &Ctx, fault: &Fault, i: usize, down_ms: u64) {
    let w = &ctx.world;
    let s = &w.services[i];
    let pid = s.kill9(&w.links);
    let n = ctx.struck(fault, format!("kill -9 {} (pid {pid:?})", s.name()));
    ctx.hold(down_ms).await;
    if !s.slot.is_running() {
        s.spawn(&w.env, &w.links);
    }
    ctx.healed(
        n,
        format!("{} started again (pid {:?})", s.name(), s.slot.pid()),
    );
}

/// One API instance's clock `secs` off and one worker's as far the other way, for
/// `ms`; a process killed meanwhile starts again on its skewed clock.
async fn skew(ctx: &Ctx, fault: &Fault, api: u8, worker: u8, secs: i64, ms: u64) {
    let w = &ctx.world;
    let (a, b) = (&w.services[api as usize], &w.services[2 + worker as usize]);
    a.set_clock(secs);
    b.set_clock(-secs);
    let n = ctx.struck(
        fault,
        format!(
            "{}'s clock {secs:+} s off, {}'s {:+} s off for {:.1} s",
            a.name(),
            b.name(),
            -secs,
            ms as f64 / 1000.0
        ),
    );
    ctx.hold(ms).await;
    a.set_clock(0);
    b.set_clock(0);
    ctx.healed(n, format!("{} and {} on time again", a.name(), b.name()));
}

/// A killed primary comes back only as a replica of the one Sentinel promotes.
async fn kill_primary(ctx: &Ctx, fault: &Fault) {
    let redis = &ctx.world.redis;
    let Some(m) = redis.master().await else {
        return ctx.note("kill -9 the primary: skipped, no sentinel names one".into());
    };
    let pid = redis.kill_node(m);
    let n = ctx.struck(
        fault,
        format!("kill -9 the primary, redis {m} (pid {pid:?})"),
    );
    // Sentinel needs a second or two; much longer when sentinels are in TILT (30 s
    // after a pause of theirs).
    let promoted = redis
        .wait_master_other_than(m, Duration::from_secs(30))
        .await;
    let how = redis.bring_back(m).await;
    ctx.healed(
        n,
        format!("redis {m} started again {how} (promoted: {promoted:?})"),
    );
}

async fn kill_replica(ctx: &Ctx, fault: &Fault, k: u8, down_ms: u64) {
    let redis = &ctx.world.redis;
    let replicas = redis.replicas().await;
    let r = replicas[k as usize % replicas.len()];
    let pid = redis.kill_node(r);
    let n = ctx.struck(
        fault,
        format!("kill -9 replica {k}, redis {r} (pid {pid:?})"),
    );
    ctx.hold(down_ms).await;
    let how = redis.bring_back(r).await;
    ctx.healed(n, format!("redis {r} started again {how}"));
}

/// The pid and name of the process playing `who` now.
async fn resolve(ctx: &Ctx, who: Who) -> Option<(u32, String)> {
    let w = &ctx.world;
    let (slot, name) = match who {
        Who::Api(k) => (&w.services[k as usize].slot, format!("api {k}")),
        Who::Worker(k) => (&w.services[2 + k as usize].slot, format!("worker {k}")),
        Who::Sentinel(k) => (&w.redis.sentinels[k as usize].slot, format!("sentinel {k}")),
        Who::Primary => {
            let m = w.redis.master().await?;
            (
                &w.redis.nodes[m as usize].slot,
                format!("the primary, redis {m}"),
            )
        }
        Who::Replica(k) => {
            let replicas = w.redis.replicas().await;
            let r = replicas[k as usize % replicas.len()];
            (
                &w.redis.nodes[r as usize].slot,
                format!("replica {k}, redis {r}"),
            )
        }
    };
    Some((slot.pid()?, name))
}

async fn pause(ctx: &Ctx, fault: &Fault, who: Who, ms: u64) {
    let Some((pid, name)) = resolve(ctx, who).await else {
        return ctx.note(format!("SIGSTOP {who}: skipped, not running"));
    };
    signal(pid, "STOP");
    let n = ctx.struck(
        fault,
        format!("SIGSTOP {name} (pid {pid}) for {:.1} s", ms as f64 / 1000.0),
    );
    ctx.hold(ms).await;
    signal(pid, "CONT");
    ctx.healed(n, format!("SIGCONT {name} (pid {pid})"));
}

async fn owner_of(ctx: &Ctx, from: From) -> (Owner, String) {
    match from {
        From::Api(k) => (Owner::Api(k), format!("api {k}")),
        From::Worker(k) => (Owner::Worker(k), format!("worker {k}")),
        From::Sentinel(k) => (Owner::Sentinel(k), format!("sentinel {k}")),
        From::Replica(k) => {
            let replicas = ctx.world.redis.replicas().await;
            let r = replicas[k as usize % replicas.len()];
            (Owner::Node(r), format!("replica {k}, redis {r}"))
        }
    }
}

async fn link(ctx: &Ctx, fault: &Fault, from: From, to: To, freeze: bool, ms: u64) {
    let (owner, name) = owner_of(ctx, from).await;
    let (target, there) = match to {
        To::Postgres => (Target::Postgres, "postgres".to_string()),
        To::Primary => match ctx.world.redis.master().await {
            Some(m) => (Target::Node(m), format!("the primary, redis {m}")),
            None => return ctx.note(format!("{}: skipped, no primary named", fault.kind())),
        },
    };
    let links = &ctx.world.links;
    let verb = if freeze { "freeze" } else { "cut" };
    if freeze {
        links.freeze(owner, target)
    } else {
        links.cut(owner, target)
    }
    let n = ctx.struck(
        fault,
        format!("{verb} {name} → {there} for {:.1} s", ms as f64 / 1000.0),
    );
    ctx.hold(ms).await;
    if freeze {
        links.thaw(owner, target)
    } else {
        links.heal(owner, target)
    }
    ctx.healed(n, format!("healed {name} → {there}"));
}

/// Two primaries: the sentinels (and maybe the replicas) lose the primary and promote
/// another, while one API instance and one worker still write to the old one.
async fn partition(
    ctx: &Ctx,
    fault: &Fault,
    keep_api: u8,
    keep_worker: u8,
    replicas_too: bool,
    ms: u64,
) {
    let redis = &ctx.world.redis;
    let Some(m) = redis.master().await else {
        return ctx.note("partition: skipped, no primary named".into());
    };
    let mut cut: Vec<Owner> = (0..3).map(Owner::Sentinel).collect();
    cut.extend([Owner::Api(1 - keep_api), Owner::Worker(1 - keep_worker)]);
    if replicas_too {
        cut.extend((0..3).filter(|r| *r != m).map(Owner::Node));
    }
    for owner in &cut {
        ctx.world.links.cut(*owner, Target::Node(m));
    }
    let n = ctx.struck(
        fault,
        format!("partition: redis {m} (the primary) cut from {cut:?}; api {keep_api} and worker {keep_worker} still reach it"),
    );
    let began = std::time::Instant::now();
    let promoted = redis
        .wait_master_other_than(m, Duration::from_millis(ms))
        .await;
    ctx.note(format!(
        "partition: the sentinels name {promoted:?} while redis {m} is cut off"
    ));
    ctx.hold(ms.saturating_sub(began.elapsed().as_millis() as u64))
        .await;
    for owner in &cut {
        ctx.world.links.heal(*owner, Target::Node(m));
    }
    ctx.healed(n, format!("partition of redis {m} healed"));
}

async fn failover_failback(ctx: &Ctx, fault: &Fault, back_after_ms: u64, hasty: bool) {
    let redis = &ctx.world.redis;
    let Some(first) = redis.master().await else {
        return ctx.note("failover: skipped, no primary named".into());
    };
    let asked = redis.failover().await;
    let n = ctx.struck(
        fault,
        format!("SENTINEL FAILOVER from redis {first}: {asked:?}"),
    );
    let Some(second) = redis
        .wait_master_other_than(first, Duration::from_secs(15))
        .await
    else {
        return ctx.healed(
            n,
            "failover: no other primary within 15 s; no failback".into(),
        );
    };
    ctx.note(format!("failover: redis {second} promoted"));
    // Only the first primary may be chosen for the way back.
    let other = (0..3u8).find(|i| *i != first && *i != second).unwrap();
    let _ = redis.set_priority(other, 0).await;
    ctx.hold(back_after_ms).await;
    // As an operator would: back only once the first primary has caught up, and once
    // the sentinels know the other replica must not be chosen.
    let synced = hasty || redis.wait_in_sync(first, Duration::from_secs(15)).await;
    let seen = redis
        .wait_priority_seen(other, 0, Duration::from_secs(12))
        .await;
    ctx.note(format!(
        "failback: redis {first} in sync: {}; the sentinels see redis {other} unelectable: {seen}",
        if hasty {
            "not waited for".to_string()
        } else {
            synced.to_string()
        }
    ));
    let asked = redis.failover().await;
    let back = redis
        .wait_master_other_than(second, Duration::from_secs(15))
        .await;
    let _ = redis.set_priority(other, 100).await;
    ctx.healed(
        n,
        format!("failback ({asked:?}): the sentinels name redis {back:?}"),
    );
}

/// The primary saved, then some seconds later killed and started at once from that
/// snapshot: an older Redis that Sentinel does not notice.
async fn rollback(ctx: &Ctx, fault: &Fault, snapshot_age_ms: u64) {
    let redis = &ctx.world.redis;
    let Some(m) = redis.master().await else {
        return ctx.note("rollback: skipped, no primary named".into());
    };
    if let Err(e) = redis.save_snapshot(m).await {
        return ctx.note(format!("rollback: SAVE on redis {m} failed ({e}); skipped"));
    }
    ctx.note(format!(
        "rollback: snapshot of redis {m} (the primary) saved"
    ));
    tokio::time::sleep(Duration::from_millis(snapshot_age_ms)).await;
    if ctx.stop.is_cancelled() || redis.master().await != Some(m) {
        return ctx.note(format!(
            "rollback: skipped, redis {m} is no longer the primary (or the run ended)"
        ));
    }
    let n = ctx.struck(
        fault,
        format!(
            "rollback: redis {m} killed, started from its snapshot of {:.1} s ago",
            snapshot_age_ms as f64 / 1000.0
        ),
    );
    let result = redis.restart_from_snapshot(m).await;
    ctx.healed(
        n,
        format!("rollback: redis {m} back from its snapshot: {result:?}"),
    );
}

async fn restart_postgres(ctx: &Ctx, fault: &Fault, immediate: bool, down_ms: u64) {
    let mode = if immediate { "immediate" } else { "fast" };
    let w = ctx.world.clone();
    let stopped = tokio::task::spawn_blocking(move || w.pg.run_stop(mode))
        .await
        .unwrap_or(false);
    let n = ctx.struck(fault, format!("postgres stopped (-m {mode}): {stopped}"));
    ctx.hold(down_ms).await;
    let w = ctx.world.clone();
    let started = tokio::task::spawn_blocking(move || w.pg.is_running() || w.pg.run_start())
        .await
        .unwrap_or(false);
    ctx.healed(n, format!("postgres started again: {started}"));
}

/// The filler's keys (not the service's), 10 KB each, written 10 a batch.
const FILLER: &str = "nemesis-filler:";
const FILLER_BATCHES: usize = 300;

/// The primary made to evict: `allkeys-lru` with `maxmemory` 1 MB above what it holds,
/// then filled until it evicted keys (ours among them, maybe); back to `noeviction`,
/// without the filler, after `ms`. The struck time is when the policy was set.
async fn evict(ctx: &Ctx, fault: &Fault, ms: u64) {
    let redis = &ctx.world.redis;
    let Some(m) = redis.master().await else {
        return ctx.note("evicting policy: skipped, no primary named".into());
    };
    let port = redis.nodes[m as usize].port;
    let info = |section: &'static str, field: &'static str| async move {
        let text: String = topology::query(port, redis::cmd("INFO").arg(section)).await?;
        text.lines()
            .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .ok_or_else(|| format!("INFO {section} has no {field}"))
    };
    let (Ok(used), Ok(evicted_before)) = (
        info("memory", "used_memory").await,
        info("stats", "evicted_keys").await,
    ) else {
        return ctx.note(format!(
            "evicting policy: skipped, redis {m} does not answer"
        ));
    };
    let set = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("allkeys-lru")
        .arg("maxmemory")
        .arg(used + 1_000_000)
        .clone();
    if let Err(e) = topology::query::<()>(port, &set).await {
        return ctx.note(format!(
            "evicting policy: CONFIG SET on redis {m} failed ({e}); skipped"
        ));
    }
    let n = ctx.struck(
        fault,
        format!(
            "redis {m} (the primary) switched to allkeys-lru, maxmemory {} MB, for {:.1} s",
            (used + 1_000_000) / 1_000_000,
            ms as f64 / 1000.0
        ),
    );
    let value = "x".repeat(10_000);
    let (mut written, mut refused) = (0, None);
    for batch in 0..FILLER_BATCHES {
        let mut mset = redis::cmd("MSET");
        for i in 0..10 {
            mset.arg(format!("{FILLER}{batch}:{i}")).arg(&value);
        }
        if let Err(e) = topology::query::<()>(port, &mset).await {
            refused = Some(e);
            break;
        }
        written += 10;
        if info("stats", "evicted_keys").await.unwrap_or(0) > evicted_before + 50 {
            break;
        }
    }
    let evicted = info("stats", "evicted_keys")
        .await
        .unwrap_or(evicted_before)
        - evicted_before;
    ctx.note(format!(
        "evicting policy: {written} filler keys written ({}), {evicted} keys evicted on redis {m}",
        refused.map_or("then enough".to_string(), |e| format!("then refused: {e}"))
    ));
    ctx.hold(ms).await;
    let back = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("noeviction")
        .arg("maxmemory")
        .arg(0)
        .clone();
    // Healed as the policy is asked back (a grab decided before that was decided under
    // the evicting one); the filler goes after (its deletes evict nothing).
    let asked = ctx.now();
    let reset = topology::query::<()>(port, &back).await;
    (ctx.world.log).healed(
        n,
        asked,
        format!("redis {m} back to noeviction ({reset:?})"),
    );
    let mut deleted = 0;
    for batch in 0..FILLER_BATCHES {
        let keys: Vec<String> = (0..10).map(|i| format!("{FILLER}{batch}:{i}")).collect();
        deleted += topology::query::<u64>(port, redis::cmd("DEL").arg(&keys))
            .await
            .unwrap_or(0);
    }
    ctx.note(format!("evicting policy: {deleted} filler keys deleted"));
}
