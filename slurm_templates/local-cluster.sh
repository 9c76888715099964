#!/usr/bin/env bash
# local-cluster.sh: a real Slurm cluster on one Debian 12 machine, for CI and for trying islands locally.
#
# It runs munged, MariaDB + slurmdbd (accounting), slurmctld and N emulated nodes (one `slurmd -N nX`
# per node, each on its own port) directly, without systemd: containers, CI runners and small VMs
# usually have no systemd, and the Debian packages' postinst scripts may not start daemons there.
# Every daemon is tracked by its pid file and is stopped only through the pid in it.
#
# Usage: local-cluster.sh install | up [--fresh] | down [--purge] | status
# Run it as root (except `status`). Environment knobs and their defaults are listed in usage() below.
set -euo pipefail

# ------------------------------------------------------------------------------------ knobs
NODES=${SLURM_NODES:-4}
NODE_CPUS=${SLURM_NODE_CPUS:-4}            # may exceed the real core count (config_overrides)
NODE_MEM=${SLURM_NODE_MEM:-4000}           # RealMemory (MB) each node claims
GPU_NODES=${SLURM_GPU_NODES:-2}            # nodes g1..gN of partition gpu; their GPUs are declared, not real
GPU_NODE_GPUS=${SLURM_GPU_NODE_GPUS:-4}
GPU_NODE_CPUS=${SLURM_GPU_NODE_CPUS:-32}
GPU_NODE_MEM=${SLURM_GPU_NODE_MEM:-262144}
DEF_MEM_PER_CPU=${SLURM_DEF_MEM_PER_CPU:-500}
CRED_EXPIRE=${SLURM_CRED_EXPIRE:-10}
REQUEUE_EXIT=${SLURM_REQUEUE_EXIT:-}        # e.g. "75": batch jobs exiting with it are requeued
CGROUP=${SLURM_CGROUP:-0}
BASE_PORT=${SLURM_NODE_BASE_PORT:-17200}
TIMEOUT=${SLURM_START_TIMEOUT:-60}

CLUSTER=islands
HOST=$(hostname -s)
DB_NAME=slurm_acct_db
DB_USER=slurm
DB_PASS=slurmdbpass                        # local socket-only MariaDB user; not a secret worth hiding
DB_SOCK=/run/mysqld/mysqld.sock
MUNGE_PID=/run/munge/munged.pid
MARIADB_PID=/run/mysqld/mysqld.pid
DBD_PID=/run/slurmdbd.pid
CTLD_PID=/run/slurmctld.pid
STATE_DIR=/var/lib/slurm/slurmctld
LOG_DIR=/var/log/slurm
PACKAGES=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server)

usage() {
    cat >&2 <<EOF
usage: $0 COMMAND

commands:
  install         apt-get install the Debian packages (skipped when all are installed)
  up [--fresh]    start whatever is not running (idempotent); --fresh first wipes the Slurm state and
                  the accounting DB, so job ids restart at 1 (use new submitit folders afterwards)
  down [--purge]  cancel all jobs and stop every daemon (idempotent); --purge also wipes state, logs, DB
  status          print sinfo and whether sacct answers; exit 0 when the cluster is usable, else 1

environment (default):
  SLURM_NODES (4)              emulated nodes n1..nN on this host
  SLURM_NODE_CPUS (4)          CPUs each node claims (may exceed the real cores)
  SLURM_NODE_MEM (4000)        RealMemory in MB each node claims
  SLURM_GPU_NODES (2)          nodes g1..gN of partition gpu, for the documented GPU examples; 0: none
  SLURM_GPU_NODE_GPUS (4)      GPUs each gpu node declares (no device behind them: jobs train on the CPU)
  SLURM_GPU_NODE_CPUS (32)     CPUs each gpu node claims
  SLURM_GPU_NODE_MEM (262144)  RealMemory in MB each gpu node claims
  SLURM_DEF_MEM_PER_CPU (500)  memory a job gets per CPU when it asks for none
  SLURM_CRED_EXPIRE (10)       seconds; also the least delay before a requeued job runs again
  SLURM_REQUEUE_EXIT ()        exit codes that requeue a batch job (slurm.conf RequeueExit)
  SLURM_CGROUP (0)             1 = cgroup v1 proctrack/task plugins with memory limits
  SLURM_NODE_BASE_PORT (17200) node nI's slurmd listens on this port + I, gI's on this port + 100 + I
  SLURM_START_TIMEOUT (60)     seconds to wait for each daemon to become ready
EOF
}

# ------------------------------------------------------------------------------------ helpers
T0=$(date +%s.%N)
log() { printf '[local-cluster %s] %s\n' "$(date +%T.%2N)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
elapsed() { awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }'; }
need_root() { [ "$(id -u)" = 0 ] || die "run as root"; }

# pid_alive PID COMM: true when PID runs and is COMM. A zombie counts as dead, because without
# systemd PID 1 may reap exited daemons late, and `kill -0` succeeds on a zombie.
pid_alive() {
    [ -n "$1" ] && kill -0 "$1" 2>/dev/null &&
        [ "$(cat "/proc/$1/comm" 2>/dev/null)" = "$2" ] &&
        [ "$(awk '{ print $3 }' "/proc/$1/stat" 2>/dev/null)" != Z ]
}
running() { pid_alive "$(cat "$1" 2>/dev/null || true)" "$2"; }   # running PIDFILE COMM

# wait_gone PID COMM [TIMEOUT_S]: wait for a signalled daemon to exit; SIGKILL it if it will not go.
wait_gone() {
    local pid=$1 comm=$2 limit=${3:-30}
    for _ in $(seq $((limit * 5))); do pid_alive "$pid" "$comm" || return 0; sleep 0.2; done
    log "$comm ($pid) ignored SIGTERM for ${limit}s; SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
}

# stop_daemon PIDFILE COMM [TIMEOUT_S]: SIGTERM the daemon named in PIDFILE and wait for it.
stop_daemon() {
    local pidfile=$1 comm=$2 limit=${3:-30} pid
    pid=$(cat "$pidfile" 2>/dev/null) || { log "$comm: not running"; return 0; }
    if ! pid_alive "$pid" "$comm"; then log "$comm: not running (stale pid file)"; rm -f "$pidfile"; return 0; fi
    kill -TERM "$pid"
    wait_gone "$pid" "$comm" "$limit"
    rm -f "$pidfile"
    log "$comm ($pid) stopped"
}

# wait_for DESC LOGFILE CMD...: retry CMD until it succeeds; on timeout show the daemon's log tail.
wait_for() {
    local desc=$1 logfile=$2 end=$(($(date +%s) + TIMEOUT)); shift 2
    until "$@" >/dev/null 2>&1; do
        if [ "$(date +%s)" -ge "$end" ]; then
            [ -r "$logfile" ] && tail -n 20 "$logfile" >&2
            die "timed out after ${TIMEOUT}s waiting for $desc (try: $0 up --fresh)"
        fi
        sleep 0.2
    done
}

sql() { mariadb --socket="$DB_SOCK" -e "$1"; }

# ------------------------------------------------------------------------------------ install
missing_packages() {
    local p
    for p in "${PACKAGES[@]}"; do
        [ "$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null)" = installed ] || echo "$p"
    done
}

# The separate slurm-wlm-emulator package registers its front-end build under the same
# alternatives with a higher priority; that slurmctld dies with "No front end nodes defined".
WLM_ALTERNATIVES=(slurmctld slurmd slurmstepd)
wlm_binaries_ok() {
    local a
    for a in "${WLM_ALTERNATIVES[@]}"; do
        [ "$(readlink -f "/usr/sbin/$a")" = "/usr/sbin/$a-wlm" ] || return 1
    done
}
fix_alternatives() {
    local a
    for a in "${WLM_ALTERNATIVES[@]}"; do
        if [ "$(readlink -f "/usr/sbin/$a")" != "/usr/sbin/$a-wlm" ]; then
            log "/usr/sbin/$a points at $(readlink -f "/usr/sbin/$a"); switching back to $a-wlm"
            update-alternatives --set "$a" "/usr/sbin/$a-wlm" >/dev/null
        fi
    done
}

cmd_install() {
    need_root
    local missing
    missing=$(missing_packages)
    if [ -z "$missing" ]; then
        log "packages already installed: ${PACKAGES[*]}"
    else
        log "installing: ${missing//$'\n'/ }"
        apt-get update -qq
        # recommends would pull ~40 extra packages (hdf5, rocm-smi, freeipmi, -dev packages, ...)
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
    fi
    fix_alternatives
    log "install done in $(elapsed)s"
}

# ------------------------------------------------------------------------------------ munge
start_munge() {
    # /run is empty after every boot; the Debian postinst normally creates the key
    install -d -o munge -g munge -m 755 /run/munge
    install -d -o munge -g munge -m 700 /var/log/munge /var/lib/munge
    if [ ! -s /etc/munge/munge.key ]; then
        install -d -o munge -g munge -m 700 /etc/munge
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    if running "$MUNGE_PID" munged; then
        log "munged already running"
    else
        rm -f "$MUNGE_PID" /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock
        runuser -u munge -- /usr/sbin/munged
        log "munged started"
    fi
    wait_for munged /var/log/munge/munged.log bash -c 'munge -n | unmunge'
}

# ------------------------------------------------------------------------------------ configs
slurm_conf() {
    local proctrack=proctrack/linuxproc task=task/none
    [ "$CGROUP" = 1 ] && { proctrack=proctrack/cgroup; task=task/cgroup; }
    cat <<EOF
# generated by slurm_templates/local-cluster.sh; edits are overwritten by the next 'up'
ClusterName=$CLUSTER
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=slurm
AuthType=auth/munge
AuthInfo=cred_expire=$CRED_EXPIRE
MailProg=/bin/true
MpiDefault=none
ProctrackType=$proctrack
TaskPlugin=$task
ReturnToService=2
KillWait=5
JobRequeue=1
${REQUEUE_EXIT:+RequeueExit=$REQUEUE_EXIT}
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=/run/slurmd-%n.pid
SlurmdSpoolDir=/var/lib/slurm/slurmd-%n
StateSaveLocation=$STATE_DIR
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=2,sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=$DEF_MEM_PER_CPU
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/linux
JobCompType=jobcomp/none
NodeName=n[1-$NODES] NodeHostname=$HOST NodeAddr=127.0.0.1 Port=[$((BASE_PORT + 1))-$((BASE_PORT + NODES))] CPUs=$NODE_CPUS RealMemory=$NODE_MEM State=UNKNOWN
PartitionName=debug Nodes=n[1-$NODES] Default=YES MaxTime=INFINITE State=UP
EOF
    [ "$GPU_NODES" -gt 0 ] || return 0
    cat <<EOF
GresTypes=gpu
NodeName=g[1-$GPU_NODES] NodeHostname=$HOST NodeAddr=127.0.0.1 Port=[$((BASE_PORT + 101))-$((BASE_PORT + 100 + GPU_NODES))] CPUs=$GPU_NODE_CPUS RealMemory=$GPU_NODE_MEM Gres=gpu:$GPU_NODE_GPUS State=UNKNOWN
PartitionName=gpu Nodes=g[1-$GPU_NODES] MaxTime=INFINITE State=UP
EOF
}

# The gpu nodes' GPUs are empty files (slurmd drops a GPU without a file): the scheduler grants
# them, which is what a job's request and sbatch's answer depend on, and a job's torch sees no CUDA
# device, so it trains on the CPU.
GPU_FILES=/var/lib/slurm/gpu
gres_conf() {
    [ "$GPU_NODES" -gt 0 ] || return 0
    printf 'AutoDetect=off\nNodeName=g[1-%s] Name=gpu File=%s[0-%s]\n' "$GPU_NODES" "$GPU_FILES" $((GPU_NODE_GPUS - 1))
}
# Why these settings (details in docs/slurm.md):
#   cred_expire=10 + sched_interval=2: a requeued job runs again after ~11 s instead of ~2 minutes.
#   DefMemPerCPU: with CR_Core_Memory a job that asks for no memory would get the whole node.
#   config_overrides: nodes may claim more CPUs than the host has instead of going INVAL/DRAIN.
#   KillWait=5: cancelled and timed-out jobs get SIGKILL 5 s after SIGTERM, not 30 s.
#   ReturnToService=2: a DOWN node rejoins as soon as its slurmd registers again.

cgroup_conf() {
    # cores are not constrained: the emulated nodes claim more CPUs than exist
    printf '%s\n' CgroupPlugin=cgroup/v1 ConstrainCores=no ConstrainDevices=no ConstrainRAMSpace=yes ConstrainSwapSpace=no
}

slurmdbd_conf() {
    cat <<EOF
AuthType=auth/munge
DbdHost=localhost
DebugLevel=info
StorageHost=localhost
StorageLoc=$DB_NAME
StorageUser=$DB_USER
StoragePass=$DB_PASS
StorageType=accounting_storage/mysql
LogFile=$LOG_DIR/slurmdbd.log
PidFile=$DBD_PID
SlurmUser=slurm
EOF
}

# replace_if_changed FILE OWNER MODE < content: install the new content only when it differs.
# Returns 0 when the file changed.
replace_if_changed() {
    local tmp; tmp=$(mktemp)
    cat >"$tmp"
    if cmp -s "$tmp" "$1"; then rm -f "$tmp"; return 1; fi
    install -o "$2" -g "$2" -m "$3" "$tmp" "$1"
    rm -f "$tmp"
}

# slurmctld and slurmd read slurm.conf only at start, so a changed config means restarting them.
write_slurm_conf() {
    install -d -o slurm -g slurm -m 755 /var/lib/slurm "$STATE_DIR" "$LOG_DIR"
    local g
    if [ "$GPU_NODES" -gt 0 ]; then for g in $(seq 0 $((GPU_NODE_GPUS - 1))); do touch "$GPU_FILES$g"; done; fi
    if [ "$CGROUP" = 1 ]; then cgroup_conf | replace_if_changed /etc/slurm/cgroup.conf root 644 || true; fi
    local changed=1
    gres_conf | replace_if_changed /etc/slurm/gres.conf root 644 && changed=0
    slurm_conf | sed '/^$/d' | replace_if_changed /etc/slurm/slurm.conf root 644 && changed=0
    if [ "$changed" = 0 ]; then
        log "slurm.conf/gres.conf written; restarting slurmctld/slurmd if they were running"
        stop_slurmds
        stop_daemon "$CTLD_PID" slurmctld
    fi
}

# ------------------------------------------------------------------------------------ accounting
start_mariadb() {
    install -d -o mysql -g mysql -m 755 /run/mysqld
    install -d -o mysql -g adm -m 2750 /var/log/mysql
    [ -d /var/lib/mysql/mysql ] || mariadb-install-db --user=mysql --datadir=/var/lib/mysql >/dev/null
    if running "$MARIADB_PID" mariadbd; then
        log "mariadbd already running"
    else
        rm -f "$MARIADB_PID"
        # mariadbd does not daemonise itself; setsid+nohup detach it from this shell and from
        # the caller's output pipe (CI's `... | tee` must not hang on it)
        setsid nohup /usr/sbin/mariadbd --user=mysql --pid-file="$MARIADB_PID" --socket="$DB_SOCK" \
            --bind-address=127.0.0.1 --innodb-buffer-pool-size=256M --innodb-lock-wait-timeout=900 \
            >>/var/log/mysql/islands-mariadbd.log 2>&1 </dev/null &
        log "mariadbd started"
    fi
    wait_for mariadbd /var/log/mysql/islands-mariadbd.log mariadb-admin --socket="$DB_SOCK" ping
}

ensure_database() {
    sql "CREATE DATABASE IF NOT EXISTS $DB_NAME;
         CREATE USER IF NOT EXISTS '$DB_USER'@'localhost' IDENTIFIED BY '$DB_PASS';
         GRANT ALL ON $DB_NAME.* TO '$DB_USER'@'localhost';"
}

start_slurmdbd() {
    # slurmdbd refuses a config that is not owned by SlurmUser or that others can read
    if slurmdbd_conf | replace_if_changed /etc/slurm/slurmdbd.conf slurm 600; then
        stop_daemon "$DBD_PID" slurmdbd
    fi
    if running "$DBD_PID" slurmdbd; then
        log "slurmdbd already running"
    else
        rm -f "$DBD_PID"
        /usr/sbin/slurmdbd
        log "slurmdbd started"
    fi
    # sacctmgr talks to slurmdbd directly (it reads AuthInfo from slurm.conf, written before this)
    wait_for slurmdbd "$LOG_DIR/slurmdbd.log" sacctmgr -n list cluster
}

# ------------------------------------------------------------------------------------ slurmctld, slurmd
start_slurmctld() {
    if running "$CTLD_PID" slurmctld; then
        log "slurmctld already running"
    else
        rm -f "$CTLD_PID"
        /usr/sbin/slurmctld
        log "slurmctld started"
    fi
    wait_for slurmctld "$LOG_DIR/slurmctld.log" bash -c 'scontrol ping | grep -q "is UP"'
}

node_names() { seq -f 'n%g' 1 "$NODES"; [ "$GPU_NODES" -gt 0 ] && seq -f 'g%g' 1 "$GPU_NODES"; return 0; }

start_slurmds() {
    local n
    for n in $(node_names); do
        if running "/run/slurmd-$n.pid" slurmd; then
            log "slurmd $n already running"
        else
            rm -f "/run/slurmd-$n.pid"
            /usr/sbin/slurmd -N "$n"    # the stock build allows several slurmd per host (MULTIPLE_SLURMD)
            log "slurmd $n started"
        fi
    done
}

# SIGTERM all slurmds first so they shut down in parallel, then wait for each by pid (a slurmd
# deletes its own pid file on exit, so the files cannot be used for the waiting).
stop_slurmds() {
    local f pid pids=()
    for f in /run/slurmd-*.pid; do
        pid=$(cat "$f" 2>/dev/null) || continue
        if pid_alive "$pid" slurmd; then kill -TERM "$pid" && pids+=("$pid"); fi
        rm -f "$f"
    done
    for pid in "${pids[@]}"; do wait_gone "$pid" slurmd; done
    log "slurmd: ${#pids[@]} stopped"
}

nodes_usable() {
    [ -z "$(sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2 !~ /^(idle|mix|alloc|comp)$/')" ] &&
        [ "$(sinfo -h -N -o %N 2>/dev/null | sort -u | wc -l)" -eq "$(node_names | wc -l)" ]
}

# Nodes drained by an earlier config (e.g. "Low CPUs") stay drained after the fix until resumed.
wait_nodes() {
    local end=$(($(date +%s) + TIMEOUT)) bad
    until nodes_usable; do
        bad=$(sinfo -h -N -t drain,drng,down,fail -o %N 2>/dev/null | sort -u | paste -sd, -)
        # fresh slurmds need a few seconds to register; only then is a DOWN node really stuck
        if [ -n "$bad" ] && [ $((end - $(date +%s))) -lt $((TIMEOUT - 5)) ]; then
            scontrol update NodeName="$bad" State=RESUME 2>/dev/null || true
        fi
        [ "$(date +%s)" -lt "$end" ] || { sinfo -N -l >&2; die "nodes not usable after ${TIMEOUT}s"; }
        sleep 0.2
    done
}

# slurmctld registers the cluster with slurmdbd on its first start; sacct needs that.
cluster_registered() { sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER"; }

# ------------------------------------------------------------------------------------ down
cancel_all_jobs() {
    running "$CTLD_PID" slurmctld || return 0
    local jobs
    read -ra jobs <<<"$(squeue -h -o %A 2>/dev/null | paste -sd' ' -)"
    [ "${#jobs[@]}" -gt 0 ] || return 0
    log "cancelling jobs: ${jobs[*]}"
    scancel "${jobs[@]}" 2>/dev/null || true
    for _ in $(seq 75); do [ -z "$(squeue -h -o %A 2>/dev/null)" ] && break; sleep 0.2; done
}

descendants() { local c; for c in $(pgrep -P "$1" || true); do descendants "$c"; echo "$c"; done; }
holds_our_log() {
    local fd
    for fd in "/proc/$1/fd/"*; do
        case "$(readlink "$fd" 2>/dev/null)" in "$LOG_DIR"/slurmd-*.log) return 0 ;; esac
    done
    return 1
}

# slurmstepd and the job's processes outlive slurmd. Kill leftovers by PID, but only step daemons
# that hold one of our slurmd logs open, so another cluster's jobs on this host are never touched.
kill_leftover_steps() {
    local pid c
    for pid in $(pgrep -x slurmstepd || true); do
        holds_our_log "$pid" || continue
        for c in $(descendants "$pid"); do kill -KILL "$c" 2>/dev/null || true; done
        if kill -KILL "$pid" 2>/dev/null; then log "killed leftover slurmstepd $pid"; fi
    done
}

# Wiping the state restarts job ids at 1; the DB must go with it, or sacct -j 1 mixes both clusters.
# Dropped with SQL: deleting files under /var/lib/mysql would corrupt InnoDB's dictionary.
purge_state() {
    log "purging slurmctld state, slurmd spools, slurm logs"
    rm -rf "${STATE_DIR:?}"/* /var/lib/slurm/slurmd-* "${LOG_DIR:?}"/*
    if running "$MARIADB_PID" mariadbd; then
        sql "DROP DATABASE IF EXISTS $DB_NAME" && log "dropped $DB_NAME"
    else
        log "mariadbd not running, $DB_NAME kept ('up --fresh' drops it)"
    fi
}

# stop_slurm PURGE: everything Slurm, leaving MariaDB and munge up.
stop_slurm() {
    cancel_all_jobs
    stop_slurmds
    kill_leftover_steps
    stop_daemon "$CTLD_PID" slurmctld
    stop_daemon "$DBD_PID" slurmdbd
    [ "$1" = 1 ] && purge_state
    return 0
}

cmd_down() {
    need_root
    local purge=0
    case "${1:-}" in --purge) purge=1 ;; "") ;; *) usage; exit 2 ;; esac
    stop_slurm "$purge"
    stop_daemon "$MARIADB_PID" mariadbd 60
    stop_daemon "$MUNGE_PID" munged
    log "down in $(elapsed)s"
}

# ------------------------------------------------------------------------------------ up
check_binaries() {
    local b
    for b in munged mariadbd slurmdbd slurmctld slurmd sbatch sacct; do
        command -v "$b" >/dev/null || die "$b not found: run '$0 install' first"
    done
    wlm_binaries_ok ||
        die "slurmctld/slurmd/slurmstepd are not the -wlm builds (slurm-wlm-emulator?): run '$0 install' to fix"
}

cmd_up() {
    need_root
    local fresh=0
    case "${1:-}" in --fresh) fresh=1 ;; "") ;; *) usage; exit 2 ;; esac
    check_binaries
    unset SLURM_CONF    # daemons and clients here must all read /etc/slurm/slurm.conf
    # --fresh gives an empty cluster with no ghost jobs, whose job ids start at 1 again. Callers
    # MUST then use new submitit folders: submitit names files by job id, so an old folder would
    # hand back a previous run's <id>_result.pkl as the result of the new job with the same id.
    [ "$fresh" = 1 ] && stop_slurm 1
    start_munge
    write_slurm_conf
    start_mariadb
    [ "$fresh" = 1 ] && sql "DROP DATABASE IF EXISTS $DB_NAME"   # in case mariadbd was down at purge
    ensure_database
    start_slurmdbd
    start_slurmctld
    start_slurmds
    wait_nodes
    wait_for "cluster registration in slurmdbd" "$LOG_DIR/slurmctld.log" cluster_registered
    log "up in $(elapsed)s"
    sinfo -N -o '%N %P %T %c %m' >&2
}

# ------------------------------------------------------------------------------------ status
# sacct is asked first because it fails at once when slurmdbd is down, while sinfo retries for
# about 9 s when slurmctld is down; sinfo is therefore run only once.
cmd_status() {
    local b ok=0 sacct_line nodes
    for b in sinfo sacct sbatch squeue; do
        command -v "$b" >/dev/null || { echo "$b not installed"; return 1; }
    done
    if sacct -n -X -S now-1minutes >/dev/null 2>&1; then sacct_line="sacct: answers"
    else sacct_line="sacct: does not answer (slurmdbd or MariaDB down?)"; ok=1; fi
    nodes=$(sinfo -N -o '%N %P %t %c %m' 2>&1) || ok=1
    echo "$nodes"
    if ! awk 'NR > 1 && $3 ~ /^(idle|mix|alloc|comp)$/ { up = 1 } END { exit !up }' <<<"$nodes"; then
        echo "no node is up"; ok=1
    fi
    echo "$sacct_line"
    return "$ok"
}

main() {
    local cmd=${1:-}
    shift || true
    case "$cmd" in
        install) cmd_install "$@" ;;
        up) cmd_up "$@" ;;
        down) cmd_down "$@" ;;
        status) cmd_status "$@" ;;
        *) usage; exit 2 ;;
    esac
}

main "$@"
