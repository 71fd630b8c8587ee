#!/usr/bin/env bash
# Coverage-guided fuzzing of every reader of untrusted input (fuzz/fuzz_targets), with
# libFuzzer through cargo-fuzz on the stable toolchain (no sanitizer: Rust is memory-safe; what
# is sought is a panic, a hang, or an allocation sized from an untrusted field, which
# -malloc_limit_mb turns into a finding).
#
#   scripts/fuzz.sh [--smoke S]     every target for S (20) seconds, new inputs kept out of the
#                                   repository (CI's smoke run; the committed corpora replay first)
#   scripts/fuzz.sh --runs 1000000 [TARGET...]   that many executions per target; the new
#                                   inputs that add coverage are merged into fuzz/corpus/TARGET
#   scripts/fuzz.sh --time 60 [TARGET...]        that many seconds per target, likewise
#
# A finding stops the run with exit 1 and leaves the input under fuzz/artifacts/TARGET/;
# replay it with `cd fuzz && cargo fuzz run -s none -O TARGET artifacts/TARGET/FILE`.
# Needs cargo-fuzz (`cargo install cargo-fuzz --locked`).
set -euo pipefail
cd "$(dirname "$0")/../fuzz"

mode=smoke
limit=20
if [[ "${1:-}" == --runs || "${1:-}" == --time || "${1:-}" == --smoke ]]; then
  mode=${1#--}
  limit=$2
  shift 2
fi
targets=("$@")
if [[ ${#targets[@]} -eq 0 ]]; then
  mapfile -t targets < <(cargo fuzz list)
fi

# Largest input (bytes), the allocation limit (MB), and the per-input time limit (s).
flags=(-max_len=65536 -malloc_limit_mb=256 -rss_limit_mb=2048 -timeout=10 -print_final_stats=1)
cargo fuzz build -s none -O

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for t in "${targets[@]}"; do
  echo "== fuzz $t ($mode $limit)"
  # New inputs go to a scratch folder; the committed corpus is read as seeds.
  dirs=("$scratch/$t" "corpus/$t")
  mkdir -p "$scratch/$t"
  case $mode in
    smoke | time) stop=(-max_total_time="$limit") ;;
    runs) stop=(-runs="$limit") ;;
  esac
  set +e
  cargo fuzz run -s none -O "$t" "${dirs[@]}" -- "${flags[@]}" "${stop[@]}" >"$scratch/$t.log" 2>&1
  status=$?
  set -e
  grep -E '^(stat::|Done|INFO: seed corpus)|ERROR|panicked|deadly|timeout|out-of-memory|malloc' \
    "$scratch/$t.log" | grep -v '^INFO: -' || true
  if [[ $status -ne 0 ]]; then
    tail -40 "$scratch/$t.log"
    echo "fuzz $t: finding (see fuzz/artifacts/$t)"
    exit 1
  fi
  if [[ $mode != smoke ]]; then
    # Keep only the new inputs that add coverage to the committed corpus.
    before=$(ls "corpus/$t" | wc -l)
    cargo fuzz run -s none -O "$t" "corpus/$t" "$scratch/$t" -- -merge=1 >"$scratch/$t.merge" 2>&1
    echo "corpus/$t: $before -> $(ls "corpus/$t" | wc -l) inputs"
  fi
done
