#!/usr/bin/env bash
# Usage: scripts/mlflow_server.sh start [DIR] [PORT] | stop [DIR] | status [DIR]   (defaults: /tmp/sage-mlflow, 5005)
#
# A private MLflow tracking server: SQLite backend store and artifacts in DIR, bound to 127.0.0.1.
# `start` waits for /health and prints the tracking URI (http://127.0.0.1:PORT) on stdout; progress
# goes to stderr, so `export MLFLOW_TRACKING_URI="$(scripts/mlflow_server.sh start)"` works.
# Starting an already running server is a no-op that prints its URI.
set -euo pipefail

TIMEOUT="${SAGE_MLFLOW_TIMEOUT:-90}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"; ROOT="$(cd "$HERE/.." && pwd)"
# Prefer the project's venv (mlflow is pinned there), else whatever `mlflow` is on PATH.
if [ -x "$ROOT/.venv/bin/mlflow" ]; then MLFLOW="$ROOT/.venv/bin/mlflow"; else MLFLOW="$(command -v mlflow || true)"; fi

log() { echo "[mlflow_server] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

set_paths() { D="$(mkdir -p "$1" && cd "$1" && pwd)"; PIDF="$D/mlflow.pid"; PORTF="$D/port"; }

# Alive = exists and is not a zombie: daemons are reparented to PID 1, which here may reap late, and a
# zombie keeps its /proc entry (and name) until then.
alive() { local st; st="$(sed -n 's/^.*) \(.\).*/\1/p' "/proc/$1/stat" 2>/dev/null)" && [ -n "$st" ] && [ "$st" != Z ]; }
# A pid file is trusted only if that process is alive and is an mlflow server (guards against stale
# files and pid reuse).
server_pid() {
    local pid
    [ -s "$PIDF" ] || return 1
    pid="$(tr -dc '0-9' <"$PIDF")"
    [ -n "$pid" ] && alive "$pid" || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q 'mlflow.* server' || return 1
    echo "$pid"
}
healthy() {
    if command -v curl >/dev/null 2>&1; then curl -fsS --max-time 2 "http://127.0.0.1:$1/health" >/dev/null 2>&1
    else "$(dirname "$MLFLOW")/python" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' \
        "http://127.0.0.1:$1/health" >/dev/null 2>&1; fi
}
port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

cmd_start() {
    set_paths "${1:-/tmp/sage-mlflow}"
    local port="${2:-5005}" pid
    if pid="$(server_pid)"; then
        local old; old="$(cat "$PORTF" 2>/dev/null || echo "$port")"
        [ "$old" = "$port" ] || log "already running on port $old (ignoring requested port $port)"
        if healthy "$old"; then log "already running (pid $pid)"; echo "http://127.0.0.1:$old"; return 0; fi
        die "pid $pid is an mlflow server but http://127.0.0.1:$old/health does not answer; run: $0 stop $D"
    fi
    rm -f "$PIDF"
    [ -n "$MLFLOW" ] || die "mlflow not found (expected $ROOT/.venv/bin/mlflow); install the project: pip install -e ."
    port_busy "$port" && die "port $port is already in use by another process"
    mkdir -p "$D/artifacts"
    echo "$port" >"$PORTF"
    log "starting mlflow server on 127.0.0.1:$port (store $D/mlflow.db)"
    # --workers 1 and no job execution: ready in ~8 s with ~400 MB instead of ~23 s and ~2.2 GB with
    # the defaults (4 workers plus the job runner), which matters on a 2-core machine.
    # setsid: the server gets its own process group, so `stop` can signal it and its uvicorn workers.
    MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false setsid "$MLFLOW" server \
        --backend-store-uri "sqlite:///$D/mlflow.db" \
        --artifacts-destination "$D/artifacts" \
        --host 127.0.0.1 --port "$port" --workers 1 \
        >>"$D/mlflow.log" 2>&1 </dev/null &
    pid=$!
    echo "$pid" >"$PIDF"
    local deadline=$((SECONDS + TIMEOUT))
    until healthy "$port"; do
        if ! alive "$pid"; then rm -f "$PIDF"; die "mlflow server exited; last log lines:
$(tail -n 20 "$D/mlflow.log")"; fi
        if [ "$SECONDS" -ge "$deadline" ]; then
            cmd_stop "$D"
            die "no answer on http://127.0.0.1:$port/health within ${TIMEOUT}s (see $D/mlflow.log)"
        fi
        sleep 0.5
    done
    log "ready (pid $pid)"
    echo "http://127.0.0.1:$port"
}

cmd_stop() {
    set_paths "${1:-/tmp/sage-mlflow}"
    local pid i
    if pid="$(server_pid)"; then
        log "stopping mlflow server (pid $pid)"
        # The whole process group: the CLI process plus the uvicorn server it spawned.
        kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
        for i in $(seq 1 150); do alive "$pid" || break; sleep 0.1; done
        if alive "$pid"; then log "did not stop in 15 s; SIGKILL"; kill -KILL -- "-$pid" 2>/dev/null || true; fi
    fi
    rm -f "$PIDF"
    log "stopped"
}

cmd_status() {
    set_paths "${1:-/tmp/sage-mlflow}"
    local pid port
    if pid="$(server_pid)"; then
        port="$(cat "$PORTF" 2>/dev/null || echo '?')"
        if healthy "$port"; then echo "running (pid $pid) http://127.0.0.1:$port"; return 0; fi
        echo "process $pid alive but not healthy on port $port"; return 3
    fi
    echo "not running"; return 3
}

case "${1:-}" in
    start) shift; cmd_start "$@" ;;
    stop) shift; cmd_stop "$@" ;;
    status) shift; cmd_status "$@" ;;
    *) sed -n '2p' "$0" >&2; exit 2 ;;
esac
