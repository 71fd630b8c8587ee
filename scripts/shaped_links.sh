#!/usr/bin/env bash
# Runs an occult model command on N MPI ranks over real slow links: one network namespace per
# rank, each joined to a hub bridge by a veth pair whose two ends are shaped with tc HTB to RATE
# (the rank's send side and its receive side). Latency is not added (netem is not available on
# these machines): the generated link profile models the veth's own ~0.1 ms.
#
# With -g G the ranks form nodes of G (rank r in node r / G, as mpirun numbers them): traffic
# between two ranks of one node is shaped to INTRA (-i, default 10gbit) instead, by a second HTB
# class that a u32 filter on the peer's address picks, so each rank has a fast link inside its
# node and a slow one (RATE) to other nodes, as a GPU has NVLink and its own NIC.
#
#   sudo scripts/shaped_links.sh [-n RANKS] [-g G] [-r RATE] [-i INTRA] [-f FLOPS] [-o DIR] -- OCCULT_ARGS...
#   sudo scripts/shaped_links.sh [-n RANKS] [-g G] [-r RATE] [-i INTRA] -e -- PROGRAM ARGS...
#
# With -e the command after -- is another engine's program, run as it is on every rank under
# the same links (no occult arguments added), with SHAPED_MASTER_ADDR (rank 0's address, for
# torch.distributed's rendezvous) and SHAPED_IFNAME (the rank's shaped interface) in its
# environment: scripts/bench_deepspeed_moe.py runs DeepSpeed-MoE's ranks this way.
#
# Example: a synthetic OLMoE-shaped model, 4 ranks at 80 Mbit/s (add -g 2 for 2 nodes of 2):
#   target/release/occult model synth --family olmoe --hidden 256 --layers 4 --experts 64 \
#       --top-k 8 --intermediate 128 -o /tmp/olmoe-256
#   sudo scripts/shaped_links.sh -n 4 -r 80mbit -- bench model --model /tmp/olmoe-256 \
#       --prompt-len 256 --decode-tokens 4
#
# The script appends `--backend mpi --devices RANKS` (so do not pass them), and for `bench
# model` and `bench train` also `--link` (a profile of this emulated machine: RATE per link,
# f32 rows, FLOPS of expert compute per rank) and `--json DIR/shaped.json` (`shaped-train.json`
# for `bench train`); they then print each mode's measured time ratio to standard dispatch
# beside the projected one. OCCULT_BIN names the binary (default: target/release/occult).
# Everything it creates (namespaces, the bridge, temporary files) is removed on exit, whether
# the run succeeded or not.
#
# Needs: root, iproute2 (ip, tc), OpenMPI, and occult built with MPI
# (`cargo build --release --features occult-eval/mpi`).
set -euo pipefail

RANKS=4
RATE=80mbit
FLOPS=2e10
OUT=.
PER_NODE=1
INTRA=10gbit
EXEC=0
usage() { sed -n '2,35p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
while getopts "n:g:r:i:f:o:eh" opt; do
  case $opt in
    n) RANKS=$OPTARG ;;
    g) PER_NODE=$OPTARG ;;
    r) RATE=$OPTARG ;;
    i) INTRA=$OPTARG ;;
    f) FLOPS=$OPTARG ;;
    o) OUT=$OPTARG ;;
    e) EXEC=1 ;;
    h) usage 0 ;;
    *) usage 2 ;;
  esac
done
shift $((OPTIND - 1))
[ "${1:-}" = "--" ] && shift
[ $# -gt 0 ] || { echo "error: give the occult command after --" >&2; usage 2; }
[ "$(id -u)" = 0 ] || { echo "error: run as root (network namespaces need it)" >&2; exit 1; }
for tool in ip tc mpirun; do
  command -v $tool >/dev/null || { echo "error: $tool is not installed" >&2; exit 1; }
done
[[ $RANKS =~ ^[0-9]+$ ]] && [ "$RANKS" -ge 2 ] && [ "$RANKS" -le 200 ] ||
  { echo "error: -n takes 2 to 200 ranks" >&2; exit 1; }
[[ $PER_NODE =~ ^[0-9]+$ ]] && [ "$PER_NODE" -ge 1 ] && [ $((RANKS % PER_NODE)) -eq 0 ] ||
  { echo "error: -g $PER_NODE must divide the $RANKS ranks" >&2; exit 1; }

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${OCCULT_BIN:-$ROOT/target/release/occult}
[ "$EXEC" = 1 ] || [ -x "$BIN" ] || { echo "error: $BIN is missing: cargo build --release --features occult-eval/mpi" >&2; exit 1; }
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

# Link bandwidth in bytes/s from tc's rate notation (bit, kbit, mbit, gbit).
rate_bytes() {
  local n unit
  n=$(sed -E 's/^([0-9.]+).*/\1/' <<<"$1"); unit=$(sed -E 's/^[0-9.]+//' <<<"$1" | tr A-Z a-z)
  case $unit in
    bit) awk -v n="$n" 'BEGIN{print n/8}' ;;
    kbit) awk -v n="$n" 'BEGIN{print n*1e3/8}' ;;
    mbit) awk -v n="$n" 'BEGIN{print n*1e6/8}' ;;
    gbit) awk -v n="$n" 'BEGIN{print n*1e9/8}' ;;
    *) echo "error: rate $1: use bit, kbit, mbit or gbit" >&2; exit 1 ;;
  esac
}
BANDWIDTH=$(rate_bytes "$RATE")
INTRA_BANDWIDTH=$BANDWIDTH
[ "$PER_NODE" -gt 1 ] && INTRA_BANDWIDTH=$(rate_bytes "$INTRA")

PREFIX=occ$$
TMP=$(mktemp -d)
teardown() {
  local status=$?
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^${PREFIX}_" || true); do
    # Processes left inside (after an abnormal mpirun exit) would keep its links alive.
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  done
  rm -rf "$TMP"
  exit $status
}
trap teardown EXIT INT TERM

HUB=${PREFIX}_hub
ip netns add "$HUB"
ip -n "$HUB" link set lo up
ip -n "$HUB" link add br0 type bridge
ip -n "$HUB" addr add 10.77.255.254/16 dev br0
ip -n "$HUB" link set br0 up
# Rank i (1-based) of node n (0-based) is 10.77.(n+1).i; shape NS DEV DIR NODE: RATE by
# default, INTRA for packets whose peer (DIR = dst or src) is in NODE.
shape() {
  ip netns exec "$1" tc qdisc add dev "$2" root handle 1: htb default 10
  ip netns exec "$1" tc class add dev "$2" parent 1: classid 1:10 htb rate "$RATE" ceil "$RATE" quantum 60000
  if [ "$PER_NODE" -gt 1 ]; then
    ip netns exec "$1" tc class add dev "$2" parent 1: classid 1:20 htb rate "$INTRA" ceil "$INTRA" quantum 60000
    ip netns exec "$1" tc filter add dev "$2" parent 1: protocol ip prio 1 u32 \
      match ip "$3" "10.77.$(($4 + 1)).0/24" flowid 1:20
  fi
}
: >"$TMP/hostfile"
for i in $(seq 1 "$RANKS"); do
  ns=${PREFIX}_r$i
  node=$(((i - 1) / PER_NODE))
  ip=10.77.$((node + 1)).$i
  ip netns add "$ns"
  ip -n "$ns" link set lo up
  ip link add "${PREFIX}h$i" netns "$HUB" type veth peer name eth0 netns "$ns"
  ip -n "$HUB" link set "${PREFIX}h$i" master br0
  ip -n "$HUB" link set "${PREFIX}h$i" up
  ip -n "$ns" addr add "$ip/16" dev eth0
  ip -n "$ns" link set eth0 up
  shape "$ns" eth0 dst "$node"               # what the rank sends
  shape "$HUB" "${PREFIX}h$i" src "$node"    # what the rank receives
  echo "$ip slots=1" >>"$TMP/hostfile"
done
# mpirun reaches each "host" by entering its namespace (in place of ssh).
cat >"$TMP/netns-rsh" <<EOF
#!/bin/bash
host=\$1; shift; n=\${host##*.}
exec ip netns exec ${PREFIX}_r\$n unshare --uts /bin/sh -c "hostname rank\$n; \$*"
EOF
chmod +x "$TMP/netns-rsh"

# This emulated machine as a link profile: f32 rows, RATE per link (INTRA inside a node of -g),
# veth latency; compute as measured (each rank's time outside the exchanges).
cat >"$TMP/shaped.toml" <<EOF
name = "shaped-$RATE"
description = "$RANKS MPI ranks in network namespaces (nodes of $PER_NODE), veth links shaped with tc HTB to $RATE between nodes"
device_flops = $FLOPS
activation_bytes = 4
ranks_per_node = $PER_NODE
measured_compute = true
[intra]
bandwidth = $INTRA_BANDWIDTH
latency = 1.0e-4
[inter]
bandwidth = $BANDWIDTH
latency = 1.0e-4
EOF

ARGS=("$@" --backend mpi --devices "$RANKS")
if [ "$EXEC" = 1 ]; then
  ARGS=()
elif [ "${1:-}" = bench ] && [ "${2:-}" = model ]; then
  ARGS+=(--link "$TMP/shaped.toml" --json "$OUT/shaped.json")
elif [ "${1:-}" = bench ] && [ "${2:-}" = train ]; then
  ARGS+=(--link "$TMP/shaped.toml" --json "$OUT/shaped-train.json")
fi
CMD=("$BIN" "${ARGS[@]}")
[ "$EXEC" = 1 ] && CMD=("$@")
if [ "$PER_NODE" -gt 1 ]; then
  echo "$RANKS ranks in nodes of $PER_NODE: $INTRA inside a node, $RATE between nodes (HTB, both directions); ${CMD[*]}" >&2
else
  echo "$RANKS ranks over $RATE links (HTB, both directions); ${CMD[*]}" >&2
fi
export SHAPED_MASTER_ADDR=10.77.1.1 SHAPED_IFNAME=eth0
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
ip netns exec "$HUB" mpirun --hostfile "$TMP/hostfile" -np "$RANKS" \
  --mca plm_rsh_agent "$TMP/netns-rsh" \
  --mca oob_tcp_if_include 10.77.0.0/16 --mca btl self,tcp --mca btl_tcp_if_include 10.77.0.0/16 \
  --mca btl_tcp_links 2 --mca mpi_yield_when_idle 1 \
  -x OMPI_ALLOW_RUN_AS_ROOT -x OMPI_ALLOW_RUN_AS_ROOT_CONFIRM -x SHAPED_MASTER_ADDR -x SHAPED_IFNAME \
  "${CMD[@]}"
