#!/usr/bin/env bash
# Mutation testing of the files where a wrong number is silent: the dispatch plans, the
# pre-reduction, the cost model, the placement search, the optimiser and its resume, the
# savers, the paired statistics, the engines' readers (arrays, SGLang's dump), the copies'
# gradient sum, the checkpoint export and the replica map. cargo-mutants (https://mutants.rs) changes one operator or one function body at a time,
# rebuilds, and runs the tests that guard that file; a mutant the tests do not catch is a bug
# they would not catch either.
#
#   scripts/mutants.sh                 every group (about 4 h 30 min on 2 cores; search alone 1 h 30)
#   scripts/mutants.sh search optim    only these groups
#   scripts/mutants.sh --list          the groups, their files, their tests and mutant counts
#   scripts/mutants.sh --iterate ...   test again only what the last run did not catch (and any
#                                      mutant it did not reach), after adding tests
#
# Needs `cargo install --locked cargo-mutants` (27.x) and OpenMPI (the tests' `mpi` feature, as in
# .ci/run). Results: mutants.out/<group>/ (outcomes.json, missed.txt, caught.txt, log/), and a
# summary at the end. Exits non-zero when a mutant is missed (one that makes the tests hang past
# the group's timeout counts as caught).
#
# It mutates the working tree in place (so the release build already in target/ is reused and
# each mutant rebuilds incrementally in seconds) and refuses to start unless the files it mutates
# are committed; cargo-mutants puts each file back after each mutant, and this script restores
# them from git if it is interrupted. CI does not run it: see docs/robustness.md for when to.
set -euo pipefail
cd "$(dirname "$0")/.."

# group | file | packages whose tests run | test targets (cargo test flags) | test timeout (s:
# about 10x the tests' time, so that a mutant that makes a search loop forever costs little)
GROUPS_TABLE=$(
    cat <<'EOF'
dispatch|occult-core/src/ep/dispatch.rs|occult-core,occult-tests|--lib --test=ep_layer --test=models --test=data_parallel|120
pre_reduce|occult-core/src/ep/pre_reduce.rs|occult-core,occult-tests|--lib --test=ep_layer --test=models|120
links|occult-core/src/analysis/cost/links.rs|occult-core,occult-tests|--lib|60
search|occult-core/src/analysis/placement/search.rs|occult-core,occult-tests|--lib --test=properties|30
optim|occult-train/src/optim.rs|occult-train,occult-tests,occult-eval|--lib --test=train --test=train_cli --test=help|120
run|occult-train/src/run.rs|occult-train,occult-tests,occult-eval|--lib --test=train --test=train_cli --test=help|120
save|occult-train/src/save.rs|occult-train,occult-tests,occult-eval|--lib --test=train --test=train_cli --test=help|120
paired|occult-eval/src/harness/paired.rs|occult-eval,occult-tests|--lib|60
arrays|occult-core/src/interop/arrays.rs|occult-core,occult-tests,occult-eval|--lib --test=routing_import --test=help|60
dump|occult-core/src/interop/sglang/dump.rs|occult-core,occult-tests,occult-eval|--lib --test=routing_import --test=help|60
copies|occult-core/src/models/model/copies.rs|occult-core,occult-tests|--lib --test=train|120
export|occult-core/src/interop/checkpoint/export.rs|occult-core,occult-tests|--lib --test=export|120
replicas|occult-core/src/analysis/placement/replicas.rs|occult-core,occult-tests|--lib --test=ep_layer --test=train|120
EOF
)

command -v cargo-mutants >/dev/null || {
    echo "cargo-mutants is missing: cargo install --locked cargo-mutants" >&2
    exit 2
}

list=0
iterate=()
wanted=()
for a in "$@"; do
    case "$a" in
    --list) list=1 ;;
    --iterate) iterate=(--iterate) ;;
    -h | --help)
        sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    *) wanted+=("$a") ;;
    esac
done
known=$(cut -d'|' -f1 <<<"$GROUPS_TABLE")
for w in "${wanted[@]+"${wanted[@]}"}"; do
    grep -qx "$w" <<<"$known" || {
        echo "unknown group '$w'; the groups are: $(tr '\n' ' ' <<<"$known")" >&2
        exit 2
    }
done
selected() { [ ${#wanted[@]} -eq 0 ] || printf '%s\n' "${wanted[@]}" | grep -qx "$1"; }

if [ "$list" = 1 ]; then
    while IFS='|' read -r group file packages targets _; do
        selected "$group" || continue
        n=$(cargo mutants --list -f "$file" | wc -l)
        printf '%-11s %4d mutants  %s\n%16s tests: -p %s %s\n' "$group" "$n" "$file" "" \
            "${packages//,/ -p }" "$targets"
    done <<<"$GROUPS_TABLE"
    exit 0
fi

files=()
while IFS='|' read -r group file _ _ _; do
    selected "$group" && files+=("$file")
done <<<"$GROUPS_TABLE"
if ! git diff --quiet HEAD -- "${files[@]}"; then
    echo "refusing to mutate files with uncommitted changes (commit or stash them first):" >&2
    git diff --stat HEAD -- "${files[@]}" >&2
    exit 2
fi
restore() { git checkout -q HEAD -- "${files[@]}"; }
trap restore EXIT

# The tests' own settings (as .ci/run): release, the `mpi` feature, mpirun as root in containers.
# Incremental release builds make a mutant's rebuild take seconds instead of a minute; this only
# changes how the workspace's own crates are compiled, not what they compute.
export CARGO_PROFILE_RELEASE_INCREMENTAL=true
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
FEATURES=occult-tests/mpi

status=0
summary=()
mkdir -p mutants.out
while IFS='|' read -r group file packages targets timeout; do
    selected "$group" || continue
    out="mutants.out/$group"
    [ ${#iterate[@]} -eq 0 ] && rm -rf "$out"
    mkdir -p "$out"
    cargo_args=()
    package_args=()
    for t in $targets; do cargo_args+=("-C" "$t"); done
    for p in ${packages//,/ }; do package_args+=("-p" "$p"); done
    # The baseline: the same tests on the unmutated tree must pass (cargo-mutants' own baseline
    # builds only the mutated package, without the test packages' features).
    echo "== $group: $file (baseline: cargo test -p ${packages//,/ -p } $targets)"
    # shellcheck disable=SC2086
    cargo test -q --release --features "$FEATURES" "${package_args[@]}" $targets \
        >"$out/baseline.log" 2>&1 || {
        echo "the unmutated tests fail; see $out/baseline.log" >&2
        exit 1
    }
    rc=0
    cargo mutants --in-place --baseline skip --timeout "$timeout" --build-timeout 900 \
        --profile release --features "$FEATURES" --test-package "$packages" \
        "${iterate[@]+"${iterate[@]}"}" "${cargo_args[@]}" -f "$file" -o "$out" || rc=$?
    # cargo-mutants exits 2 when mutants are missed, 3 on timeouts (a mutant that makes the tests
    # hang is caught: they do not pass); anything else is a failure.
    case $rc in
    0 | 2 | 3) ;;
    *)
        echo "cargo mutants failed ($rc) on $group" >&2
        exit "$rc"
        ;;
    esac
    o="$out/mutants.out"
    [ -s "$o/missed.txt" ] && status=1
    # A mutant can make a test write where it must not (an export over its own source, say):
    # the fixtures are put back, and the group's outcomes after the change are suspect.
    if [ -n "$(git status --porcelain -- tests/fixtures)" ]; then
        echo "warning: a mutant of $group changed tests/fixtures (put back from git); outcomes" \
            "after that mutant may be wrong: see $o/log" >&2
        git status --porcelain -- tests/fixtures >&2
        git checkout -q HEAD -- tests/fixtures
        git clean -qfd -- tests/fixtures
        status=1
    fi
    summary+=("$(printf '%-11s caught %4d  missed %3d  timeout %2d  unviable %3d' "$group" \
        "$(wc -l <"$o/caught.txt")" "$(wc -l <"$o/missed.txt")" \
        "$(wc -l <"$o/timeout.txt")" "$(wc -l <"$o/unviable.txt")")")
done <<<"$GROUPS_TABLE"

echo
echo "== summary (missed and timed-out mutants: mutants.out/<group>/mutants.out/{missed,timeout}.txt)"
printf '%s\n' "${summary[@]}"
cat mutants.out/*/mutants.out/missed.txt mutants.out/*/mutants.out/timeout.txt 2>/dev/null || true
exit "$status"
