//! The operand element types the kernels take, f32 and bf16 ([`Elem`]), and bf16 widened to f32
//! with AVX-512 or AVX2 vectors (a shift into the high half); [`transpose`] lays a slice of
//! them out the other way, for a kernel that takes the other operand order.

use super::isa::Simd;
use half::bf16;

/// An operand element type with kernels here: f32 or bf16.
pub trait Elem: Copy + Send + Sync + 'static {
    /// Whether the element is f32 already (weight rows are then read in place).
    const IS_F32: bool;
    fn to_f32(self) -> f32;
    /// Widens `src` into `dst` (same length) with `simd`'s vectors.
    ///
    /// # Safety
    /// `simd`'s instructions.
    unsafe fn widen(src: &[Self], dst: &mut [f32], simd: Simd);
}

impl Elem for f32 {
    const IS_F32: bool = true;
    fn to_f32(self) -> f32 {
        self
    }
    unsafe fn widen(src: &[f32], dst: &mut [f32], _: Simd) {
        dst.copy_from_slice(src)
    }
}

impl Elem for bf16 {
    const IS_F32: bool = false;
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    unsafe fn widen(src: &[bf16], dst: &mut [f32], simd: Simd) {
        #[cfg(target_arch = "x86_64")]
        match simd {
            Simd::Avx512 => avx512::widen_bf16(src, dst),
            Simd::Avx2 => avx2::widen_bf16(src, dst),
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = simd;
            for (d, s) in dst.iter_mut().zip(src) {
                *d = s.to_f32();
            }
        }
    }
}

/// `dst` `[cols, rows]` = `src` `[rows, cols]` transposed, in blocks of 16 rows (each column of
/// a block is written as one run).
pub fn transpose<E: Copy>(src: &[E], dst: &mut [E], rows: usize, cols: usize) {
    for r0 in (0..rows).step_by(16) {
        let r1 = (r0 + 16).min(rows);
        for c in 0..cols {
            let run = &mut dst[c * rows + r0..c * rows + r1];
            for (i, d) in run.iter_mut().enumerate() {
                *d = src[(r0 + i) * cols + c];
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use half::bf16;
    use std::arch::x86_64::*;

    /// bf16 to f32 is a shift into the high half.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn widen_bf16(src: &[bf16], dst: &mut [f32]) {
        let n = src.len().min(dst.len());
        let s = src.as_ptr() as *const u16;
        let d = dst.as_mut_ptr();
        let mut i = 0;
        while i + 16 <= n {
            let h = _mm256_loadu_si256(s.add(i) as *const __m256i);
            let w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
            _mm512_storeu_ps(d.add(i), _mm512_castsi512_ps(w));
            i += 16;
        }
        while i < n {
            *d.add(i) = f32::from_bits((*s.add(i) as u32) << 16);
            i += 1;
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    use half::bf16;
    use std::arch::x86_64::*;

    /// bf16 to f32, eight at a time.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn widen_bf16(src: &[bf16], dst: &mut [f32]) {
        let n = src.len().min(dst.len());
        let s = src.as_ptr() as *const u16;
        let d = dst.as_mut_ptr();
        let mut i = 0;
        while i + 8 <= n {
            _mm256_storeu_ps(d.add(i), load_bf16(s.add(i), 8));
            i += 8;
        }
        while i < n {
            *d.add(i) = f32::from_bits((*s.add(i) as u32) << 16);
            i += 1;
        }
    }

    /// Eight f32 from `p`, or its first `n < 8` and zeros.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(in crate::kernels) unsafe fn load_f32(p: *const f32, n: usize) -> __m256 {
        if n >= 8 {
            _mm256_loadu_ps(p)
        } else {
            let mut buf = [0f32; 8];
            std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), n);
            _mm256_loadu_ps(buf.as_ptr())
        }
    }

    /// The sum of the eight lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(in crate::kernels) unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// Eight bf16 from `p` (or its first `n < 8` and zeros) as f32.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(in crate::kernels) unsafe fn load_bf16(p: *const u16, n: usize) -> __m256 {
        let h = if n >= 8 {
            _mm_loadu_si128(p as *const __m128i)
        } else {
            let mut buf = [0u16; 8];
            std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), n);
            _mm_loadu_si128(buf.as_ptr() as *const __m128i)
        };
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    }
}
