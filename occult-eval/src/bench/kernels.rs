//! `occult bench kernels`: the linear kernels side by side on the same operands (candle's
//! matmul, the portable path, and Occult's kernels at this CPU's level) in f32 and bf16, with
//! GFLOP/s and each one's largest difference from the portable path; the memory read
//! bandwidth that bounds decode; and the FMA peak at each vector width.

use crate::table::Table;
use anyhow::Result;
use occult_core::kernels::{bench, describe, isa, process_level, Simd};
use std::path::Path;

/// Reads `MxNxK` shapes (rows x output features x input features), refusing any over 2^34
/// multiply-adds.
pub fn parse_shapes(given: &[String]) -> Result<Vec<(usize, usize, usize)>> {
    let mut shapes = Vec::new();
    for s in given {
        let dims: Vec<usize> = s
            .split('x')
            .map(|d| d.trim().parse::<usize>())
            .collect::<Result<_, _>>()
            .map_err(|_| anyhow::anyhow!("--shapes: {s:?} is not MxNxK (three whole numbers)"))?;
        let [m, n, k] = dims[..] else {
            anyhow::bail!("--shapes: {s:?} is not MxNxK (three whole numbers)");
        };
        if m * n * k > 1 << 34 {
            anyhow::bail!("--shapes: {s} is over 2^34 multiply-adds; give a smaller shape");
        }
        shapes.push((m, n, k));
    }
    Ok(shapes)
}

/// Times every candidate on `shapes` (`repeat` calls each, the best kept), measures the read
/// bandwidth over `bandwidth_mib` MiB, prints the tables and writes them as JSON to `json`.
pub fn run(
    shapes: &[(usize, usize, usize)],
    repeat: usize,
    bandwidth_mib: usize,
    json: Option<&Path>,
) -> Result<()> {
    let threads = rayon::current_num_threads();
    eprintln!(
        "{threads} threads; level {} (AVX2 {}, AVX-512 F {}, BF16 {}, AMX {}); f32: {}; bf16: {}",
        process_level(),
        isa().avx2,
        isa().avx512f,
        isa().avx512bf16,
        isa().amx,
        describe(candle::DType::F32),
        describe(candle::DType::BF16)
    );
    let mut rows = Vec::new();
    let mut t = Table::new(&[
        "shape",
        "dtype",
        "candidate",
        "ms",
        "GFLOP/s",
        "vs candle",
        "max |diff|",
    ]);
    for &(m, n, k) in shapes {
        for dtype in [candle::DType::F32, candle::DType::BF16] {
            let r = bench::time_linear(m, n, k, dtype, repeat)?;
            let candle_s = r[0].seconds;
            for c in &r {
                t.row(vec![
                    format!("{m}x{n}x{k}"),
                    c.dtype.clone(),
                    c.candidate.clone(),
                    format!("{:.3}", c.seconds * 1e3),
                    format!("{:.1}", c.gflops),
                    format!("{:.2}x", candle_s / c.seconds),
                    format!("{:.2e}", c.max_abs_diff),
                ]);
            }
            rows.extend(r);
        }
    }
    println!("{}", t.render());
    let bw = bench::read_bandwidth(bandwidth_mib << 20, 5);
    println!(
        "memory read bandwidth: {:.1} GB/s ({} MiB buffer, best of 5)",
        bw / 1e9,
        bandwidth_mib
    );
    // The FMA peak at each vector width this process's kernels may use.
    let mut peaks = serde_json::Map::new();
    for (simd, name, has) in [
        (Simd::Avx2, "avx2", isa().avx2),
        (Simd::Avx512, "avx512", isa().avx512f),
    ] {
        if let Some(peak) = has.then(|| bench::fma_peak(simd, 5)).flatten() {
            println!(
                "f32 FMA peak at {name} ({threads} threads, register-only loop, best of 5): \
                 {:.1} GFLOP/s",
                peak / 1e9
            );
            peaks.insert(name.into(), serde_json::json!(peak));
        }
    }
    if let Some(p) = json {
        let v = serde_json::json!({
            "threads": threads,
            "level": process_level().name(),
            "fma_peak_flops": peaks,
            "isa": {"avx2": isa().avx2, "avx512f": isa().avx512f, "avx512bf16": isa().avx512bf16, "amx": isa().amx},
            "timings": rows,
            "read_bandwidth_bytes_per_s": bw,
        });
        super::report::write(p, "kernels", v)?;
    }
    Ok(())
}
