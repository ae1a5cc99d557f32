# Sourced by scripts/test, scripts/dev and load/*: Redis and Postgres for tests, benchmarks
# and a development run. Uses the servers at REDIS_URL / DATABASE_URL when they answer;
# otherwise starts private ones on loopback ports, installing Debian's packages if absent.
#
#   ensure_services          # test and load: private servers on fixed ports in $RUN_DIR,
#                            # left running and reused by the next run
#   start_redis [PORT]       # without PORT: the first spare one from 63800 up
#   start_postgres [PORT]    # without PORT: the first spare one from 54340 up
#   stop_private_services    # stops the private servers this shell started

# Whether the caller chose the servers (a server there that refuses us is then an error).
REDIS_URL_GIVEN="${REDIS_URL:+1}"
DATABASE_URL_GIVEN="${DATABASE_URL:+1}"
export REDIS_URL="${REDIS_URL:-redis://127.0.0.1:6379}"
export DATABASE_URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
export DEBIAN_FRONTEND=noninteractive
# Where private servers keep their data, sockets and logs (created when one starts).
RUN_DIR="${SECKILL_TEST_DIR:-/tmp/seckill-test-$(id -u)}"
# What this shell started, for stop_private_services.
STARTED_REDIS_PORT=""
STARTED_POSTGRES_DATA=""

log() { printf '==> %s\n' "$*" >&2; }

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; else sudo -n "$@"; fi
}

ensure_packages() {
  local missing=()
  for pkg in "$@"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing ${missing[*]}"
  # Tests start scripts side by side on a new machine: one install at a time, each
  # waiting its turn (apt-get update does not wait for apt's list lock, and another
  # install may hold dpkg's), in one lock file whatever TMPDIR says.
  local wait=(-o DPkg::Lock::Timeout=600)
  (
    flock -w 900 9 || { echo "another install held /tmp/seckill-apt.lock for 15 minutes" >&2; exit 1; }
    missing=()
    for pkg in "$@"; do
      dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
    done
    [ ${#missing[@]} -eq 0 ] && exit 0
    as_root apt-get "${wait[@]}" update -qq
    as_root apt-get "${wait[@]}" install -y -qq "${missing[@]}" >/dev/null
  ) 9>>/tmp/seckill-apt.lock
}

# The probes never wait for long (a server that does not answer, or psql asking for a
# password on the terminal, would hang the script): psql runs with -w (never prompt) and
# PGCONNECT_TIMEOUT, redis-cli under `timeout`. Only the client tools are installed for
# them; a server package only when a private server is needed.
redis_answers() {
  command -v redis-cli >/dev/null || ensure_packages redis-tools
  [ "$(timeout 5 redis-cli -u "$REDIS_URL" ping 2>/dev/null)" = PONG ]
}
postgres_answers() {
  command -v psql >/dev/null || ensure_packages postgresql-client
  PGCONNECT_TIMEOUT=3 timeout 10 psql -w "$DATABASE_URL" -Atqc 'select 1' >/dev/null 2>&1
}

# Why the server at REDIS_URL / DATABASE_URL is not usable, for the message: "" when
# nothing answers there, else what it said (it answers but refuses us: a password it
# wants, a wrong one, an unknown role or database).
redis_refusal() {
  local said
  said=$(timeout 5 redis-cli -u "$REDIS_URL" ping 2>&1 | grep -v '^Warning:' | head -n 1) || true
  case "$said" in "" | *"Could not connect"* | *"Connection refused"*) echo "" ;; *) echo "$said" ;; esac
}
postgres_refusal() {
  # pg_isready does not log in: it tells a server that answers from none.
  PGCONNECT_TIMEOUT=3 timeout 10 pg_isready -q -d "$DATABASE_URL" >/dev/null 2>&1 || return 0
  PGCONNECT_TIMEOUT=3 timeout 10 psql -w "$DATABASE_URL" -Atqc 'select 1' 2>&1 >/dev/null |
    grep -v '^$' | tail -n 1 || true
}

# A URL as it may be printed: its password (user:PASSWORD@ or ?password=) masked.
mask_url() {
  printf '%s\n' "$1" | sed -e 's#^\([A-Za-z][A-Za-z0-9+.-]*://[^:/@]*\):[^@/]*@#\1:***@#' \
    -e 's#\([?&]password=\)[^&]*#\1***#g'
}

# Uses the Redis at REDIS_URL when it answers, else starts a private one (start_redis
# with these arguments) and sets redis_private=1. A server that answers but refuses us
# (auth) is not used: a private one is started instead, saying so, unless the caller set
# REDIS_URL (they asked for that server: a clear error then). Likewise for Postgres.
redis_private="" postgres_private=""
use_or_start_redis() { use_or_start redis Redis REDIS_URL "$REDIS_URL_GIVEN" "its password?" "$@"; }
use_or_start_postgres() {
  use_or_start postgres Postgres DATABASE_URL "$DATABASE_URL_GIVEN" \
    "its password? PGPASSWORD and ~/.pgpass work too" "$@"
}

# use_or_start KIND NAME URL_VARIABLE GIVEN HINT [START ARGUMENTS]: the above for the
# server KIND (redis, postgres), through KIND_answers, KIND_refusal and start_KIND.
use_or_start() {
  local kind=$1 name=$2 var=$3 given=$4 hint=$5 refused
  shift 5
  "${kind}_answers" && return 0
  refused=$("${kind}_refusal")
  if [ -n "$refused" ]; then
    if [ -n "$given" ]; then
      log "the $name at $(mask_url "${!var}") answers but refuses us: $refused"
      log "fix $var ($hint), or unset it to use a private $name"
      exit 1
    fi
    log "the $name at $(mask_url "${!var}") answers but refuses us ($refused): starting a private one (set $var to use yours)"
  fi
  "start_$kind" "$@"
  printf -v "${kind}_private" 1
}

# Whether 127.0.0.1:PORT is in use: something accepts connections on it, or any socket
# holds it (54340 lies in Linux's ephemeral range: a client's outgoing connection may
# hold it, and a server cannot bind it then, though nothing listens).
port_open() {
  (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
  command -v ss >/dev/null && [ -n "$(ss -Htan "( sport = :$1 )" 2>/dev/null)" ]
}

# The first port from START up that nothing uses (a private server's port must not be
# anybody else's: a fixed one would collide with a second run or another project).
spare_port() {
  local port=$1
  while port_open "$port"; do
    port=$((port + 1))
    [ "$port" -lt $(($1 + 200)) ] || { log "no spare port in $1..$port"; return 1; }
  done
  echo "$port"
}

start_redis() {
  ensure_packages redis-server redis-tools
  local port=${1:-}
  [ -n "$port" ] || port=$(spare_port "${redis_from:-63800}") || exit 1
  export REDIS_URL="redis://127.0.0.1:$port"
  # A fixed port may already have this directory's server from an earlier run.
  if [ -n "${1:-}" ] && redis_answers; then return 0; fi
  mkdir -p "$RUN_DIR"
  log "starting a private Redis on 127.0.0.1:$port"
  # Marked before it starts: an interrupt from here on must stop it.
  STARTED_REDIS_PORT=$port
  redis-server --daemonize yes --bind 127.0.0.1 --port "$port" --save "" --appendonly no \
    --dir "$RUN_DIR" --logfile "$RUN_DIR/redis-$port.log" --pidfile "$RUN_DIR/redis-$port.pid"
  for _ in $(seq 50); do
    if redis_answers; then
      # Ours, not another one that took the port since spare_port looked.
      [ "$(timeout 5 redis-cli -p "$port" config get dir 2>/dev/null | tail -n 1)" = "$(cd "$RUN_DIR" && pwd -P)" ] && return 0
      STARTED_REDIS_PORT=""
      # A spare port taken meanwhile (another run starting at the same moment): the next
      # spare one, a few times.
      if [ -z "${1:-}" ] && [ "${redis_start_tries:-0}" -lt 3 ]; then
        redis_start_tries=$((${redis_start_tries:-0} + 1))
        log "127.0.0.1:$port was taken by another Redis while this one started; trying the next port"
        redis_from=$((port + 1))
        start_redis
        return
      fi
      log "127.0.0.1:$port was taken by another Redis while this one started; try again"
      exit 1
    fi
    sleep 0.1
  done
  log "Redis did not start; the end of $RUN_DIR/redis-$port.log:"
  tail -n 20 "$RUN_DIR/redis-$port.log" >&2 2>/dev/null || true
  exit 1
}

start_postgres() {
  ensure_packages postgresql postgresql-client
  local port=${1:-} bin data="$RUN_DIR/pgdata"
  [ -n "$port" ] || port=$(spare_port "${postgres_from:-54340}") || exit 1
  bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
  local run=()
  mkdir -p "$RUN_DIR"
  # Postgres refuses to run as root: use the postgres account the package created.
  if [ "$(id -u)" = 0 ]; then run=(runuser -u postgres --); chown postgres "$RUN_DIR"; fi
  export DATABASE_URL="postgres://postgres@127.0.0.1:$port/postgres"
  # A fixed port may already have this directory's cluster from an earlier run.
  if [ -n "${1:-}" ] && postgres_answers; then return 0; fi
  if [ ! -s "$data/PG_VERSION" ]; then
    log "creating a private Postgres cluster in $data"
    "${run[@]}" "$bin/initdb" -D "$data" -U postgres -A trust >/dev/null
  fi
  log "starting a private Postgres on 127.0.0.1:$port"
  # Marked before it starts: an interrupt during pg_ctl's wait must still stop the
  # postmaster (it runs in a session of its own), whose data directory goes at exit.
  STARTED_POSTGRES_DATA=$data
  if ! "${run[@]}" "$bin/pg_ctl" -D "$data" -l "$RUN_DIR/postgres.log" -w \
    -o "-p $port -k $RUN_DIR -c listen_addresses=127.0.0.1 -c max_connections=300 -c fsync=off" start >/dev/null ||
    ! postgres_answers; then
    # A spare port taken meanwhile (another run starting at the same moment): the next
    # spare one, a few times.
    if [ -z "${1:-}" ] && [ "${postgres_start_tries:-0}" -lt 3 ] &&
      tail -n 20 "$RUN_DIR/postgres.log" 2>/dev/null | grep -q 'Address already in use'; then
      postgres_start_tries=$((${postgres_start_tries:-0} + 1))
      log "127.0.0.1:$port was taken while this Postgres started; trying the next port"
      postgres_from=$((port + 1))
      start_postgres
      return
    fi
    log "Postgres did not start; the end of $RUN_DIR/postgres.log:"
    tail -n 20 "$RUN_DIR/postgres.log" >&2 2>/dev/null || true
    exit 1
  fi
}

# Stops the private servers this shell started (not the ones it found running).
stop_private_services() {
  if [ -n "$STARTED_REDIS_PORT" ]; then
    local pidfile="$RUN_DIR/redis-$STARTED_REDIS_PORT.pid" pid=""
    # Read first: the server removes its pid file as it shuts down, before it is gone.
    [ -s "$pidfile" ] && pid=$(cat "$pidfile" 2>/dev/null)
    timeout 5 redis-cli -p "$STARTED_REDIS_PORT" shutdown nosave >/dev/null 2>&1 || true
    # Interrupted while it started, it may not have answered yet: its pid file tells.
    [ -z "$pid" ] && [ -s "$pidfile" ] && pid=$(cat "$pidfile" 2>/dev/null)
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
      kill -TERM "$pid" 2>/dev/null || true
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      # Still there after 5 s (a loaded machine): it must not outlive the script.
      kill -KILL "$pid" 2>/dev/null || true
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
    STARTED_REDIS_PORT=""
  fi
  if [ -n "$STARTED_POSTGRES_DATA" ]; then
    local bin run=()
    bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
    [ "$(id -u)" = 0 ] && run=(runuser -u postgres --)
    # Not running (interrupted before it started) is fine; just started, it may not
    # have written its pid file yet: a few tries.
    for _ in 1 2 3 4 5; do
      "${run[@]}" "$bin/pg_ctl" -D "$STARTED_POSTGRES_DATA" -m fast -w stop >/dev/null 2>&1 && break
      [ -e "$STARTED_POSTGRES_DATA/postmaster.pid" ] || sleep 0.2
      [ -e "$STARTED_POSTGRES_DATA/postmaster.pid" ] || break
    done
    STARTED_POSTGRES_DATA=""
  fi
}

# Points REDIS_URL and DATABASE_URL at servers that answer, starting them if needed: on
# fixed ports in $RUN_DIR, left running for the next run to reuse.
ensure_services() {
  # The TLS tests make their certificates with openssl and start a Postgres of their own
  # (initdb, as the postgres account when run as root) and TLS-only redis-servers; the
  # Sentinel tests run `redis-server --sentinel` (redis-server's own mode: no package).
  ensure_packages openssl postgresql redis-server redis-tools
  use_or_start_redis 63790
  use_or_start_postgres 54329
  # Left running on purpose: scripts/test and load/* reuse them next time.
  STARTED_REDIS_PORT="" STARTED_POSTGRES_DATA=""
  log "Redis at $(mask_url "$REDIS_URL"), Postgres at $(mask_url "$DATABASE_URL")"
}
