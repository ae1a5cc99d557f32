//! Hearing the announcements of sale changes (pub/sub): a sale named is forgotten, and
//! every sale whenever the subscription was (re)made or went quiet.

use super::*;

/// How often the subscription is pinged (and how long a ping may take).
const PING_EVERY: Duration = Duration::from_secs(2);

impl Edge {
    /// Listens for announcements until cancelled: forgets each sale named, and every
    /// sale whenever the subscription was (re)made or went quiet (messages may have been
    /// missed meanwhile). A PING every [`PING_EVERY`] tells a live subscription from a
    /// silently cut one.
    pub async fn listen(
        self: Arc<Self>,
        source: crate::redis_conn::Subscriber,
        channel: String,
        cancel: tokio_util::sync::CancellationToken,
    ) {
        let mut backoff =
            crate::backoff::Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
        loop {
            let subscribed = async {
                let mut pubsub = source.connect().await?;
                // (A silently cut link would never answer.)
                tokio::time::timeout(PING_EVERY, pubsub.subscribe(&channel))
                    .await
                    .map_err(|_| crate::redis_conn::timed_out("SUBSCRIBE"))??;
                RedisResult::Ok(pubsub)
            };
            let pubsub = tokio::select! {
                _ = cancel.cancelled() => return,
                r = subscribed => r,
            };
            match pubsub {
                Ok(pubsub) => {
                    backoff.reset();
                    self.forget_all();
                    tracing::debug!(%channel, "listening for sale changes");
                    let lost = tokio::select! {
                        _ = cancel.cancelled() => return,
                        lost = self.hear(pubsub) => lost,
                    };
                    tracing::warn!(%channel, %lost, "lost the subscription to sale changes; resubscribing");
                }
                Err(e) => {
                    tracing::warn!(%channel, error = %e, "cannot subscribe to sale changes");
                }
            }
            self.forget_all();
            source.next_node();
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(backoff.next_delay()) => {}
            }
        }
    }

    /// Forgets each sale announced on `pubsub` until the subscription ends or a PING
    /// goes unanswered; why it ended.
    async fn hear(&self, pubsub: redis::aio::PubSub) -> String {
        use futures_util::StreamExt;
        let (mut sink, mut messages) = pubsub.split();
        let mut ping = tokio::time::interval(PING_EVERY);
        ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Pings answered in order: one in flight at a time, within the interval.
        let pinged = async {
            loop {
                ping.tick().await;
                match tokio::time::timeout(PING_EVERY, sink.ping::<redis::Value>()).await {
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => return format!("ping failed: {e}"),
                    Err(_) => return "no answer to a ping".to_string(),
                }
            }
        };
        let heard = async {
            while let Some(message) = messages.next().await {
                metrics::counter!(crate::metrics::SALE_CHANGES_HEARD).increment(1);
                match message.get_payload::<i64>() {
                    // Not a sale (not positive): nothing remembered to forget.
                    Ok(raw) => VoucherId::new(raw).into_iter().for_each(|v| self.forget(v)),
                    Err(_) => self.forget_all(),
                }
            }
            "the connection closed".to_string()
        };
        tokio::select! {
            why = pinged => why,
            why = heard => why,
        }
    }
}
