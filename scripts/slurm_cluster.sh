#!/usr/bin/env bash
# Usage: scripts/slurm_cluster.sh install | start [STATE_DIR] | stop [STATE_DIR] | status [STATE_DIR]   (default STATE_DIR: /tmp/sage-slurm)
#
# A single-node SLURM 22.05 cluster (munge + MariaDB + slurmdbd + slurmctld + slurmd) for tests and
# small sweeps on one machine without systemd. `start` prints `export SLURM_CONF=...` on stdout (all
# progress goes to stderr), so callers can do: eval "$(scripts/slurm_cluster.sh start)".
#
# Why accounting (slurmdbd + MariaDB) and not just slurmctld: without it `sacct` fails, submitit logs
# warnings on every poll, and a job killed by SIGKILL never reaches a final state from submitit's point
# of view, so `job.result()` hangs forever. With accounting the same job shows FAILED within seconds.
#
# Environment overrides (rarely needed): SAGE_SLURM_CLUSTER (cluster name, default "sage"),
# SAGE_SLURM_DB_PORT (MariaDB TCP port, default 33061), SAGE_SLURMCTLD_PORT / SAGE_SLURMD_PORT /
# SAGE_SLURMDBD_PORT (defaults 6817 / 6818 / 6819), SAGE_SLURM_TIMEOUT (seconds per wait, default 60).
set -euo pipefail

CLUSTER="${SAGE_SLURM_CLUSTER:-sage}"
DB_PORT="${SAGE_SLURM_DB_PORT:-33061}"
CTLD_PORT="${SAGE_SLURMCTLD_PORT:-6817}"
SLURMD_PORT="${SAGE_SLURMD_PORT:-6818}"
DBD_PORT="${SAGE_SLURMDBD_PORT:-6819}"
TIMEOUT="${SAGE_SLURM_TIMEOUT:-60}"
PACKAGES=(slurm-wlm munge slurmdbd mariadb-server)
# One binary per package (plus the clients submitit calls) tells us whether `install` has work to do.
BINARIES=(slurmctld slurmd slurmdbd sbatch sacct sacctmgr sinfo munged munge mariadbd mariadb-install-db mariadb-admin mariadb)
MUNGE_SOCKET=/run/munge/munge.socket.2

log() { echo "[slurm_cluster] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

set_paths() {
    S="$(mkdir -p "$1" && cd "$1" && pwd)"
    ETC="$S/etc"; RUN="$S/run"; LOGD="$S/log"; SPOOL="$S/spool"; DB="$S/mariadb"
    export SLURM_CONF="$ETC/slurm.conf"
}

missing_binaries() {
    local b out=()
    for b in "${BINARIES[@]}"; do
        # Daemons live in /usr/sbin, which is not always on PATH for non-login shells.
        command -v "$b" >/dev/null 2>&1 || [ -x "/usr/sbin/$b" ] || out+=("$b")
    done
    echo "${out[*]:-}"
}

cmd_install() {
    local missing; missing="$(missing_binaries)"
    if [ -z "$missing" ]; then log "already installed"; return 0; fi
    log "installing ${PACKAGES[*]} (missing: $missing)"
    # Without systemd, the packages' postinst would start system-wide munged/mariadb/slurm daemons via
    # init.d; we run our own private ones, so forbid service starts during the install (policy-rc.d
    # exit 101 = "action not allowed"), and remove the file again only if we created it.
    local policy=/usr/sbin/policy-rc.d created_policy=0
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy"; chmod 755 "$policy"; created_policy=1
    fi
    local apt=(apt-get -o DPkg::Lock::Timeout=300 -qq -y --no-install-recommends)
    local rc=0
    DEBIAN_FRONTEND=noninteractive "${apt[@]}" install "${PACKAGES[@]}" >/dev/null || rc=$?
    if [ "$rc" -ne 0 ]; then
        # A fresh machine may have empty or stale package lists.
        log "apt-get install failed (rc=$rc); running apt-get update and retrying"
        rc=0
        apt-get -qq update >/dev/null && DEBIAN_FRONTEND=noninteractive "${apt[@]}" install "${PACKAGES[@]}" >/dev/null || rc=$?
    fi
    [ "$created_policy" = 1 ] && rm -f "$policy"
    [ "$rc" -eq 0 ] || die "apt-get install ${PACKAGES[*]} failed (rc=$rc)"
    missing="$(missing_binaries)"
    [ -z "$missing" ] || die "installed, but still missing: $missing"
    log "installed"
}

# Alive = exists and is not a zombie: daemons are reparented to PID 1, which here may reap late, and a
# zombie keeps its /proc entry (and name) until then.
alive() { local st; st="$(sed -n 's/^.*) \(.\).*/\1/p' "/proc/$1/stat" 2>/dev/null)" && [ -n "$st" ] && [ "$st" != Z ]; }
# --- pid-file helpers: a pid file is trusted only if the process is alive AND has the expected name,
# --- so stale files (reboot, kill -9, pid reuse) are detected and ignored.
pid_of() {  # pid_of PIDFILE COMM -> prints pid if alive with that command name
    local f="$1" comm="$2" pid
    [ -s "$f" ] || return 1
    pid="$(tr -dc '0-9' <"$f")"
    [ -n "$pid" ] && alive "$pid" || return 1
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$comm" ] || return 1
    echo "$pid"
}
running() { pid_of "$@" >/dev/null; }

wait_for() {  # wait_for DESCRIPTION COMMAND... : poll COMMAND until it succeeds or TIMEOUT elapses
    local what="$1"; shift
    local deadline=$((SECONDS + TIMEOUT))
    until "$@" >/dev/null 2>&1; do
        [ "$SECONDS" -lt "$deadline" ] || return 1
        sleep 0.3
    done
}

stop_group() {  # stop_group NAME:PIDFILE:COMM... : SIGTERM all, wait up to 15 s, then SIGKILL; removes pid files
    # Daemons in one group are stopped in parallel (each takes ~2 s to exit); groups run in order.
    local spec name f comm pid pids=() i
    for spec in "$@"; do
        IFS=: read -r name f comm <<<"$spec"
        if pid="$(pid_of "$f" "$comm")"; then
            log "stopping $name (pid $pid)"
            kill -TERM "$pid" 2>/dev/null || true
            pids+=("$pid")
        fi
        rm -f "$f"
    done
    for pid in "${pids[@]}"; do
        for i in $(seq 1 150); do alive "$pid" || break; sleep 0.1; done
        if alive "$pid"; then log "pid $pid did not stop in 15 s; SIGKILL"; kill -KILL "$pid" 2>/dev/null || true; fi
    done
}

munge_ok() { munge -n -S "$MUNGE_SOCKET" 2>/dev/null | unmunge -S "$MUNGE_SOCKET" >/dev/null 2>&1; }
db_ping() { mariadb-admin --no-defaults --socket="$DB/mysqld.sock" -u root ping; }
node_ready() {
    # "idle" on a fresh start; "mixed"/"allocated" if the cluster is already running jobs.
    local st; st="$(sinfo -h -o %T 2>/dev/null | head -n1)"
    case "$st" in idle|mixed|allocated|completing) return 0 ;; *) return 1 ;; esac
}

write_configs() {
    mkdir -p "$ETC" "$RUN" "$LOGD" "$SPOOL/ctld" "$SPOOL/d"
    local host cpus mem_mib
    host="$(hostname -s)"
    cpus="$(nproc --all)"
    # Leave 1 GiB to the OS; slurmd refuses to register a node that claims more memory than it has.
    mem_mib=$(( $(awk '/^MemTotal:/ {print int($2/1024)}' /proc/meminfo) - 1024 ))
    [ "$mem_mib" -ge 512 ] || mem_mib=512
    if [ ! -s "$ETC/db_password" ]; then
        (umask 077; head -c 18 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' >"$ETC/db_password")
    fi
    local pw; pw="$(cat "$ETC/db_password")"
    # Rewritten on every cold start so CPUs/RealMemory always match the machine this runs on.
    cat >"$ETC/slurm.conf.tmp" <<EOF
# Generated by scripts/slurm_cluster.sh; edits are overwritten on the next cold start.
ClusterName=$CLUSTER
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
# Daemons run as root: no systemd/cgroups here, and the scratch paths below belong to root.
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
# No mail on this machine; the default (/bin/mail) is absent and slurmctld logs an error for it.
MailProg=/bin/true
# No cgroup hierarchy to delegate in this container: track processes by parent pid, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
# Cores are the only consumable: jobs with --mem still run and several jobs can share the node.
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
StateSaveLocation=$SPOOL/ctld
SlurmdSpoolDir=$SPOOL/d
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$LOGD/slurmctld.log
SlurmdLogFile=$LOGD/slurmd.log
# Accounting through slurmdbd (see header): sacct, and final states for SIGKILLed jobs.
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
JobCompType=jobcomp/none
# SIGTERM -> SIGKILL grace on scancel/timeout: short, so cancelled test jobs finish within seconds.
KillWait=5
# Completed jobs stay visible to squeue/scontrol for 5 min (sacct keeps them forever).
MinJobAge=300
# The launcher requeues preempted/timed-out jobs (submitit uses scontrol requeue).
JobRequeue=1
# A node that went down because its slurmd restarted comes back by itself.
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mib State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
    mv "$ETC/slurm.conf.tmp" "$ETC/slurm.conf"
    # slurmdbd reads slurmdbd.conf from the directory of SLURM_CONF and refuses it unless mode 600.
    (umask 077; cat >"$ETC/slurmdbd.conf" <<EOF
# Generated by scripts/slurm_cluster.sh
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
LogFile=$LOGD/slurmdbd.log
PidFile=$RUN/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$pw
StorageLoc=slurm_acct_db
EOF
    )
    chmod 600 "$ETC/slurmdbd.conf"
}

start_munge() {
    if munge_ok; then
        # Someone (us earlier, or the machine) already runs munged on the standard socket: reuse it.
        log "munged already answering on $MUNGE_SOCKET"
        return 0
    fi
    if [ ! -s /etc/munge/munge.key ]; then
        log "creating /etc/munge/munge.key"
        mkdir -p /etc/munge
        (umask 077; dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none)
    fi
    chown munge:munge /etc/munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
    # /run is a tmpfs: the socket dir vanishes on reboot and the package cannot recreate it without systemd.
    mkdir -p /run/munge /var/lib/munge /var/log/munge
    chown munge:munge /run/munge /var/lib/munge /var/log/munge
    chmod 755 /run/munge
    rm -f "$MUNGE_SOCKET" "$MUNGE_SOCKET.lock"
    log "starting munged"
    # munged refuses to run as root; it writes /run/munge/munged.pid, which we copy so that `stop`
    # only ever stops a munged this script started.
    runuser -u munge -- /usr/sbin/munged --force
    wait_for munged munge_ok || die "munged did not answer within ${TIMEOUT}s (see /var/log/munge/munged.log)"
    cp /run/munge/munged.pid "$RUN/munged.pid"
}

start_mariadb() {
    if running "$RUN/mariadb.pid" mariadbd && db_ping >/dev/null 2>&1; then log "mariadb already running"; return 0; fi
    rm -f "$RUN/mariadb.pid"
    if [ ! -d "$DB/data/mysql" ]; then
        log "initialising MariaDB datadir $DB/data"
        rm -rf "$DB"; mkdir -p "$DB/data"; chown -R mysql:mysql "$DB"
        mariadb-install-db --no-defaults --datadir="$DB/data" --user=mysql \
            --auth-root-authentication-method=socket --skip-test-db >"$LOGD/mariadb-install.log" 2>&1 \
            || die "mariadb-install-db failed (see $LOGD/mariadb-install.log)"
    fi
    chown mysql:mysql "$DB"
    rm -f "$DB/mysqld.sock"
    log "starting mariadb on 127.0.0.1:$DB_PORT (socket $DB/mysqld.sock)"
    # --no-defaults: ignore /etc/mysql so a system MariaDB config (port 3306, /run/mysqld) cannot interfere.
    setsid /usr/sbin/mariadbd --no-defaults --user=mysql --datadir="$DB/data" --socket="$DB/mysqld.sock" \
        --port="$DB_PORT" --bind-address=127.0.0.1 --pid-file="$DB/mariadbd.pid" \
        --innodb-buffer-pool-size=64M --max-connections=100 \
        >>"$LOGD/mariadb.log" 2>&1 </dev/null &
    wait_for mariadb db_ping || die "mariadb did not answer within ${TIMEOUT}s (see $LOGD/mariadb.log)"
    cp "$DB/mariadbd.pid" "$RUN/mariadb.pid"
    local pw; pw="$(cat "$ETC/db_password")"
    # slurmdbd connects over TCP to 127.0.0.1; grant both host spellings so name resolution does not matter.
    mariadb --no-defaults --socket="$DB/mysqld.sock" -u root <<EOF
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$pw';
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$pw';
ALTER USER 'slurm'@'localhost' IDENTIFIED BY '$pw';
ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$pw';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
FLUSH PRIVILEGES;
EOF
}

start_slurmdbd() {
    if running "$RUN/slurmdbd.pid" slurmdbd; then log "slurmdbd already running"; return 0; fi
    rm -f "$RUN/slurmdbd.pid"
    log "starting slurmdbd"
    /usr/sbin/slurmdbd || die "slurmdbd failed to start (see $LOGD/slurmdbd.log)"
    wait_for slurmdbd sacctmgr -n -P show cluster \
        || die "slurmdbd did not answer within ${TIMEOUT}s (see $LOGD/slurmdbd.log)"
}

register_accounting() {
    # slurmctld would auto-register the cluster, but doing it explicitly (before slurmctld starts) also
    # lets us add an account and root's association, so `sacctmgr show assoc` and -A/--account work.
    if ! sacctmgr -n -P show cluster format=cluster | grep -qx "$CLUSTER"; then
        log "registering cluster $CLUSTER in accounting"
        sacctmgr -i add cluster "$CLUSTER" >/dev/null
    fi
    if ! sacctmgr -n -P show account format=account | grep -qx "$CLUSTER"; then
        sacctmgr -i add account "$CLUSTER" Cluster="$CLUSTER" Description=sage Organization=sage >/dev/null
    fi
    if ! sacctmgr -n -P show user format=user | grep -qx root; then
        sacctmgr -i add user root Account="$CLUSTER" DefaultAccount="$CLUSTER" >/dev/null
    fi
}

start_slurmctld() {
    if running "$RUN/slurmctld.pid" slurmctld; then log "slurmctld already running"; return 0; fi
    rm -f "$RUN/slurmctld.pid"
    log "starting slurmctld"
    /usr/sbin/slurmctld || die "slurmctld failed to start (see $LOGD/slurmctld.log)"
    wait_for slurmctld scontrol ping || die "slurmctld did not answer within ${TIMEOUT}s (see $LOGD/slurmctld.log)"
}

start_slurmd() {
    if running "$RUN/slurmd.pid" slurmd; then log "slurmd already running"; return 0; fi
    rm -f "$RUN/slurmd.pid"
    log "starting slurmd"
    /usr/sbin/slurmd || die "slurmd failed to start (see $LOGD/slurmd.log)"
}

all_running() {
    munge_ok && running "$RUN/mariadb.pid" mariadbd && running "$RUN/slurmdbd.pid" slurmdbd \
        && running "$RUN/slurmctld.pid" slurmctld && running "$RUN/slurmd.pid" slurmd
}

cmd_start() {
    set_paths "${1:-/tmp/sage-slurm}"
    local missing; missing="$(missing_binaries)"
    [ -z "$missing" ] || die "missing binaries: $missing -- run: scripts/slurm_cluster.sh install"
    if all_running && node_ready; then
        log "already running (state dir $S)"
    else
        # Only rewrite configs when no daemon of ours is up, so a running cluster never sees a config
        # that differs from what it loaded.
        if ! running "$RUN/slurmctld.pid" slurmctld && ! running "$RUN/slurmd.pid" slurmd \
            && ! running "$RUN/slurmdbd.pid" slurmdbd; then
            write_configs
        fi
        start_munge
        start_mariadb
        start_slurmdbd
        register_accounting
        start_slurmctld
        start_slurmd
        # Jobs of a session that died with the cluster up were saved in StateSaveLocation and are requeued
        # now; on this scratch cluster they would hold the node's CPUs against new work, so cancel them.
        # (Not `slurmctld -c`: it also resets the job-id counter, and ids would repeat in accounting.)
        local stale; stale="$(squeue -h -o %F | sort -u | tr '\n' ' ')"
        if [ -n "$stale" ]; then log "cancelling jobs left by an earlier session: $stale"; scancel $stale || true; fi
        if ! wait_for node node_ready; then
            # A node left DOWN/DRAIN by an earlier unclean stop: bring it back once, then wait again.
            scontrol update NodeName="$(hostname -s)" State=RESUME >/dev/null 2>&1 || true
            wait_for node node_ready || die "node not idle within ${TIMEOUT}s: $(sinfo -h -o '%T %E' 2>&1) (see $LOGD)"
        fi
        log "cluster up: $(sinfo -h -o '%P %D %T %c cpus %m MiB' | head -n1)"
    fi
    echo "export SLURM_CONF=$SLURM_CONF"
}

cmd_stop() {
    set_paths "${1:-/tmp/sage-slurm}"
    # Reverse start order: the SLURM daemons first (slurmctld flushes job records to slurmdbd), then
    # slurmdbd, then its database. Each stop is a no-op when the pid file is missing or stale.
    # munged only if this script started it (see start_munge).
    stop_group "slurmd:$RUN/slurmd.pid:slurmd" "slurmctld:$RUN/slurmctld.pid:slurmctld"
    stop_group "slurmdbd:$RUN/slurmdbd.pid:slurmdbd"
    stop_group "mariadb:$RUN/mariadb.pid:mariadbd" "munged:$RUN/munged.pid:munged"
    log "stopped"
}

cmd_status() {
    set_paths "${1:-/tmp/sage-slurm}"
    local rc=0 name comm pid
    if munge_ok; then echo "munged: running"; else echo "munged: not running"; rc=3; fi
    for name in mariadb:mariadbd slurmdbd:slurmdbd slurmctld:slurmctld slurmd:slurmd; do
        comm="${name#*:}"; name="${name%%:*}"
        if pid="$(pid_of "$RUN/$name.pid" "$comm")"; then echo "$name: running (pid $pid)"; else echo "$name: not running"; rc=3; fi
    done
    if [ -f "$SLURM_CONF" ] && command -v sinfo >/dev/null 2>&1; then
        echo "sinfo: $(sinfo -h -o '%P %D %T' 2>&1 | head -n1)"
    fi
    echo "SLURM_CONF=$SLURM_CONF"
    return "$rc"
}

case "${1:-}" in
    install) cmd_install ;;
    start) shift; cmd_start "$@" ;;
    stop) shift; cmd_stop "$@" ;;
    status) shift; cmd_status "$@" ;;
    *) sed -n '2p' "$0" >&2; exit 2 ;;
esac
