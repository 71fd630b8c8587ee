#!/usr/bin/env bash
# The GPU check, in one go (about 5 minutes) on a machine with an NVIDIA GPU:
#   1. the GPU parity tests (tests/tests/gpu.rs): every family's forward in f32 and bf16 and a
#      next-token loss's gradients against the CPU reference; the expert-parallel layer's
#      forward and backward in f32 and bf16 against the CPU reference, over threads and over
#      NCCL; the pre-reduction kernel and the padded, batched experts against their candle-op
#      references; a model expert-parallel on the GPU; the memory check; the NCCL
#      communicator on one rank (self send and receive, rows kept on the device);
#   2. `occult bench layer --cuda 0 --backend nccl` (one rank, rows through NCCL) on OLMoE's
#      MoE shape (64 experts, top-8, hidden 2048, expert size 1024), bf16 and f32, 4096 tokens:
#      per-stage times, tokens/s, and the expert compute's TFLOP/s and share of the GPU's bf16
#      matmul peak;
#   3. `occult bench model --cuda 0` on a one-layer model of that shape, bf16 and f32,
#      reference and expert-parallel over single-rank NCCL, 512-token prompt: tokens/s.
#
# Binaries: .gpu/gpu-tests.xz and .gpu/occult.xz from scripts/gpu-build.sh (made on a machine
# with cargo; carry `.gpu`), or built here with cargo where cargo and nvcc are present. Libraries:
# the driver's libcuda.so.1, and CUDA 13's runtime, cuBLAS, cuRAND, NVRTC and NCCL from the
# system or from python3's nvidia packages.
#
#   scripts/gpu-check.sh [OUT_DIR]        # OUT_DIR (default target/gpu-check) gets logs and JSON
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/gpu-check}
mkdir -p "$out"

nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv

# The driver runs PTX of its CUDA version or older; the GPU must have the compute capability
# the kernels were built for.
if [ -f .gpu/build.txt ]; then
  built=$(sed -n 's/^cuda //p' .gpu/build.txt)
  cap=$(sed -n 's/^compute_cap //p' .gpu/build.txt)
  driver=$(nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9.]*\).*/\1/p' | head -1)
  have=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)
  if [ "$(printf '%s\n%s\n' "$built" "$driver" | sort -V | head -1)" != "$built" ]; then
    echo "the binaries were built with CUDA $built; this driver runs CUDA $driver at most:" \
      "rebuild with an nvcc of $driver or older" >&2
    exit 1
  fi
  if [ "$have" -lt "$cap" ]; then
    echo "the kernels were built for compute capability $cap; this GPU has $have" >&2
    exit 1
  fi
fi

unpack() { # .gpu/NAME.xz to .gpu/NAME, with xz or else Python's lzma
  if command -v xz >/dev/null; then
    xz -dc ".gpu/$1.xz" >".gpu/$1.part"
  else
    python3 -c 'import lzma, shutil, sys
with lzma.open(sys.argv[1]) as i, open(sys.argv[2], "wb") as o: shutil.copyfileobj(i, o)' \
      ".gpu/$1.xz" ".gpu/$1.part"
  fi
  chmod +x ".gpu/$1.part" && mv ".gpu/$1.part" ".gpu/$1"
}
for bin in gpu-tests occult; do
  if [ ! -x ".gpu/$bin" ] && [ -f ".gpu/$bin.xz" ]; then
    unpack "$bin"
  fi
done
if [ ! -x .gpu/gpu-tests ] || [ ! -x .gpu/occult ]; then
  command -v cargo >/dev/null || {
    echo "no .gpu/ binaries and no cargo here: run scripts/gpu-build.sh on a machine with" \
      "cargo, and carry .gpu" >&2
    exit 1
  }
  export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-$(nvidia-smi --query-gpu=compute_cap \
    --format=csv,noheader | head -1 | tr -d .)}
  mkdir -p .gpu
  tests=$(cargo test --release -p occult-tests --features occult-tests/nccl --test gpu \
    --no-run --message-format=json | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu":
        print(m["executable"])')
  cargo build --release -p occult-eval --features occult-eval/nccl
  cp "$tests" .gpu/gpu-tests
  cp "${CARGO_TARGET_DIR:-target}/release/occult" .gpu/occult
fi

# CUDA 13's libraries from python3's nvidia packages, where the system has none.
if libs=$(python3 -c '
import glob, os, nvidia
dirs = {os.path.dirname(p) for root in nvidia.__path__
        for p in glob.glob(root + "/**/lib*.so*", recursive=True)}
print(":".join(sorted(dirs)))
' 2>/dev/null); then
  export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

echo "== GPU parity tests"
# A failing test or benchmark is reported at the end; the rest runs either way.
tests_rc=0 bench_rc=0
.gpu/gpu-tests --test-threads 1 --nocapture 2>&1 | tee "$out/gpu-tests.log" || tests_rc=1

peak=989e12 # H100/H200 SXM dense bf16 tensor-core peak, FLOP/s

echo "== bench layer on the GPU, one NCCL rank"
for dtype in bf16 f32; do
  .gpu/occult bench layer --cuda 0 --backend nccl --devices 1 --dtype "$dtype" --experts 64 \
    --top-k 8 --hidden 2048 --intermediate 1024 --tokens 4096 --steps 5 --warmup 2 \
    --json "$out/layer-$dtype.json" || bench_rc=1
done

echo "== bench model on the GPU"
model="$out/olmoe-layer"
[ -f "$model/model.safetensors" ] || .gpu/occult model synth --family qwen3_moe --hidden 2048 \
  --layers 1 --heads 16 --kv-heads 16 --experts 64 --top-k 8 --intermediate 1024 \
  --vocab 1024 -o "$model" || bench_rc=1
for dtype in bf16 f32; do
  .gpu/occult bench model --model "$model" --cuda 0 --dtype "$dtype" --mode reference \
    --prompt-len 512 --decode-tokens 16 --repeats 5 --json "$out/model-$dtype-reference.json" ||
    bench_rc=1
  .gpu/occult bench model --model "$model" --cuda 0 --dtype "$dtype" --mode occult \
    --backend nccl --prompt-len 512 --decode-tokens 16 --repeats 5 \
    --json "$out/model-$dtype-occult-nccl.json" || bench_rc=1
done

echo "== summary"
python3 - "$out" "$peak" <<'PY'
import glob, json, sys
out, peak = sys.argv[1], float(sys.argv[2])
for path in sorted(glob.glob(out + "/layer-*.json")):
    doc = json.load(open(path))
    for r in doc["results"]:
        f = r["expert_flops_per_s"]
        print(f"layer {doc['config']['dtype']} {r['mode']}: {r['tokens_per_s']:.0f} tok/s, "
              f"compute {1e3 * r['compute_s']:.2f} ms, experts {f / 1e12:.1f} TFLOP/s = "
              f"{100 * f / peak:.1f}% of the bf16 peak")
# The model's prefill: 3 products of 2 x hidden x expert size per token and routed expert,
# over the whole prefill (attention and the LM head included: a lower bound).
for path in sorted(glob.glob(out + "/model-*.json")):
    for row in json.load(open(path))["results"]:
        s, t = row["prefill_s"], row["prompt_tokens"]
        flops = t * 8 * 3 * 2 * 2048 * 1024
        print(f"{path.split('/')[-1]} {row['implementation']}: prefill {t / s:.0f} tok/s, "
              f"decode {row['decode_ms_per_token']:.2f} ms/token, experts at least "
              f"{flops / s / 1e12:.1f} TFLOP/s = {100 * flops / s / peak:.2f}% of the bf16 peak")
PY
if [ "$tests_rc" != 0 ] || [ "$bench_rc" != 0 ]; then
  [ "$tests_rc" = 0 ] || echo "gpu check: GPU parity tests FAILED (see $out/gpu-tests.log)" >&2
  [ "$bench_rc" = 0 ] || echo "gpu check: a benchmark FAILED (see its output above)" >&2
  exit 1
fi
echo "gpu check: done (logs and JSON in $out)"
