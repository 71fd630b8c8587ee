//! Element-wise math of the inference paths on AVX-512: `exp` (for softmax and SiLU) and f32 to
//! bf16 rounding, sixteen lanes at a time, with scalar fallbacks that the tests hold them to;
//! and [`Stored`], the element types those paths keep activations in.
//!
//! `exp` is `2^n · p(r)`: `n = round(x · log2 e)`, `r = x - n ln 2` (ln 2 in two parts), `p` the
//! degree-6 Taylor polynomial of `e^r` on `|r| ≤ ln 2 / 2` (truncation under 2e-8, relative),
//! and `vscalefps` for `2^n`, which gives 0 below the f32 range and +inf above it. It is within
//! a few ulp of the correctly rounded result; libm's `expf` is within one, so the two differ
//! in the last bits. The bf16 rounding is `vcvtneps2bf16`: round to nearest even, as
//! `half::bf16::from_f32`, except that it flushes f32 subnormals to zero.

use super::{isa, Operand};
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
}

/// `xs[i] = exp(xs[i] - sub)` for every element; returns their sum (in f32, in lane order).
pub fn exp_sub_sum(xs: &mut [f32], sub: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa().avx512f {
        // SAFETY: AVX-512 F was detected.
        return unsafe { x86::exp_sub_sum(xs, sub) };
    }
    let mut sum = 0.0;
    for x in xs {
        *x = (*x - sub).exp();
        sum += *x;
    }
    sum
}

/// `xs = softmax(scale * xs)` in place: max, `exp(x - max)`, sum, divide (candle's steps).
pub fn scaled_softmax(xs: &mut [f32], scale: f32) {
    if xs.is_empty() {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa().avx512f {
        // SAFETY: AVX-512 F was detected.
        let max = unsafe { x86::scale_max(xs, scale) };
        let sum = exp_sub_sum(xs, max);
        // SAFETY: as above.
        return unsafe { x86::div(xs, sum) };
    }
    let mut max = f32::NEG_INFINITY;
    for x in xs.iter_mut() {
        *x *= scale;
        max = max.max(*x);
    }
    let sum = exp_sub_sum(xs, max);
    for x in xs.iter_mut() {
        *x /= sum;
    }
}

/// SwiGLU's middle: `g[i] = silu(g[i]) * u[i]`, `silu(v) = v / (1 + exp(-v))`.
pub fn silu_mul(g: &mut [f32], u: &[f32]) {
    assert_eq!(g.len(), u.len(), "silu_mul: operands of different lengths");
    #[cfg(target_arch = "x86_64")]
    if isa().avx512f {
        // SAFETY: AVX-512 F was detected; the lengths match.
        return unsafe { x86::silu_mul(g, u) };
    }
    for (g, &u) in g.iter_mut().zip(u) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// `dst[i] = bf16(src[i])`, rounded to nearest even.
pub fn to_bf16(src: &[f32], dst: &mut [bf16]) {
    assert_eq!(src.len(), dst.len(), "to_bf16: slices of different lengths");
    #[cfg(target_arch = "x86_64")]
    if isa().avx512bf16 {
        // SAFETY: AVX-512 F and BF16 were detected; the lengths match.
        return unsafe { x86::to_bf16(src, dst) };
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn exp_is_within_a_few_ulp_of_libm() {
        let xs: Vec<f32> = (0..20_001)
            .map(|i| -100.0 + i as f32 * 0.0094)
            .chain([0.0, -0.0, 88.5, -87.0, 1e-8, -1e-8])
            .collect();
        let mut ys = xs.clone();
        exp_sub_sum(&mut ys, 0.5);
        for (&x, &y) in xs.iter().zip(&ys) {
            let want = (x - 0.5).exp();
            // Normal results within 4 ulp; results in the subnormal range within 1e-38.
            assert!(
                ulps(y, want) <= 4 || (want < 1.2e-38 && (y - want).abs() < 1e-38),
                "exp({}) = {y}, libm {want}",
                x - 0.5
            );
        }
        // The sum, over a range that does not overflow it.
        let mut zs: Vec<f32> = (0..1001).map(|i| i as f32 * 0.01).collect();
        let want: f64 = zs.iter().map(|&z| ((z - 10.0) as f64).exp()).sum();
        let sum = exp_sub_sum(&mut zs, 10.0) as f64;
        assert!((sum - want).abs() <= 1e-5 * want, "{sum} {want}");
        let mut big = [100.0f32, -200.0, f32::NEG_INFINITY];
        exp_sub_sum(&mut big, 0.0);
        assert_eq!(big, [f32::INFINITY, 0.0, 0.0]);
    }

    #[test]
    fn scaled_softmax_matches_the_plain_steps() {
        for n in [1usize, 15, 16, 17, 100, 512] {
            let x0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.7).sin() * 30.0).collect();
            let mut x = x0.clone();
            scaled_softmax(&mut x, 0.125);
            let y: Vec<f64> = x0.iter().map(|&v| v as f64 * 0.125).collect();
            let max = y.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = y.iter().map(|v| (v - max).exp()).sum();
            for (i, &v) in y.iter().enumerate() {
                let want = (v - max).exp() / sum;
                assert!(
                    (x[i] as f64 - want).abs() <= 1e-6 * want.max(1e-30) + 1e-12,
                    "{n} {i}"
                );
            }
        }
    }

    #[test]
    fn silu_mul_and_bf16_rounding_match_the_scalar_forms() {
        let g0: Vec<f32> = (0..1003).map(|i| (i as f32 * 0.37).sin() * 9.0).collect();
        let u: Vec<f32> = (0..1003).map(|i| (i as f32 * 0.11).cos()).collect();
        let mut g = g0.clone();
        silu_mul(&mut g, &u);
        for i in 0..g.len() {
            let want = g0[i] / (1.0 + (-g0[i]).exp()) * u[i];
            assert!(
                (g[i] - want).abs() <= 4.0 * f32::EPSILON * want.abs().max(1e-30),
                "silu({}) * {} = {}, want {want}",
                g0[i],
                u[i],
                g[i]
            );
        }
        let mut b = vec![bf16::ZERO; g.len()];
        to_bf16(&g, &mut b);
        for (&s, &d) in g.iter().zip(&b) {
            assert_eq!(d.to_bits(), bf16::from_f32(s).to_bits(), "{s}");
        }
    }
}
