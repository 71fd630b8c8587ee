#!/usr/bin/env bash
# Builds the GPU binaries (features `cuda`, `nccl`) on a machine without a GPU, for
# scripts/gpu-check.sh to run on one: the device machines here have a driver, CUDA 13 and NCCL
# (in their Python packages) but no Rust toolchain and no network. The CUDA 13 compiler, runtime,
# cuBLAS, cuRAND, NVRTC and NCCL come from PyPI into a virtual environment; the driver library
# is linked against a stub (`libcuda.so.1`, the driver's own name, is loaded on the GPU
# machine). Writes `.gpu/` (ignored by git), compressed to fit what a call to the GPU machine
# carries (64 MiB with the working tree; stripped, the two are 120 MB, compressed 15 MB):
#
#   .gpu/gpu-tests.xz   the GPU parity tests (tests/tests/gpu.rs)
#   .gpu/occult.xz      the command, for `--cuda N`
#
#   scripts/gpu-build.sh            # then, on the GPU machine: scripts/gpu-check.sh
#
# CUDA 13.0, the GPU machines' driver version: a driver runs PTX from its own CUDA version or
# older, so candle's kernels are compiled with nvcc 13.0 and cudarc binds CUDA 13.0's API.
#
# Env: OCCULT_CUDA_VENV (default target/cuda-build-venv), CARGO_TARGET_DIR (default
# target/cuda-build), CUDA_COMPUTE_CAP (default 90: H100/H200).
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${OCCULT_CUDA_VENV:-target/cuda-build-venv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# The compiler and headers of CUDA 13.0; the libraries are only linked against (their sonames
# are the same across 13.x), the GPU machine's own are loaded.
# (nvcc's front end and headers come in packages of their own, pinned with it: a newer front
# end writes PTX that 13.0's assembler refuses.)
"$venv/bin/pip" install --quiet --disable-pip-version-check nvidia-cuda-nvcc==13.0.88 \
  nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-cuda-runtime==13.0.88 \
  nvidia-cuda-cccl==13.0.85 nvidia-cublas==13.10.0.20 nvidia-curand==10.4.5.25 \
  nvidia-cuda-nvrtc==13.0.88 nvidia-nccl-cu13==2.32.3
site=$("$venv/bin/python" -c 'import nvidia; print(nvidia.__path__[0])')
cuda="$site/cu13"

# Unversioned names for the linker, and a stub of the driver library.
link=$(realpath -m "${CARGO_TARGET_DIR:-target/cuda-build}")/link
mkdir -p "$link/lib64"
for lib in "$cuda"/lib/libcudart.so.* "$cuda"/lib/libnvrtc.so.* "$cuda"/lib/libcurand.so.* \
  "$cuda"/lib/libcublas.so.* "$cuda"/lib/libcublasLt.so.* "$site"/nccl/lib/libnccl.so.*; do
  case $lib in *builtins*) continue ;; esac
  name=$(basename "$lib")
  ln -sf "$lib" "$link/lib64/${name%%.so*}.so"
done
# Every driver function cuda.h declares, under its versioned name (cuMemAlloc_v2...), and the
# profiler's three (their header is not in the PyPI packages).
{
  echo '#include <cuda.h>' | cc -E -I"$cuda/include" - |
    grep -oE '\bcu[A-Z][A-Za-z0-9_]*[[:space:]]*\(' | tr -d '( '
  printf '%s\n' cuProfilerInitialize cuProfilerStart cuProfilerStop
} | sort -u | sed 's/.*/void &(void) {}/' >"$link/stub.c"
cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$link/lib64/libcuda.so" "$link/stub.c"

export PATH="$cuda/bin:$PATH" CUDA_HOME="$cuda" CUDA_ROOT="$link"
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90} CUDARC_CUDA_VERSION=13000
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/cuda-build}

tests=$(cargo test --release -p occult-tests --features occult-tests/nccl --test gpu --no-run \
  --message-format=json | "$venv/bin/python" -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu":
        print(m["executable"])')
cargo build --release -p occult-eval --features occult-eval/nccl
rm -rf .gpu && mkdir -p .gpu
cp "$tests" .gpu/gpu-tests
cp "$CARGO_TARGET_DIR/release/occult" .gpu/occult
strip .gpu/gpu-tests .gpu/occult
xz -T0 -6 .gpu/gpu-tests .gpu/occult
# What gpu-check.sh checks the machine against.
nvcc --version | sed -n 's/.*release \([0-9.]*\),.*/cuda \1/p' >.gpu/build.txt
echo "compute_cap $CUDA_COMPUTE_CAP" >>.gpu/build.txt
ls -la .gpu; cat .gpu/build.txt
echo "gpu build: .gpu/ is ready; on the GPU machine run scripts/gpu-check.sh (carry .gpu)"
