//! Lua on Redis. The `seckill` function library (`lua/seckill.lua`, with
//! `lua/load_voucher.lua` and `lua/move_units.lua` appended) is called with FCALL; the other scripts with
//! EVALSHA. Either is sent again once after the server says it does not know it (a
//! restart, a failover, a flush). When replicas must acknowledge a state move
//! (`REDIS_WAIT_REPLICAS`), WAIT follows the call in the same round trip, on the same
//! connection: a WAIT sent alone after a reconnect would count the writes of a fresh
//! connection (none) and answer at once.

use std::sync::LazyLock;
use std::time::Duration;

use redis::aio::ConnectionLike;
use redis::{Cmd, FromRedisValue, RedisError, RedisResult, Script, ToRedisArgs, Value};

/// The library's source: `lua/seckill.lua` with `lua/load_voucher.lua` and
/// `lua/move_units.lua` appended.
fn library_source() -> String {
    format!(
        "{}\n{}\n{}",
        include_str!("../lua/seckill.lua"),
        include_str!("../lua/load_voucher.lua"),
        include_str!("../lua/move_units.lua")
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

/// How many replicas must hold a state move before it counts, and how long to wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Replicas {
    pub n: u32,
    pub timeout: Duration,
}

impl Replicas {
    /// No waiting (the default).
    pub const NONE: Replicas = Replicas {
        n: 0,
        timeout: Duration::ZERO,
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
        format!("{acked} of {wanted} replica(s) acknowledged in time"),
    )
    .into()
}

/// What a call runs: a function of the library, or a plain script.
#[derive(Clone, Copy)]
enum Target {
    Function(&'static str),
    Script(&'static Script),
}

/// One FCALL or EVALSHA with its keys and arguments.
#[derive(Clone)]
pub(crate) struct Call {
    target: Target,
    keys: Vec<Vec<u8>>,
    args: Vec<Vec<u8>>,
}

impl Call {
    /// A function of the `seckill` library.
    pub(crate) fn function(name: &'static str) -> Self {
        Self {
            target: Target::Function(name),
            keys: Vec::new(),
            args: Vec::new(),
        }
    }

    /// A plain script (EVALSHA).
    pub(crate) fn script(script: &'static Script) -> Self {
        Self {
            target: Target::Script(script),
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
        let mut cmd = match self.target {
            Target::Function(name) => {
                let mut c = redis::cmd("FCALL");
                c.arg(name);
                c
            }
            Target::Script(script) => {
                let mut c = redis::cmd("EVALSHA");
                c.arg(script.get_hash());
                c
            }
        };
        cmd.arg(self.keys.len()).arg(&self.keys).arg(&self.args);
        cmd
    }

    /// Runs the call, loading the library or script once if the server lacks it.
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
        let acked: i64 = redis::from_redis_value(acked?)?;
        if acked < replicas.n as i64 {
            return Err(not_replicated(replicas.n, acked));
        }
        Ok(redis::from_redis_value(reply)?)
    }

    fn unknown_to_server(&self, e: &RedisError) -> bool {
        match self.target {
            Target::Script(_) => e.code() == Some("NOSCRIPT"),
            Target::Function(_) => e.to_string().contains("Function not found"),
        }
    }

    async fn install<C: ConnectionLike + Send>(&self, conn: &mut C) -> RedisResult<()> {
        match self.target {
            Target::Script(script) => script.load_async(conn).await.map(drop),
            Target::Function(_) => install_library(conn, self.keys.first()).await,
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every change of the library's code comes with a new VERSION: a server runs one
    /// library, and two releases with one version and different code would replace each
    /// other in turns (each time drawing a new term: every sale rebuilt).
    #[test]
    fn the_library_code_is_pinned_to_its_version() {
        let pinned = (4, "7d821c52a9d34232");
        assert_eq!(
            (*LIBRARY_VERSION, LIBRARY_CODE.as_str()),
            pinned,
            "lua/seckill.lua, lua/load_voucher.lua or lua/move_units.lua changed: raise VERSION in \
             lua/seckill.lua and pin the new version and hash here"
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
        assert!(!e.is_connection_refusal(), "it ran: not 'nothing reserved'");
    }
}
