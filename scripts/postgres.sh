#!/usr/bin/env bash
# Usage: scripts/postgres.sh start [DIR] [PORT] | stop [DIR] | status [DIR]   (defaults: /tmp/sage-postgres, 55432)
#
# A private PostgreSQL 15 instance for Optuna studies shared by parallel SLURM trials (SQLite locks
# up under concurrent writers). Data and socket live in DIR; it listens on 127.0.0.1:PORT only.
# `start` prints a SQLAlchemy URL on stdout: postgresql+psycopg://optuna:PASSWORD@127.0.0.1:PORT/optuna
# (psycopg 3 driver; SQLAlchemy 2.x picks psycopg2 for a bare postgresql:// URL). Progress goes to
# stderr. Starting an already running instance is a no-op that prints its URL.
set -euo pipefail

TIMEOUT="${SAGE_PG_TIMEOUT:-60}"
PG_USER_OS="${SAGE_PG_OS_USER:-postgres}"  # initdb/postgres refuse to run as root
DB_NAME=optuna
DB_USER=optuna

log() { echo "[postgres] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

find_bindir() {
    local d
    for d in /usr/lib/postgresql/*/bin; do [ -x "$d/pg_ctl" ] && BIN="$d"; done
    if [ -z "${BIN:-}" ] && command -v pg_ctl >/dev/null 2>&1; then BIN="$(dirname "$(readlink -f "$(command -v pg_ctl)")")"; fi
    [ -n "${BIN:-}" ] || die "PostgreSQL server binaries not found; install them with: apt-get install -y postgresql"
}

set_paths() {
    D="$(mkdir -p "$1" && cd "$1" && pwd)"
    DATA="$D/data"; SOCK="$D/run"; PORTF="$D/port"; PWF="$D/password"
}

as_pg() { runuser -u "$PG_USER_OS" -- "$@"; }
is_running() { [ -f "$DATA/PG_VERSION" ] && as_pg "$BIN/pg_ctl" -D "$DATA" status >/dev/null 2>&1; }
url() { echo "postgresql+psycopg://$DB_USER:$(cat "$PWF")@127.0.0.1:$1/$DB_NAME"; }
psql_admin() { as_pg "$BIN/psql" -h "$SOCK" -p "$1" -d postgres -v ON_ERROR_STOP=1 -qtA "${@:2}"; }

cmd_start() {
    find_bindir
    set_paths "${1:-/tmp/sage-postgres}"
    local port="${2:-55432}"
    if is_running; then
        local old; old="$(cat "$PORTF")"
        [ "$old" = "$port" ] || log "already running on port $old (ignoring requested port $port)"
        log "already running"
        url "$old"
        return 0
    fi
    # The server runs as $PG_USER_OS, so it must be able to reach DIR (e.g. not under a 0700 root dir).
    chown "$PG_USER_OS": "$D"
    as_pg test -w "$D" || die "$D is not writable by user $PG_USER_OS (a parent directory is private?); choose another DIR"
    mkdir -p "$SOCK"; chown "$PG_USER_OS": "$SOCK"
    if [ ! -s "$PWF" ]; then (umask 077; head -c 18 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' >"$PWF"); fi
    if [ ! -f "$DATA/PG_VERSION" ]; then
        log "initdb $DATA"
        rm -rf "$DATA"; mkdir -p "$DATA"; chown "$PG_USER_OS": "$DATA"
        # Local socket: peer auth (only the postgres OS user administers); TCP: password (scram).
        as_pg "$BIN/initdb" -D "$DATA" -U postgres --auth-local=peer --auth-host=scram-sha-256 \
            -E UTF8 --locale=C.UTF-8 >"$D/initdb.log" 2>&1 || die "initdb failed (see $D/initdb.log)"
    fi
    echo "$port" >"$PORTF"
    log "starting postgres on 127.0.0.1:$port (socket dir $SOCK)"
    # -c options instead of editing postgresql.conf: port/socket can change between starts.
    as_pg "$BIN/pg_ctl" -D "$DATA" -l "$D/postgres.log" -w -t "$TIMEOUT" \
        -o "-c listen_addresses=127.0.0.1 -c port=$port -c unix_socket_directories=$SOCK" start >/dev/null \
        || die "pg_ctl start failed (port $port busy? see $D/postgres.log)"
    local pw; pw="$(cat "$PWF")"
    # Idempotent: create the role/database only if missing, and (re)set the password from $PWF.
    if [ "$(psql_admin "$port" -c "SELECT 1 FROM pg_roles WHERE rolname='$DB_USER'")" != 1 ]; then
        psql_admin "$port" -c "CREATE ROLE $DB_USER LOGIN"
    fi
    psql_admin "$port" -c "ALTER ROLE $DB_USER PASSWORD '$pw'"
    if [ "$(psql_admin "$port" -c "SELECT 1 FROM pg_database WHERE datname='$DB_NAME'")" != 1 ]; then
        psql_admin "$port" -c "CREATE DATABASE $DB_NAME OWNER $DB_USER"
    fi
    log "ready"
    url "$port"
}

cmd_stop() {
    find_bindir
    set_paths "${1:-/tmp/sage-postgres}"
    if is_running; then
        log "stopping"
        # fast: roll back open transactions and disconnect clients instead of waiting for them.
        as_pg "$BIN/pg_ctl" -D "$DATA" -m fast -w -t "$TIMEOUT" stop >/dev/null
    fi
    log "stopped"
}

cmd_status() {
    find_bindir
    set_paths "${1:-/tmp/sage-postgres}"
    if is_running; then echo "running on 127.0.0.1:$(cat "$PORTF")"; return 0; fi
    echo "not running"; return 3
}

case "${1:-}" in
    start) shift; cmd_start "$@" ;;
    stop) shift; cmd_stop "$@" ;;
    status) shift; cmd_status "$@" ;;
    *) sed -n '2p' "$0" >&2; exit 2 ;;
esac
