//! Element-wise math of the inference paths: `exp` (for softmax and SiLU) and f32 to bf16
//! rounding, sixteen lanes at a time on AVX-512 and eight on AVX2, with scalar fallbacks (the
//! portable level) that the tests hold them to; and [`Stored`], the element types those paths
//! keep activations in. Each function has an `_on` form that takes the instruction sets.
//!
//! `exp` is `2^n · p(r)`: `n = round(x · log2 e)`, `r = x - n ln 2` (ln 2 in two parts), `p` the
//! degree-6 Taylor polynomial of `e^r` on `|r| ≤ ln 2 / 2` (truncation under 2e-8, relative),
//! and `2^n` by `vscalefps` on AVX-512, or on AVX2 as two factors `2^(n/2)`, `2^(n - n/2)`
//! built in the exponent field (each a normal number for the `n` that occur), so that both
//! give 0 below the f32 range, subnormals rounded once, and +inf above it. It is within a few
//! ulp of the correctly rounded result; libm's `expf` is within one, so the two differ in the
//! last bits. The bf16 rounding is `vcvtneps2bf16` on AVX-512 BF16: round to nearest even, as
//! `half::bf16::from_f32`, except that it flushes f32 subnormals to zero; on AVX2 it is the
//! same integer rounding as `half`'s (subnormals kept, NaN kept quiet).

use super::{isa, Isa, Operand};
use half::bf16;

/// An element activations are stored in on the inference paths: f32 or bf16, with its
/// conversions to and from f32 and its form as a kernel operand.
pub trait Stored: Copy + Send + Sync + Default + 'static {
    /// `dst[i] = src[i]` widened to f32 (exact).
    fn widen(src: &[Self], dst: &mut [f32]);
    /// `dst[i] = src[i]` rounded to this type (to nearest even).
    fn round(src: &[f32], dst: &mut [Self]);
    /// The slice as an operand of [`super::linear_rows`].
    fn operand(s: &[Self]) -> Operand<'_>;
    /// The operand's elements if they are of this type.
    fn of(op: Operand<'_>) -> Option<&[Self]>;
}

impl Stored for f32 {
    fn widen(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src)
    }
    fn round(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src)
    }
    fn operand(s: &[f32]) -> Operand<'_> {
        Operand::F32(s)
    }
    fn of(op: Operand<'_>) -> Option<&[f32]> {
        match op {
            Operand::F32(s) => Some(s),
            _ => None,
        }
    }
}

impl Stored for bf16 {
    fn widen(src: &[bf16], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits((s.to_bits() as u32) << 16);
        }
    }
    fn round(src: &[f32], dst: &mut [bf16]) {
        to_bf16(src, dst)
    }
    fn operand(s: &[bf16]) -> Operand<'_> {
        Operand::Bf16(s)
    }
    fn of(op: Operand<'_>) -> Option<&[bf16]> {
        match op {
            Operand::Bf16(s) => Some(s),
            _ => None,
        }
    }
}

/// `xs[i] = exp(xs[i] - sub)` for every element; returns their sum (in f32, in lane order).
pub fn exp_sub_sum(xs: &mut [f32], sub: f32) -> f32 {
    exp_sub_sum_on(isa(), xs, sub)
}

/// [`exp_sub_sum`] with the instruction sets `isa` (at most this CPU's).
pub fn exp_sub_sum_on(isa: Isa, xs: &mut [f32], sub: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa.avx512f {
        // SAFETY: AVX-512 F is in `isa`, at most this CPU's.
        return unsafe { x86::exp_sub_sum(xs, sub) };
    } else if isa.avx2 {
        // SAFETY: AVX2 and FMA are in `isa`.
        return unsafe { avx2::exp_sub_sum(xs, sub) };
    }
    let _ = isa;
    let mut sum = 0.0;
    for x in xs {
        *x = (*x - sub).exp();
        sum += *x;
    }
    sum
}

/// `xs = softmax(scale * xs)` in place: max, `exp(x - max)`, sum, divide (candle's steps).
pub fn scaled_softmax(xs: &mut [f32], scale: f32) {
    scaled_softmax_on(isa(), xs, scale)
}

/// [`scaled_softmax`] with the instruction sets `isa` (at most this CPU's).
pub fn scaled_softmax_on(isa: Isa, xs: &mut [f32], scale: f32) {
    scaled_softmax_sink_on(isa, xs, scale, None)
}

/// [`scaled_softmax`] with an attention sink (gpt-oss): the softmax over `scale * xs` and the
/// logit `sink`, whose share is dropped (its `exp` joins the max and the sum only).
pub fn scaled_softmax_sink(xs: &mut [f32], scale: f32, sink: Option<f32>) {
    scaled_softmax_sink_on(isa(), xs, scale, sink)
}

/// [`scaled_softmax_sink`] with the instruction sets `isa` (at most this CPU's).
pub fn scaled_softmax_sink_on(isa: Isa, xs: &mut [f32], scale: f32, sink: Option<f32>) {
    if xs.is_empty() {
        return;
    }
    let with_sink = |max: f32| sink.map_or(max, |s| max.max(s));
    let sink_term = |max: f32| sink.map_or(0.0, |s| (s - max).exp());
    #[cfg(target_arch = "x86_64")]
    if isa.avx512f {
        // SAFETY: AVX-512 F is in `isa`, at most this CPU's.
        let max = with_sink(unsafe { x86::scale_max(xs, scale) });
        let sum = exp_sub_sum_on(isa, xs, max) + sink_term(max);
        // SAFETY: as above.
        return unsafe { x86::div(xs, sum) };
    } else if isa.avx2 {
        // SAFETY: AVX2 and FMA are in `isa`.
        let max = with_sink(unsafe { avx2::scale_max(xs, scale) });
        let sum = exp_sub_sum_on(isa, xs, max) + sink_term(max);
        // SAFETY: as above.
        return unsafe { avx2::div(xs, sum) };
    }
    let mut max = f32::NEG_INFINITY;
    for x in xs.iter_mut() {
        *x *= scale;
        max = max.max(*x);
    }
    let max = with_sink(max);
    let sum = exp_sub_sum_on(isa, xs, max) + sink_term(max);
    for x in xs.iter_mut() {
        *x /= sum;
    }
}

/// SwiGLU's middle: `g[i] = silu(g[i]) * u[i]`, `silu(v) = v / (1 + exp(-v))`.
pub fn silu_mul(g: &mut [f32], u: &[f32]) {
    silu_mul_on(isa(), g, u)
}

/// [`silu_mul`] with the instruction sets `isa` (at most this CPU's).
pub fn silu_mul_on(isa: Isa, g: &mut [f32], u: &[f32]) {
    assert_eq!(g.len(), u.len(), "silu_mul: operands of different lengths");
    #[cfg(target_arch = "x86_64")]
    if isa.avx512f {
        // SAFETY: AVX-512 F is in `isa`, at most this CPU's; the lengths match.
        return unsafe { x86::silu_mul(g, u) };
    } else if isa.avx2 {
        // SAFETY: AVX2 and FMA are in `isa`; the lengths match.
        return unsafe { avx2::silu_mul(g, u) };
    }
    let _ = isa;
    for (g, &u) in g.iter_mut().zip(u) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// gpt-oss's clamped SwiGLU in place: `g[i] = g' sigmoid(alpha g') (u' + 1)` with `g' =
/// min(g + bg, limit)` and `u' = clamp(u + bu, -limit, limit)`, the biases `(bg, bu)` (one row
/// each, added to every row of `g` and `u`) if given; `u` is scratch (overwritten). Runs as
/// [`silu_mul`] of `alpha g'` and `(u' + 1) / alpha`, which is the same product: two more
/// roundings (3 U more, relative) than the formula's.
pub fn clamped_swiglu(
    g: &mut [f32],
    u: &mut [f32],
    alpha: f32,
    limit: f32,
    bias: Option<(&[f32], &[f32])>,
) {
    clamped_swiglu_on(isa(), g, u, alpha, limit, bias)
}

/// [`clamped_swiglu`] with the instruction sets `isa` (at most this CPU's).
pub fn clamped_swiglu_on(
    isa: Isa,
    g: &mut [f32],
    u: &mut [f32],
    alpha: f32,
    limit: f32,
    bias: Option<(&[f32], &[f32])>,
) {
    assert_eq!(
        g.len(),
        u.len(),
        "clamped_swiglu: operands of different lengths"
    );
    let inv = 1.0 / alpha;
    let zero = [0f32; 1];
    let (bg, bu) = bias.unwrap_or((&zero, &zero));
    assert!(
        !bg.is_empty() && bg.len() == bu.len() && g.len().is_multiple_of(bg.len()),
        "clamped_swiglu: bias rows of {} and {} for {} values",
        bg.len(),
        bu.len(),
        g.len()
    );
    // Plain loops the compiler vectorises (add, min, max, multiply): one pass over each.
    for row in g.chunks_exact_mut(bg.len()) {
        for (x, &b) in row.iter_mut().zip(bg) {
            *x = (*x + b).min(limit) * alpha;
        }
    }
    for row in u.chunks_exact_mut(bu.len()) {
        for (x, &b) in row.iter_mut().zip(bu) {
            *x = ((*x + b).max(-limit).min(limit) + 1.0) * inv;
        }
    }
    silu_mul_on(isa, g, u)
}

/// `dst[i] = bf16(src[i])`, rounded to nearest even.
pub fn to_bf16(src: &[f32], dst: &mut [bf16]) {
    to_bf16_on(isa(), src, dst)
}

/// [`to_bf16`] with the instruction sets `isa` (at most this CPU's).
pub fn to_bf16_on(isa: Isa, src: &[f32], dst: &mut [bf16]) {
    assert_eq!(src.len(), dst.len(), "to_bf16: slices of different lengths");
    #[cfg(target_arch = "x86_64")]
    if isa.avx512bf16 {
        // SAFETY: AVX-512 F and BF16 are in `isa`, at most this CPU's; the lengths match.
        return unsafe { x86::to_bf16(src, dst) };
    } else if isa.avx2 {
        // SAFETY: AVX2 is in `isa`; the lengths match.
        return unsafe { avx2::to_bf16(src, dst) };
    }
    let _ = isa;
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = bf16::from_f32(s);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The sixteen-lane forms.
    use half::bf16;
    use std::arch::x86_64::*;

    /// `exp` of sixteen lanes (see the module doc).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn exp16(x: __m512) -> __m512 {
        let x = _mm512_max_ps(x, _mm512_set1_ps(-104.0));
        let x = _mm512_min_ps(x, _mm512_set1_ps(89.0));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_145_75), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428_606_8e-6), r);
        let mut p = _mm512_set1_ps(1.0 / 720.0);
        for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        _mm512_scalef_ps(p, n)
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn exp_sub_sum(xs: &mut [f32], sub: f32) -> f32 {
        let (n, p) = (xs.len(), xs.as_mut_ptr());
        let s = _mm512_set1_ps(sub);
        let mut acc = _mm512_setzero_ps();
        let mut i = 0;
        while i < n {
            let mask = tail(i, n);
            let x = _mm512_maskz_loadu_ps(mask, p.add(i));
            let e = exp16(_mm512_sub_ps(x, s));
            _mm512_mask_storeu_ps(p.add(i), mask, e);
            acc = _mm512_mask_add_ps(acc, mask, acc, e);
            i += 16;
        }
        _mm512_reduce_add_ps(acc)
    }

    /// Lanes of the 16 from `i` that are within `n`.
    #[inline]
    fn tail(i: usize, n: usize) -> __mmask16 {
        if n - i >= 16 {
            u16::MAX
        } else {
            (1u16 << (n - i)) - 1
        }
    }

    /// `xs *= scale`; returns the largest.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn scale_max(xs: &mut [f32], scale: f32) -> f32 {
        let (n, p) = (xs.len(), xs.as_mut_ptr());
        let s = _mm512_set1_ps(scale);
        let mut max = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut i = 0;
        while i < n {
            let mask = tail(i, n);
            let x = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, p.add(i)), s);
            _mm512_mask_storeu_ps(p.add(i), mask, x);
            max = _mm512_mask_max_ps(max, mask, max, x);
            i += 16;
        }
        _mm512_reduce_max_ps(max)
    }

    /// `xs /= d`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn div(xs: &mut [f32], d: f32) {
        let (n, p) = (xs.len(), xs.as_mut_ptr());
        let d = _mm512_set1_ps(d);
        let mut i = 0;
        while i < n {
            let mask = tail(i, n);
            let x = _mm512_maskz_loadu_ps(mask, p.add(i));
            _mm512_mask_storeu_ps(p.add(i), mask, _mm512_div_ps(x, d));
            i += 16;
        }
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn silu_mul(g: &mut [f32], u: &[f32]) {
        let (n, gp, up) = (g.len(), g.as_mut_ptr(), u.as_ptr());
        let one = _mm512_set1_ps(1.0);
        let mut i = 0;
        while i < n {
            let mask = tail(i, n);
            let x = _mm512_maskz_loadu_ps(mask, gp.add(i));
            let e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
            let silu = _mm512_div_ps(x, _mm512_add_ps(one, e));
            let y = _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(mask, up.add(i)));
            _mm512_mask_storeu_ps(gp.add(i), mask, y);
            i += 16;
        }
    }

    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn to_bf16(src: &[f32], dst: &mut [bf16]) {
        let (n, s, d) = (src.len(), src.as_ptr(), dst.as_mut_ptr() as *mut u16);
        let mut i = 0;
        while i < n {
            let mask = tail(i, n);
            let x = _mm512_maskz_loadu_ps(mask, s.add(i));
            let h: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(x));
            _mm256_mask_storeu_epi16(d.add(i) as *mut i16, mask, h);
            i += 16;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! The eight-lane forms (AVX2 and FMA). A tail is read and written with `vmaskmovps`.
    use half::bf16;
    use std::arch::x86_64::*;

    /// `exp` of eight lanes (see the module doc).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp8(x: __m256) -> __m256 {
        let x = _mm256_max_ps(x, _mm256_set1_ps(-104.0));
        let x = _mm256_min_ps(x, _mm256_set1_ps(89.0));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_145_75), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428_606_8e-6), r);
        let mut p = _mm256_set1_ps(1.0 / 720.0);
        for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        // n in [-150, 128]: 2^n as 2^h · 2^(n - h), h = n / 2, both in [-75, 64] (normal).
        let ni = _mm256_cvtps_epi32(n);
        let h = _mm256_srai_epi32::<1>(ni);
        let bias = _mm256_set1_epi32(127);
        let f1 = _mm256_slli_epi32::<23>(_mm256_add_epi32(h, bias));
        let f2 = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_sub_epi32(ni, h), bias));
        _mm256_mul_ps(
            _mm256_mul_ps(p, _mm256_castsi256_ps(f1)),
            _mm256_castsi256_ps(f2),
        )
    }

    /// Lanes of the 8 from `i` that are within `n`, as a `vmaskmovps` mask.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tail(i: usize, n: usize) -> __m256i {
        let left = (n - i).min(8) as i32;
        _mm256_cmpgt_epi32(
            _mm256_set1_epi32(left),
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        )
    }

    /// The sum of the eight lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// The largest of the eight lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hmax(v: __m256) -> f32 {
        let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_max_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_sub_sum(xs: &mut [f32], sub: f32) -> f32 {
        let (n, p) = (xs.len(), xs.as_mut_ptr());
        let s = _mm256_set1_ps(sub);
        let mut acc = _mm256_setzero_ps();
        let mut i = 0;
        while i < n {
            let mask = tail(i, n);
            let x = _mm256_maskload_ps(p.add(i), mask);
            let e = _mm256_and_ps(exp8(_mm256_sub_ps(x, s)), _mm256_castsi256_ps(mask));
            _mm256_maskstore_ps(p.add(i), mask, e);
            acc = _mm256_add_ps(acc, e);
            i += 8;
        }
        hsum(acc)
    }

    /// `xs *= scale`; returns the largest.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn scale_max(xs: &mut [f32], scale: f32) -> f32 {
        let (n, p) = (xs.len(), xs.as_mut_ptr());
        let s = _mm256_set1_ps(scale);
        let low = _mm256_set1_ps(f32::NEG_INFINITY);
        let mut max = low;
        let mut i = 0;
        while i < n {
            let mask = tail(i, n);
            let x = _mm256_mul_ps(_mm256_maskload_ps(p.add(i), mask), s);
            _mm256_maskstore_ps(p.add(i), mask, x);
            let x = _mm256_blendv_ps(low, x, _mm256_castsi256_ps(mask));
            max = _mm256_max_ps(max, x);
            i += 8;
        }
        hmax(max)
    }

    /// `xs /= d`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn div(xs: &mut [f32], d: f32) {
        let (n, p) = (xs.len(), xs.as_mut_ptr());
        let d = _mm256_set1_ps(d);
        let mut i = 0;
        while i < n {
            let mask = tail(i, n);
            let x = _mm256_maskload_ps(p.add(i), mask);
            _mm256_maskstore_ps(p.add(i), mask, _mm256_div_ps(x, d));
            i += 8;
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn silu_mul(g: &mut [f32], u: &[f32]) {
        let (n, gp, up) = (g.len(), g.as_mut_ptr(), u.as_ptr());
        let one = _mm256_set1_ps(1.0);
        let mut i = 0;
        while i < n {
            let mask = tail(i, n);
            let x = _mm256_maskload_ps(gp.add(i), mask);
            let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
            let silu = _mm256_div_ps(x, _mm256_add_ps(one, e));
            let y = _mm256_mul_ps(silu, _mm256_maskload_ps(up.add(i), mask));
            _mm256_maskstore_ps(gp.add(i), mask, y);
            i += 8;
        }
    }

    /// Round to nearest even in the integers, as `half::bf16::from_f32`: add `0x7fff` and the
    /// lowest kept bit, keep the high half; a NaN keeps its high half with the quiet bit set.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn to_bf16(src: &[f32], dst: &mut [bf16]) {
        let (n, s, d) = (src.len(), src.as_ptr(), dst.as_mut_ptr() as *mut u16);
        let (one, bias, quiet) = (
            _mm256_set1_epi32(1),
            _mm256_set1_epi32(0x7fff),
            _mm256_set1_epi32(0x40),
        );
        let mut i = 0;
        while i + 8 <= n {
            let x = _mm256_loadu_ps(s.add(i));
            let bits = _mm256_castps_si256(x);
            let high = _mm256_srli_epi32::<16>(bits);
            let lsb = _mm256_and_si256(high, one);
            let rounded =
                _mm256_srli_epi32::<16>(_mm256_add_epi32(bits, _mm256_add_epi32(bias, lsb)));
            let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(x, x));
            let r = _mm256_blendv_epi8(rounded, _mm256_or_si256(high, quiet), nan);
            // Eight 32-bit values under 2^16 to eight u16: pack within lanes, then gather the
            // two lanes' low halves.
            let packed = _mm256_permute4x64_epi64::<0b1000>(_mm256_packus_epi32(r, r));
            _mm_storeu_si128(d.add(i) as *mut __m128i, _mm256_castsi256_si128(packed));
            i += 8;
        }
        for j in i..n {
            *d.add(j) = bf16::from_f32(*s.add(j)).to_bits();
        }
    }
}

#[cfg(test)]
mod tests {
    //! Every function at every level this CPU supports (always the portable one), against f64
    //! or libm, within bounds derived from the algorithm (`U` is f32's unit roundoff, 2⁻²⁴).
    use super::*;
    use crate::kernels::Level;

    const U: f64 = 1.0 / (1u64 << 24) as f64;

    /// The instruction sets of every level this CPU supports, named.
    fn levels() -> Vec<(Level, Isa)> {
        Level::supported()
            .into_iter()
            .map(|l| (l, Isa::detect().at(l)))
            .collect()
    }

    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn exp_is_within_a_few_ulp_of_libm() {
        let xs: Vec<f32> = (0..20_001)
            .map(|i| -100.0 + i as f32 * 0.0094)
            .chain([0.0, -0.0, 88.5, -87.0, 1e-8, -1e-8])
            .collect();
        for (level, isa) in levels() {
            let mut ys = xs.clone();
            exp_sub_sum_on(isa, &mut ys, 0.5);
            for (&x, &y) in xs.iter().zip(&ys) {
                let want = (x - 0.5).exp();
                // Normal results within 4 ulp (the polynomial's truncation and its roundings);
                // results in the subnormal range within 1e-38.
                assert!(
                    ulps(y, want) <= 4 || (want < 1.2e-38 && (y - want).abs() < 1e-38),
                    "{level}: exp({}) = {y}, libm {want}",
                    x - 0.5
                );
            }
            // The sum of n positive terms, each within 4 ulp (8 U relative), summed in f32 in
            // any order: within (n - 1 + 8) U of the exact sum, relative.
            let mut zs: Vec<f32> = (0..1001).map(|i| i as f32 * 0.01).collect();
            let want: f64 = zs.iter().map(|&z| ((z - 10.0) as f64).exp()).sum();
            let sum = exp_sub_sum_on(isa, &mut zs, 10.0) as f64;
            let bound = (1000.0 + 8.0) * U * want;
            assert!((sum - want).abs() <= bound, "{level}: {sum} {want}");
            let mut big = [100.0f32, -200.0, f32::NEG_INFINITY];
            exp_sub_sum_on(isa, &mut big, 0.0);
            assert_eq!(big, [f32::INFINITY, 0.0, 0.0], "{level}");
        }
    }

    #[test]
    fn scaled_softmax_matches_the_plain_steps() {
        for (level, isa) in levels() {
            for n in [1usize, 7, 8, 9, 15, 16, 17, 100, 512] {
                let x0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.7).sin() * 30.0).collect();
                let mut x = x0.clone();
                scaled_softmax_on(isa, &mut x, 0.125);
                let y: Vec<f64> = x0.iter().map(|&v| v as f64 * 0.125).collect();
                let max = y.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = y.iter().map(|v| (v - max).exp()).sum();
                // Each exponent's argument is off by at most 4 M U (M the largest |scaled x|:
                // the scaling of x and of the max, and the subtraction), and exp adds 4 ulp (8
                // U): each term within (8 + 4 M) U; their sum in f32 adds (n - 1) U; the
                // division U. So each output is within (n + 16 + 8 M) U of the exact softmax,
                // relative (with 1% for second-order terms).
                let m = y.iter().fold(0f64, |a, v| a.max(v.abs()));
                let rel = 1.01 * (n as f64 + 16.0 + 8.0 * m) * U;
                for (i, &v) in y.iter().enumerate() {
                    let want = (v - max).exp() / sum;
                    assert!(
                        (x[i] as f64 - want).abs() <= rel * want,
                        "{level}: n {n}, element {i}: {} against {want} (bound {rel:e} relative)",
                        x[i]
                    );
                }
            }
        }
    }

    #[test]
    fn softmax_with_a_sink_matches_its_definition() {
        for (level, isa) in levels() {
            for (n, sink) in [(1usize, 0.3f32), (9, -2.0), (17, 5.0), (100, 40.0)] {
                let x0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.7).sin() * 30.0).collect();
                let mut x = x0.clone();
                scaled_softmax_sink_on(isa, &mut x, 0.125, Some(sink));
                let y: Vec<f64> = x0.iter().map(|&v| v as f64 * 0.125).collect();
                let max = y.iter().cloned().fold(sink as f64, f64::max);
                let sum: f64 =
                    y.iter().map(|v| (v - max).exp()).sum::<f64>() + (sink as f64 - max).exp();
                // As in the plain softmax, with the sink as one more term.
                let m = y.iter().fold((sink as f64).abs(), |a, v| a.max(v.abs()));
                let rel = 1.01 * (n as f64 + 17.0 + 8.0 * m) * U;
                for (i, &v) in y.iter().enumerate() {
                    let want = (v - max).exp() / sum;
                    assert!(
                        (x[i] as f64 - want).abs() <= rel * want + 1e-30,
                        "{level}: n {n}, sink {sink}, element {i}: {} against {want}",
                        x[i]
                    );
                }
            }
        }
    }

    #[test]
    fn clamped_swiglu_matches_its_definition() {
        let g0: Vec<f32> = (0..1003).map(|i| (i as f32 * 0.37).sin() * 9.0).collect();
        let u0: Vec<f32> = (0..1003).map(|i| (i as f32 * 0.11).cos() * 9.0).collect();
        // A bias row over rows of 17 (1003 = 59 x 17).
        let bg: Vec<f32> = (0..17).map(|i| i as f32 * 0.3 - 2.0).collect();
        let bu: Vec<f32> = (0..17).map(|i| 1.5 - i as f32 * 0.2).collect();
        let (alpha, limit) = (1.702f32, 7.0f32);
        for (level, isa) in levels() {
            for biased in [false, true] {
                let (mut g, mut u) = (g0.clone(), u0.clone());
                let bias = biased.then_some((bg.as_slice(), bu.as_slice()));
                clamped_swiglu_on(isa, &mut g, &mut u, alpha, limit, bias);
                for i in 0..g.len() {
                    // The biased inputs as f32 adds them (that rounding is the definition's).
                    let (b0, b1) = if biased {
                        (bg[i % 17], bu[i % 17])
                    } else {
                        (0.0, 0.0)
                    };
                    let x = ((g0[i] + b0) as f64).min(limit as f64);
                    let v = ((u0[i] + b1) as f64).clamp(-limit as f64, limit as f64) + 1.0;
                    let want = x / (1.0 + (-(alpha as f64) * x).exp()) * v;
                    // silu_mul's 12 U, the scaled inputs' 3 U (alpha g', u' + 1, the
                    // division), and the cancellation in u' + 1 near u' = -1 (absolute: U
                    // times |u'| + 1).
                    let bound = 16.0 * U * want.abs() + 2.0 * U * (limit as f64 + 1.0) * x.abs();
                    assert!(
                        (g[i] as f64 - want).abs() <= bound,
                        "{level} biased {biased}: g {} u {}: {} against {want}",
                        g0[i],
                        u0[i],
                        g[i]
                    );
                }
            }
        }
    }

    #[test]
    fn silu_mul_and_bf16_rounding_match_the_scalar_forms() {
        let g0: Vec<f32> = (0..1003).map(|i| (i as f32 * 0.37).sin() * 9.0).collect();
        let u: Vec<f32> = (0..1003).map(|i| (i as f32 * 0.11).cos()).collect();
        for (level, isa) in levels() {
            let mut g = g0.clone();
            silu_mul_on(isa, &mut g, &u);
            for i in 0..g.len() {
                let (x, v) = (g0[i] as f64, u[i] as f64);
                let want = x / (1.0 + (-x).exp()) * v;
                // exp within 8 U, 1 + e within 9 U, the division and the product 1 U each.
                let bound = 12.0 * U * want.abs();
                assert!(
                    (g[i] as f64 - want).abs() <= bound,
                    "{level}: silu({x}) * {v} = {}, want {want}",
                    g[i]
                );
            }
            // Ties to even, the largest finite values (one rounds to inf), infinities, NaN,
            // and a tail past the last whole vector.
            let special = [
                f32::from_bits(0x3f80_8000),
                f32::from_bits(0x3f81_8000),
                f32::from_bits(0xbf80_8001),
                f32::MAX,
                f32::from_bits(0x7f7f_7fff),
                f32::INFINITY,
                f32::NEG_INFINITY,
                f32::NAN,
                -0.0,
            ];
            let src: Vec<f32> = g.iter().chain(&special).copied().collect();
            let mut b = vec![bf16::ZERO; src.len()];
            to_bf16_on(isa, &src, &mut b);
            for (&s, &d) in src.iter().zip(&b) {
                assert_eq!(
                    d.to_bits(),
                    bf16::from_f32(s).to_bits(),
                    "{level}: bf16 of {s} ({:#010x})",
                    s.to_bits()
                );
            }
        }
    }
}
