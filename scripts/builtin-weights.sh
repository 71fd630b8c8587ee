#!/usr/bin/env bash
# Rebuilds the built-in model's weights from nothing (the default recipe: data, random start,
# 800 steps of pre-training; about 7 minutes on 2 cores) and writes the three committed files
# again: occult-eval/builtin/{model.safetensors,log.jsonl,manifest.json}. Run it whenever the
# built-in recipe or its data generators change (the test
# the_committed_weights_are_what_the_default_recipe_builds says when), then rebuild occult,
# which compiles the weights in.
#
#   scripts/builtin-weights.sh [--check]
#
# --check writes into a temporary folder instead and compares it with the committed files:
# on the machine that built them they are equal byte for byte (pre-training is deterministic
# for a given CPU level and thread count).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p occult-eval --bin occult
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
out=occult-eval/builtin
if [ "${1:-}" = --check ]; then
    out="$work/export"
fi
./target/release/occult model builtin --rebuild --dir "$work/builtin" --export-weights "$out"
if [ "${1:-}" = --check ]; then
    for f in model.safetensors log.jsonl; do
        cmp "$out/$f" "occult-eval/builtin/$f"
    done
    # The manifest's digests (its `built` line says where and how long, which differs).
    diff <(grep -v '"built"' "$out/manifest.json") <(grep -v '"built"' occult-eval/builtin/manifest.json)
    echo "the rebuilt weights, log and digests equal the committed ones"
fi
