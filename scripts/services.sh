# Sourced by scripts/test and load/*: Redis and Postgres for tests and benchmarks.
# Uses the servers at REDIS_URL / DATABASE_URL when they answer; otherwise starts private
# ones on spare loopback ports, installing Debian's packages if absent.

export REDIS_URL="${REDIS_URL:-redis://127.0.0.1:6379}"
export DATABASE_URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
export DEBIAN_FRONTEND=noninteractive
RUN_DIR="${SECKILL_TEST_DIR:-/tmp/seckill-test-$(id -u)}"
mkdir -p "$RUN_DIR"

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

start_redis() {
  ensure_packages redis-server redis-tools
  redis_answers && return 0
  local port=63790
  log "starting a private Redis on 127.0.0.1:$port"
  redis-server --daemonize yes --bind 127.0.0.1 --port "$port" --save "" --appendonly no \
    --dir "$RUN_DIR" --logfile "$RUN_DIR/redis.log" --pidfile "$RUN_DIR/redis.pid"
  export REDIS_URL="redis://127.0.0.1:$port"
  for _ in $(seq 50); do redis_answers && return 0; sleep 0.1; done
  log "Redis did not start; see $RUN_DIR/redis.log"; exit 1
}

start_postgres() {
  ensure_packages postgresql postgresql-client
  postgres_answers && return 0
  local port=54329 bin data="$RUN_DIR/pgdata"
  bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
  local run=()
  # Postgres refuses to run as root: use the postgres account the package created.
  if [ "$(id -u)" = 0 ]; then run=(runuser -u postgres --); chown postgres "$RUN_DIR"; fi
  export DATABASE_URL="postgres://postgres@127.0.0.1:$port/postgres"
  if postgres_answers; then return 0; fi
  if [ ! -s "$data/PG_VERSION" ]; then
    log "creating a private Postgres cluster in $data"
    "${run[@]}" "$bin/initdb" -D "$data" -U postgres -A trust >/dev/null
  fi
  log "starting the private Postgres on 127.0.0.1:$port"
  "${run[@]}" "$bin/pg_ctl" -D "$data" -l "$RUN_DIR/postgres.log" -w \
    -o "-p $port -k $RUN_DIR -c listen_addresses=127.0.0.1 -c max_connections=300 -c fsync=off" start >/dev/null
  postgres_answers || { log "Postgres did not start; see $RUN_DIR/postgres.log"; exit 1; }
}

# Points REDIS_URL and DATABASE_URL at servers that answer, starting them if needed.
ensure_services() {
  # The TLS tests make their certificates with openssl and start a Postgres of their own
  # (initdb, as the postgres account when run as root) and TLS-only redis-servers.
  ensure_packages openssl postgresql redis-server redis-tools
  redis_answers || start_redis
  postgres_answers || start_postgres
  log "Redis at $REDIS_URL, Postgres at $DATABASE_URL"
}

