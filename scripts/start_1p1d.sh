#!/usr/bin/env bash
# Start a 1P1D PD cluster (PD master + one prefill node + one decode node) on this machine.
#
# Usage: scripts/start_1p1d.sh [options] [-- PREFILL_NODE_FLAGS...]
#
# Without --model_dir the tiny demo model is generated offline (python -m lightllm.utils.demo_model)
# into $LIGHTLLM_DEMO_MODEL_DIR (default /tmp/lightllm_demo_tiny) on first use, so the script runs
# on a CPU-only machine with nothing downloaded. On GPUs give each node its devices with
# --prefill_devices / --decode_devices (CUDA_VISIBLE_DEVICES of that node only).
# The script waits until the master's /health answers 200 (both nodes registered), prints the
# URLs, and stops all three processes on Ctrl-C or SIGTERM. Run with --help for every option.

# Not when sourced (as its tests do, for its functions): set -u would stay on in the caller's shell.
[[ "${BASH_SOURCE[0]}" != "$0" ]] || set -u

HOST="${PD_HOST:-127.0.0.1}"
MASTER_PORT="${PD_MASTER_PORT:-1212}"
PREFILL_PORT="${PD_PREFILL_PORT:-8100}"
DECODE_PORT="${PD_DECODE_PORT:-8200}"
PREFILL_DEVICES="${PD_PREFILL_DEVICES:-}"
DECODE_DEVICES="${PD_DECODE_DEVICES:-}"
MODEL_DIR="${PD_MODEL_DIR:-}"
DEMO_DIR="${LIGHTLLM_DEMO_MODEL_DIR:-/tmp/lightllm_demo_tiny}"
LOG_DIR="${PD_LOG_DIR:-}"
START_TIMEOUT="${PD_START_TIMEOUT:-300}"
STOP_TIMEOUT="${PD_STOP_TIMEOUT:-60}"
PYTHON="${PYTHON:-python}"
NODE_ARGS=""
DECODE_ARGS=""
MASTER_ARGS=""
PREFILL_EXTRA=()

usage() {
    cat <<EOF
Usage: $0 [options] [-- PREFILL_NODE_FLAGS...]

Starts a PD master, a prefill node and a decode node of lightllm.server.api_server on one machine.
Flags after -- go to the prefill node only (e.g. -- --prefill_queue_strategy hrrn).

Options (environment variable in brackets):
  --model_dir DIR        checkpoint served by all three [PD_MODEL_DIR]; default: the tiny demo model,
                         generated into \$LIGHTLLM_DEMO_MODEL_DIR ($DEMO_DIR) if missing
  --host HOST            listen address of all three [PD_HOST] ($HOST); IPv6 bare or in brackets (::1, [::1]);
                         with a wildcard (0.0.0.0, ::) the nodes reach the master on 127.0.0.1 or ::1
  --master_port N        the master's HTTP port, the public API [PD_MASTER_PORT] ($MASTER_PORT)
  --prefill_port N       the prefill node's HTTP port [PD_PREFILL_PORT] ($PREFILL_PORT)
  --decode_port N        the decode node's HTTP port [PD_DECODE_PORT] ($DECODE_PORT)
  --prefill_devices IDS  CUDA_VISIBLE_DEVICES of the prefill node, e.g. 0 or 0,1 [PD_PREFILL_DEVICES]
  --decode_devices IDS   CUDA_VISIBLE_DEVICES of the decode node, e.g. 1 or 2,3 [PD_DECODE_DEVICES]
  --node_args "FLAGS"    flags for both nodes, one shell-quoted string (e.g. "--tp 2 --max_total_token_num 65536")
  --decode_args "FLAGS"  flags for the decode node only (e.g. "--pd_max_segment_tokens 256")
  --master_args "FLAGS"  flags for the master only (e.g. "--pd_heartbeat_interval 1")
  --log_dir DIR          where master.log, prefill.log and decode.log go [PD_LOG_DIR]; default: a new temp dir
  --start_timeout S      seconds to wait for the master's /health to answer 200 [PD_START_TIMEOUT] ($START_TIMEOUT)
  --stop_timeout S       seconds each process gets to exit after SIGTERM before it is killed [PD_STOP_TIMEOUT] ($STOP_TIMEOUT)
  -h, --help             this text

The environment reaches all three processes: set LIGHTLLM_PD_CLUSTER_KEY to protect the cluster's
own /pd/ endpoints, and with it LIGHTLLM_API_KEY for client keys (a PD process with client keys
but no cluster key refuses to start).
EOF
}

die() {
    echo "start_1p1d.sh: $*" >&2
    exit 2
}

need_value() {
    [ "$#" -ge 2 ] && [ -n "$2" ] || die "$1 needs a value (see --help)"
}

# Print the loopback address a client on this machine reaches a server listening on host $1 at
# (127.0.0.1 or ::1), or nothing when $1 is no wildcard. Wildcards as lightllm/utils/wildcard_hosts.py
# reads them (ipaddress's is_unspecified, as Python 3.11 parses an address): "", 0.0.0.0, and an
# IPv6 address of zeros in any spelling (::, ::0, 0::, 0:0:0:0:0:0:0:0, ::0.0.0.0 with its last two
# groups written as IPv4, 0:0:0:0:0:0:0.0.0.0), with or without a zone (%eth0: one or more
# characters, no % or /), bare or in URL brackets ([::]). Read in bash: asking $PYTHON ran it
# before any server, and a $PYTHON that never returns then hung the script past --start_timeout
# (its own test's stand-in does exactly that).
wildcard_loopback() {
    local host="$1" addr zone group count=0
    local -a groups
    # "" is one ("--host ''" listens everywhere), "[]" none: the brackets are taken off after.
    [[ -n "$host" ]] || { echo 127.0.0.1; return 0; }
    [[ "$host" == \[*\] ]] && host="${host:1:${#host}-2}"
    [[ "$host" != 0.0.0.0 ]] || { echo 127.0.0.1; return 0; }
    addr="${host%%\%*}"
    if [[ "$addr" != "$host" ]]; then
        zone="${host#*%}"
        [[ -n "$zone" && "$zone" != *[%/]* ]] || return 0
    fi
    # A dotted IPv4 tail is the last two groups: only 0.0.0.0 (no leading zeros) is two of zeros.
    [[ "$addr" == *:0.0.0.0 ]] && addr="${addr%0.0.0.0}0:0"
    [[ "$addr" =~ ^[0:]+$ ]] || return 0
    if [[ "$addr" == *::* ]]; then
        # One "::" (standing for one group or more); a single ":" at either end is no address.
        [[ "$addr" != *::*::* && "$addr" != *:::* && "$addr" != :[!:]* && "$addr" != *[!:]: ]] || return 0
        IFS=: read -r -a groups <<< "$addr"
        for group in "${groups[@]}"; do
            [ -z "$group" ] && continue
            [ "${#group}" -le 4 ] || return 0
            count=$((count + 1))
        done
        [ "$count" -le 7 ] || return 0
    else
        [[ "$addr" =~ ^0{1,4}(:0{1,4}){7}$ ]] || return 0
    fi
    echo ::1
}

# Sourced (as its tests do, to call wildcard_loopback): define the functions, start nothing.
[[ "${BASH_SOURCE[0]}" == "$0" ]] || return 0

while [ "$#" -gt 0 ]; do
    case "$1" in
        --model_dir) need_value "$@"; MODEL_DIR="$2"; shift 2 ;;
        --host) need_value "$@"; HOST="$2"; shift 2 ;;
        --master_port) need_value "$@"; MASTER_PORT="$2"; shift 2 ;;
        --prefill_port) need_value "$@"; PREFILL_PORT="$2"; shift 2 ;;
        --decode_port) need_value "$@"; DECODE_PORT="$2"; shift 2 ;;
        --prefill_devices) need_value "$@"; PREFILL_DEVICES="$2"; shift 2 ;;
        --decode_devices) need_value "$@"; DECODE_DEVICES="$2"; shift 2 ;;
        --node_args) [ "$#" -ge 2 ] || die "--node_args needs a value"; NODE_ARGS="$2"; shift 2 ;;
        --decode_args) [ "$#" -ge 2 ] || die "--decode_args needs a value"; DECODE_ARGS="$2"; shift 2 ;;
        --master_args) [ "$#" -ge 2 ] || die "--master_args needs a value"; MASTER_ARGS="$2"; shift 2 ;;
        --log_dir) need_value "$@"; LOG_DIR="$2"; shift 2 ;;
        --start_timeout) need_value "$@"; START_TIMEOUT="$2"; shift 2 ;;
        --stop_timeout) need_value "$@"; STOP_TIMEOUT="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        --) shift; PREFILL_EXTRA=("$@"); break ;;
        *) die "unknown option $1 (flags for the prefill node go after --; see --help)" ;;
    esac
done

for pair in "master_port:$MASTER_PORT" "prefill_port:$PREFILL_PORT" "decode_port:$DECODE_PORT"; do
    name="${pair%%:*}"; value="${pair#*:}"
    [[ "$value" =~ ^[0-9]+$ ]] && [ "$value" -ge 1 ] && [ "$value" -le 65535 ] \
        || die "--$name must be a port in 1..65535, got '$value'"
done
[ "$MASTER_PORT" != "$PREFILL_PORT" ] && [ "$MASTER_PORT" != "$DECODE_PORT" ] && [ "$PREFILL_PORT" != "$DECODE_PORT" ] \
    || die "the master, prefill and decode ports must differ, got $MASTER_PORT, $PREFILL_PORT and $DECODE_PORT"
for pair in "start_timeout:$START_TIMEOUT" "stop_timeout:$STOP_TIMEOUT"; do
    name="${pair%%:*}"; value="${pair#*:}"
    [[ "$value" =~ ^[0-9]+$ ]] && [ "$value" -ge 1 ] || die "--$name must be a whole number of seconds >= 1, got '$value'"
done

# An IPv6 --host may come bare (::1) or in URL brackets ([::1]); the servers are given it bare and
# every URL below brackets it (http://[::1]:8100): "http://::1:8100" is no URL curl can parse.
case "$HOST" in
    \[*\]) HOST="${HOST:1:${#HOST}-2}"
           [[ "$HOST" == *:* ]] || die "--host [$HOST]: only an IPv6 address goes in brackets" ;;
    *\[*|*\]*) die "--host $HOST: unbalanced brackets" ;;
esac
# One pair is stripped above; "[::1]]" or "[[::1]" would leave one the nodes refuse later, less clearly.
[[ "$HOST" != *[\[\]]* ]] || die "--host: only one IPv6 address in one pair of brackets, got '$HOST'"
# The address the nodes and this script reach the master on: a wildcard is where a server listens,
# not an address to connect to, so they use the loopback of the same family (wildcard_loopback).
REACH_HOST="$(wildcard_loopback "$HOST")"
[ -n "$REACH_HOST" ] || REACH_HOST="$HOST"
if [[ "$REACH_HOST" == *:* ]]; then REACH_URL_HOST="[$REACH_HOST]"; else REACH_URL_HOST="$REACH_HOST"; fi

# The node flags are shell-quoted strings; split them the way a shell would (no expansion).
read_flags() {
    local -n out="$1"
    out=()
    [ -n "$2" ] || return 0
    "$PYTHON" -c 'import shlex, sys; shlex.split(sys.argv[1])' "$2" 2>/dev/null \
        || die "$3 is not a valid shell-quoted string: $2"
    mapfile -d '' -t out < <("$PYTHON" -c \
        'import shlex, sys; sys.stdout.write("".join(a + "\0" for a in shlex.split(sys.argv[1])))' "$2")
}
read_flags NODE_FLAGS "$NODE_ARGS" --node_args
read_flags DECODE_FLAGS "$DECODE_ARGS" --decode_args
read_flags MASTER_FLAGS "$MASTER_ARGS" --master_args

# The script sets these itself; a second value would make the launch ambiguous.
for flag in "${NODE_FLAGS[@]}" "${DECODE_FLAGS[@]}" "${MASTER_FLAGS[@]}" "${PREFILL_EXTRA[@]}"; do
    case "${flag%%=*}" in
        --run_mode|--model_dir|--host|--port|--pd_master_ip|--pd_master_port)
            die "${flag%%=*} is set by the script; use its own options instead (see --help)" ;;
    esac
done

command -v curl >/dev/null || die "curl is needed to poll the master's /health; install it first"
command -v setsid >/dev/null || die "setsid (util-linux) is needed to start the processes; install it first"

# Bad directories are refused before anything is created: a given --model_dir first, then
# --log_dir, and only then is the demo model generated.
[ -z "$MODEL_DIR" ] || [ -d "$MODEL_DIR" ] || die "--model_dir $MODEL_DIR is not a directory"
if [ -z "$LOG_DIR" ]; then
    LOG_DIR="$(mktemp -d /tmp/lightllm_1p1d.XXXXXX)" || die "could not create a log directory"
fi
mkdir -p "$LOG_DIR" || die "could not create --log_dir $LOG_DIR"

if [ -z "$MODEL_DIR" ]; then
    MODEL_DIR="$DEMO_DIR"
    if [ ! -f "$MODEL_DIR/config.json" ]; then
        echo "generating the tiny demo model into $MODEL_DIR (offline, about a second)"
        "$PYTHON" -m lightllm.utils.demo_model --out "$MODEL_DIR" --size tiny || die "could not generate the demo model"
    fi
fi

MASTER_PID=""
PREFILL_PID=""
DECODE_PID=""
STOPPING=0

# Start one process in a session of its own (so a Ctrl-C reaches only this script, which stops
# the cluster in order) with its output in LOG_DIR/NAME.log; stores its pid in variable VAR.
start_process() {
    local var="$1" name="$2" devices="$3"
    shift 3
    if [ -n "$devices" ]; then
        CUDA_VISIBLE_DEVICES="$devices" PYTHONUNBUFFERED=1 setsid "$@" >"$LOG_DIR/$name.log" 2>&1 </dev/null &
    else
        PYTHONUNBUFFERED=1 setsid "$@" >"$LOG_DIR/$name.log" 2>&1 </dev/null &
    fi
    printf -v "$var" '%s' "$!"
}

alive() {
    [ -n "$1" ] && kill -0 "$1" 2>/dev/null
}

# Milliseconds since the epoch. Deadlines use it, not $SECONDS: that one counts whole seconds of
# the clock, so "SECONDS + 2" came due after as little as 1.0 s (--start_timeout 2 gave up after 1.86 s).
now_ms() {
    local t="${EPOCHREALTIME:-}"
    if [ -n "$t" ]; then
        t="${t//[.,]/}"  # microseconds; the separator follows the locale
        echo $((10#$t / 1000))
    else
        echo $(($(date +%s%N) / 1000000))
    fi
}

stop_all() {
    [ "$STOPPING" = 1 ] && return
    STOPPING=1
    trap '' INT TERM
    echo "stopping the cluster (SIGTERM; up to ${STOP_TIMEOUT}s each before SIGKILL)"
    local pid
    # All three at once (nodes first); each then gets up to STOP_TIMEOUT seconds of the same deadline.
    for pid in "$DECODE_PID" "$PREFILL_PID" "$MASTER_PID"; do
        alive "$pid" && kill -TERM "$pid" 2>/dev/null
    done
    local deadline=$(($(now_ms) + STOP_TIMEOUT * 1000))
    for pid in "$DECODE_PID" "$PREFILL_PID" "$MASTER_PID"; do
        while alive "$pid" && [ "$(now_ms)" -lt "$deadline" ]; do
            sleep 0.2
        done
        if alive "$pid"; then
            echo "process $pid did not exit in time; killing its process group" >&3
            kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null
        fi
        [ -n "$pid" ] && wait "$pid" 2>/dev/null
    done
    echo "stopped; logs in $LOG_DIR"
}

on_signal() {
    stop_all
    exit 0
}
# The script's own stderr, for its messages: the serving loop below discards fd 2 (see there),
# and stop_all may run inside it.
exec 3>&2
trap on_signal INT TERM
trap stop_all EXIT

http_status() {
    # -g: the brackets of an IPv6 URL are the address's, not curl's URL globbing.
    curl -g -s -o /dev/null -w '%{http_code}' --noproxy '*' --max-time 2 "$1" 2>/dev/null || echo 000
}

show_tail() {
    echo "---- last lines of $LOG_DIR/$1.log ----" >&2
    tail -n 30 "$LOG_DIR/$1.log" >&2
}

SERVER=("$PYTHON" -m lightllm.server.api_server --model_dir "$MODEL_DIR" --host "$HOST")
MASTER_URL="http://$REACH_URL_HOST:$MASTER_PORT"

start_process MASTER_PID master "" "${SERVER[@]}" --run_mode pd_master --port "$MASTER_PORT" "${MASTER_FLAGS[@]}"
start_process PREFILL_PID prefill "$PREFILL_DEVICES" "${SERVER[@]}" --run_mode prefill --port "$PREFILL_PORT" \
    --pd_master_ip "$REACH_HOST" --pd_master_port "$MASTER_PORT" "${NODE_FLAGS[@]}" "${PREFILL_EXTRA[@]}"
start_process DECODE_PID decode "$DECODE_DEVICES" "${SERVER[@]}" --run_mode decode --port "$DECODE_PORT" \
    --pd_master_ip "$REACH_HOST" --pd_master_port "$MASTER_PORT" "${NODE_FLAGS[@]}" "${DECODE_FLAGS[@]}"
echo "started master (pid $MASTER_PID), prefill node (pid $PREFILL_PID), decode node (pid $DECODE_PID); logs in $LOG_DIR"
echo "waiting up to ${START_TIMEOUT}s for $MASTER_URL/health to answer 200 (both nodes registered)"

deadline=$(($(now_ms) + START_TIMEOUT * 1000))
while :; do
    for role in master prefill decode; do
        pid_var="${role^^}_PID"
        if ! alive "${!pid_var}"; then
            echo "the $role process exited during start-up" >&2
            show_tail "$role"
            exit 1
        fi
    done
    [ "$(http_status "$MASTER_URL/health")" = 200 ] && break
    if [ "$(now_ms)" -ge "$deadline" ]; then
        echo "the master's /health did not answer 200 within ${START_TIMEOUT}s" >&2
        show_tail master; show_tail prefill; show_tail decode
        exit 1
    fi
    sleep 0.5
done

cat <<EOF
1P1D cluster ready (model $MODEL_DIR)
  public API (PD master): $MASTER_URL   e.g. curl $MASTER_URL/generate -H 'Content-Type: application/json' -d '{"inputs": "Hello", "parameters": {"max_new_tokens": 16}}'
  OpenAI API:             $MASTER_URL/v1
  readiness / nodes:      $MASTER_URL/health   $MASTER_URL/pd/nodes
  metrics:                $MASTER_URL/metrics   http://$REACH_URL_HOST:$PREFILL_PORT/metrics   http://$REACH_URL_HOST:$DECODE_PORT/metrics
  prefill node:           http://$REACH_URL_HOST:$PREFILL_PORT   (log $LOG_DIR/prefill.log)
  decode node:            http://$REACH_URL_HOST:$DECODE_PORT   (log $LOG_DIR/decode.log)
Press Ctrl-C to stop all three.
EOF

# Serve until the master exits or a signal arrives; a node that exits is reported once (the
# master drops it and answers 503 until a node of that role registers again).  The loop's own
# stderr is discarded: bash reports a background job killed by a signal there ("line N: PID
# Killed ..."), beside the warning below, which goes to the script's stderr (fd 3).
reported_prefill=0
reported_decode=0
{
    while alive "$MASTER_PID"; do
        if [ "$reported_prefill" = 0 ] && ! alive "$PREFILL_PID"; then
            echo "warning: the prefill node exited (log $LOG_DIR/prefill.log)" >&3; reported_prefill=1
        fi
        if [ "$reported_decode" = 0 ] && ! alive "$DECODE_PID"; then
            echo "warning: the decode node exited (log $LOG_DIR/decode.log)" >&3; reported_decode=1
        fi
        sleep 1
    done
} 2>/dev/null
echo "the master exited (log $LOG_DIR/master.log)" >&2
show_tail master
exit 1
