//! Reading the stores behind the app: Postgres orders, statuses and stock, Redis
//! stock and pending entries, and the invariants that must hold after any fault.

use super::*;

impl TestApp {
    /// An order's status in Postgres (`None`: not written).
    pub async fn pg_status(&self, order_id: &str) -> Option<String> {
        sqlx::query_scalar("SELECT status FROM voucher_orders WHERE id = $1")
            .bind(order_id.parse::<i64>().unwrap())
            .fetch_optional(&self.db)
            .await
            .unwrap()
    }

    /// The sale's orders by status, counted; and checked against the counts its row
    /// keeps for the live view (every status but created, and created as the orders
    /// written less those), which every transition must keep equal.
    pub async fn pg_statuses(&self, voucher_id: i64) -> std::collections::BTreeMap<String, i64> {
        // One statement, so one snapshot even while orders move.
        let (counted, kept): (sqlx::types::Json<std::collections::BTreeMap<String, i64>>, Vec<i64>) =
            sqlx::query_as(
                "SELECT coalesce((SELECT jsonb_object_agg(status, n) FROM (SELECT status, count(*) AS n \
                     FROM voucher_orders WHERE voucher_id = $1 GROUP BY status) c), '{}'), \
                 ARRAY[(initial_stock - stock + units_back - paid - used - refunding - refunded \
                        - cancelled - expired)::int8, \
                       paid, used, refunding, refunded, cancelled, expired, \
                       units_back - (SELECT count(*) FROM voucher_orders \
                                     WHERE voucher_id = $1 AND closed_at IS NOT NULL)] \
                 FROM seckill_vouchers WHERE voucher_id = $1",
            )
            .bind(voucher_id)
            .fetch_one(&self.db)
            .await
            .unwrap();
        let counted = counted.0;
        let of = |status: &str| counted.get(status).copied().unwrap_or(0);
        let statuses = [
            "created",
            "paid",
            "used",
            "refunding",
            "refunded",
            "cancelled",
            "expired",
        ];
        let mut expected: Vec<i64> = statuses.iter().map(|s| of(s)).collect();
        expected.push(0);
        assert_eq!(
            kept, expected,
            "the sale row's counts ({statuses:?}, and units back less the orders closed) \
             against its orders"
        );
        counted
    }

    /// Releases still owed to Redis.
    pub async fn owed_releases(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM stock_releases")
            .fetch_one(&self.db)
            .await
            .unwrap()
    }

    /// The epoch Postgres recorded for the sale's (first segment's) state: what its
    /// admissions stamp their entries with (`None`: never built with one).
    pub async fn epoch(&self, voucher_id: i64) -> Option<seckill::domain::Epoch> {
        sqlx::query_scalar("SELECT epoch FROM sale_epochs WHERE voucher_id = $1 AND segment = 0")
            .bind(voucher_id)
            .fetch_optional(&self.db)
            .await
            .unwrap()
    }

    /// `XADD` of an entry of one order as admission writes it, stamped with the sale's
    /// epoch (it takes no unit and sets no buyer record).
    pub async fn entry_of_one_order(
        &self,
        voucher_id: i64,
        user: i64,
        order_id: i64,
    ) -> redis::Cmd {
        let mut cmd = redis::cmd("XADD");
        cmd.arg(self.keys.stream(self.keys.shard_of(vid(voucher_id))))
            .arg("*")
            .arg("order_id")
            .arg(order_id)
            .arg("voucher_id")
            .arg(voucher_id)
            .arg("user_id")
            .arg(user)
            .arg("admitted_ms")
            .arg(chrono::Utc::now().timestamp_millis());
        if let Some(epoch) = self.epoch(voucher_id).await {
            cmd.arg("epoch").arg(epoch.get());
        }
        cmd
    }

    pub async fn pg_stock(&self, voucher_id: i64) -> i32 {
        sqlx::query_scalar("SELECT stock FROM seckill_vouchers WHERE voucher_id = $1")
            .bind(voucher_id)
            .fetch_one(&self.db)
            .await
            .unwrap()
    }

    /// `(order id, user id)` of the voucher's active orders: those holding a unit
    /// (created, paid, used, refunding but for a late payment's).
    pub async fn pg_orders(&self, voucher_id: i64) -> Vec<(i64, i64)> {
        sqlx::query_as(
            "SELECT id, user_id FROM voucher_orders \
             WHERE voucher_id = $1 AND closed_at IS NULL ORDER BY id",
        )
        .bind(voucher_id)
        .fetch_all(&self.db)
        .await
        .unwrap()
    }

    /// How many of [`Self::pg_orders`] there are, without fetching them: cheap to poll.
    pub async fn pg_order_count(&self, voucher_id: i64) -> usize {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM voucher_orders \
             WHERE voucher_id = $1 AND closed_at IS NULL",
        )
        .bind(voucher_id)
        .fetch_one(&self.db)
        .await
        .unwrap();
        n as usize
    }

    /// Redis's live stock of a sale (`None`: not loaded), summed over its segments, read as
    /// the API reads it.
    pub async fn redis_stock(&self, voucher_id: i64) -> Option<i64> {
        let segments: i16 =
            sqlx::query_scalar("SELECT segments FROM seckill_vouchers WHERE voucher_id = $1")
                .bind(voucher_id)
                .fetch_one(&self.db)
                .await
                .unwrap();
        seckill::admission::redis_stock(
            &mut self.redis.clone(),
            &self.keys,
            vid(voucher_id),
            segments as u8,
        )
        .await
        .unwrap()
    }

    pub async fn redis_cmd<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> T {
        cmd.query_async(&mut self.redis.clone()).await.unwrap()
    }

    /// Every order of the voucher in Postgres, asserting the invariants that must hold
    /// after any fault: no user twice, and stock = initial - orders.
    pub async fn assert_consistent(
        &self,
        voucher_id: i64,
        initial: i64,
    ) -> std::collections::HashSet<i64> {
        let orders = self.pg_orders(voucher_id).await;
        let users: std::collections::HashSet<i64> = orders.iter().map(|(_, u)| *u).collect();
        assert_eq!(users.len(), orders.len(), "a user holds two orders");
        assert!(
            orders.len() as i64 <= initial,
            "oversold: {} orders for {initial}",
            orders.len()
        );
        assert_eq!(
            self.pg_stock(voucher_id).await as i64,
            initial - orders.len() as i64,
            "postgres stock = initial - orders"
        );
        orders.into_iter().map(|(id, _)| id).collect()
    }

    /// Waits (bounded) until Postgres holds `n` orders of the voucher.
    pub async fn wait_for_orders(&self, voucher_id: i64, n: usize, limit: Duration) -> usize {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let have = self.pg_order_count(voucher_id).await;
            if have >= n || tokio::time::Instant::now() > deadline {
                return have;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Entries of the group not yet acknowledged.
    pub async fn pending_count(&self) -> i64 {
        let stream = self.keys.stream(seckill::keys::Shard(0));
        let reply: redis::Value = self
            .redis_cmd(
                redis::cmd("XPENDING")
                    .arg(stream)
                    .arg(seckill::stream::GROUP),
            )
            .await;
        match reply {
            redis::Value::Array(segments) => redis::from_redis_value_ref(&segments[0]).unwrap(),
            other => panic!("unexpected XPENDING reply {other:?}"),
        }
    }
}
