#!/usr/bin/env bash
# The CPU comparison of docs/kernels.md ("Against transformers and llama.cpp, at every
# level"): `occult bench model` against transformers and llama.cpp on the OLMoE-shaped
# 1-layer qwen3_moe (64 experts, top-8, hidden 2048, expert size 1024), in f32 and bf16, with
# 512- and 128-token prompts, 8 decode steps, 5 paired repeats, at this CPU's own level and
# again with everything held to AVX-512 without BF16 (where the CPU has more, with
# LLAMA_AVX512_PYTHON) and to AVX2, on THREADS threads. Prints one Markdown table; the JSON
# of every run stays in OUT.
#
#   TORCH_PYTHON=venv/bin/python LLAMA_PYTHON=venv/bin/python \
#   LLAMA_AVX2_PYTHON=venv-avx2/bin/python scripts/bench_cpu_peers.sh
#
# Env:
#   TORCH_PYTHON       Python with torch and transformers (held to our level by occult)
#   LLAMA_PYTHON       Python with llama-cpp-python built for this CPU (GGML_NATIVE=ON, the
#                      default), and the converter's needs (torch, transformers, gguf)
#   LLAMA_AVX2_PYTHON  Python with llama-cpp-python built for AVX2 only, for the AVX2 rows
#                      (see scripts/bench_llama_cpp.py); without it they are left out
#   LLAMA_AVX512_PYTHON  Python with llama-cpp-python built for AVX-512 without BF16
#                      (-DGGML_AVX512=ON), for rows held to `avx512` on a CPU with BF16 or
#                      AMX; without it they are left out
#   LLAMA_CPP_CONVERTER  llama.cpp's convert_hf_to_gguf.py (e.g. from the llama-cpp-python
#                      0.3.36 sdist: vendor/llama.cpp/convert_hf_to_gguf.py)
#   OCCULT (default target/release/occult), OUT (default bench-cpu-peers), THREADS (default 2)
set -euo pipefail
cd "$(dirname "$0")/.."

occult=$(realpath "${OCCULT:-target/release/occult}")
out=${OUT:-bench-cpu-peers}
threads=${THREADS:-2}
: "${TORCH_PYTHON:?set TORCH_PYTHON to a Python with torch and transformers}"
: "${LLAMA_PYTHON:?set LLAMA_PYTHON to a Python with llama-cpp-python}"
[[ -x $occult ]] || { echo "no $occult: cargo build --release -p occult-eval" >&2; exit 1; }
mkdir -p "$out"
cd "$out"
export RAYON_NUM_THREADS=$threads

if [[ ! -f olmoe-layer/model.safetensors ]]; then
  "$occult" model synth --family qwen3_moe --hidden 2048 --layers 1 --heads 16 --kv-heads 16 \
    --experts 64 --top-k 8 --intermediate 1024 --vocab 1024 -o olmoe-layer
fi

top=$(OCCULT_KERNELS=auto "$occult" bench kernels --shapes 1x8x8 --repeat 1 --bandwidth-mib 1 2>&1 |
  sed -n 's/.*level \([a-z0-9]*\) .*/\1/p' | head -1)
levels=("$top")
# Held to AVX-512 without BF16 where the CPU has more (with llama.cpp's AVX512 build), and to
# AVX2.
[[ ($top == amx || $top == avx512bf16) && -n ${LLAMA_AVX512_PYTHON:-} ]] && levels+=(avx512)
[[ $top != avx2 && $top != portable ]] && levels+=(avx2)

for level in "${levels[@]}"; do
  for dtype in f32 bf16; do
    for prompt in 512 128; do
      for peer in transformers llama.cpp; do
        py=$TORCH_PYTHON
        extra=()
        if [[ $peer == llama.cpp ]]; then
          py=$LLAMA_PYTHON
          if [[ $level == avx2 && $top != avx2 ]]; then
            [[ -n ${LLAMA_AVX2_PYTHON:-} ]] || continue
            py=$LLAMA_AVX2_PYTHON
          elif [[ $level == avx512 && $top != avx512 ]]; then
            py=$LLAMA_AVX512_PYTHON
          fi
          extra=(--gguf "olmoe-layer-$dtype.gguf")
        fi
        json="$level-$dtype-$prompt-$peer.json"
        echo "== $level $dtype prompt $prompt against $peer" >&2
        OCCULT_KERNELS=$level OCCULT_PYTHON=$py "$occult" bench model --model olmoe-layer \
          --dtype "$dtype" --prompt-len "$prompt" --decode-tokens 8 --repeats 5 \
          --against "$peer" "${extra[@]}" --json "$json" 2>"${json%.json}.log" >/dev/null ||
          { tail -20 "${json%.json}.log" >&2; exit 1; }
      done
    done
  done
done

python3 - <<'EOF'
import glob, json
rows = []
for f in sorted(glob.glob("*-*-*-*.json")):
    r = json.load(open(f))
    ours, theirs = r["results"]
    rows.append((r["kernel_level"], r["dtype"], ours["prompt_tokens"], theirs["implementation"],
                 ours["prefill_tokens_per_s"], theirs["prefill_tokens_per_s"],
                 ours["decode_ms_per_token"], theirs["decode_ms_per_token"],
                 r["speed_ratio"]["prefill"], r["speed_ratio"]["decode"], r["max_abs_logit_diff"]))
order = {"amx": 0, "avx512bf16": 1, "avx512": 2, "avx2": 3, "portable": 4}
rows.sort(key=lambda x: (order.get(x[0], 9), x[1] != "f32", -x[2], x[3]))
print("| level | dtype | prompt | against | ours prefill tok/s | theirs | ours decode ms/tok | theirs | "
      "speed ours/theirs, prefill | decode | max logit diff |")
print("|---|---|--:|---|--:|--:|--:|--:|--:|--:|--:|")
for x in rows:
    print(f"| {x[0]} | {x[1]} | {x[2]} | {x[3]} | {x[4]:.0f} | {x[5]:.0f} | {x[6]:.2f} | {x[7]:.2f} "
          f"| {x[8]:.2f} | {x[9]:.2f} | {x[10]:.1e} |")
EOF
