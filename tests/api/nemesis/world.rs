//! Everything a campaign runs, started in order and torn down on drop (panics
//! included): Postgres and its proxy, the Redis deployment, the seckill processes; and
//! the log of what the faults did to it.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::postgres::Postgres;
use super::proxy::{Links, OwnedProxy, Target};
use super::schedule::Fault;
use super::services::{self, Env, Service};
use super::topology::{self, Redis};

/// A fault as it ran: what it hit, when it struck and when it was healed.
#[derive(Clone, Debug)]
pub struct Executed {
    pub fault: Fault,
    pub kind: String,
    pub detail: String,
    pub start_ms: f64,
    pub healed_ms: Option<f64>,
}

#[derive(Default)]
pub struct FaultLog {
    pub executed: Mutex<Vec<Executed>>,
    lines: Mutex<Vec<String>>,
}

impl FaultLog {
    /// A line of the log, printed as it happens.
    pub fn note(&self, at_ms: f64, text: String) {
        let line = format!("{:>8.1} s  {text}", at_ms / 1000.0);
        println!("nemesis: {line}");
        self.lines.lock().unwrap().push(line);
    }

    /// A fault struck; its number, for [`FaultLog::healed`].
    pub fn struck(&self, at_ms: f64, fault: Fault, detail: String) -> usize {
        self.note(at_ms, detail.clone());
        let mut executed = self.executed.lock().unwrap();
        executed.push(Executed {
            fault,
            kind: fault.kind(),
            detail,
            start_ms: at_ms,
            healed_ms: None,
        });
        executed.len() - 1
    }

    pub fn healed(&self, n: usize, at_ms: f64, text: String) {
        self.note(at_ms, text);
        self.executed.lock().unwrap()[n].healed_ms = Some(at_ms);
    }

    pub fn text(&self) -> String {
        self.lines.lock().unwrap().join("\n") + "\n"
    }
}

pub struct World {
    /// First to go on drop: the processes that use the stores.
    pub services: Vec<Service>,
    pub redis: Redis,
    /// Held for its lifetime: every client's way to Postgres.
    _pg_proxy: OwnedProxy,
    pub pg: Postgres,
    pub links: Arc<Links>,
    pub env: Env,
    /// Postgres directly, for the harness's own reads.
    pub direct_url: String,
    /// Held by the fault that is changing the Redis deployment.
    pub topology: tokio::sync::Mutex<()>,
    pub log: FaultLog,
}

impl World {
    pub async fn start(dir: &Path, bin: PathBuf) -> Self {
        let links = Arc::new(Links::default());
        let pg_dir = dir.join("postgres");
        let pg_port = topology::port();
        let pg = tokio::task::spawn_blocking(move || Postgres::start(&pg_dir, pg_port))
            .await
            .unwrap();
        let pg_proxy = OwnedProxy::start(
            links.clone(),
            topology::port(),
            Target::Postgres,
            ([127, 0, 0, 1], pg.port).into(),
        )
        .await;
        let redis = Redis::start(dir, links.clone()).await;
        let env = Env {
            bin,
            sentinels: redis.sentinel_urls(),
            master: topology::MASTER.to_string(),
            database_url: pg.url(pg_proxy.port),
        };
        let direct_url = pg.url(pg.port);
        services::migrate(&env, &direct_url).await;
        let world = Self {
            services: services::services(dir),
            redis,
            _pg_proxy: pg_proxy,
            pg,
            links,
            env,
            direct_url,
            topology: tokio::sync::Mutex::new(()),
            log: FaultLog::default(),
        };
        for s in &world.services {
            s.spawn(&world.env, &world.links);
        }
        for base in world.services.iter().filter_map(Service::base) {
            wait_ready(&base).await;
        }
        world
    }

    pub fn api_bases(&self) -> Vec<String> {
        self.services.iter().filter_map(Service::base).collect()
    }

    /// After the campaign: every link healed, every process running and resumed,
    /// Postgres up; then waits (bounded) for the Redis deployment to settle. The
    /// primary then, if it settled.
    pub async fn heal_all(self: &Arc<Self>) -> Option<u8> {
        self.links.heal_all();
        for s in &self.services {
            s.set_clock(0);
        }
        let pids = self
            .services
            .iter()
            .map(|s| &s.slot)
            .chain(self.redis.nodes.iter().map(|n| &n.slot))
            .chain(self.redis.sentinels.iter().map(|s| &s.slot))
            .filter_map(|slot| slot.pid());
        for pid in pids {
            topology::signal(pid, "CONT");
        }
        for s in self.redis.sentinels.iter().filter(|s| !s.slot.is_running()) {
            self.redis.restart_sentinel(s.index).await;
        }
        for n in self.redis.nodes.iter().filter(|n| !n.slot.is_running()) {
            let how = self.redis.bring_back(n.index).await;
            println!("nemesis: redis {} started again {how}", n.index);
        }
        // A failback cut short may have left a replica unelectable.
        for n in &self.redis.nodes {
            let _ = self.redis.set_priority(n.index, 100).await;
        }
        let me = self.clone();
        let pg_up = tokio::task::spawn_blocking(move || me.pg.is_running() || me.pg.run_start());
        if !pg_up.await.unwrap_or(false) {
            println!("nemesis: postgres did not start again");
        }
        for s in self.services.iter().filter(|s| !s.slot.is_running()) {
            s.spawn(&self.env, &self.links);
        }
        self.redis.settle(Duration::from_secs(60)).await
    }
}

/// Waits (bounded) until `GET {base}/readyz` answers 200.
async fn wait_ready(base: &str) {
    let http = reqwest::Client::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while tokio::time::Instant::now() < deadline {
        let ready = http
            .get(format!("{base}/readyz"))
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .is_ok_and(|r| r.status() == reqwest::StatusCode::OK);
        if ready {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{base} never became ready");
}
