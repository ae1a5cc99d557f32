//! The nemesis: a fault campaign against the whole deployment. A realistic mix of
//! shoppers and an administrator runs through two API instances and two workers,
//! against Sentinel-managed Redis (a primary, two replicas, three sentinels) and
//! Postgres, with `REDIS_WAIT_REPLICAS=1`, while a seeded schedule strikes a fault
//! every 1-2.5 s: processes killed or paused, links cut or frozen, the primary
//! partitioned from the sentinels while some clients still write to it, failovers and
//! failbacks, the primary restarted from an older snapshot, Postgres restarted, the
//! primary evicting keys, an API instance's and a worker's clocks minutes off. Then
//! everything is healed and the checker judges every promise from the history and the
//! stores (see `checker.rs`).
//!
//! The short form runs with `cargo test` (fixed seeds); the long form is the ignored
//! test `load/nemesis` runs with `SEED` and `DURATION` from the environment. A failing
//! run keeps its directory (history, schedule, fault log, every process's log) and
//! prints its path.

mod checker;
mod faults;
mod history;
mod observe;
mod postgres;
mod proxy;
mod report;
mod schedule;
mod services;
mod topology;
mod workload;
mod world;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use checker::{Evidence, Verdict};
use history::Recorder;
use workload::Workload;
use world::World;

/// Faults begin once the first sales are open.
const WARMUP_MS: u64 = 3_000;
/// Shopper tasks, and users each: 400 shoppers, tens of requests a second.
const SHOPPERS: i64 = 8;
const USERS_EACH: i64 = 50;
/// After the last heal every open sale must answer a definite answer within this.
const ADMIT_BOUND_SECS: f64 = 30.0;

pub struct Config {
    pub seed: u64,
    pub duration: Duration,
    /// The seckill binary.
    pub bin: PathBuf,
}

impl Config {
    /// `SEED` (else a random one), `DURATION` in seconds (else `default_secs`), `BIN`
    /// (else this build's binary).
    pub fn from_env(default_secs: u64) -> Self {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let seed = var("SEED").map_or_else(
            || u64::from(rand::random::<u32>()),
            |s| s.parse().expect("SEED: a number"),
        );
        let secs = var("DURATION").map_or(default_secs, |s| s.parse().expect("DURATION: seconds"));
        Self {
            seed,
            duration: Duration::from_secs(secs),
            bin: var("BIN").map_or_else(|| env!("CARGO_BIN_EXE_seckill").into(), PathBuf::from),
        }
    }
}

/// One campaign at a time in a test process: each runs a whole deployment.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Runs a campaign and checks it; prints its figures. The run directory is removed
/// when every promise held, else kept and named.
pub async fn campaign(config: Config) -> Verdict {
    let _one = ONE_AT_A_TIME.lock().await;
    let duration_ms = config.duration.as_millis() as u64;
    let plan = schedule::plan(config.seed, WARMUP_MS, duration_ms);
    let sales_plan = workload::plan_sales(config.seed, duration_ms);
    let dir = std::env::temp_dir().join(format!(
        "seckill-nemesis-seed{}-{}-{:06x}",
        config.seed,
        std::process::id(),
        rand::random::<u32>() & 0xff_ffff
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let described = format!(
        "seed {} ({} s; replay with SEED={})\nfault schedule ({} faults):\n{}sales: {sales_plan:?}\n",
        config.seed,
        config.duration.as_secs(),
        config.seed,
        plan.len(),
        schedule::describe(&plan)
    );
    println!("nemesis: run directory {}\n{described}", dir.display());
    std::fs::write(dir.join("schedule.txt"), &described).unwrap();

    let world = Arc::new(World::start(&dir, config.bin.clone()).await);
    let recorder = Arc::new(Recorder::new());
    // The processes' logs carry UTC times: this is where the history's 0 lies.
    world.log.note(
        0.0,
        format!(
            "the campaign starts: t = 0 is {}",
            chrono::Utc::now().to_rfc3339()
        ),
    );
    let workload = Arc::new(Workload::new(
        world.api_bases(),
        recorder.clone(),
        config.duration,
    ));
    run_campaign(&world, &workload, &plan, sales_plan, &config).await;

    // "Admitting again" counts from here: the heal itself is part of the wait.
    let heal_began = recorder.now_ms();
    let primary = world.heal_all().await;
    world.log.note(
        recorder.now_ms(),
        format!("everything healed; the primary: {primary:?}"),
    );
    let (evidence, reconcile, redis_state) = gather(&world, &workload, &recorder, heal_began).await;
    let verdict = checker::check(&evidence);
    let executed = world.log.executed.lock().unwrap().clone();
    let summary = report::Summary {
        seed: config.seed,
        duration_secs: config.duration.as_secs(),
        planned: plan.len(),
        executed: &executed,
        history: &evidence.history,
        verdict: &verdict,
        reconcile: &reconcile,
        admit_again: &evidence.admit_again,
        settled: evidence.settled,
    }
    .render();
    println!("{summary}");
    keep(&dir, &world, &evidence, &summary, &redis_state);
    drop(world);
    finish(&dir, verdict.violations.is_empty());
    verdict
}

/// The workload and the faults for the campaign's duration; returns once both stopped.
async fn run_campaign(
    world: &Arc<World>,
    workload: &Arc<Workload>,
    plan: &[schedule::Planned],
    sales_plan: Vec<(u64, workload::SaleAction)>,
    config: &Config,
) {
    let stop = CancellationToken::new();
    let mut tasks = Vec::new();
    let w = workload.clone();
    let s = stop.clone();
    tasks.push(tokio::spawn(
        async move { w.administer(sales_plan, s).await },
    ));
    for i in 0..SHOPPERS {
        let users = (0..USERS_EACH).map(|j| 10_000 + i + SHOPPERS * j).collect();
        let (w, s, seed) = (
            workload.clone(),
            stop.clone(),
            config.seed ^ ((i as u64 + 1) << 32),
        );
        tasks.push(tokio::spawn(async move { w.shop(seed, users, s).await }));
    }
    let faults = faults::launch(world.clone(), workload.recorder.clone(), plan, stop.clone());
    tokio::time::sleep(config.duration).await;
    stop.cancel();
    for task in tasks.into_iter().chain(faults) {
        // Everything inside is bounded; this bound only keeps a bug from hanging the run.
        let abort = task.abort_handle();
        if tokio::time::timeout(Duration::from_secs(120), task)
            .await
            .is_err()
        {
            abort.abort();
        }
    }
}

/// After the last heal: how soon each open sale admits again, then (once nothing is in
/// flight) everything the checker reads.
async fn gather(
    world: &Arc<World>,
    workload: &Workload,
    recorder: &Recorder,
    heal_began: f64,
) -> (Evidence, (Option<i32>, String), String) {
    let db = observe::pool(&world.direct_url).await;
    let open = observe::open_sales(&db).await;
    let admit_again = workload
        .admit_again(&open, heal_began, Duration::from_secs(60))
        .await;
    let settled = observe::wait_settled(world, &db, Duration::from_secs(120)).await;
    // Before the orders: a draw's winners' orders commit with it, and none goes away.
    let lotteries = observe::lotteries(&db, recorder.start_unix_ms).await;
    // Units on their way between the segments of a segmented sale arrive within seconds.
    let mut books = observe::pg_books(&db, recorder.start_unix_ms).await;
    let mut sales = observe::sales(world, &books).await;
    for _ in 0..5 {
        if sales
            .iter()
            .all(|s| s.redis_stock.is_none_or(|r| r == s.pg_stock))
        {
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        books = observe::pg_books(&db, recorder.start_unix_ms).await;
        sales = observe::sales(world, &books).await;
    }
    let observe::PgBooks { orders, dead, .. } = books;
    let redis_state = observe::describe_redis(world, &sales, &orders).await;
    let evidence = Evidence {
        history: recorder.snapshot(),
        orders,
        dead,
        sales,
        lotteries,
        start_unix_ms: recorder.start_unix_ms,
        settled,
        reconcile_exit: None,
        admit_again,
        admit_bound_secs: ADMIT_BOUND_SECS,
        evicting: evicting_windows(world, recorder),
        api_stopped: api_stopped(world, recorder),
    };
    let reconcile = observe::reconcile(world).await;
    db.close().await;
    (
        Evidence {
            reconcile_exit: reconcile.0,
            ..evidence
        },
        reconcile,
        redis_state,
    )
}

/// When each fault `pick` takes something from ran, from its strike to its heal (one
/// still running when the campaign ended lasts until now), with what it took.
fn fault_windows<T>(
    world: &World,
    recorder: &Recorder,
    pick: impl Fn(schedule::Fault) -> Option<T>,
) -> Vec<(T, f64, f64)> {
    let now = recorder.now_ms();
    world
        .log
        .executed
        .lock()
        .unwrap()
        .iter()
        .filter_map(|x| Some((pick(x.fault)?, x.start_ms, x.healed_ms.unwrap_or(now))))
        .collect()
}

/// When the primary could evict keys, as the eviction faults ran.
fn evicting_windows(world: &World, recorder: &Recorder) -> Vec<(f64, f64)> {
    let evicting = |f| matches!(f, schedule::Fault::Evict { .. }).then_some(());
    fault_windows(world, recorder, evicting)
        .into_iter()
        .map(|((), from, to)| (from, to))
        .collect()
}

/// When each API instance was stopped (killed, until started again; paused), as the
/// faults ran.
fn api_stopped(world: &World, recorder: &Recorder) -> Vec<(u8, f64, f64)> {
    use schedule::{Fault, Who};
    fault_windows(world, recorder, |f| match f {
        Fault::Kill {
            who: Who::Api(k), ..
        }
        | Fault::Pause {
            who: Who::Api(k), ..
        } => Some(k),
        _ => None,
    })
}

/// Writes what a reader of a failed run needs into its directory.
fn keep(dir: &Path, world: &World, evidence: &Evidence, summary: &str, redis_state: &str) {
    let _ = std::fs::write(dir.join("redis-state.txt"), redis_state);
    let _ = std::fs::write(
        dir.join("history.jsonl"),
        history::to_json_lines(&evidence.history),
    );
    let _ = std::fs::write(dir.join("faults.log"), world.log.text());
    let _ = std::fs::write(dir.join("report.txt"), summary);
}

/// Removes the run directory after a clean run; names it after a failing one.
fn finish(dir: &Path, clean: bool) {
    if clean {
        let _ = std::fs::remove_dir_all(dir);
    } else {
        println!("nemesis: the run is kept in {}", dir.display());
    }
}

/// Seed `seed`'s schedule of `secs`, which must plan each fault of `kinds`.
fn planning(seed: u64, secs: u64, kinds: &[&str]) -> Vec<schedule::Planned> {
    let planned = schedule::plan(seed, WARMUP_MS, secs * 1000);
    for kind in kinds {
        assert!(
            planned.iter().any(|p| p.fault.kind().contains(kind)),
            "seed {seed} plans no {kind} in {secs} s"
        );
    }
    planned
}

/// Runs seed `seed` for `secs` with this build: no violation.
async fn keeps_every_promise(seed: u64, secs: u64) {
    let verdict = campaign(Config {
        seed,
        duration: Duration::from_secs(secs),
        bin: env!("CARGO_BIN_EXE_seckill").into(),
    })
    .await;
    assert!(
        verdict.violations.is_empty(),
        "violations: {}",
        verdict.violations.len()
    );
}

/// A short campaign, as `cargo test` runs it: its seed must plan at least 30 faults,
/// among them each change of the Redis deployment (seeds 41 and 55 do in 70 s; 55's
/// failback is a hasty one).
async fn short(seed: u64, secs: u64) {
    let kinds = [
        "kill -9 primary",
        "partition",
        "failover",
        "snapshot",
        "postgres",
        "may evict",
        "clock skew",
    ];
    let planned = planning(seed, secs, &kinds);
    assert!(
        planned.len() >= 30,
        "seed {seed} plans {} faults in {secs} s",
        planned.len()
    );
    keeps_every_promise(seed, secs).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_campaign_of_seventy_seconds_with_seed_55_keeps_every_promise() {
    short(55, 70).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_campaign_of_seventy_seconds_with_seed_41_keeps_every_promise() {
    short(41, 70).await;
}

/// A seed that once found a violation, replayed as far as the fault that struck it
/// (`kind`, planned by `secs`): it keeps every promise now.
async fn regression(seed: u64, secs: u64, kind: &str) {
    planning(seed, secs, &[kind]);
    keeps_every_promise(seed, secs).await;
}

/// Seed 1234 lost 13 202s to a partition with two primaries in its first 8 s: the old
/// primary's 202s, acknowledged by a replica then resynced under the new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn seed_1234_a_partition_with_two_primaries_loses_no_202() {
    regression(1234, 20, "partition").await;
}

/// Seed 29 lost 3 202s to the primary restarted from an older snapshot before Sentinel
/// noticed, its replicas resynced from it and the worker holding them frozen; then one
/// of them broke when its shopper won again through the other instance before the first
/// instance, cut from Postgres, had admitted it again. The new term holds its sales
/// until every instance has (docs/durability.md, "The 202s an instance keeps").
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn seed_29_a_primary_restarted_from_an_older_snapshot_loses_no_202() {
    regression(29, 20, "older snapshot").await;
}

/// Seed 1 lost 9 202s answered on the old primary between a Sentinel failover and the
/// moment the API instances moved.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn seed_1_a_sentinel_failover_loses_no_202_answered_on_the_old_primary() {
    regression(1, 60, "failover").await;
}

/// The long form: `load/nemesis` runs it (`SEED`, `DURATION`, `BIN`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "the long form, run by load/nemesis"]
async fn a_campaign_of_the_seed_and_duration_the_environment_gives_keeps_every_promise() {
    let config = Config::from_env(120);
    println!(
        "nemesis: SEED={} DURATION={}",
        config.seed,
        config.duration.as_secs()
    );
    let verdict = campaign(config).await;
    assert!(
        verdict.violations.is_empty(),
        "violations: {}",
        verdict.violations.len()
    );
}
