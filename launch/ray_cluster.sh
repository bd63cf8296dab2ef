#!/usr/bin/env bash
# Start a Ray cluster over ssh from a host list, wait for every node, then optionally run a command on the
# head (usually `beamrl train RECIPE`). The first host is the head. See docs/launch.md.
#
#   launch/ray_cluster.sh [--dry-run] [--port 6379] [--timeout 600] [--repo DIR] HOSTFILE [COMMAND ...]
#   launch/ray_cluster.sh --stop HOSTFILE
#
# HOSTFILE: one host per line; blank lines and '#' comments are ignored.
# --repo: the beamrl checkout on every host (same path everywhere; default: this checkout's path).
# --dry-run: print the commands instead of running them (one per line).
# Ray's token authentication is on: a fresh token for this cluster is installed on every host first
# (~/.ray/beamrl_auth_token, mode 600, sent over ssh's stdin: never on a command line).
set -euo pipefail

usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }

DRY_RUN=0 STOP=0 PORT=6379 TIMEOUT=600
REPO=$(cd "$(dirname "$0")/.." && pwd)
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY_RUN=1; shift ;;
    --stop) STOP=1; shift ;;
    --port) PORT=${2:?--port needs a value}; shift 2 ;;
    --timeout) TIMEOUT=${2:?--timeout needs a value}; shift 2 ;;
    --repo) REPO=${2:?--repo needs a value}; shift 2 ;;
    -h|--help) usage 0 ;;
    -*) echo "ray_cluster.sh: unknown option $1" >&2; usage ;;
    *) break ;;
  esac
done
[[ $# -ge 1 ]] || usage
HOSTFILE=$1; shift
[[ -f "$HOSTFILE" ]] || { echo "ray_cluster.sh: host file not found: $HOSTFILE" >&2; exit 2; }
mapfile -t HOSTS < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$HOSTFILE" | grep -v '^$' || true)
[[ ${#HOSTS[@]} -ge 1 ]] || { echo "ray_cluster.sh: no hosts in $HOSTFILE" >&2; exit 2; }
HEAD=${HOSTS[0]}
VENV_BIN="$REPO/.venv/bin"
# Every remote command: enter the checkout, load the cluster env (launch/env.sh), use the venv's tools, and
# require Ray's token (RAY_AUTH_MODE=token: a missing token is an error, not an open cluster).
PRELUDE="cd $(printf '%q' "$REPO") && source launch/env.sh && export PATH=$(printf '%q' "$VENV_BIN"):\$PATH"
PRELUDE+=" && export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=\$HOME/.ray/beamrl_auth_token"
INSTALL_TOKEN='umask 077 && mkdir -p ~/.ray && cat > ~/.ray/beamrl_auth_token'

run_on() {  # run_on HOST COMMAND-STRING
  local host=$1 cmd=$2
  if [[ $DRY_RUN == 1 ]]; then
    echo "ssh $host '$PRELUDE && $cmd'"  # readable, not re-quoted: for eyes and snapshot tests
  else
    ssh -o BatchMode=yes "$host" "$PRELUDE && $cmd"
  fi
}

if [[ $STOP == 1 ]]; then
  for host in "${HOSTS[@]}"; do run_on "$host" "ray stop --force"; done
  exit 0
fi

echo "ray_cluster.sh: head $HEAD, ${#HOSTS[@]} node(s), port $PORT" >&2
TOKEN=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
for host in "${HOSTS[@]}"; do
  if [[ $DRY_RUN == 1 ]]; then
    echo "ssh $host '$INSTALL_TOKEN' < (this cluster's token)"
  else
    printf '%s' "$TOKEN" | ssh -o BatchMode=yes "$host" "$INSTALL_TOKEN"
  fi
done
run_on "$HEAD" "ray start --head --port=$PORT --disable-usage-stats"
for host in "${HOSTS[@]:1}"; do
  run_on "$host" "ray start --address=$HEAD:$PORT"
done
run_on "$HEAD" "python launch/wait_for_ray.py --address $HEAD:$PORT --nodes ${#HOSTS[@]} --timeout $TIMEOUT"
if [[ $# -gt 0 ]]; then
  cmd=$(printf '%q ' "$@")
  run_on "$HEAD" "${cmd% }"
fi
