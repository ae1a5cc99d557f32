//! The campaign's own Postgres: a cluster made with initdb in the run directory and run
//! with pg_ctl as the postgres account (Postgres refuses root), so that restarting it
//! as a fault touches nobody else's database. Clients reach it through its proxy.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Postgres's programs refuse to run as root: as root, run them as `postgres`.
fn as_postgres(program: &Path) -> Command {
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
    if root {
        let mut cmd = Command::new("runuser");
        cmd.args(["-u", "postgres", "--"]).arg(program);
        cmd
    } else {
        Command::new(program)
    }
}

/// The newest installed Postgres's program (Debian's layout), else the one on PATH.
fn pg_bin(name: &str) -> PathBuf {
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| {
            d.flatten()
                .filter_map(|e| {
                    let v = e.file_name().to_str()?.parse().ok()?;
                    Some((v, e.path().join("bin").join(name)))
                })
                .collect()
        })
        .unwrap_or_default();
    versions.sort();
    versions
        .into_iter()
        .rev()
        .map(|(_, p)| p)
        .find(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from(name))
}

pub struct Postgres {
    pub port: u16,
    data: PathBuf,
    dir: PathBuf,
}

impl Postgres {
    /// initdb in `dir` (a fresh directory), then start.
    pub fn start(dir: &Path, port: u16) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let _ = Command::new("chown")
            .args(["-R", "postgres"])
            .arg(dir)
            .status();
        let data = dir.join("data");
        let status = as_postgres(&pg_bin("initdb"))
            .arg("-D")
            .arg(&data)
            .args(["-U", "postgres", "-A", "trust", "--no-sync"])
            .stdout(Stdio::null())
            .status()
            .expect("initdb");
        assert!(status.success(), "initdb failed");
        let pg = Self {
            port,
            data,
            dir: dir.to_path_buf(),
        };
        assert!(pg.run_start(), "postgres did not start: {}", pg.log_tail());
        pg
    }

    pub fn url(&self, port: u16) -> String {
        format!("postgres://postgres@127.0.0.1:{port}/postgres")
    }

    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.join("postgres.log")).unwrap_or_default();
        log.lines().rev().take(20).collect::<Vec<_>>().join("\n")
    }

    /// `pg_ctl start -w` (blocking: run it off the runtime's threads).
    pub fn run_start(&self) -> bool {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200",
            self.port,
            self.dir.display()
        );
        as_postgres(&pg_bin("pg_ctl"))
            .arg("-D")
            .arg(&self.data)
            .arg("-l")
            .arg(self.dir.join("postgres.log"))
            .args(["-w", "-t", "60", "-o", &options, "start"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// `pg_ctl stop -m <mode>` (`immediate`: a crash, recovered at the next start).
    pub fn run_stop(&self, mode: &str) -> bool {
        as_postgres(&pg_bin("pg_ctl"))
            .arg("-D")
            .arg(&self.data)
            .args(["-w", "-t", "60", "-m", mode, "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Whether the server is up (its pid file names a live postmaster).
    pub fn is_running(&self) -> bool {
        as_postgres(&pg_bin("pg_ctl"))
            .arg("-D")
            .arg(&self.data)
            .arg("status")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }
}

impl Drop for Postgres {
    /// Stopped, and its data files removed: they say nothing its log (kept beside them
    /// in a failed run's directory) and the checker's figures do not.
    fn drop(&mut self) {
        self.run_stop("immediate");
        let _ = std::fs::remove_dir_all(&self.data);
    }
}
