//! The fault schedule: a pure function of the seed and the duration, printed at the
//! start, so `SEED=` replays the same faults at the same times. Targets are roles
//! ("the primary", "replica 1"): which node plays a role is only known when the fault
//! runs, and the fault log says which one it was.

use std::collections::HashMap;
use std::fmt;

/// SplitMix64: a generator of our own, so a seed replays the same schedule whatever
/// version of `rand` the lock file holds.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }

    pub fn chance(&mut self, p: f64) -> bool {
        ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64) < p
    }

    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.next_u64() as usize % items.len()]
    }
}

/// A process a fault hits, by role.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Who {
    Api(u8),
    Worker(u8),
    Primary,
    /// The k-th replica of the moment (in port order).
    Replica(u8),
    Sentinel(u8),
}

/// The client end of a link a fault cuts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum From {
    Api(u8),
    Worker(u8),
    /// A replica's replication link.
    Replica(u8),
    Sentinel(u8),
}

/// The server end of a link.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum To {
    Primary,
    Postgres,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Fault {
    /// `kill -9`, started again after `down_ms` (a killed primary only once Sentinel
    /// has promoted another, as its replica: a primary without persistence must not come
    /// back empty and wipe its replicas).
    Kill { who: Who, down_ms: u64 },
    /// SIGSTOP, SIGCONT after `ms`.
    Pause { who: Who, ms: u64 },
    /// The link cut (connections dropped, new ones refused) or frozen (nothing passes,
    /// connections stay open: a silent partition), healed after `ms`.
    Link {
        from: From,
        to: To,
        freeze: bool,
        ms: u64,
    },
    /// The primary cut off from every sentinel (and the replicas, if `replicas_too`) and
    /// from one API instance and one worker, while the others still reach it: Sentinel
    /// promotes a replica and two primaries take writes at once, until it heals.
    Partition {
        keep_api: u8,
        keep_worker: u8,
        replicas_too: bool,
        ms: u64,
    },
    /// `SENTINEL FAILOVER`, then after `back_after_ms` a failover back to the first
    /// primary: once it has caught up, or (`hasty`) at once, wherever its replication
    /// stands (a failover to a replica that lags, which the service must heal from).
    FailoverFailback { back_after_ms: u64, hasty: bool },
    /// The primary saved (`SAVE`) `snapshot_age_ms` before, then killed and started at
    /// once from that snapshot: an older Redis, before Sentinel notices anything.
    Rollback { snapshot_age_ms: u64 },
    /// Postgres stopped (`-m immediate`, else `fast`) and started after `down_ms`.
    RestartPostgres { immediate: bool, down_ms: u64 },
    /// The primary switched to `maxmemory-policy allkeys-lru` with `maxmemory` just
    /// above what it holds, and filled until it evicts keys; back to `noeviction` (the
    /// filler deleted) after `ms`.
    Evict { ms: u64 },
    /// API instance `api`'s wall clock set `secs` off and worker `worker`'s `-secs` off
    /// (libfaketime: a step, as NTP makes one), both set right again after `ms`.
    Skew {
        api: u8,
        worker: u8,
        secs: i64,
        ms: u64,
    },
}

/// Faults that must not overlap: two at once in one group could leave the deployment
/// with no way back (two nodes down, no quorum), which proves nothing about the service.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Group {
    Process(Who),
    Topology,
    Sentinels,
    Postgres,
    /// The primary's memory settings (it waits its turn among the changes of the
    /// deployment when it runs: see [`Fault::touches_topology`]).
    Memory,
    /// The processes' clocks: one skew at a time (each sets clocks right when it ends).
    /// A skewed process may also be killed or paused meanwhile: it starts again on the
    /// skewed clock.
    Clocks,
}

impl Fault {
    /// The milliseconds it needs before its start (the snapshot of a rollback) and
    /// after it (the heal and what follows it: a restart, a resync, a failover).
    fn span(&self) -> (u64, u64) {
        match *self {
            Fault::Kill {
                who: Who::Primary, ..
            } => (0, 12_000),
            Fault::Kill { who, down_ms } => (0, down_ms + if is_node(who) { 3_000 } else { 2_500 }),
            Fault::Pause { who, ms } => (0, ms + if is_node(who) { 3_000 } else { 500 }),
            Fault::Link { ms, .. } => (0, ms + 2_000),
            Fault::Partition { ms, .. } => (0, ms + 5_000),
            Fault::FailoverFailback { back_after_ms, .. } => (0, back_after_ms + 6_000),
            Fault::Rollback { snapshot_age_ms } => (snapshot_age_ms, 5_000),
            Fault::RestartPostgres { down_ms, .. } => (0, down_ms + 2_000),
            Fault::Evict { ms } => (0, ms + 3_000),
            // (libfaketime reads the clock's file once a second.)
            Fault::Skew { ms, .. } => (0, ms + 2_000),
        }
    }

    fn groups(&self) -> Vec<Group> {
        let of_who = |who: Who| match who {
            Who::Api(_) | Who::Worker(_) => Group::Process(who),
            Who::Primary | Who::Replica(_) => Group::Topology,
            Who::Sentinel(_) => Group::Sentinels,
        };
        match *self {
            Fault::Kill { who, .. } | Fault::Pause { who, .. } => vec![of_who(who)],
            Fault::Link { from, .. } => vec![match from {
                From::Api(k) => Group::Process(Who::Api(k)),
                From::Worker(k) => Group::Process(Who::Worker(k)),
                From::Replica(_) => Group::Topology,
                From::Sentinel(_) => Group::Sentinels,
            }],
            Fault::Partition { .. } | Fault::FailoverFailback { .. } | Fault::Rollback { .. } => {
                vec![Group::Topology]
            }
            Fault::Evict { .. } => vec![Group::Memory],
            Fault::Skew { .. } => vec![Group::Clocks],
            Fault::RestartPostgres { .. } => vec![Group::Postgres],
        }
    }

    /// Whether it changes the Redis deployment itself (nodes, replication, who is
    /// primary): such faults run one at a time, also when one takes longer than planned.
    pub fn touches_topology(&self) -> bool {
        self.groups()
            .iter()
            .any(|g| matches!(g, Group::Topology | Group::Memory))
    }

    /// Its kind, as the figures count faults.
    pub fn kind(&self) -> String {
        match self {
            Fault::Kill { who, .. } => format!("kill -9 {}", who.kind()),
            Fault::Pause { who, .. } => format!("SIGSTOP {}", who.kind()),
            Fault::Link {
                from, to, freeze, ..
            } => format!(
                "{} {}→{}",
                if *freeze { "freeze" } else { "cut" },
                from.kind(),
                to
            ),
            Fault::Partition { .. } => "partition (two primaries)".into(),
            Fault::FailoverFailback { .. } => "failover and failback".into(),
            Fault::Rollback { .. } => "primary restarted from an older snapshot".into(),
            Fault::RestartPostgres { .. } => "postgres restarted".into(),
            Fault::Evict { .. } => "primary may evict keys".into(),
            Fault::Skew { .. } => "clock skew (api and worker)".into(),
        }
    }
}

fn is_node(who: Who) -> bool {
    matches!(who, Who::Primary | Who::Replica(_))
}

impl Who {
    fn kind(&self) -> &'static str {
        match self {
            Who::Api(_) => "api",
            Who::Worker(_) => "worker",
            Who::Primary => "primary",
            Who::Replica(_) => "replica",
            Who::Sentinel(_) => "sentinel",
        }
    }
}

impl From {
    fn kind(&self) -> &'static str {
        match self {
            From::Api(_) => "api",
            From::Worker(_) => "worker",
            From::Replica(_) => "replica (replication)",
            From::Sentinel(_) => "sentinel",
        }
    }
}

impl fmt::Display for Who {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Who::Api(k) => write!(f, "api {k}"),
            Who::Worker(k) => write!(f, "worker {k}"),
            Who::Primary => write!(f, "the primary"),
            Who::Replica(k) => write!(f, "replica {k}"),
            Who::Sentinel(k) => write!(f, "sentinel {k}"),
        }
    }
}

impl fmt::Display for From {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            From::Api(k) => write!(f, "api {k}"),
            From::Worker(k) => write!(f, "worker {k}"),
            From::Replica(k) => write!(f, "replica {k}"),
            From::Sentinel(k) => write!(f, "sentinel {k}"),
        }
    }
}

impl fmt::Display for To {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            To::Primary => "primary",
            To::Postgres => "postgres",
        })
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = |ms: &u64| *ms as f64 / 1000.0;
        match self {
            Fault::Kill { who, down_ms } => write!(f, "kill -9 {who}, back after {:.1} s", s(down_ms)),
            Fault::Pause { who, ms } => write!(f, "SIGSTOP {who} for {:.1} s", s(ms)),
            Fault::Link { from, to, freeze, ms } => write!(
                f,
                "{} the link {from} → {to} for {:.1} s",
                if *freeze { "freeze" } else { "cut" },
                s(ms)
            ),
            Fault::Partition { keep_api, keep_worker, replicas_too, ms } => write!(
                f,
                "partition the primary from the sentinels{}, api {} and worker {} for {:.1} s (api {keep_api} and worker {keep_worker} still reach it)",
                if *replicas_too { ", the replicas" } else { "" },
                1 - keep_api,
                1 - keep_worker,
                s(ms)
            ),
            Fault::FailoverFailback {
                back_after_ms,
                hasty,
            } => write!(
                f,
                "SENTINEL FAILOVER, failback after {:.1} s{}",
                s(back_after_ms),
                if *hasty { " without waiting for the first primary to catch up" } else { "" }
            ),
            Fault::Rollback { snapshot_age_ms } => write!(
                f,
                "restart the primary from a snapshot taken {:.1} s before",
                s(snapshot_age_ms)
            ),
            Fault::RestartPostgres { immediate, down_ms } => write!(
                f,
                "stop postgres (-m {}), start after {:.1} s",
                if *immediate { "immediate" } else { "fast" },
                s(down_ms)
            ),
            Fault::Evict { ms } => write!(
                f,
                "switch the primary to maxmemory-policy allkeys-lru and fill it until it evicts, noeviction again after {:.1} s",
                s(ms)
            ),
            Fault::Skew { api, worker, secs, ms } => write!(
                f,
                "set api {api}'s clock {secs:+} s off and worker {worker}'s {:+} s off, right again after {:.1} s",
                -secs,
                s(ms)
            ),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Planned {
    /// When it strikes, in ms since the campaign's start.
    pub at_ms: u64,
    pub fault: Fault,
}

impl Planned {
    /// When its work begins (a rollback's snapshot comes first).
    pub fn begins_ms(&self) -> u64 {
        self.at_ms - self.fault.span().0
    }
}

/// One draw from the list, by weight.
fn draw(rng: &mut Rng) -> Fault {
    let pause_ms = |rng: &mut Rng| rng.range(500, 5_000);
    let api = |rng: &mut Rng| rng.range(0, 1) as u8;
    match rng.range(0, 17) {
        0 | 1 => Fault::Kill {
            who: Who::Api(api(rng)),
            down_ms: rng.range(300, 3_000),
        },
        2 | 3 => Fault::Kill {
            who: Who::Worker(api(rng)),
            down_ms: rng.range(300, 3_000),
        },
        4 => Fault::Kill {
            who: Who::Primary,
            down_ms: 0,
        },
        5 => Fault::Kill {
            who: Who::Replica(api(rng)),
            down_ms: rng.range(500, 3_000),
        },
        6 => Fault::Kill {
            who: Who::Sentinel(rng.range(0, 2) as u8),
            down_ms: rng.range(500, 3_000),
        },
        7..=9 => {
            let whos = [
                Who::Api(0),
                Who::Api(1),
                Who::Worker(0),
                Who::Worker(1),
                Who::Primary,
                Who::Replica(0),
                Who::Replica(1),
                Who::Sentinel(0),
                Who::Sentinel(1),
                Who::Sentinel(2),
            ];
            Fault::Pause {
                who: rng.pick(&whos),
                ms: pause_ms(rng),
            }
        }
        10..=13 => {
            let links = [
                (From::Api(0), To::Primary),
                (From::Api(1), To::Primary),
                (From::Worker(0), To::Primary),
                (From::Worker(1), To::Primary),
                (From::Api(0), To::Postgres),
                (From::Api(1), To::Postgres),
                (From::Worker(0), To::Postgres),
                (From::Worker(1), To::Postgres),
                (From::Replica(0), To::Primary),
                (From::Replica(1), To::Primary),
                (From::Sentinel(0), To::Primary),
                (From::Sentinel(1), To::Primary),
            ];
            let (from, to) = rng.pick(&links);
            Fault::Link {
                from,
                to,
                freeze: rng.chance(0.4),
                ms: pause_ms(rng),
            }
        }
        14 => Fault::Partition {
            keep_api: api(rng),
            keep_worker: api(rng),
            replicas_too: rng.chance(0.5),
            ms: rng.range(4_000, 9_000),
        },
        15 => Fault::FailoverFailback {
            back_after_ms: rng.range(3_000, 10_000),
            hasty: rng.chance(0.3),
        },
        16 => Fault::Rollback {
            snapshot_age_ms: rng.range(2_000, 6_000),
        },
        _ => Fault::RestartPostgres {
            immediate: rng.chance(0.5),
            down_ms: rng.range(300, 3_000),
        },
    }
}

/// The schedule: a new fault every 1-2.5 s from `warmup_ms` until `duration_ms`, each
/// drawn until one fits beside the faults still running; then the faults added since
/// the schedule was first written, each kind once in every period of its own, where
/// they fit (so a seed's older faults still strike as they did).
pub fn plan(seed: u64, warmup_ms: u64, duration_ms: u64) -> Vec<Planned> {
    let mut planned = plan_drawn(seed, warmup_ms, duration_ms);
    let span = (warmup_ms, duration_ms);
    add_every(
        seed ^ 0x6576_6963_7469_6f6e,
        (25_000, 30),
        span,
        &mut planned,
        |rng| Fault::Evict {
            ms: rng.range(1_000, 4_000),
        },
    );
    add_every(
        seed ^ 0x636c_6f63_6b5f_736b,
        (20_000, 200),
        span,
        &mut planned,
        |rng| {
            let secs = rng.range(60, 600) as i64;
            Fault::Skew {
                api: rng.range(0, 1) as u8,
                worker: rng.range(0, 1) as u8,
                secs: if rng.chance(0.5) { secs } else { -secs },
                ms: rng.range(3_000, 8_000),
            }
        },
    );
    planned
}

/// One fault `draw` makes in every `period_ms` of `(warmup_ms, duration_ms)`, at a
/// time its groups are free and a second away from any other fault, found within
/// `tries` (`rng` seeded by `seed`, its own for each kind).
fn add_every(
    seed: u64,
    (period_ms, tries): (u64, usize),
    (warmup_ms, duration_ms): (u64, u64),
    planned: &mut Vec<Planned>,
    draw: impl Fn(&mut Rng) -> Fault,
) {
    let mut rng = Rng::new(seed);
    let mut window = warmup_ms;
    while window < duration_ms {
        let end = (window + period_ms).min(duration_ms);
        for _ in 0..tries {
            let fault = draw(&mut rng);
            let at_ms = rng.range(window, end - 1);
            let after = fault.span().1;
            let fits = |p: &Planned| {
                let shared = p.fault.groups().iter().any(|g| fault.groups().contains(g));
                p.at_ms.abs_diff(at_ms) >= 1_000
                    && (!shared
                        || at_ms >= p.at_ms + p.fault.span().1
                        || p.begins_ms() >= at_ms + after)
            };
            if planned.iter().all(fits) {
                planned.push(Planned { at_ms, fault });
                break;
            }
        }
        window = end;
    }
    planned.sort_by_key(|p| p.at_ms);
}

fn plan_drawn(seed: u64, warmup_ms: u64, duration_ms: u64) -> Vec<Planned> {
    let mut rng = Rng::new(seed);
    let mut busy: HashMap<Group, u64> = HashMap::new();
    let mut planned = Vec::new();
    let mut t = warmup_ms;
    loop {
        // 1-2.5 s: within the 1-3 s, and dense enough for 1,000 faults in 30
        // minutes although a slot now and then finds nothing that fits.
        t += rng.range(1_000, 2_500);
        if t >= duration_ms {
            return planned;
        }
        for _ in 0..30 {
            let fault = draw(&mut rng);
            let (before, after) = fault.span();
            let groups = fault.groups();
            let free = t >= warmup_ms + before
                && groups
                    .iter()
                    .all(|g| busy.get(g).is_none_or(|&until| until <= t - before));
            if free {
                for g in groups {
                    busy.insert(g, t + after);
                }
                planned.push(Planned { at_ms: t, fault });
                break;
            }
        }
    }
}

/// The schedule as printed.
pub fn describe(planned: &[Planned]) -> String {
    planned
        .iter()
        .map(|p| format!("  {:>7.1} s  {}\n", p.at_ms as f64 / 1000.0, p.fault))
        .collect()
}

#[test]
fn a_seed_replays_the_same_schedule_and_another_seed_does_not() {
    assert_eq!(plan(7, 2_000, 600_000), plan(7, 2_000, 600_000));
    assert_ne!(plan(7, 2_000, 600_000), plan(8, 2_000, 600_000));
}

#[test]
fn faults_come_every_one_to_three_seconds_and_never_two_of_one_group_at_once() {
    let planned = plan(11, 2_000, 1_800_000);
    assert!(planned.len() >= 1_000, "{} faults in 30 min", planned.len());
    let gaps: Vec<u64> = planned
        .windows(2)
        .map(|p| p[1].at_ms - p[0].at_ms)
        .collect();
    assert!(gaps.iter().all(|g| *g >= 1_000), "{gaps:?}");
    let late = gaps.iter().filter(|g| **g > 3_000).count();
    assert!(
        late * 50 < gaps.len(),
        "{late} of {} gaps above 3 s",
        gaps.len()
    );
    for (i, a) in planned.iter().enumerate() {
        for b in &planned[i + 1..] {
            let overlap = b.begins_ms() < a.at_ms + a.fault.span().1;
            let shared = a
                .fault
                .groups()
                .iter()
                .any(|g| b.fault.groups().contains(g));
            assert!(!(overlap && shared), "{a:?} and {b:?} overlap");
        }
    }
    let kinds: std::collections::HashSet<String> = planned.iter().map(|p| p.fault.kind()).collect();
    assert!(kinds.len() >= 20, "{kinds:?}");
}
