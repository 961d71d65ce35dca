#!/usr/bin/env bash
# Start (or reuse) a throwaway PostgreSQL cluster for the tests and print its URL.
#
#   export HCAPO_TEST_PG_URL=$(bash .ci/start-postgres.sh)
#
# - Installs Debian's postgresql only when no /usr/lib/postgresql/*/bin/initdb exists.
# - Works as root (initdb refuses root, so the cluster belongs to the postgres user)
#   and as an ordinary user (the cluster then belongs to that user).
# - Idempotent: a cluster already running in $HCAPO_PG_DIR is reused; its URL is printed.
# - Trust authentication, listening on 127.0.0.1 only, at a free port ($HCAPO_PG_PORT to pin).
# - Only the URL goes to stdout; progress goes to stderr; the server log to $DIR/log.
set -euo pipefail

DIR="${HCAPO_PG_DIR:-/tmp/hcapo-ci-pg}"
log() { echo "start-postgres: $*" >&2; }

find_bin() {
    local initdb
    initdb=$(ls -d /usr/lib/postgresql/*/bin/initdb 2>/dev/null | sort -V | tail -n 1 || true)
    if [ -n "$initdb" ]; then dirname "$initdb"; fi
}

BIN=$(find_bin)
if [ -z "$BIN" ]; then
    if [ "$(id -u)" -ne 0 ]; then
        log "PostgreSQL is not installed and we are not root: apt-get install -y postgresql"
        exit 1
    fi
    log "installing postgresql (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    # The Debian package would create and start a default cluster on 5432; we do not need it.
    apt-get install -y -qq --no-install-recommends postgresql >&2
    BIN=$(find_bin)
    [ -n "$BIN" ] || { log "postgresql installed but no initdb found"; exit 1; }
fi

if [ "$(id -u)" -eq 0 ]; then
    id postgres >/dev/null 2>&1 || useradd --system --home-dir /var/lib/postgresql --shell /bin/bash postgres
    as_pg() { su postgres -s /bin/bash -c "$1"; }
    OWNER=postgres
else
    as_pg() { bash -c "$1"; }
    OWNER=$(id -un)
fi

free_port() {
    python3 - <<'EOF'
import socket
s = socket.socket()
s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])
s.close()
EOF
}

url_for() { echo "postgresql://postgres@127.0.0.1:$1/postgres"; }

# Reuse a running cluster.
if [ -f "$DIR/data/postmaster.pid" ] && as_pg "'$BIN/pg_ctl' -D '$DIR/data' status" >/dev/null 2>&1; then
    PORT=$(cat "$DIR/port")
    log "reusing the running cluster in $DIR (port $PORT)"
    url_for "$PORT"
    exit 0
fi

mkdir -p "$DIR"
chown "$OWNER" "$DIR"
chmod 700 "$DIR"
if [ ! -f "$DIR/data/PG_VERSION" ]; then
    log "initdb in $DIR/data"
    rm -rf "$DIR/data"
    as_pg "'$BIN/initdb' -D '$DIR/data' -A trust -U postgres -E UTF8 --locale=C.UTF-8 >'$DIR/initdb.log' 2>&1" \
        || as_pg "'$BIN/initdb' -D '$DIR/data' -A trust -U postgres -E UTF8 --no-locale >'$DIR/initdb.log' 2>&1" \
        || { cat "$DIR/initdb.log" >&2; exit 1; }
fi
rm -f "$DIR/data/postmaster.pid"  # left by a killed server; pg_ctl status said it is not running

PORT="${HCAPO_PG_PORT:-$(free_port)}"
echo "$PORT" >"$DIR/port"
chown "$OWNER" "$DIR/port"
# Small and fast: the data is throwaway, so durability is off.
OPTS="-k '$DIR' -h 127.0.0.1 -p $PORT -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
log "starting on 127.0.0.1:$PORT (log: $DIR/log)"
if ! as_pg "'$BIN/pg_ctl' -D '$DIR/data' -o \"$OPTS\" -l '$DIR/log' -w -t 60 start" >&2; then
    tail -n 30 "$DIR/log" >&2 || true
    exit 1
fi
url_for "$PORT"
