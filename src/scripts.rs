//! Lua on Redis. The `seckill` function library (`lua/seckill.lua`, with
//! `lua/load_voucher.lua`, `lua/move_units.lua` and `lua/lifecycle.lua` appended) holds
//! every script that moves a sale's state, called with FCALL, and loaded again once
//! after the server says it does not know it (a restart, a failover, a flush); the live
//! view's and the stream's housekeeping scripts are plain ones. When replicas must acknowledge a state move
//! (`REDIS_WAIT_REPLICAS`), WAIT follows the call in the same round trip, on the same
//! connection: a WAIT sent alone after a reconnect would count the writes of a fresh
//! connection (none) and answer at once.

use std::sync::LazyLock;
use std::time::Duration;

use redis::aio::ConnectionLike;
use redis::{Cmd, FromRedisValue, RedisError, RedisResult, ToRedisArgs, Value};

/// The library's source: `lua/seckill.lua` with `lua/load_voucher.lua`,
/// `lua/move_units.lua` and `lua/lifecycle.lua` appended.
fn library_source() -> String {
    format!(
        "{}\n{}\n{}\n{}",
        include_str!("../lua/seckill.lua"),
        include_str!("../lua/load_voucher.lua"),
        include_str!("../lua/move_units.lua"),
        include_str!("../lua/lifecycle.lua")
    )
}

/// A stable hash of the library's source (FNV-1a, 64 bits, hex): the same code gives the
/// same hash whatever built the binary.
pub(crate) static LIBRARY_CODE: LazyLock<String> = LazyLock::new(|| {
    let hash = library_source()
        .bytes()
        .fold(0xcbf29ce484222325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x100000001b3)
        });
    format!("{hash:016x}")
});

/// The library's code, as loaded with `FUNCTION LOAD` (its hash filled in).
pub(crate) static LIBRARY: LazyLock<String> =
    LazyLock::new(|| library_source().replacen("__CODE__", &LIBRARY_CODE, 1));

/// The library version this binary carries (`local VERSION = N` in `lua/seckill.lua`).
pub(crate) static LIBRARY_VERSION: LazyLock<i64> = LazyLock::new(|| {
    LIBRARY
        .lines()
        .find_map(|l| l.strip_prefix("local VERSION = ")?.trim().parse().ok())
        .expect("lua/seckill.lua declares its VERSION")
});

/// How many replicas must hold a state move before it counts, how long to wait, and
/// how long ago a replica may have acknowledged last and still count (below that, the
/// master refuses writes: see `admission::guard::require_replicas`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Replicas {
    pub n: u32,
    pub timeout: Duration,
    pub max_lag: Duration,
}

impl Replicas {
    /// No waiting (the default).
    pub const NONE: Replicas = Replicas {
        n: 0,
        timeout: Duration::ZERO,
        max_lag: Duration::ZERO,
    };

    pub(crate) fn waits(&self) -> bool {
        self.n > 0
    }
}

/// Too few replicas acknowledged a call in time: it ran on the master, and a failover
/// could still undo it. An I/O error of kind `TimedOut`, so that every caller treats it
/// as an outcome it cannot know (as a lost reply).
pub(crate) fn not_replicated(wanted: u32, acked: i64) -> RedisError {
    std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("{acked} of {wanted} {NOT_REPLICATED}"),
    )
    .into()
}

const NOT_REPLICATED: &str = "replica(s) acknowledged in time";

/// Whether `e` is [`not_replicated`]: the call ran, its replicas did not acknowledge.
pub(crate) fn is_not_replicated(e: &RedisError) -> bool {
    e.kind() == redis::ErrorKind::Io && e.to_string().contains(NOT_REPLICATED)
}

/// Errors after which a call surely did not run: no connection was made, or Redis
/// refused the command with an error reply, whether the client library knows its code
/// or not (`NOREPLICAS`: too few replicas acknowledging lately; `OOM`, `MISCONF`,
/// `BUSY`: all refused before anything was written). A timeout, a connection lost
/// after sending, or too few acknowledgements after it ([`not_replicated`]) may come
/// after the call ran.
pub(crate) fn surely_not_run(e: &RedisError) -> bool {
    e.is_connection_refusal()
        || matches!(
            e.kind(),
            redis::ErrorKind::Server(_) | redis::ErrorKind::Extension
        )
}

/// A WAIT after a call that ran was refused: the outcome is as unknown as when too few
/// replicas acknowledged (an I/O error of kind `TimedOut`).
fn wait_refused(e: &RedisError) -> RedisError {
    std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("the call ran, but waiting for its replicas failed: {e}"),
    )
    .into()
}

/// One FCALL of a function of the `seckill` library, with its keys and arguments.
#[derive(Clone)]
pub(crate) struct Call {
    function: &'static str,
    keys: Vec<Vec<u8>>,
    args: Vec<Vec<u8>>,
}

impl Call {
    /// A function of the `seckill` library.
    pub(crate) fn function(name: &'static str) -> Self {
        Self {
            function: name,
            keys: Vec::new(),
            args: Vec::new(),
        }
    }

    pub(crate) fn key(&mut self, key: impl ToRedisArgs) -> &mut Self {
        self.keys.extend(key.to_redis_args());
        self
    }

    pub(crate) fn arg(&mut self, arg: impl ToRedisArgs) -> &mut Self {
        self.args.extend(arg.to_redis_args());
        self
    }

    fn cmd(&self) -> Cmd {
        let mut cmd = redis::cmd("FCALL");
        cmd.arg(self.function)
            .arg(self.keys.len())
            .arg(&self.keys)
            .arg(&self.args);
        cmd
    }

    /// Runs the call, loading the library once if the server lacks it.
    pub(crate) async fn invoke<T: FromRedisValue, C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
    ) -> RedisResult<T> {
        self.invoke_waiting(conn, Replicas::NONE).await
    }

    /// Runs the call and, when `replicas` says so, waits in the same round trip until
    /// that many replicas hold it; fewer in time is [`not_replicated`].
    pub(crate) async fn invoke_waiting<T: FromRedisValue, C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        replicas: Replicas,
    ) -> RedisResult<T> {
        match self.send(conn, replicas).await {
            Err(e) if self.unknown_to_server(&e) => {
                self.install(conn).await?;
                self.send(conn, replicas).await
            }
            other => other,
        }
    }

    async fn send<T: FromRedisValue, C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        replicas: Replicas,
    ) -> RedisResult<T> {
        if !replicas.waits() {
            return self.cmd().query_async(conn).await;
        }
        let mut pipe = redis::pipe();
        pipe.add_command(self.cmd())
            .add_command(wait_cmd(replicas))
            .ignore_errors();
        let mut replies: Vec<RedisResult<Value>> = pipe.query_async(conn).await?;
        let acked = replies.pop().unwrap_or(Ok(Value::Nil));
        let reply = replies.pop().unwrap_or(Ok(Value::Nil))?;
        // The call ran (its reply came): a WAIT answered with an error (NOPERM, say)
        // leaves it as unknown as one that timed out.
        let acked: i64 = match acked.and_then(|v| Ok(redis::from_redis_value::<i64>(v)?)) {
            Ok(n) => n,
            Err(e) => return Err(wait_refused(&e)),
        };
        if acked < replicas.n as i64 {
            return Err(not_replicated(replicas.n, acked));
        }
        Ok(redis::from_redis_value(reply)?)
    }

    fn unknown_to_server(&self, e: &RedisError) -> bool {
        e.to_string().contains("Function not found")
    }

    async fn install<C: ConnectionLike + Send>(&self, conn: &mut C) -> RedisResult<()> {
        install_library(conn, self.keys.first()).await
    }
}

/// What `seckill_version` answered: the version and the code's hash (an earlier library
/// gave the version alone).
fn loaded_version(value: Value) -> (i64, String) {
    match redis::from_redis_value::<(i64, String)>(value.clone()) {
        Ok(both) => both,
        Err(_) => (redis::from_redis_value(value).unwrap_or(0), String::new()),
    }
}

/// `WAIT n timeout`: how many replicas hold every write this connection made so far.
fn wait_cmd(replicas: Replicas) -> Cmd {
    let mut cmd = redis::cmd("WAIT");
    cmd.arg(replicas.n)
        .arg(replicas.timeout.as_millis().max(1) as u64);
    cmd
}

/// Makes sure the server (the node of `route_key`, in a cluster) runs this library or a
/// newer one: loads it where missing, and replaces an older version (which draws a new
/// term there: every sale on it is rebuilt once). In cluster mode `FUNCTION LOAD` goes
/// to every master.
pub(crate) async fn install_library<C: ConnectionLike + Send>(
    conn: &mut C,
    route_key: Option<&Vec<u8>>,
) -> RedisResult<()> {
    let mut version = redis::cmd("FCALL_RO");
    version.arg("seckill_version");
    match route_key {
        Some(key) => version.arg(1).arg(key),
        None => version.arg(0),
    };
    let loaded = match version.query_async::<Value>(conn).await {
        Ok(value) => Ok(loaded_version(value)),
        Err(e) => Err(e),
    };
    let replace = match loaded {
        Ok((v, _)) if v > *LIBRARY_VERSION => return Ok(()),
        Ok((v, code)) if v == *LIBRARY_VERSION && code == *LIBRARY_CODE => return Ok(()),
        Ok((v, _)) => {
            tracing::warn!(
                loaded = v,
                ours = *LIBRARY_VERSION,
                "replacing the seckill function library in redis (older, or other code)"
            );
            true
        }
        Err(e) if e.to_string().contains("Function not found") => false,
        Err(e) => return Err(e),
    };
    let mut load = redis::cmd("FUNCTION");
    load.arg("LOAD");
    if replace {
        load.arg("REPLACE");
    }
    match load.arg(LIBRARY.as_str()).query_async::<Value>(conn).await {
        // Another process (or another node of a cluster) had it already.
        Err(e) if e.to_string().contains("already exists") => Ok(()),
        other => other.map(drop),
    }
}

/// Whether term `a` was drawn before term `b`: a term begins with the server's clock (in
/// seconds and microseconds) when it was drawn, so a replica promoted by a failover
/// draws its term after the old primary drew its own (as `older` in
/// `lua/seckill.lua`). Terms that do not read so are never before anything.
pub(crate) fn term_drawn_before(a: &str, b: &str) -> bool {
    let time = |t: &str| -> Option<(u64, u64)> {
        let mut parts = t.split('.');
        Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
    };
    matches!((time(a), time(b)), (Some(a), Some(b)) if a < b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_term_is_drawn_before_another_by_the_clock_it_begins_with() {
        assert!(term_drawn_before(
            "1795734190.251474.aa",
            "1795734190.251475.bb"
        ));
        assert!(term_drawn_before(
            "1795734189.999999.aa",
            "1795734190.000000.aa"
        ));
        assert!(!term_drawn_before(
            "1795734190.251474.aa",
            "1795734190.251474.bb"
        ));
        assert!(!term_drawn_before(
            "1795734191.0.aa",
            "1795734190.999999.aa"
        ));
        assert!(!term_drawn_before("garbage", "1795734190.0.aa"));
    }

    /// Every change of the library's code comes with a new VERSION: a server runs one
    /// library, and two releases with one version and different code would replace each
    /// other in turns (each time drawing a new term: every sale rebuilt).
    #[test]
    fn the_library_code_is_pinned_to_its_version() {
        let pinned = (13, "95d798575747bbdc");
        assert_eq!(
            (*LIBRARY_VERSION, LIBRARY_CODE.as_str()),
            pinned,
            "a file of the library (lua/seckill.lua, load_voucher.lua, move_units.lua, \
             lifecycle.lua) changed: raise VERSION in lua/seckill.lua and pin the new \
             version and hash here"
        );
    }

    #[test]
    fn the_library_declares_its_version_and_name() {
        assert!(*LIBRARY_VERSION >= 1);
        assert!(LIBRARY.starts_with("#!lua name=seckill\n"));
        assert!(LIBRARY.contains("redis.register_function('seckill_load'"));
    }

    #[test]
    fn a_missing_replica_acknowledgement_reads_as_an_unknown_outcome() {
        let e = not_replicated(1, 0);
        assert_eq!(e.kind(), redis::ErrorKind::Io);
        assert!(!surely_not_run(&e), "it ran: not 'nothing reserved'");
        assert!(is_not_replicated(&e));
    }

    #[test]
    fn a_wait_refused_after_the_call_ran_reads_as_an_unknown_outcome() {
        let noperm = RedisError::from((
            redis::ErrorKind::Server(redis::ServerErrorKind::NoPerm),
            "NOPERM",
            "this user has no permissions to run the 'wait' command".to_string(),
        ));
        assert!(
            surely_not_run(&noperm),
            "alone, a refusal means it did not run"
        );
        let noreplicas = redis::make_extension_error(
            "NOREPLICAS".to_string(),
            Some("Not enough good replicas to write.".to_string()),
        );
        assert!(surely_not_run(&noreplicas), "refused before it ran");
        let e = wait_refused(&noperm);
        assert!(!is_not_replicated(&e), "a refusal, not a silence");
        assert!(
            !surely_not_run(&e),
            "after the call ran: unknown, not 'nothing reserved'"
        );
        assert!(e.to_string().contains("NOPERM"), "{e}");
    }
}
