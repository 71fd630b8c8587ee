//! The many-row path of bf16 weights at the `avx512bf16` level: outer products as
//! [`super::outer`]'s, multiplied with `vdpbf16ps`, which adds two bf16 products
//! into each f32 lane per instruction, where the f32 path's FMA adds one. On CPUs without
//! AMX whose `vdpbf16ps` issues as fast as an FMA (AMD's Zen 4 and 5), that is twice the
//! multiply-adds; where it issues at half the FMA rate (Intel's, which have AMX anyway) it is
//! even.
//!
//! `A` is packed once per call in tiles of up to [`MT`] rows, as pairs along `k`: tile `t`
//! holds `[k / 2][16 v]` 32-bit lanes, lane `(p, r)` being row `r`'s elements `2p` and
//! `2p + 1` (a zero for the second where `k` is odd; rows padded with zeros to whole
//! vectors). `B` is read in place: a micro-tile broadcasts one weight row's pair at each step
//! (32 bits of two bf16 elements, as stored) and multiplies it into the tile's `v` vectors,
//! keeping `v x NR` accumulators over a block of `k`. Their columns go into a transposed
//! buffer, turned into rows of `C` when the tile is done ([`super::outer::store_tile`]). A
//! weight row's last element of an odd `k` (whose pair would run into the next row) and
//! micro-tiles short of columns are read from a zero-padded copy.
//!
//! Every product is of bf16 values (exact in f32) and the sums are f32's, as on the other
//! paths; `vdpbf16ps` treats denormal inputs and results as zero. f32 activations are rounded
//! to bf16 (to nearest, even) as they are packed, as the AMX kernel rounds them.

use super::outer::{block_width, nr_for, store_tile, vectors, MT};
use super::shared::Shared;
use half::bf16;
use rayon::prelude::*;

/// Pairs of `k` per block: the packed tile's block (`KP x 64` lanes, 256 KB) stays in L2, and
/// each weight row is read in runs of 2 KB.
const KP: usize = 512;

/// An activation as the bf16 bits `vdpbf16ps` multiplies: bf16 as it is, f32 rounded.
pub trait PairElem: Copy + Send + Sync {
    fn bf16_bits(self) -> u32;
}

impl PairElem for bf16 {
    fn bf16_bits(self) -> u32 {
        u32::from(self.to_bits())
    }
}

impl PairElem for f32 {
    fn bf16_bits(self) -> u32 {
        u32::from(bf16::from_f32(self).to_bits())
    }
}

/// `A` `[m, k]` packed as pairs tile by tile: tile `t` starts at `MT * t * kp` (`kp = ⌈k/2⌉`)
/// and holds `[kp][16 * vectors(rows)]` lanes, zero past its last row.
fn pack_a<A: PairElem>(a: &[A], m: usize, k: usize) -> Vec<u32> {
    let kp = k.div_ceil(2);
    let tiles = m.div_ceil(MT);
    let last = m - (tiles - 1) * MT;
    let mut packed = vec![0u32; (tiles - 1) * MT * kp + 16 * vectors(last) * kp];
    let bits = |x: A| x.bf16_bits();
    let mut parts: Vec<&mut [u32]> = Vec::with_capacity(tiles);
    let mut rest = packed.as_mut_slice();
    for t in 0..tiles {
        let rows = MT.min(m - t * MT);
        let (head, tail) = rest.split_at_mut((16 * vectors(rows) * kp).min(rest.len()));
        parts.push(head);
        rest = tail;
    }
    parts.into_par_iter().enumerate().for_each(|(t, dst)| {
        let rows = MT.min(m - t * MT);
        let width = 16 * vectors(rows);
        for r in 0..rows {
            let row = &a[(t * MT + r) * k..(t * MT + r + 1) * k];
            for (p, pair) in row.chunks(2).enumerate() {
                let hi = pair.get(1).map_or(0, |&x| bits(x));
                dst[p * width + r] = bits(pair[0]) | hi << 16;
            }
        }
    });
    packed
}

/// `c[m, n] = a[m, k] · b[n, k]ᵀ`, accumulated in f32, with `vdpbf16ps`.
///
/// # Safety
/// AVX-512 F and BF16; slices of `m * k`, `n * k` and `m * n` elements.
pub unsafe fn gemm<A: PairElem>(a: &[A], b: &[bf16], c: &mut [f32], m: usize, n: usize, k: usize) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        c.fill(0.0);
        return;
    }
    let kp = k.div_ceil(2);
    let packed = pack_a(a, m, k);
    let (pa, pb, pc) = (
        Shared(packed.as_ptr()),
        Shared(b.as_ptr().cast::<u16>()),
        Shared(c.as_mut_ptr()),
    );
    let width = block_width(n);
    let blocks = n.div_ceil(width);
    let block = |blk: usize| {
        let c0 = blk * width;
        let c1 = (c0 + width).min(n);
        let mut ct = vec![0f32; (c1 - c0) * MT];
        // Zero-padded weight pairs: a micro-tile short of columns, or an odd `k`'s last pair.
        let mut wbuf: Vec<u16> = Vec::new();
        for t in 0..m.div_ceil(MT) {
            let rows = MT.min(m - t * MT);
            let v = vectors(rows);
            let nr = nr_for(v);
            let tile = pa.at(t * MT * kp);
            let mut pb0 = 0;
            while pb0 < kp {
                let pairs = KP.min(kp - pb0);
                // Whole pairs of every row lie in the row; an odd `k`'s last does not.
                let whole = pb0 + pairs <= k / 2;
                let mut j = c0;
                while j < c1 {
                    let cols = nr.min(c1 - j);
                    let (w, ldw) = if cols == nr && whole {
                        (pb.at(j * k + 2 * pb0), k)
                    } else {
                        let ldw = 2 * pairs;
                        wbuf.clear();
                        wbuf.resize(nr * ldw, 0);
                        for r in 0..cols {
                            let from = 2 * pb0;
                            let len = (k - from).min(ldw);
                            let src = std::slice::from_raw_parts(pb.at((j + r) * k + from), len);
                            wbuf[r * ldw..r * ldw + len].copy_from_slice(src);
                        }
                        (wbuf.as_ptr(), ldw)
                    };
                    let (at, out) = (
                        tile.add(pb0 * 16 * v),
                        ct.as_mut_ptr().add((j - c0) * 16 * v),
                    );
                    #[cfg(target_arch = "x86_64")]
                    x86::micro(v, at, w, ldw, pairs, out, cols, pb0 == 0);
                    #[cfg(not(target_arch = "x86_64"))]
                    unreachable!("x86 kernels on another CPU ({at:?} {out:?} {w:?} {ldw})");
                    j += cols;
                }
                pb0 += pairs;
            }
            store_tile(
                super::isa::Simd::Avx512,
                &ct,
                rows,
                c1 - c0,
                pc.at(t * MT * n + c0),
                n,
            );
        }
    };
    if blocks > 1 && rayon::current_num_threads() > 1 {
        (0..blocks).into_par_iter().for_each(block);
    } else {
        (0..blocks).for_each(block);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The micro-tiles, one instantiation per vector count.
    use super::nr_for;
    use std::arch::x86_64::*;

    /// How far ahead (in bf16) each weight row is prefetched, a line each 16 pairs.
    const PF: usize = 256;

    /// The micro-tile for a tile of `v` vectors of rows: `nr_for(v)` weight rows from `w` (row
    /// stride `ldw` bf16, `pairs` pairs long), of which the first `cols` are real, into the
    /// transposed output `ct` (`[column][16 v]`; overwritten when `first`, else added to).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn micro(
        v: usize,
        a: *const u32,
        w: *const u16,
        ldw: usize,
        pairs: usize,
        ct: *mut f32,
        cols: usize,
        first: bool,
    ) {
        match v {
            4 => micro_const::<4, { nr_for(4) }>(a, w, ldw, pairs, ct, cols, first),
            3 => micro_const::<3, { nr_for(3) }>(a, w, ldw, pairs, ct, cols, first),
            2 => micro_const::<2, { nr_for(2) }>(a, w, ldw, pairs, ct, cols, first),
            1 => micro_const::<1, { nr_for(1) }>(a, w, ldw, pairs, ct, cols, first),
            _ => unreachable!("tile of {v} vectors"),
        }
    }

    #[target_feature(enable = "avx512f,avx512bf16")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn micro_const<const V: usize, const NR: usize>(
        a: *const u32,
        w: *const u16,
        ldw: usize,
        pairs: usize,
        ct: *mut f32,
        cols: usize,
        first: bool,
    ) {
        let mut acc = [[_mm512_setzero_ps(); NR]; V];
        let rows: [*const u16; NR] = std::array::from_fn(|j| w.add(j * ldw));
        for p in 0..pairs {
            if p % 16 == 0 {
                for r in rows {
                    _mm_prefetch::<_MM_HINT_T0>(r.wrapping_add(2 * p + PF) as *const i8);
                }
            }
            let mut av = [_mm512_setzero_si512(); V];
            for (i, x) in av.iter_mut().enumerate() {
                *x = _mm512_loadu_si512(a.add(p * V * 16 + i * 16).cast());
            }
            // One broadcast pair per weight row, used by every vector of rows.
            #[allow(clippy::needless_range_loop)]
            for j in 0..NR {
                let pair = rows[j].add(2 * p).cast::<i32>().read_unaligned();
                let b: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair));
                for (i, x) in av.iter().enumerate() {
                    let x: __m512bh = std::mem::transmute(*x);
                    acc[i][j] = _mm512_dpbf16_ps(acc[i][j], x, b);
                }
            }
        }
        crate::kernels::outer::x86::store_acc(&acc, ct, cols, first);
    }
}
