//! The many-row f32 path of [`super::gemm_nt`]: `C = A · Bᵀ` as outer products over a packed
//! panel of `B`, for long prefills and training batches, where the dot-product tiles would
//! re-read `B` from L2 for every four rows.
//!
//! `B` is taken [`PC`] columns (weight rows) at a time and packed so that one `k` step of the
//! panel is contiguous (`[k][PC]`, zero past the last column). A micro-tile of [`PR`] rows of
//! `A` keeps `PR x PC/16` accumulators, broadcasts one `A` value per row and step, and reads
//! two vectors of the panel. `k` is walked in blocks that keep the panel's block in L1
//! while every micro-tile passes over it. Panels are split across rayon's threads; each writes
//! its own columns of `C`.

use super::Shared;
use rayon::prelude::*;

/// Rows of `A` per micro-tile.
pub const PR: usize = 8;
/// Columns of `C` (rows of `B`) per panel: two 16-lane vectors.
const PC: usize = 32;
/// `k` per block: 32 KB of panel.
const KC_F32: usize = 256;

/// Runs `panel(n0, cols)` for every panel, in parallel when there is more than one thread.
fn for_each_panel(n: usize, panel: impl Fn(usize, usize) + Sync + Send) {
    let panels = n.div_ceil(PC);
    let one = |p: usize| {
        let n0 = p * PC;
        panel(n0, PC.min(n - n0));
    };
    if panels <= 1 || rayon::current_num_threads() <= 1 {
        (0..panels).for_each(one);
    } else {
        (0..panels).into_par_iter().for_each(one);
    }
}

/// `c = a · bᵀ` in f32 (`c` overwritten).
///
/// # Safety
/// AVX-512 F; slices of `m * k`, `n * k` and `m * n` elements.
#[cfg(target_arch = "x86_64")]
pub unsafe fn gemm_f32(a: &[f32], b: &[f32], c: &mut [f32], m: usize, n: usize, k: usize) {
    if k == 0 {
        c.fill(0.0);
        return;
    }
    let (pa, pb, pc) = (
        Shared(a.as_ptr()),
        Shared(b.as_ptr()),
        Shared(c.as_mut_ptr()),
    );
    for_each_panel(n, |n0, cols| {
        let mut panel = vec![0f32; k * PC];
        for j in 0..cols {
            let row = std::slice::from_raw_parts(pb.at((n0 + j) * k), k);
            for (kk, &v) in row.iter().enumerate() {
                panel[kk * PC + j] = v;
            }
        }
        let mut kb = 0;
        while kb < k {
            let kc = KC_F32.min(k - kb);
            let mut r = 0;
            while r < m {
                let rows = PR.min(m - r);
                x86::micro_f32(
                    rows,
                    pa.at(r * k + kb),
                    k,
                    panel.as_ptr().add(kb * PC),
                    kc,
                    pc.at(r * n + n0),
                    n,
                    cols,
                    kb == 0,
                );
                r += rows;
            }
            kb += kc;
        }
    });
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The micro-tiles, one instantiation per row count.
    use super::PC;
    use std::arch::x86_64::*;

    macro_rules! by_rows {
        ($f:ident, $rows:expr, $($arg:expr),*) => {
            match $rows {
                8 => $f::<8>($($arg),*),
                7 => $f::<7>($($arg),*),
                6 => $f::<6>($($arg),*),
                5 => $f::<5>($($arg),*),
                4 => $f::<4>($($arg),*),
                3 => $f::<3>($($arg),*),
                2 => $f::<2>($($arg),*),
                1 => $f::<1>($($arg),*),
                r => unreachable!("micro-tile of {r} rows"),
            }
        };
    }

    #[allow(clippy::too_many_arguments)]
    pub unsafe fn micro_f32(
        rows: usize,
        a: *const f32,
        lda: usize,
        panel: *const f32,
        kc: usize,
        c: *mut f32,
        ldc: usize,
        cols: usize,
        first: bool,
    ) {
        by_rows!(
            micro_f32_const,
            rows,
            a,
            lda,
            panel,
            kc,
            c,
            ldc,
            cols,
            first
        )
    }

    /// Lanes of the two output vectors that hold real columns.
    fn masks(cols: usize) -> (__mmask16, __mmask16) {
        let lo = cols.min(16);
        let hi = cols.saturating_sub(16).min(16);
        (
            ((1u32 << lo) - 1) as __mmask16,
            ((1u32 << hi) - 1) as __mmask16,
        )
    }

    /// Writes (or adds, after the first `k` block) the accumulators to `c`'s real columns.
    #[target_feature(enable = "avx512f")]
    unsafe fn store<const R: usize>(
        acc: &[[__m512; 2]; R],
        c: *mut f32,
        ldc: usize,
        cols: usize,
        first: bool,
    ) {
        let (m0, m1) = masks(cols);
        for (i, row) in acc.iter().enumerate() {
            let p = c.add(i * ldc);
            let (mut v0, mut v1) = (row[0], row[1]);
            if !first {
                v0 = _mm512_add_ps(v0, _mm512_maskz_loadu_ps(m0, p));
                v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(m1, p.add(16)));
            }
            _mm512_mask_storeu_ps(p, m0, v0);
            _mm512_mask_storeu_ps(p.add(16), m1, v1);
        }
    }

    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn micro_f32_const<const R: usize>(
        a: *const f32,
        lda: usize,
        panel: *const f32,
        kc: usize,
        c: *mut f32,
        ldc: usize,
        cols: usize,
        first: bool,
    ) {
        let mut acc = [[_mm512_setzero_ps(); 2]; R];
        for kk in 0..kc {
            let b0 = _mm512_loadu_ps(panel.add(kk * PC));
            let b1 = _mm512_loadu_ps(panel.add(kk * PC + 16));
            for (i, row) in acc.iter_mut().enumerate() {
                let av = _mm512_set1_ps(*a.add(i * lda + kk));
                row[0] = _mm512_fmadd_ps(av, b0, row[0]);
                row[1] = _mm512_fmadd_ps(av, b1, row[1]);
            }
        }
        store::<R>(&acc, c, ldc, cols, first);
    }
}
