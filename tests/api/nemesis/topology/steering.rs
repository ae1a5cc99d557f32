//! Steering the deployment as an operator does: a Sentinel failover, replica
//! priorities, waiting for a replica to catch up or for the deployment to settle.

use std::time::Duration;

use tokio::time::Instant;

use super::{query, Redis, MASTER};

impl Redis {
    /// `SENTINEL FAILOVER` through the first sentinel that takes it.
    pub async fn failover(&self) -> Result<u8, String> {
        let mut last = String::from("no sentinel");
        for s in &self.sentinels {
            match query::<String>(s.port, redis::cmd("SENTINEL").arg("FAILOVER").arg(MASTER)).await
            {
                Ok(_) => return Ok(s.index),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// Sets `replica-priority` on node `i` (0: never promoted).
    pub async fn set_priority(&self, i: u8, priority: u32) -> Result<(), String> {
        let cmd = redis::cmd("CONFIG")
            .arg("SET")
            .arg("replica-priority")
            .arg(priority)
            .clone();
        query::<()>(self.nodes[i as usize].port, &cmd).await
    }

    /// Waits until every sentinel sees node `i`'s priority as `priority` (they read
    /// their replicas' INFO only every few seconds).
    pub async fn wait_priority_seen(&self, i: u8, priority: u32, limit: Duration) -> bool {
        let cmd = redis::cmd("SENTINEL").arg("REPLICAS").arg(MASTER).clone();
        let want = (
            self.nodes[i as usize].proxy.port.to_string(),
            priority.to_string(),
        );
        let began = Instant::now();
        while began.elapsed() < limit {
            let mut all = true;
            for s in &self.sentinels {
                let replicas: Vec<std::collections::HashMap<String, String>> =
                    query(s.port, &cmd).await.unwrap_or_default();
                all &= replicas.iter().any(|r| {
                    r.get("port") == Some(&want.0) && r.get("slave-priority") == Some(&want.1)
                });
            }
            if all {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        false
    }

    /// Waits until the primary sees node `i` online and acknowledging within the last
    /// second (`slaveN:...,state=online,...,lag=0|1`): caught up, as an operator reads it
    /// (under writes the offsets of the two are never equal at one look).
    pub async fn wait_in_sync(&self, i: u8, limit: Duration) -> bool {
        let port = format!("port={},", self.nodes[i as usize].proxy.port);
        let began = Instant::now();
        while began.elapsed() < limit {
            if let Some(m) = self.master().await.filter(|m| *m != i) {
                let info: String = query(
                    self.nodes[m as usize].port,
                    redis::cmd("INFO").arg("replication"),
                )
                .await
                .unwrap_or_default();
                let caught_up = info.lines().any(|l| {
                    l.starts_with("slave")
                        && l.contains(&port)
                        && l.contains("state=online")
                        && (l.ends_with("lag=0") || l.ends_with("lag=1"))
                });
                if caught_up {
                    return true;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        false
    }

    /// Waits (bounded) until the sentinels agree on a primary that says so itself and
    /// has a replica online: the deployment can acknowledge writes again.
    pub async fn settle(&self, limit: Duration) -> Option<u8> {
        let began = Instant::now();
        while began.elapsed() < limit {
            let named = self.named().await;
            if let Some(&m) = named
                .first()
                .filter(|m| named.len() >= 2 && named.iter().all(|n| n == *m))
            {
                let info: String = query(
                    self.nodes[m as usize].port,
                    redis::cmd("INFO").arg("replication"),
                )
                .await
                .unwrap_or_default();
                if info.contains("role:master") && info.contains("state=online") {
                    return Some(m);
                }
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        None
    }
}
