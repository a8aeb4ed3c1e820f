#!/usr/bin/env bash
# A single-node Ray head on 127.0.0.1 for trying `ray job submit` locally.
#   scripts/local_cluster.sh start   # head + dashboard/job server on http://127.0.0.1:8265
#   scripts/local_cluster.sh stop    # stops only the head this script started
# Env: RAY_PORT (6379), DASHBOARD_PORT (8265), AGENT_PORT (52365), CLIENT_PORT (10001),
# NUM_CPUS (4), CLUSTER_DIR (/tmp/rl-async-ray). Change the ports when another Ray cluster
# runs on this machine: a second head on Ray's fixed default agent port 52365 comes up
# without a job agent and `ray job submit` answers "No available agent to submit job".
#
# `stop` does not call `ray stop`: that kills every Ray process of this user on the machine
# (matched by name), other clusters included. `start` runs `ray start` in a new session
# (setsid); every daemon and worker of this head stays in that session, so `stop` signals
# exactly the processes whose session id is the one recorded at start.
set -euo pipefail
cd "$(dirname "$0")/.."
RAY=${RAY:-.venv/bin/ray}
DIR=${CLUSTER_DIR:-/tmp/rl-async-ray}  # short: Ray's unix socket paths must fit in 107 bytes
SID_FILE="$DIR/session_id"
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0  # bind to 127.0.0.1 only
# The job's `rl-async` entrypoint is found on the PATH the head inherits.
export PATH="$PWD/.venv/bin:$PATH"

members() { ps -eo pid=,sid= | awk -v s="$1" '$2 == s { print $1 }'; }

case "${1:-}" in
start)
  if [ -f "$SID_FILE" ] && [ -n "$(members "$(cat "$SID_FILE")")" ]; then
    echo "a head started by this script is already running (session $(cat "$SID_FILE"))" >&2
    exit 1
  fi
  mkdir -p "$DIR"
  setsid "$RAY" start --head --node-ip-address=127.0.0.1 --port="${RAY_PORT:-6379}" \
    --dashboard-host=127.0.0.1 --dashboard-port="${DASHBOARD_PORT:-8265}" \
    --include-dashboard=true --num-cpus="${NUM_CPUS:-4}" --temp-dir="$DIR" \
    --dashboard-agent-listen-port="${AGENT_PORT:-52365}" \
    --ray-client-server-port="${CLIENT_PORT:-10001}" \
    --disable-usage-stats > "$DIR/start.log" 2>&1 &
  pid=$!
  wait "$pid" || { cat "$DIR/start.log" >&2; exit 1; }
  echo "$pid" > "$SID_FILE"   # setsid execs ray start: its pid is the session id
  grep -i "token authentication" "$DIR/start.log" || true
  echo "Ray head up. Dashboard and job server: http://127.0.0.1:${DASHBOARD_PORT:-8265}"
  ;;
stop)
  [ -f "$SID_FILE" ] || { echo "no head recorded in $SID_FILE" >&2; exit 1; }
  sid=$(cat "$SID_FILE")
  pids=$(members "$sid")
  [ -n "$pids" ] && kill -TERM $pids 2>/dev/null || true
  for _ in $(seq 20); do [ -z "$(members "$sid")" ] && break; sleep 0.5; done
  pids=$(members "$sid")
  [ -n "$pids" ] && kill -KILL $pids 2>/dev/null || true
  for _ in $(seq 20); do [ -z "$(members "$sid")" ] && break; sleep 0.5; done
  rm -f "$SID_FILE"
  echo "stopped the Ray head of session $sid"
  ;;
*)
  echo "usage: $0 start|stop" >&2
  exit 2
  ;;
esac
