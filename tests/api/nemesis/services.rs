//! The service under test: two `seckill api` and two `seckill worker` processes of the
//! real binary, finding Redis through the sentinels and Postgres through its proxy,
//! each logging to a file of the run directory (appended across restarts).

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use super::proxy::{Links, Owner};
use super::topology::Slot;

/// The JWT secret of the campaign's processes and tokens.
pub const SECRET: &str = "nemesis-secret";
/// Every Redis key of the campaign lies under it.
pub const PREFIX: &str = "nemesis:";

/// What every seckill process of the campaign is started with.
#[derive(Clone)]
pub struct Env {
    pub bin: PathBuf,
    pub sentinels: String,
    pub master: String,
    /// `DATABASE_URL` through the Postgres proxy.
    pub database_url: String,
}

impl Env {
    pub fn command(&self, subcommand: &str) -> Command {
        let mut cmd = Command::new(&self.bin);
        // Nothing of the caller's environment (a REDIS_URL, a rate limit) leaks in.
        cmd.env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .arg(subcommand)
            .env("REDIS_SENTINEL_URLS", &self.sentinels)
            .env("REDIS_SENTINEL_MASTER", &self.master)
            .env("REDIS_WAIT_REPLICAS", "1")
            .env("DATABASE_URL", &self.database_url)
            .env("JWT_SECRET", SECRET)
            .env("PAYMENT_WEBHOOK_SECRETS", crate::common::PAYMENT_SECRET)
            // Two instances on this host: each its own internal listener.
            .env("ADMIN_BIND", "127.0.0.1:0")
            .env("REDIS_KEY_PREFIX", PREFIX)
            .env("RUST_LOG", "warn")
            .env("SKIP_MIGRATIONS", "1");
        cmd
    }
}

/// One seckill process, started again as it was after a kill.
pub struct Service {
    pub owner: Owner,
    /// An API instance's port (it gets it back after a restart).
    pub port: Option<u16>,
    log: PathBuf,
    /// How far its wall clock is off (libfaketime reads the file each second): a skew
    /// fault writes it; a restart keeps it.
    clock: PathBuf,
    pub slot: Slot,
}

impl Service {
    pub fn name(&self) -> String {
        match self.owner {
            Owner::Api(k) => format!("api-{k}"),
            Owner::Worker(k) => format!("worker-{k}"),
            other => format!("{other:?}"),
        }
    }

    /// Sets its wall clock `secs` off (ahead when positive) from the next second on.
    pub fn set_clock(&self, secs: i64) {
        std::fs::write(&self.clock, format!("{secs:+}\n")).unwrap();
    }

    pub fn base(&self) -> Option<String> {
        self.port.map(|p| format!("http://127.0.0.1:{p}"))
    }

    /// Starts it (again); no wait for readiness: the workload copes with a process
    /// that is not there yet, as a load balancer's clients do.
    pub fn spawn(&self, env: &Env, links: &Links) {
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let mut cmd = match self.owner {
            Owner::Api(_) => {
                let mut cmd = env.command("api");
                // Its promises outlive a kill -9, as in a deployment that keeps the
                // file across the instance's restarts.
                cmd.env("BIND", format!("127.0.0.1:{}", self.port.unwrap()))
                    .env("RATE_LIMIT_PER_IP", "0")
                    .env("PROMISES_FILE", self.log.with_extension("promises"));
                cmd
            }
            _ => {
                let mut cmd = env.command("worker");
                // A stable consumer name: a restarted worker replays its own pending
                // entries; a stopped one's are claimed by the other after 3 s.
                cmd.env("WORKER_CONSUMER", self.name())
                    .env("WORKER_CLAIM_IDLE_MS", "3000");
                cmd
            }
        };
        // Its clock as the file says (libfaketime; its monotonic clock stays true).
        cmd.env("LD_PRELOAD", crate::common::faults::libfaketime())
            .env("FAKETIME_TIMESTAMP_FILE", &self.clock)
            .env("FAKETIME_CACHE_DURATION", "1")
            .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
        let child = cmd
            .stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap_or_else(|e| panic!("{}: {e}", env.bin.display()));
        links.register(child.id(), self.owner);
        self.slot.set(child);
    }

    pub fn kill9(&self, links: &Links) -> Option<u32> {
        let pid = self.slot.kill9()?;
        links.forget(pid);
        Some(pid)
    }
}

/// The four processes.
pub fn services(dir: &Path) -> Vec<Service> {
    let logs = dir.join("logs");
    std::fs::create_dir_all(&logs).unwrap();
    let service = |owner: Owner, name: String, port: Option<u16>| {
        let s = Service {
            owner,
            port,
            log: logs.join(format!("{name}.log")),
            clock: logs.join(format!("{name}.clock")),
            slot: Slot::default(),
        };
        s.set_clock(0);
        s
    };
    let api = |k: u8| {
        service(
            Owner::Api(k),
            format!("api-{k}"),
            Some(super::topology::port()),
        )
    };
    let worker = |k: u8| service(Owner::Worker(k), format!("worker-{k}"), None);
    vec![api(0), api(1), worker(0), worker(1)]
}

/// `seckill migrate`, against Postgres directly, bounded.
pub async fn migrate(env: &Env, direct_url: &str) {
    let mut cmd = env.command("migrate");
    cmd.env("DATABASE_URL", direct_url);
    let out = run_bounded(cmd, Duration::from_secs(60)).await;
    assert_eq!(out.0, Some(0), "seckill migrate: {}", out.1);
}

/// Runs a command to its end, killed after `limit`; its exit code (`None`: killed or
/// not started) and its output.
pub async fn run_bounded(mut cmd: Command, limit: Duration) -> (Option<i32>, String) {
    let child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn();
    let Ok(child) = child else {
        return (None, "could not start".into());
    };
    let pid = child.id();
    let waiting = tokio::task::spawn_blocking(move || child.wait_with_output());
    match tokio::time::timeout(limit, waiting).await {
        Ok(Ok(Ok(out))) => {
            let text = String::from_utf8_lossy(&out.stdout).to_string()
                + &String::from_utf8_lossy(&out.stderr);
            (out.status.code(), text)
        }
        _ => {
            super::topology::signal(pid, "KILL");
            (None, format!("no exit within {limit:?}"))
        }
    }
}
