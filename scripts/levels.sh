#!/usr/bin/env bash
# Runs the tests that exercise the CPU kernels at every instruction-set level: occult-core's
# unit tests (vector math, the experts' and attention's inference paths), the kernel tests, the
# model parity tests and (natively) the built-in model's committed weights against their
# pre-training's first steps.
#
#  1. Natively, once per level this CPU has below its highest (`OCCULT_KERNELS`; the highest
#     is what the plain test run used), so a machine with AVX-512 also proves its AVX2 and
#     portable paths.
#  2. Under qemu-user (Debian's qemu-user), as older CPUs: `-cpu Haswell` has AVX2 and FMA
#     without AVX-512, `-cpu Nehalem` neither, so detection itself picks the level there
#     (`OCCULT_EXPECT_LEVEL` tells the detection test what the emulated model has, since
#     qemu-user shows the host's /proc/cpuinfo). QEMU does not emulate AVX-512: those paths
#     run natively where the CPU has them.
#
#   scripts/levels.sh [--native-only | --emulated-only]
#
# Needs the test binaries built as the README's test command builds them (the same features,
# so nothing is rebuilt) and, for step 2, qemu-x86_64 (`apt-get install qemu-user`).
set -euo pipefail
cd "$(dirname "$0")/.."

mode=${1:-all}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

# The test executables, as cargo reports them (no rebuild when the test run came first).
mapfile -t bins < <(
  cargo test --workspace --release --features occult-tests/mpi --no-run \
    --message-format=json 2>/dev/null |
    python3 -c '
import json, sys
want = {("occult_core", "lib"), ("kernels", "test"), ("model_parity", "test"), ("builtin", "test")}
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        t = m["target"]
        if any((t["name"], kind) in want for kind in t["kind"]):
            print(m["executable"])
'
)
if [[ ${#bins[@]} -ne 4 ]]; then
  echo "levels.sh: expected 4 test binaries (occult-core, kernels, model_parity, builtin), found ${#bins[@]}: ${bins[*]}" >&2
  exit 1
fi

# The kernel tests hold every level this CPU has in one process (`Level::supported()`), so a
# native run at a lower `OCCULT_KERNELS` only needs their tests of the process's own level (the
# ones named `the_...`); under emulation they all run, on shapes sized for soft-float
# (`OCCULT_TEST_EMULATED=1`).
run() { # label, kernel-test filter, then the command
  local label=$1 filter=$2
  shift 2
  local start=$SECONDS
  local log
  log=$(mktemp)
  for b in "${bins[@]}"; do
    local args=()
    if [[ $(basename "$b") == kernels-* && -n $filter ]]; then args=("$filter"); fi
    # The built-in model's committed weights, held to their pre-training's first steps at each
    # level (natively: the steps take minutes under emulation).
    if [[ $(basename "$b") == builtin-* ]]; then
      [[ $label == native* ]] || continue
      args=(the_committed_weights_are --nocapture)
    fi
    if ! "$@" "$b" "${args[@]}" >"$log" 2>&1; then
      tail -60 "$log"
      echo "levels.sh: $(basename "$b") failed at $label" >&2
      exit 1
    fi
    echo "$label, $(basename "$b"): $(grep '^test result' "$log")"
  done
  rm -f "$log"
  echo "== $label: $((SECONDS - start)) s"
}

flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
has() { [[ " $flags " == *" $1 "* ]]; }

if [[ $mode != --emulated-only ]]; then
  levels=(portable)
  if has avx2 && has fma; then levels+=(avx2); fi
  if has avx512f; then levels+=(avx512); fi
  if has avx512f && has avx512_bf16; then levels+=(avx512bf16); fi
  if has amx_tile; then levels+=(amx); fi
  # The highest is the plain test run's; every other one here.
  unset 'levels[${#levels[@]}-1]'
  for level in "${levels[@]}"; do
    run "native, OCCULT_KERNELS=$level" the_ env OCCULT_KERNELS="$level"
  done
fi

if [[ $mode != --native-only ]]; then
  command -v qemu-x86_64 >/dev/null || {
    echo "levels.sh: qemu-x86_64 not found (apt-get install qemu-user)" >&2
    exit 1
  }
  # Haswell's model lists features TCG lacks (pcid, x2apic, tsc-deadline, hle, invpcid, rtm,
  # all beside the point here); taking them off keeps qemu quiet.
  haswell=Haswell,-pcid,-x2apic,-tsc-deadline,-hle,-invpcid,-rtm
  export OCCULT_TEST_EMULATED=1
  run "qemu -cpu Haswell (avx2)" "" env OCCULT_EXPECT_LEVEL=avx2 qemu-x86_64 -cpu "$haswell"
  run "qemu -cpu Nehalem (portable)" "" env OCCULT_EXPECT_LEVEL=portable qemu-x86_64 -cpu Nehalem
fi
