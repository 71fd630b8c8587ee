#!/usr/bin/env bash
# Runs some of the test files, with the `occult` binary they run rebuilt first. A filtered
# `cargo test -p occult-tests --test NAME` builds the test but not the binary, and the CLI tests
# refuse a binary older than its sources; this is the one command that does both, with the
# features the full test command uses (MPI where mpirun is installed).
#
#   scripts/test.sh cli train_cli                 # two test files
#   scripts/test.sh routing_import -- a_dump      # one file, tests whose name has `a_dump`
#   scripts/test.sh                               # every test file of occult-tests
set -euo pipefail
cd "$(dirname "$0")/.."

tests=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  tests+=(--test "$1")
  shift
done
if command -v mpirun >/dev/null; then
  bin_features=(--features occult-eval/mpi)
  test_features=(--features occult-tests/mpi)
else
  bin_features=()
  test_features=()
fi
cargo build --release -p occult-eval "${bin_features[@]}"
cargo test --release -p occult-tests "${test_features[@]}" "${tests[@]}" "$@"
