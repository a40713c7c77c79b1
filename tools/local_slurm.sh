#!/usr/bin/env bash
# local_slurm.sh — a real Slurm cluster on this machine, for hpcnft's hpc tests and CI: one node on
# localhost (the default), or HPCNFT_SLURM_NODES=N nodes, each a network namespace of its own.
#
# Usage:
#   tools/local_slurm.sh [DIR] [start|stop|status|restart]     (defaults: /tmp/hpcnft-slurm start)
#   source DIR/env.sh            # exports SLURM_CONF (also symlinked from /etc/slurm/slurm.conf)
#
# Built for Debian 12 (bookworm) with Slurm 22.05 from Debian, run as root, with or without
# systemd (none of it is used: every daemon is started by hand and self-daemonizes), no cgroup
# plugins. With one node everything listens on 127.0.0.1 only.
#
# Several nodes (HPCNFT_SLURM_NODES=N, N > 1): node K (node1 ... nodeN, SLURM_NODE_PREFIX) is a
# network namespace with its own hostname (a UTS namespace: `unshare --uts` + hostname) and one
# slurmd (`slurmd -N nodeK`). Each namespace has one end of a veth pair named eth0 with the
# address NET.(10+K)/24; the other ends join a bridge in the root namespace that holds NET.1,
# where slurmctld answers (SlurmctldHost=localhost(NET.1)). NET (SLURM_NET, default 10.213.0) is a
# private range used only there: no traffic leaves the machine. Every name resolves on every node
# through a block of /etc/hosts, delimited by "# BEGIN/END hpcnft local_slurm DIR" lines (the
# namespaces share the file system). slurmctld, slurmdbd, MariaDB and munge run in the root
# namespace as with one node. What start made is listed in DIR/run/net.list; stop removes exactly
# that (namespaces, links, the bridge and its address, the hosts block) after killing the
# slurmds and whatever is left in their namespaces.
#
# start (idempotent: whatever is already running is left alone; exit 0 when the node is usable)
#   1. apt-get install, only what is missing: slurmctld slurmd slurm-client munge
#        + openmpi-bin libopenmpi-dev (brings libpmix2: `srun --mpi=pmix` needs it present
#          when slurmd starts)                                                     [WITH_MPI=1]
#        + slurmdbd mariadb-server (real accounting: `sacct`, submitit's job.state) [WITH_ACCOUNTING=1]
#        + hdf5-tools (h5clear, to recover run files of killed SWMR writers)     [WITH_HDF5_TOOLS=1]
#   2. writes DIR/etc/slurm.conf (+ slurmdbd.conf) and DIR/env.sh
#   3. starts munged, [mariadbd (private datadir DIR/mysql), slurmdbd], slurmctld, slurmd
#   4. waits until `sinfo` shows every node idle; where no slurmctld and no slurmd ran before
#      this start (a machine restarted under a running cluster), the jobs slurmctld recovers
#      from DIR/state have no processes left: they are cancelled, as they would otherwise hold
#      their nodes until slurmctld gives up on them (minutes)
# stop     cancels this cluster's jobs, then kills only the PIDs in DIR/run/*.pid (and munged,
#          through /run/munge/munged.pid, only if this script started it), newest first,
#          waiting for each to exit. Never kills anything by name.
# status   one line per daemon + sinfo; exit 0 if all daemons run, 3 if not
# restart  stop, then start (needed for slurm.conf changes such as AuthInfo; a running
#          cluster gets `scontrol reconfigure` on other changes)
#
# Knobs (environment variables):
#   WITH_ACCOUNTING=1     slurmdbd + MariaDB (0: accounting_storage/none; then `sacct` fails with
#                         "Slurm accounting storage is disabled" and submitit's job.state is UNKNOWN)
#   WITH_MPI=1            install Open MPI (+PMIx) before slurmd starts so mpi/pmix loads
#   WITH_HDF5_TOOLS=1     install hdf5-tools (h5clear)
#   HPCNFT_SLURM_NODES=1  nodes; more than 1: one network namespace per node (above)
#   SLURM_NET=10.213.0    the /24 of the nodes' addresses (N > 1): bridge .1, nodeK .(10+K)
#   SLURM_NODE_PREFIX=node  node names PREFIX1 ... PREFIXN (N > 1)
#   SLURM_NODE_CPUS=8     CPUs advertised for each node (oversubscribes the real cores; needs
#                         SlurmdParameters=config_overrides, else the node goes INVAL)
#   SLURM_NODE_MEM=16000  RealMemory (MB) advertised
#   SLURM_MIN_JOB_AGE=300 seconds a finished job stays visible to squeue/scontrol
#   SLURM_KILL_WAIT=5     seconds between SIGTERM and SIGKILL at cancel/timeout/requeue
#   SLURMD_TIMEOUT=60     seconds without an answer from a slurmd before its node is DOWN (a
#                         lost node ends its jobs this much later)
#   SLURM_CRED_EXPIRE=10  AuthInfo cred_expire; also the delay before a requeued job may start
#                         again (Slurm's default 120 s makes requeue tests crawl)
#   SLURM_MPI_DEFAULT=none  ("pmix" makes plain `srun` do PMIx for MPI programs)
#   SLURM_CTLD_PORT=6817 SLURM_SLURMD_PORT=6818 SLURM_DBD_PORT=6819 SLURM_MYSQL_PORT=6830
#   LINK_ETC=1            symlink /etc/slurm/slurm.conf -> DIR/etc/slurm.conf (only if that path is
#                         absent or already a symlink), so sbatch/srun/submitit need no SLURM_CONF
#   CANCEL_JOBS_ON_STOP=1 scancel the cluster's jobs before stopping the daemons
#   CANCEL_STALE_JOBS=1   scancel the jobs recovered by a start of a cluster none of whose
#                         daemons was running (4. above)
#
# Files outside DIR it touches: /etc/slurm/slurm.conf (symlink), /etc/munge/munge.key (created by
# the munge package), /run/munge (munged's socket and pid file), and with N > 1 /etc/hosts (its
# own delimited block) and /run/netns (ip netns).
set -euo pipefail

DIR=/tmp/hpcnft-slurm
ACTION=start
for a in "$@"; do
  case "$a" in
    start|stop|restart|status) ACTION=$a ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "local_slurm.sh: unknown option $a (usage: local_slurm.sh [DIR] start|stop|status|restart)" >&2; exit 2 ;;
    *) DIR=$a ;;
  esac
done
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)

WITH_ACCOUNTING=${WITH_ACCOUNTING:-1}
WITH_MPI=${WITH_MPI:-1}
WITH_HDF5_TOOLS=${WITH_HDF5_TOOLS:-1}
NODE_CPUS=${SLURM_NODE_CPUS:-8}
NODE_MEM=${SLURM_NODE_MEM:-16000}
MIN_JOB_AGE=${SLURM_MIN_JOB_AGE:-300}
KILL_WAIT=${SLURM_KILL_WAIT:-5}
SLURMD_TIMEOUT_S=${SLURMD_TIMEOUT:-60}
CRED_EXPIRE=${SLURM_CRED_EXPIRE:-10}
MPI_DEFAULT=${SLURM_MPI_DEFAULT:-none}
CTLD_PORT=${SLURM_CTLD_PORT:-6817}
SLURMD_PORT=${SLURM_SLURMD_PORT:-6818}
DBD_PORT=${SLURM_DBD_PORT:-6819}
MYSQL_PORT=${SLURM_MYSQL_PORT:-6830}
LINK_ETC=${LINK_ETC:-1}
NODES=${HPCNFT_SLURM_NODES:-1}
NET=${SLURM_NET:-10.213.0}
NODE_PREFIX=${SLURM_NODE_PREFIX:-node}
CLUSTER=localcluster
DB_PASS=slurmlocal

export SLURM_CONF="$DIR/etc/slurm.conf"
RUN="$DIR/run"
LOG="$DIR/log"

if ! [[ "$NODES" =~ ^[1-9][0-9]{0,2}$ ]] || [ "$NODES" -gt 200 ]; then
  echo "local_slurm.sh: HPCNFT_SLURM_NODES=$NODES is not a node count from 1 to 200" >&2; exit 2
fi
if ! [[ "$NET" =~ ^(10\.[0-9]{1,3}|172\.(1[6-9]|2[0-9]|3[01])|192\.168)\.([0-9]{1,3})$ ]] \
   || [ "$(echo "$NET" | cut -d. -f2)" -gt 255 ] || [ "${BASH_REMATCH[3]}" -gt 255 ]; then
  echo "local_slurm.sh: SLURM_NET=$NET is not the first three numbers of a private /24 (e.g. 10.213.0)" >&2; exit 2
fi
# names of what the multi-node network is made of; link names have at most 15 characters
NET_TAG="h$(echo "$NET" | cut -d. -f2)x$(echo "$NET" | cut -d. -f3)"
if ! [[ "$NODE_PREFIX" =~ ^[a-z][a-z0-9-]{0,20}$ ]]; then
  echo "local_slurm.sh: SLURM_NODE_PREFIX=$NODE_PREFIX is not a host name prefix (a-z, 0-9, -)" >&2; exit 2
fi
BRIDGE="${NET_TAG}br"
HOSTS_BEGIN="# BEGIN hpcnft local_slurm $DIR"
HOSTS_END="# END hpcnft local_slurm $DIR"
NET_LIST="$RUN/net.list"   # what start made, one "KIND NAME" a line, in the order made
node_name() { echo "$NODE_PREFIX$1"; }
node_addr() { echo "$NET.$((10 + $1))"; }
node_ns() { echo "hpcnft-$NET_TAG-$NODE_PREFIX$1"; }
node_veth() { echo "${NET_TAG}v$1"; }
if [ "$NODES" = 1 ]; then NODE_LIST=localhost; else NODE_LIST="$NODE_PREFIX[1-$NODES]"; fi

log() { printf '[local_slurm %s] %s\n' "$(date +%T)" "$*" >&2; }
now() { date +%s.%N; }
T_START=$(now)
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.1f", b-a}'; }

# pid_alive PIDFILE NAME: the pid in PIDFILE is alive and its comm starts with NAME
# (guards against a stale pid file whose number now belongs to another process)
pid_alive() {
  local f=$1 name=$2 pid
  [ -s "$f" ] || return 1
  pid=$(tr -dc '0-9' < "$f")
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 1
  [[ "$(cat /proc/"$pid"/comm 2>/dev/null)" == "$name"* ]]
}

wait_pidfile() {  # wait_pidfile PIDFILE NAME: wait up to 10 s for a daemon to write its pid file
  for _ in $(seq 1 100); do pid_alive "$1" "$2" && { tr -dc '0-9' < "$1"; return 0; }; sleep 0.1; done
  log "$2 did not come up (no live pid in $1)"; return 1
}

any_alive() {  # any_alive PID...: at least one of them still runs (a zombie has exited: whoever
  # adopted the daemon reaps it when it will, which in a container's PID 1 can be much later)
  local p
  for p in "$@"; do
    kill -0 "$p" 2>/dev/null && [ "$(awk '{print $3}' /proc/"$p"/stat 2>/dev/null)" != Z ] && return 0
  done
  return 1
}

stop_pidfiles() {  # stop_pidfiles NAME:PIDFILE ...: SIGTERM them together, SIGKILL after 10 s
  local n f name pid pids=()
  for n in "$@"; do
    name=${n%%:*}; f=${n#*:}
    if pid_alive "$f" "$name"; then
      pid=$(tr -dc '0-9' < "$f")
      log "stopping $name (pid $pid)"
      kill "$pid" 2>/dev/null || true
      pids+=("$pid")
    fi
    rm -f "$f"
  done
  [ ${#pids[@]} -eq 0 ] && return 0
  for _ in $(seq 1 100); do
    any_alive "${pids[@]}" || return 0
    sleep 0.1
  done
  for pid in "${pids[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then log "pid $pid did not exit, SIGKILL"; kill -9 "$pid" 2>/dev/null || true; fi
  done
  for _ in $(seq 1 50); do  # gone before stop returns, even on a loaded machine
    any_alive "${pids[@]}" || return 0
    sleep 0.1
  done
}

port_in_use() {  # port_in_use PORT: something accepts connections on 127.0.0.1:PORT
  (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

remove_hosts_block() {  # our block of /etc/hosts, rewritten in place (it is often a bind mount)
  grep -qxF "$HOSTS_BEGIN" /etc/hosts 2>/dev/null || return 0
  awk -v b="$HOSTS_BEGIN" -v e="$HOSTS_END" '$0 == b {skip = 1; next} $0 == e {skip = 0; next} !skip' \
    /etc/hosts > "$RUN/hosts.new"
  cat "$RUN/hosts.new" > /etc/hosts
  rm -f "$RUN/hosts.new"
}

net_record() { mkdir -p "$RUN"; grep -qxF "$*" "$NET_LIST" 2>/dev/null || echo "$*" >> "$NET_LIST"; }

add_net() {  # the nodes' namespaces, links, addresses and names; what exists already is kept
  local k name ns veth addr
  net_record link "$BRIDGE"
  ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
  ip addr replace "$NET.1/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  for k in $(seq 1 "$NODES"); do
    name=$(node_name "$k"); ns=$(node_ns "$k"); veth=$(node_veth "$k"); addr=$(node_addr "$k")
    net_record netns "$ns"
    [ -e "/run/netns/$ns" ] || ip netns add "$ns"
    net_record link "$veth"
    ip link show "$veth" >/dev/null 2>&1 || ip link add "$veth" type veth peer name eth0 netns "$ns"
    ip link set "$veth" master "$BRIDGE"
    ip link set "$veth" up
    ip -n "$ns" addr replace "$addr/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
  done
  net_record hosts /etc/hosts
  remove_hosts_block
  {
    echo "$HOSTS_BEGIN"
    for k in $(seq 1 "$NODES"); do echo "$(node_addr "$k") $(node_name "$k")"; done
    echo "$HOSTS_END"
  } >> /etc/hosts
  log "network: bridge $BRIDGE $NET.1/24; nodes $(for k in $(seq 1 "$NODES"); do printf '%s=%s ' "$(node_name "$k")" "$(node_addr "$k")"; done)"
}

remove_net() {  # everything net.list names, newest first; processes left in a namespace are killed
  local kind name pids
  [ -f "$NET_LIST" ] || return 0
  tac "$NET_LIST" | while read -r kind name; do
    case "$kind" in
      netns)
        if [ -e "/run/netns/$name" ]; then
          pids=$(ip netns pids "$name" 2>/dev/null | tr '\n' ' ' || true)
          if [ -n "${pids// /}" ]; then
            log "killing what is left in namespace $name: $pids"
            # shellcheck disable=SC2086  # a list of pids
            kill -9 $pids 2>/dev/null || true
          fi
          ip netns del "$name" 2>/dev/null || log "could not delete namespace $name"
        fi ;;
      link) ! ip link show "$name" >/dev/null 2>&1 || ip link del "$name" || log "could not delete link $name" ;;
      hosts) remove_hosts_block ;;
    esac
  done
  rm -f "$NET_LIST"
  log "network removed"
}

slurmd_pidfiles() {  # NAME:PIDFILE of every slurmd this cluster runs (one per node)
  local f
  [ -e "$RUN/slurmd.pid" ] && echo "slurmd:$RUN/slurmd.pid"
  for f in "$RUN"/slurmd-*.pid; do [ -e "$f" ] && echo "slurmd:$f"; done
  return 0
}

cancel_jobs() {  # REASON: scancel every job squeue lists, saying REASON, and wait until none is left
  local jobs
  jobs=$(squeue -h -o %i 2>/dev/null | tr '\n' ' ' || true)
  [ -z "${jobs// /}" ] && return 0
  log "cancelling jobs $1: $jobs"
  # shellcheck disable=SC2086  # a list of job ids
  scancel --full $jobs 2>/dev/null || true
  for _ in $(seq 1 $(( (KILL_WAIT + 10) * 5 ))); do
    [ -z "$(squeue -h -t PD,R,CG,S,CF -o %i 2>/dev/null)" ] && break; sleep 0.2
  done
}

do_stop() {
  # cancel this cluster's jobs first, so no slurmstepd/job processes outlive slurmd
  if pid_alive "$RUN/slurmctld.pid" slurmctld && [ "${CANCEL_JOBS_ON_STOP:-1}" = 1 ]; then
    cancel_jobs "left running"
  fi
  # Slurm daemons first (they need munge and slurmdbd to shut down cleanly), then the rest
  # shellcheck disable=SC2046  # one word per pid file
  stop_pidfiles $(slurmd_pidfiles) "slurmctld:$RUN/slurmctld.pid"
  remove_net
  stop_pidfiles "slurmdbd:$RUN/slurmdbd.pid" "mariadbd:$RUN/mariadbd.pid"
  if [ -f "$RUN/munged.started-by-us" ]; then
    stop_pidfiles munged:/run/munge/munged.pid
    rm -f "$RUN/munged.started-by-us"
  fi
}

do_status() {  # one line per daemon (a slurmd per node: "slurmd nodeK"), then sinfo
  local n label name f k all=0
  local daemons=(munged:/run/munge/munged.pid)
  [ "$WITH_ACCOUNTING" = 1 ] && daemons+=("mariadbd:$RUN/mariadbd.pid" "slurmdbd:$RUN/slurmdbd.pid")
  daemons+=("slurmctld:$RUN/slurmctld.pid")
  if [ "$NODES" = 1 ]; then daemons+=("slurmd:$RUN/slurmd.pid")
  else for k in $(seq 1 "$NODES"); do daemons+=("slurmd $(node_name "$k"):$RUN/slurmd-$(node_name "$k").pid"); done; fi
  for n in "${daemons[@]}"; do
    label=${n%%:*}; f=${n#*:}; name=${label%% *}
    if pid_alive "$f" "$name"; then echo "$label: running (pid $(tr -dc '0-9' < "$f"))"
    else echo "$label: not running"; all=3; fi
  done
  if command -v sinfo >/dev/null; then sinfo 2>&1 || all=3; fi
  return $all
}

case "$ACTION" in
  stop) do_stop; log "stopped (state kept in $DIR)"; exit 0 ;;
  status) rc=0; do_status || rc=$?; exit $rc ;;
  restart) do_stop ;;
esac

# ---------------------------------------------------------------- 1. packages
PKGS=(slurmctld slurmd slurm-client munge)
[ "$WITH_MPI" = 1 ] && PKGS+=(openmpi-bin libopenmpi-dev)
[ "$WITH_ACCOUNTING" = 1 ] && PKGS+=(slurmdbd mariadb-server)
[ "$WITH_HDF5_TOOLS" = 1 ] && PKGS+=(hdf5-tools)
MISSING=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || MISSING+=("$p")
done
if [ ${#MISSING[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] || { log "missing packages ${MISSING[*]} and not root: install them first"; exit 1; }
  log "apt-get install ${MISSING[*]}"
  T=$(now)
  export DEBIAN_FRONTEND=noninteractive
  # a failing third-party source must not stop us; the install below says if lists are unusable
  apt-get update -qq >"$DIR/apt-update.log" 2>&1 || log "apt-get update reported errors (see $DIR/apt-update.log); trying the install anyway"
  # Package postinst scripts call invoke-rc.d, which without systemd falls back to the
  # /etc/init.d scripts of munge/mariadb/slurm* and would start them with the distribution
  # config. A policy-rc.d that says 101 ("action forbidden") prevents that; container images
  # usually ship one, else put one in place for the install only.
  OWN_POLICY=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod 755 /usr/sbin/policy-rc.d; OWN_POLICY=1
  fi
  rc=0
  apt-get install -y -qq --no-install-recommends "${MISSING[@]}" >"$DIR/apt-install.log" 2>&1 || rc=$?
  [ "$OWN_POLICY" = 1 ] && rm -f /usr/sbin/policy-rc.d
  [ "$rc" = 0 ] || { tail -30 "$DIR/apt-install.log" >&2; log "apt-get install failed"; exit 1; }
  log "apt done in $(elapsed "$T")s"
fi

# ---------------------------------------------------------------- 2. config
mkdir -p "$DIR/etc" "$DIR/state" "$DIR/spool" "$LOG" "$RUN"
ACCT_LINES="AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none"
if [ "$WITH_ACCOUNTING" = 1 ]; then
  ACCT_LINES="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30"
fi
# one node: "localhost" on 127.0.0.1; several: nodeK on NET.(10+K), each slurmd with its own
# pid file, spool and log (%n: the node name), slurmctld reached on the bridge's NET.1
NODE_SHAPE="CPUs=$NODE_CPUS Sockets=1 CoresPerSocket=$NODE_CPUS ThreadsPerCore=1 RealMemory=$NODE_MEM State=UNKNOWN"
if [ "$NODES" = 1 ]; then
  CONF_TITLE='single node "localhost"'
  CTLD_HOST=localhost
  SLURMD_FILE=slurmd; SLURMD_SPOOL=$DIR/spool
  NODE_LINES="NodeName=localhost NodeAddr=127.0.0.1 $NODE_SHAPE"
else
  CONF_TITLE="$NODES nodes $NODE_LIST in network namespaces on $NET.0/24"
  CTLD_HOST="localhost($NET.1)"
  SLURMD_FILE=slurmd-%n; SLURMD_SPOOL=$DIR/spool/%n
  NODE_LINES=$(for k in $(seq 1 "$NODES"); do echo "NodeName=$(node_name "$k") NodeAddr=$(node_addr "$k") $NODE_SHAPE"; done)
fi
NEW_CONF=$(cat <<EOF
# generated by hpcnft tools/local_slurm.sh — $CONF_TITLE, no cgroups, no systemd
ClusterName=$CLUSTER
SlurmctldHost=$CTLD_HOST
AuthType=auth/munge
# cred_expire is also how long a requeued job waits before it is eligible again (default 120)
AuthInfo=cred_expire=$CRED_EXPIRE
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$SLURMD_SPOOL
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/$SLURMD_FILE.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/$SLURMD_FILE.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=$MPI_DEFAULT
SwitchType=switch/none
JobCompType=jobcomp/none
$ACCT_LINES
MailProg=/bin/true
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# the node advertises more CPUs than the machine has; without this it is marked INVAL
SlurmdParameters=config_overrides
KillWait=$KILL_WAIT
MinJobAge=$MIN_JOB_AGE
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=$SLURMD_TIMEOUT_S
$NODE_LINES
PartitionName=debug Nodes=$NODE_LIST Default=YES MaxTime=INFINITE State=UP
EOF
)
if [ ! -f "$SLURM_CONF" ] || [ "$(cat "$SLURM_CONF")" != "$NEW_CONF" ]; then
  printf '%s\n' "$NEW_CONF" > "$SLURM_CONF"
  CONF_CHANGED=1
else
  CONF_CHANGED=0
fi
if [ "$WITH_ACCOUNTING" = 1 ]; then
  # slurmdbd has no -f: it reads slurmdbd.conf from the directory of $SLURM_CONF; mode 600
  cat > "$DIR/etc/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
DebugLevel=info
LogFile=$LOG/slurmdbd.log
PidFile=$RUN/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$MYSQL_PORT
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
  chmod 600 "$DIR/etc/slurmdbd.conf"
fi
if [ "$NODES" != 1 ]; then
  # PMIx's per-step client folders: DIR/pmix, which each node mounts from a folder of its own
  printf 'PMIxCliTmpDirBase=%s\n' "$DIR/pmix" > "$DIR/etc/mpi.conf"
else
  rm -f "$DIR/etc/mpi.conf"
fi
printf 'export SLURM_CONF=%q\n' "$SLURM_CONF" > "$DIR/env.sh"
if [ "$LINK_ETC" = 1 ]; then
  mkdir -p /etc/slurm
  if [ -L /etc/slurm/slurm.conf ] || [ ! -e /etc/slurm/slurm.conf ]; then
    ln -sfn "$SLURM_CONF" /etc/slurm/slurm.conf
  else
    log "WARNING: /etc/slurm/slurm.conf is a regular file; left alone — export SLURM_CONF=$SLURM_CONF"
  fi
fi

# ---------------------------------------------------------------- 3. daemons
if [ "$NODES" != 1 ]; then
  [ "$(id -u)" = 0 ] || { log "HPCNFT_SLURM_NODES=$NODES needs root (ip netns, veth, /etc/hosts)"; exit 1; }
  add_net
fi
# munge (default socket /run/munge/munge.socket.2, which Slurm's auth/munge uses)
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  [ -s /etc/munge/munge.key ] || { mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null \
      || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none; }
  chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge; chmod 755 /run/munge
  runuser -u munge -- /usr/sbin/munged
  touch "$RUN/munged.started-by-us"
  for _ in $(seq 1 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
  munge -n | unmunge >/dev/null || { log "munged failed"; exit 1; }
  log "munged started (pid $(tr -dc '0-9' < /run/munge/munged.pid 2>/dev/null))"
fi

# refuse_port PORT NAME: a port taken by something that is not ours (another cluster?) is fatal
refuse_port() {
  if port_in_use "$1"; then
    log "port $1 for $2 is already in use by a process this script did not start (another Slurm/DB"
    log "instance, e.g. one started with a different DIR?). Stop it, or set the SLURM_*_PORT knobs."
    exit 1
  fi
}

if [ "$WITH_ACCOUNTING" = 1 ]; then
  MYSQL=(mariadb --no-defaults --socket="$RUN/mysqld.sock" -u root)
  if ! pid_alive "$RUN/mariadbd.pid" mariadbd; then
    refuse_port "$MYSQL_PORT" mariadbd
    if [ ! -d "$DIR/mysql/mysql" ]; then
      mariadb-install-db --no-defaults --user=root --datadir="$DIR/mysql" \
        --auth-root-authentication-method=socket --skip-test-db >"$LOG/mariadb-install.log" 2>&1 \
        || { tail -20 "$LOG/mariadb-install.log" >&2; exit 1; }
    fi
    # setsid + nohup: detach from the caller's session so it survives the calling shell
    setsid nohup /usr/sbin/mariadbd --no-defaults --user=root --datadir="$DIR/mysql" \
      --socket="$RUN/mysqld.sock" --port="$MYSQL_PORT" --bind-address=127.0.0.1 \
      --pid-file="$RUN/mariadbd.pid" --log-error="$LOG/mariadbd.log" \
      --innodb-buffer-pool-size=128M --innodb-lock-wait-timeout=900 --max-allowed-packet=64M \
      </dev/null >/dev/null 2>&1 &
    for _ in $(seq 1 150); do "${MYSQL[@]}" -e 'select 1' >/dev/null 2>&1 && break; sleep 0.2; done
    "${MYSQL[@]}" -e 'select 1' >/dev/null || { tail -20 "$LOG/mariadbd.log" >&2; exit 1; }
    log "mariadbd started (pid $(wait_pidfile "$RUN/mariadbd.pid" mariadbd))"
  fi
  "${MYSQL[@]}" -e "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1'; FLUSH PRIVILEGES;"
  if ! pid_alive "$RUN/slurmdbd.pid" slurmdbd; then
    refuse_port "$DBD_PORT" slurmdbd
    /usr/sbin/slurmdbd
    wait_pidfile "$RUN/slurmdbd.pid" slurmdbd >/dev/null || { tail -20 "$LOG/slurmdbd.log" >&2; exit 1; }
    for _ in $(seq 1 150); do sacctmgr -n show cluster >/dev/null 2>&1 && break; sleep 0.2; done
    sacctmgr -n show cluster >/dev/null || { tail -20 "$LOG/slurmdbd.log" >&2; exit 1; }
    log "slurmdbd started (pid $(tr -dc '0-9' < "$RUN/slurmdbd.pid"))"
  fi
  if ! sacctmgr -n -P show cluster format=cluster | grep -qx "$CLUSTER"; then
    sacctmgr -i add cluster "$CLUSTER" >/dev/null
  fi
fi

# no slurmctld and no slurmd alive: whatever jobs DIR/state recovers lost their processes
STALE_JOBS=0
if ! pid_alive "$RUN/slurmctld.pid" slurmctld && [ -z "$(for f in $(slurmd_pidfiles); do pid_alive "${f#*:}" slurmd && echo alive; done)" ]; then
  STALE_JOBS=1
fi
if pid_alive "$RUN/slurmctld.pid" slurmctld; then
  [ "$CONF_CHANGED" = 1 ] && { log "slurm.conf changed: scontrol reconfigure (AuthInfo changes need 'restart')"; scontrol reconfigure || true; }
else
  refuse_port "$CTLD_PORT" slurmctld
  /usr/sbin/slurmctld -f "$SLURM_CONF"
  P=$(wait_pidfile "$RUN/slurmctld.pid" slurmctld) || { tail -20 "$LOG/slurmctld.log" >&2; exit 1; }
  log "slurmctld started (pid $P)"
fi
if [ "$NODES" = 1 ]; then
  if ! pid_alive "$RUN/slurmd.pid" slurmd; then
    refuse_port "$SLURMD_PORT" slurmd
    # -N localhost: the node name differs from `hostname`
    /usr/sbin/slurmd -f "$SLURM_CONF" -N localhost
    P=$(wait_pidfile "$RUN/slurmd.pid" slurmd) || { tail -20 "$LOG/slurmd.log" >&2; exit 1; }
    log "slurmd started (pid $P)"
  fi
else
  for k in $(seq 1 "$NODES"); do
    name=$(node_name "$k")
    if ! pid_alive "$RUN/slurmd-$name.pid" slurmd; then
      # in the node's network namespace, under a UTS namespace that holds its hostname: the
      # jobs it starts inherit both, so `hostname` on a node says nodeK, as on a real cluster.
      # nsenter, not `ip netns exec`, which mounts a sysfs of its own and so hides
      # /sys/fs/cgroup, without which slurmd does not start
      # A mount namespace too, where DIR/pmix is the node's own folder: PMIx (srun --mpi=pmix)
      # makes per-step folders named by job and step only, which would collide on the shared /tmp.
      mkdir -p "$DIR/nodes/$name/pmix" "$DIR/pmix"
      nsenter --net="/run/netns/$(node_ns "$k")" unshare --uts --mount \
        sh -c 'hostname "$1" && mount --bind "$3" "$4" && exec /usr/sbin/slurmd -f "$2" -N "$1"' \
        sh "$name" "$SLURM_CONF" "$DIR/nodes/$name/pmix" "$DIR/pmix"
      P=$(wait_pidfile "$RUN/slurmd-$name.pid" slurmd) || { tail -20 "$LOG/slurmd-$name.log" >&2; exit 1; }
      log "slurmd $name started (pid $P)"
    fi
  done
fi

# ---------------------------------------------------------------- 4. wait for every node idle
ready=0
states=""
for _ in $(seq 1 300); do
  states=$(sinfo -h -N -n "$NODE_LIST" -o '%N=%T' 2>/dev/null | sort -u | tr '\n' ' ' || true)
  ready=$(printf '%s\n' $states | grep -cE '=(idle|mixed|allocated|completing)$' || true)
  [ "$ready" -ge "$NODES" ] && break
  case "$states" in
    *=down*|*=drain*) scontrol update NodeName="$NODE_LIST" State=RESUME >/dev/null 2>&1 || true ;;
  esac
  sleep 0.2
done
if [ "$ready" -lt "$NODES" ]; then
  log "nodes not ready ($states)"; tail -20 "$LOG/slurmctld.log" "$LOG"/slurmd*.log >&2; exit 1
fi
if [ "$STALE_JOBS" = 1 ] && [ "${CANCEL_STALE_JOBS:-1}" = 1 ]; then
  cancel_jobs "recovered from a cluster that was not running"
fi
log "cluster ready: $states; total $(elapsed "$T_START")s; source $DIR/env.sh"
sinfo
