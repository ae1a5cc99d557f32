//! Redis connections.
//!
//! The API shares one multiplexed, self-reconnecting connection: every request's
//! EVALSHA is pipelined onto it, which beats a pool of checked-out connections. A
//! worker gets a connection of its own, because its blocking XREADGROUP would stall
//! every command queued behind it.

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};

pub type RedisConn = ConnectionManager;

/// Connects lazily, so a process starts (and reports not-ready) while Redis is down.
pub fn connect(url: &str, response_timeout: Duration) -> anyhow::Result<RedisConn> {
    let client = redis::Client::open(url)?;
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(2)))
        .set_response_timeout(Some(response_timeout))
        .set_number_of_retries(2)
        .set_max_delay(Duration::from_millis(500));
    Ok(ConnectionManager::new_lazy_with_config(client, config)?)
}

/// Response timeout for ordinary commands (the API's hot path).
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(2);
