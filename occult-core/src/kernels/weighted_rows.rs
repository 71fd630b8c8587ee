//! `y += Σ_j w[j] · x_j` over the rows `x_j` of a matrix, accumulated in f32: the value
//! product of decode's attention, a query row's probabilities against the cached values
//! read in place (the linear kernels take their second operand as rows of the reduced
//! dimension, so they need the values transposed, a pass over the whole cache per step).
//! Sixteen lanes at AVX-512, eight at AVX2, a plain loop elsewhere; bf16 rows are widened
//! exactly, so each product is exact in f32 and only the sums round.

use super::isa::{isa, Isa};
use super::vmath::Stored;
use half::bf16;

/// A row element the vector forms read: f32 as it is, bf16 widened.
pub trait RowElem: Stored {
    /// # Safety
    /// AVX-512 F and BW; `x` valid for `n <= 16` elements.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(x: *const Self, n: usize) -> std::arch::x86_64::__m512;
    /// # Safety
    /// AVX2 and FMA; `x` valid for `n <= 8` elements.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(x: *const Self, n: usize) -> std::arch::x86_64::__m256;
    fn to_f32(self) -> f32;
}

impl RowElem for f32 {
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn load16(x: *const f32, n: usize) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        _mm512_maskz_loadu_ps(((1u32 << n) - 1) as __mmask16, x)
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn load8(x: *const f32, n: usize) -> std::arch::x86_64::__m256 {
        super::elem::avx2::load_f32(x, n)
    }
    fn to_f32(self) -> f32 {
        self
    }
}

impl RowElem for bf16 {
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load16(x: *const bf16, n: usize) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        let h = _mm256_maskz_loadu_epi16(((1u32 << n) - 1) as __mmask16, x as *const i16);
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn load8(x: *const bf16, n: usize) -> std::arch::x86_64::__m256 {
        super::elem::avx2::load_bf16(x as *const u16, n)
    }
    fn to_f32(self) -> f32 {
        self.to_f32()
    }
}

/// `y += Σ_j w[j] · x[j * d..(j + 1) * d]` with `d = y.len()`.
///
/// # Panics
/// If `x` does not hold `w.len()` rows of `y.len()`.
pub fn weighted_rows<E: RowElem>(w: &[f32], x: &[E], y: &mut [f32]) {
    weighted_rows_on(isa(), w, x, y)
}

/// [`weighted_rows`] with the instruction sets `isa` (at most this CPU's).
pub fn weighted_rows_on<E: RowElem>(isa: Isa, w: &[f32], x: &[E], y: &mut [f32]) {
    let d = y.len();
    assert_eq!(
        x.len(),
        w.len() * d,
        "weighted_rows: {} rows of {d}",
        w.len()
    );
    #[cfg(target_arch = "x86_64")]
    if isa.avx512f && isa.avx512bw {
        // SAFETY: AVX-512 F and BW (VL with BW on every such CPU) are in `isa`, at most this
        // CPU's; the lengths were checked.
        return unsafe { x86::weighted_rows(w, x, y) };
    } else if isa.avx2 {
        // SAFETY: AVX2 and FMA are in `isa`; the lengths were checked.
        return unsafe { avx2::weighted_rows(w, x, y) };
    }
    let _ = isa;
    for (&wj, row) in w.iter().zip(x.chunks_exact(d.max(1))) {
        for (yc, &xc) in y.iter_mut().zip(row) {
            *yc += wj * xc.to_f32();
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::RowElem;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub unsafe fn weighted_rows<E: RowElem>(w: &[f32], x: &[E], y: &mut [f32]) {
        let (d, xp, yp) = (y.len(), x.as_ptr(), y.as_mut_ptr());
        let mut c = 0;
        while c < d {
            let n = (d - c).min(16);
            let mask = ((1u32 << n) - 1) as __mmask16;
            let mut acc = _mm512_maskz_loadu_ps(mask, yp.add(c));
            for (j, &wj) in w.iter().enumerate() {
                acc = _mm512_fmadd_ps(_mm512_set1_ps(wj), E::load16(xp.add(j * d + c), n), acc);
            }
            _mm512_mask_storeu_ps(yp.add(c), mask, acc);
            c += 16;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::RowElem;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn weighted_rows<E: RowElem>(w: &[f32], x: &[E], y: &mut [f32]) {
        let (d, xp) = (y.len(), x.as_ptr());
        let mut c = 0;
        while c < d {
            let n = (d - c).min(8);
            let mut buf = [0f32; 8];
            buf[..n].copy_from_slice(&y[c..c + n]);
            let mut acc = _mm256_loadu_ps(buf.as_ptr());
            for (j, &wj) in w.iter().enumerate() {
                acc = _mm256_fmadd_ps(_mm256_set1_ps(wj), E::load8(xp.add(j * d + c), n), acc);
            }
            _mm256_storeu_ps(buf.as_mut_ptr(), acc);
            y[c..c + n].copy_from_slice(&buf[..n]);
            c += 8;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::Level;

    /// Every level this CPU has, against the sum in f64: products exact in f32 (bf16 rows) or
    /// rounded once, sums within `1.01 n U Σ|w x|` (`U = 2⁻²⁴`).
    #[test]
    fn weighted_rows_equal_the_plain_sum_at_every_level() {
        for level in Level::supported() {
            let isa = Isa::detect().at(level);
            for (rows, d) in [(0, 5), (1, 1), (3, 7), (40, 16), (9, 128), (17, 33)] {
                let w: Vec<f32> = (0..rows)
                    .map(|j| ((j * 7 % 11) as f32 - 5.0) / 3.0)
                    .collect();
                let x: Vec<f32> = (0..rows * d)
                    .map(|i| ((i * 13 % 17) as f32 - 8.0) / 5.0)
                    .collect();
                let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
                let y0: Vec<f32> = (0..d).map(|c| c as f32 * 0.25).collect();
                for bf in [false, true] {
                    let mut y = y0.clone();
                    if bf {
                        weighted_rows_on(isa, &w, &xb, &mut y);
                    } else {
                        weighted_rows_on(isa, &w, &x, &mut y);
                    }
                    for c in 0..d {
                        let xs = |j: usize| {
                            if bf {
                                xb[j * d + c].to_f64()
                            } else {
                                x[j * d + c] as f64
                            }
                        };
                        let want: f64 =
                            y0[c] as f64 + (0..rows).map(|j| w[j] as f64 * xs(j)).sum::<f64>();
                        let mag: f64 = y0[c].abs() as f64
                            + (0..rows).map(|j| (w[j] as f64 * xs(j)).abs()).sum::<f64>();
                        let tol = 1.01 * (rows + 2) as f64 * 2f64.powi(-24) * mag + 1e-30;
                        assert!(
                            (y[c] as f64 - want).abs() <= tol,
                            "{level} bf16 {bf} {rows}x{d} [{c}]: {} vs {want}",
                            y[c]
                        );
                    }
                }
            }
        }
    }
}
