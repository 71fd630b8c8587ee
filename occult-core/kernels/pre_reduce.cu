// Occult's pre-reduction on the GPU (see occult-core/src/ep/pre_reduce.rs): every received
// row's expert outputs, gate-weighted and summed into the row, in one pass.
//
// Pairs are listed per output row (`row_start[r]..row_start[r + 1]` in `row_pairs`), so each
// output element is one thread's sum over its row's pairs in a fixed order: no atomics, and the
// same bits on every run. Adjacent threads take adjacent columns of one row, so the reads of
// `y` coalesce.

#include <stdint.h>

// out[r, h] = sum_j g_j * y[p_j, h] over the pairs p_j of row r, where g_j is
// weight[weight_at[p_j]] when WEIGHTED, else 1 (standard dispatch: the source applies the gate
// weights later).
template <bool WEIGHTED>
__device__ void pre_reduce(
    const float *y,
    const float *weight,
    const uint32_t *weight_at,
    const uint32_t *row_start,
    const uint32_t *row_pairs,
    float *out,
    const uint32_t rows,
    const uint32_t hidden) {
  const uint64_t n = (uint64_t)rows * hidden;
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (uint64_t)blockDim.x * gridDim.x) {
    const uint64_t r = i / hidden;
    const uint64_t h = i % hidden;
    float acc = 0.0f;
    for (uint32_t j = row_start[r]; j < row_start[r + 1]; ++j) {
      const uint32_t p = row_pairs[j];
      const float v = y[(uint64_t)p * hidden + h];
      acc += WEIGHTED ? weight[weight_at[p]] * v : v;
    }
    out[i] = acc;
  }
}

extern "C" __global__ void pre_reduce_weighted_f32(
    const float *y, const float *weight, const uint32_t *weight_at, const uint32_t *row_start,
    const uint32_t *row_pairs, float *out, const uint32_t rows, const uint32_t hidden) {
  pre_reduce<true>(y, weight, weight_at, row_start, row_pairs, out, rows, hidden);
}

extern "C" __global__ void pre_reduce_f32(
    const float *y, const uint32_t *row_start, const uint32_t *row_pairs, float *out,
    const uint32_t rows, const uint32_t hidden) {
  pre_reduce<false>(y, nullptr, nullptr, row_start, row_pairs, out, rows, hidden);
}
