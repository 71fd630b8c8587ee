//! Side-by-side timing of the ways to compute `x · wᵀ` on this CPU (candle's matmul, the
//! portable path, our kernels) on the same operands in one run, and the machine's memory read
//! bandwidth, which bounds decode. Behind `occult bench kernels`.

use super::{linear_on, linear_with, process_level, Isa, Kernel, Level, Path};
use crate::Result;
use candle::{DType, Device, Tensor};
use rayon::prelude::*;
use serde::Serialize;
use std::time::Instant;

/// One candidate on one shape and dtype.
#[derive(Clone, Debug, Serialize)]
pub struct KernelTiming {
    pub dtype: String,
    /// `candle` (candle's matmul as models call it), `portable`, `occult` (the kernel picked by
    /// rows), one kernel forced (`occult-rows` at one row, `occult-dot`, `occult-outer`, `occult-amx`), or the kernel
    /// picked by rows at a lower level than the process's (`occult@avx2`).
    pub candidate: String,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// Best of the timed calls, seconds.
    pub seconds: f64,
    pub gflops: f64,
    /// Largest difference from the portable path's output (0 for itself).
    pub max_abs_diff: f64,
}

/// The candidates for `dtype`, each as a name and the call.
type Candidate<'a> = (String, Box<dyn Fn() -> Result<Tensor> + 'a>);

/// Times candle's matmul, the portable path, ours as picked and each of our kernels forced, on
/// `[m, k] · [n, k]ᵀ` in `dtype`: one warm-up call, then the best of `repeat` (of 2 for a
/// candidate expected to take over a second a call, as candle's bf16 matmul does at prefill
/// sizes).
pub fn time_linear(
    m: usize,
    n: usize,
    k: usize,
    dtype: DType,
    repeat: usize,
) -> Result<Vec<KernelTiming>> {
    let dev = Device::Cpu;
    let x = Tensor::randn(0f32, 1.0, (m, k), &dev)?.to_dtype(dtype)?;
    let w = Tensor::randn(0f32, 1.0, (n, k), &dev)?.to_dtype(dtype)?;
    let flops = 2.0 * (m * n * k) as f64;
    let mut candidates: Vec<Candidate> = vec![
        ("candle".into(), Box::new(|| Ok(x.matmul(&w.t()?)?))),
        (
            "portable".into(),
            Box::new(|| linear_with(&x, &w, Path::Portable)),
        ),
        (
            "occult".into(),
            Box::new(|| linear_with(&x, &w, Path::Auto)),
        ),
        (
            "occult-dot".into(),
            Box::new(|| linear_with(&x, &w, Path::Kernel(Kernel::Dot))),
        ),
        (
            "occult-outer".into(),
            Box::new(|| linear_with(&x, &w, Path::Kernel(Kernel::Outer))),
        ),
    ];
    if m == 1 {
        candidates.push((
            "occult-rows".into(),
            Box::new(|| linear_with(&x, &w, Path::Kernel(Kernel::Rows))),
        ));
    }
    if dtype == DType::BF16 && super::isa().avx512bf16 {
        candidates.push((
            "occult-outer-dp".into(),
            Box::new(|| linear_with(&x, &w, Path::Kernel(Kernel::OuterDp))),
        ));
    }
    if dtype == DType::BF16 && super::isa().amx {
        candidates.push((
            "occult-amx".into(),
            Box::new(|| linear_with(&x, &w, Path::Kernel(Kernel::Amx))),
        ));
    }
    // The kernels of each lower level this CPU has, side by side with the process's.
    for level in Level::supported() {
        if level > Level::Portable && level < process_level() {
            let (isa, x, w) = (Isa::detect().at(level), &x, &w);
            candidates.push((
                format!("occult@{level}"),
                Box::new(move || linear_on(x, w, Path::Auto, isa)),
            ));
        }
    }
    let base = linear_with(&x, &w, Path::Portable)?.to_dtype(DType::F64)?;
    let mut out = Vec::new();
    for (name, f) in &candidates {
        let t = Instant::now();
        let y = f()?;
        let first = t.elapsed().as_secs_f64();
        let runs = if first > 1.0 {
            repeat.min(2)
        } else {
            repeat.max(1)
        };
        let mut best = f64::INFINITY;
        for _ in 0..runs {
            let t = Instant::now();
            f()?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        let diff = (y.to_dtype(DType::F64)? - &base)?
            .abs()?
            .flatten_all()?
            .max(0)?;
        out.push(KernelTiming {
            dtype: format!("{dtype:?}").to_lowercase(),
            candidate: name.to_string(),
            m,
            n,
            k,
            seconds: best,
            gflops: flops / best / 1e9,
            max_abs_diff: if m * n == 0 { 0.0 } else { diff.to_scalar()? },
        });
    }
    Ok(out)
}

/// Memory read bandwidth in bytes per second: the best of `repeat` parallel sums over a buffer
/// of `bytes` (make it far larger than the last-level cache).
pub fn read_bandwidth(bytes: usize, repeat: usize) -> f64 {
    // Integer sums: the compiler may reorder them, so the loop vectorises and the time is the
    // memory's.
    let buf: Vec<u64> = (0..bytes / 8).map(|i| i as u64).collect();
    let mut best = f64::INFINITY;
    let mut sink = 0u64;
    for _ in 0..repeat.max(1) {
        let t = Instant::now();
        let s = buf
            .par_chunks(1 << 15)
            .map(|c| c.iter().fold(0u64, |a, &b| a.wrapping_add(b)))
            .reduce(|| 0, u64::wrapping_add);
        best = best.min(t.elapsed().as_secs_f64());
        sink = sink.wrapping_add(s);
    }
    std::hint::black_box(sink);
    (buf.len() * 8) as f64 / best
}

/// The f32 FMA peak of this CPU at `simd`'s width on all of rayon's threads, in FLOP/s, or
/// `None` where the CPU lacks that width: the best of `repeat` runs of a loop of independent
/// register-only FMAs (twelve chains, more than latency times issue ports on current x86
/// cores), so no load or store bounds it. What a kernel's GFLOP/s is to be read against: a
/// product cannot run faster than this.
pub fn fma_peak(simd: super::Simd, repeat: usize) -> Option<f64> {
    let cpu = Isa::detect();
    let (has, lanes) = match simd {
        super::Simd::Avx2 => (cpu.avx2, 8),
        super::Simd::Avx512 => (cpu.avx512f, 16),
    };
    if !has {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        const ITERS: usize = 4_000_000;
        let threads = rayon::current_num_threads().max(1);
        let mut best = f64::INFINITY;
        for _ in 0..repeat.max(1) {
            let t = Instant::now();
            let sink: f32 = (0..threads)
                .into_par_iter()
                .map(|_| {
                    // SAFETY: the CPU has the width (checked above).
                    unsafe {
                        match simd {
                            super::Simd::Avx2 => fma_chains::avx2(ITERS),
                            super::Simd::Avx512 => fma_chains::avx512(ITERS),
                        }
                    }
                })
                .sum();
            best = best.min(t.elapsed().as_secs_f64());
            std::hint::black_box(sink);
        }
        Some((threads * ITERS * fma_chains::CHAINS * lanes * 2) as f64 / best)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (repeat, lanes);
        None
    }
}

#[cfg(target_arch = "x86_64")]
mod fma_chains {
    //! Register-only FMA loops for [`super::fma_peak`].
    use std::arch::x86_64::*;

    /// Independent accumulator chains.
    pub const CHAINS: usize = 12;

    /// # Safety
    /// AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn avx2(iters: usize) -> f32 {
        let (m, a) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
        let mut acc = [_mm256_set1_ps(1.0); CHAINS];
        for _ in 0..iters {
            for r in acc.iter_mut() {
                *r = _mm256_fmadd_ps(*r, m, a);
            }
        }
        let mut out = [0f32; 8];
        let s = acc
            .iter()
            .fold(_mm256_setzero_ps(), |s, &r| _mm256_add_ps(s, r));
        _mm256_storeu_ps(out.as_mut_ptr(), s);
        out.iter().sum()
    }

    /// # Safety
    /// AVX-512 F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn avx512(iters: usize) -> f32 {
        let (m, a) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
        let mut acc = [_mm512_set1_ps(1.0); CHAINS];
        for _ in 0..iters {
            for r in acc.iter_mut() {
                *r = _mm512_fmadd_ps(*r, m, a);
            }
        }
        let s = acc
            .iter()
            .fold(_mm512_setzero_ps(), |s, &r| _mm512_add_ps(s, r));
        _mm512_reduce_add_ps(s)
    }
}
