#!/usr/bin/env bash
# Compile check of the GPU build (`cuda` and `nccl` features) on a machine without a GPU or a
# CUDA install: nvcc and the CUDA headers come from PyPI (nvidia-cuda-nvcc, -runtime, -cccl;
# CUDA 13) into a virtual environment, and `cargo check` and clippy run on every target with
# the features on. candle's build compiles its .cu kernels to PTX for CUDA_COMPUTE_CAP (90: an
# H100/H200) with that nvcc; nothing is linked or run, so no driver and no NCCL library is
# needed (binaries built with the features link libcuda.so.1 and libnccl.so.2 dynamically: see
# scripts/gpu-build.sh).
#
#   scripts/cuda-check.sh            # venv in target/cuda-venv, build in target/cuda-check
#
# Env: OCCULT_CUDA_VENV (the venv), CARGO_TARGET_DIR (default target/cuda-check),
# CUDAFORGE_THREADS (default: every core), NVCC_APPEND_FLAGS (default -Xptxas -O0),
# CUDA_COMPUTE_CAP (default 90), CUDARC_CUDA_VERSION (default 13040: cudarc's bindings for
# CUDA 13.4, the newest it knows; the driver API it calls is the same in 13.5).
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${OCCULT_CUDA_VENV:-target/cuda-venv}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
# Pinned to the versions checked (a new major version moves the layout: nvidia/cu13 ...).
# pip is quiet when everything is there already.
"$venv/bin/pip" install --quiet --disable-pip-version-check \
  nvidia-cuda-nvcc==13.5.37 nvidia-nvvm==13.5.37 nvidia-cuda-crt==13.5.37 \
  nvidia-cuda-runtime==13.5.37 nvidia-cuda-cccl==13.3.5.0.6
cuda=$("$venv/bin/python" -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13"))')
[ -x "$cuda/bin/nvcc" ] || { echo "nvcc not found under $cuda" >&2; exit 1; }

export PATH="$cuda/bin:$PATH" CUDA_ROOT="$cuda" CUDA_PATH="$cuda" CUDA_HOME="$cuda"
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90} CUDARC_CUDA_VERSION=${CUDARC_CUDA_VERSION:-13040}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/cuda-check}
# Most of the check's time is candle-kernels' build script compiling its CUDA kernels (5.5 of
# 8.5 minutes on 2 cores, one file at a time: cudaforge takes half the cores by default). Here
# it takes them all, and ptxas skips optimising the machine code it writes, which is never run.
export CUDAFORGE_THREADS=${CUDAFORGE_THREADS:-$(nproc)}
export NVCC_APPEND_FLAGS=${NVCC_APPEND_FLAGS:--Xptxas -O0}
nvcc --version | tail -1

features=occult-tests/nccl,occult-tests/mpi,occult-eval/nccl
cargo clippy --workspace --all-targets --features "$features" -- -D warnings
echo "cuda check: cargo clippy with cuda,nccl passed"
