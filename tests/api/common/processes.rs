//! Running the app's other duties in the test: workers, the expiry sweeper, and the
//! `seckill` command line.

use super::*;

impl TestApp {
    /// A worker named `consumer` reads a batch of `shard`, commits it, and dies before
    /// XACK: its entries stay pending. Returns the orders committed.
    pub async fn commit_without_ack(
        &self,
        consumer: &str,
        shard: seckill::keys::Shard,
    ) -> Vec<seckill::store::orders::NewOrder> {
        use seckill::stream::{Delivery, ReadFrom};
        let dying = self.worker_named(consumer);
        dying.ensure_groups().await.unwrap();
        let batch = dying
            .read_batch(shard, ReadFrom::New { block_ms: 1 })
            .await
            .unwrap();
        let orders: Vec<_> = batch
            .iter()
            .map(|e| match e {
                Delivery::Order { order, .. } => *order,
                other => panic!("unexpected {other:?}"),
            })
            .collect();
        seckill::store::orders::persist_batch(&self.db, &orders, &all_live)
            .await
            .unwrap();
        orders
    }

    /// One pass of the expiry sweeper, in this process.
    pub async fn sweep(&self) -> seckill::lifecycle::sweeper::SweepReport {
        let mut conn = self.redis.clone();
        seckill::lifecycle::sweeper::sweep_once(
            &self.db,
            &mut conn,
            &self.keys,
            100,
            seckill::scripts::Replicas::NONE,
        )
        .await
        .unwrap()
    }

    /// Runs `seckill <args>` against the test's database and key space; returns the
    /// exit code and standard output.
    pub fn cli(&self, args: &[&str]) -> (i32, String) {
        let out = self.cli_command(args).output().unwrap();
        Self::cli_output(args, out)
    }

    /// [`TestApp::cli`] with more environment (Sentinel, say), without blocking the
    /// test's runtime (whose tasks, a proxy say, the command may need).
    pub async fn cli_async(&self, args: &[&str], env: &[(&str, String)]) -> (i32, String) {
        let mut cmd = self.cli_command(args);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let out = tokio::process::Command::from(cmd).output().await.unwrap();
        Self::cli_output(args, out)
    }

    fn cli_command(&self, args: &[&str]) -> std::process::Command {
        let mut cmd = std::process::Command::new(faults::BIN);
        cmd.args(args)
            .env("DATABASE_URL", faults::database_url(&self.db, None))
            .env("REDIS_URL", &self.redis_url)
            .env("REDIS_KEY_PREFIX", self.keys.prefix())
            .env("RUST_LOG", "warn");
        cmd
    }

    fn cli_output(args: &[&str], out: std::process::Output) -> (i32, String) {
        let stdout = String::from_utf8(out.stdout).unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        println!("$ seckill {}\n{stdout}{stderr}", args.join(" "));
        (out.status.code().unwrap(), stdout)
    }

    pub fn worker_named(&self, consumer: &str) -> Worker {
        self.worker_on(self.db.clone(), consumer)
    }

    /// A worker writing through `db` (say, a pool behind a proxy).
    pub fn worker_on(&self, db: PgPool, consumer: &str) -> Worker {
        let conn = redis_conn::connect(&self.redis_url, Duration::from_secs(5)).unwrap();
        Worker::new(
            db,
            conn,
            self.keys.clone(),
            WorkerConfig {
                consumer: consumer.into(),
                batch_size: 64,
                block: Duration::from_millis(50),
                claim_idle: Duration::from_millis(200),
                max_deliveries: 3,
                trim_every: Duration::from_millis(100),
                replicas: seckill::scripts::Replicas::NONE,
            },
        )
    }

    pub fn worker(&self) -> Worker {
        self.worker_named(&WorkerConfig::unique_consumer_name())
    }

    /// Runs a worker until the stream is empty.
    pub async fn drain(&self) -> BatchReport {
        self.worker().drain().await.unwrap()
    }
}
