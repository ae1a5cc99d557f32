# Sourced by scripts/test, scripts/dev and load/*: Redis and Postgres for tests, benchmarks
# and a development run. Uses the servers at REDIS_URL / DATABASE_URL when they answer;
# otherwise starts private ones on loopback ports, installing Debian's packages if absent.
#
#   ensure_services          # test and load: private servers on fixed ports in $RUN_DIR,
#                            # left running and reused by the next run
#   start_redis [PORT]       # without PORT: the first spare one from 63800 up
#   start_postgres [PORT]    # without PORT: the first spare one from 54340 up
#   stop_private_services    # stops the private servers this shell started

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

apt_updated=""
ensure_packages() {
  local missing=()
  for pkg in "$@"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing ${missing[*]}"
  if [ -z "$apt_updated" ]; then as_root apt-get update -qq; apt_updated=1; fi
  as_root apt-get install -y -qq "${missing[@]}" >/dev/null
}

redis_answers() { command -v redis-cli >/dev/null && [ "$(redis-cli -u "$REDIS_URL" ping 2>/dev/null)" = PONG ]; }
postgres_answers() { command -v psql >/dev/null && psql "$DATABASE_URL" -Atqc 'select 1' >/dev/null 2>&1; }

# Whether something accepts connections on 127.0.0.1:PORT.
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# The first port from START up that nothing listens on (a private server's port must not
# be anybody else's: a fixed one would collide with a second run or another project).
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
  [ -n "$port" ] || port=$(spare_port 63800) || exit 1
  export REDIS_URL="redis://127.0.0.1:$port"
  # A fixed port may already have this directory's server from an earlier run.
  if redis_answers; then return 0; fi
  mkdir -p "$RUN_DIR"
  log "starting a private Redis on 127.0.0.1:$port"
  redis-server --daemonize yes --bind 127.0.0.1 --port "$port" --save "" --appendonly no \
    --dir "$RUN_DIR" --logfile "$RUN_DIR/redis-$port.log" --pidfile "$RUN_DIR/redis-$port.pid"
  for _ in $(seq 50); do
    if redis_answers; then STARTED_REDIS_PORT=$port; return 0; fi
    sleep 0.1
  done
  log "Redis did not start; see $RUN_DIR/redis-$port.log"; exit 1
}

start_postgres() {
  ensure_packages postgresql postgresql-client
  local port=${1:-} bin data="$RUN_DIR/pgdata"
  [ -n "$port" ] || port=$(spare_port 54340) || exit 1
  bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
  local run=()
  mkdir -p "$RUN_DIR"
  # Postgres refuses to run as root: use the postgres account the package created.
  if [ "$(id -u)" = 0 ]; then run=(runuser -u postgres --); chown postgres "$RUN_DIR"; fi
  export DATABASE_URL="postgres://postgres@127.0.0.1:$port/postgres"
  # A fixed port may already have this directory's cluster from an earlier run.
  if postgres_answers; then return 0; fi
  if [ ! -s "$data/PG_VERSION" ]; then
    log "creating a private Postgres cluster in $data"
    "${run[@]}" "$bin/initdb" -D "$data" -U postgres -A trust >/dev/null
  fi
  log "starting a private Postgres on 127.0.0.1:$port"
  "${run[@]}" "$bin/pg_ctl" -D "$data" -l "$RUN_DIR/postgres.log" -w \
    -o "-p $port -k $RUN_DIR -c listen_addresses=127.0.0.1 -c max_connections=300 -c fsync=off" start >/dev/null
  postgres_answers || { log "Postgres did not start; see $RUN_DIR/postgres.log"; exit 1; }
  STARTED_POSTGRES_DATA=$data
}

# Stops the private servers this shell started (not the ones it found running).
stop_private_services() {
  if [ -n "$STARTED_REDIS_PORT" ]; then
    redis-cli -p "$STARTED_REDIS_PORT" shutdown nosave >/dev/null 2>&1 || true
    STARTED_REDIS_PORT=""
  fi
  if [ -n "$STARTED_POSTGRES_DATA" ]; then
    local bin run=()
    bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
    [ "$(id -u)" = 0 ] && run=(runuser -u postgres --)
    "${run[@]}" "$bin/pg_ctl" -D "$STARTED_POSTGRES_DATA" -m fast -w stop >/dev/null 2>&1 || true
    STARTED_POSTGRES_DATA=""
  fi
}

# Points REDIS_URL and DATABASE_URL at servers that answer, starting them if needed: on
# fixed ports in $RUN_DIR, left running for the next run to reuse.
ensure_services() {
  # The TLS tests make their certificates with openssl and start a Postgres of their own
  # (initdb, as the postgres account when run as root) and TLS-only redis-servers.
  ensure_packages openssl postgresql redis-server redis-tools
  redis_answers || start_redis 63790
  postgres_answers || start_postgres 54329
  # Left running on purpose: scripts/test and load/* reuse them next time.
  STARTED_REDIS_PORT="" STARTED_POSTGRES_DATA=""
  log "Redis at $REDIS_URL, Postgres at $DATABASE_URL"
}
