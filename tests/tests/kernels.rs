//! The CPU linear kernels (`occult_core::kernels`) against plain f64 loops over the same
//! operands: forward and backward, f32, bf16 and f32 activations with bf16 weights, shapes with
//! 0 and 1 rows, odd sizes, and sizes that are not a multiple of a tile, a panel, a k block or
//! a vector; the fast path, each of its kernels forced, and the forced portable path; at every
//! instruction-set level this CPU supports (always the portable one). And the level detected
//! against what `/proc/cpuinfo` says.

use candle::{DType, Device, Tensor, Var};
use occult_core::kernels::{self, linear_on, Isa, Kernel, Level, Path};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// `[rows, cols]` of uniform values in [-1, 1), as f64 (for the reference) and as a tensor of
/// `dtype` holding the same values (rounded to `dtype` first, so both see one operand).
fn operand(rng: &mut ChaCha8Rng, rows: usize, cols: usize, dtype: DType) -> (Vec<f64>, Tensor) {
    let raw: Vec<f32> = (0..rows * cols)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let t = Tensor::from_vec(raw, (rows, cols), &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    (values(&t), t)
}

fn values(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// `a [m, k] · b [n, k]ᵀ` and, per output, `Σ |a b|` (what bounds its rounding error).
fn reference_nt(a: &[f64], b: &[f64], m: usize, n: usize, k: usize) -> (Vec<f64>, Vec<f64>) {
    let mut y = vec![0.0; m * n];
    let mut mag = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            for p in 0..k {
                y[i * n + j] += a[i * k + p] * b[j * k + p];
                mag[i * n + j] += (a[i * k + p] * b[j * k + p]).abs();
            }
        }
    }
    (y, mag)
}

fn transpose(a: &[f64], rows: usize, cols: usize) -> Vec<f64> {
    let mut t = vec![0.0; a.len()];
    for i in 0..rows {
        for j in 0..cols {
            t[j * rows + i] = a[i * cols + j];
        }
    }
    t
}

/// The instruction sets of every level this CPU supports, lowest first.
fn levels() -> Vec<(Level, Isa)> {
    Level::supported()
        .into_iter()
        .map(|l| (l, Isa::detect().at(l)))
        .collect()
}

/// Whether `path` may round f32 activations to bf16 before multiplying them by bf16 weights:
/// the AMX kernel and the `vdpbf16ps` outer products do (their products are of bf16 values),
/// where `isa` has them.
fn rounds_activations(isa: Isa, path: Path, dtype: DType, wdtype: DType) -> bool {
    let amx = isa.amx && matches!(path, Path::Auto | Path::Kernel(Kernel::Amx));
    let dp = isa.avx512bf16 && matches!(path, Path::Auto | Path::Kernel(Kernel::OuterDp));
    dtype == DType::F32 && wdtype == DType::BF16 && (amx || dp)
}

/// Holds `got` to `want`: each output is a sum of `k` products accumulated in f32 (each
/// product exact in f32's significand for bf16 operands, rounded once for f32 ones), in any
/// order and grouping (lanes, tiles, `k` blocks), so it is within `γ_k Σ|a b|` of the exact
/// sum, `γ_k = k U / (1 - k U)` with f32's unit roundoff `U = 2⁻²⁴` (bounded here as
/// `1.01 k U`); plus one rounding to `dtype`, plus (with `rounded`) the rounding of one
/// operand to bf16 (relative 2⁻⁸ per product).
#[allow(clippy::too_many_arguments)]
fn assert_close(
    got: &[f64],
    want: &[f64],
    mag: &[f64],
    k: usize,
    dtype: DType,
    rounded: bool,
    what: &str,
) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let round = if dtype == DType::BF16 {
        2f64.powi(-8)
    } else {
        2f64.powi(-23)
    };
    let gamma = 1.01 * (k.max(1) as f64) * 2f64.powi(-24);
    for (i, ((g, w), m)) in got.iter().zip(want).zip(mag).enumerate() {
        let operand = if rounded { 2f64.powi(-8) * m } else { 0.0 };
        let tol = round * w.abs() + gamma * m + operand + 1e-30;
        assert!(
            (g - w).abs() <= tol,
            "{what}: element {i} is {g}, expected {w} (tolerance {tol})"
        );
    }
}

const SHAPES: &[(usize, usize, usize)] = &[
    (0, 5, 7),
    (1, 1, 1),
    (1, 64, 2048),
    // One row: the row kernels' tails of `k` (a whole vector, part of one, none), and weight
    // rows split unevenly across tasks.
    (1, 105, 40),
    (1, 3, 45),
    (1, 130, 2055),
    (1, 150, 33),
    (1, 171, 70),
    (3, 5, 7),
    (4, 4, 16),
    (4, 4, 32),
    (5, 9, 33),
    (7, 13, 31),
    (9, 130, 65),
    (17, 3, 100),
    (64, 67, 129),
    (8, 33, 600),
    (13, 40, 1029),
    (256, 33, 7),
    (260, 50, 300),
    // Outer-product tiles of 1 to 4 vectors, after full tiles; `n` off the micro-tile widths
    // and the column blocks; `k` off its blocks.
    (49, 50, 300),
    (69, 97, 257),
    (84, 49, 513),
    (104, 7, 40),
    (128, 145, 256),
    (200, 300, 33),
    (2, 1, 0),
    // AMX: weights read in place (`n` a multiple of 32, `k` of 32) with 1 to 5 row tiles, a
    // last column block of one weight tile, a long `k`, and rows in three row blocks (64 rows
    // a block at k = 4096, the last one a part tile).
    (16, 32, 32),
    (33, 64, 64),
    (40, 48, 96),
    (70, 96, 512),
    (150, 40, 4096),
];

/// The shapes of a run under emulation (`OCCULT_TEST_EMULATED=1`, which scripts/levels.sh sets
/// under qemu-user): there every floating-point operation is a call into QEMU's soft-float, 50
/// to 100 times slower, so these keep what [`SHAPES`] is for (0 and 1 rows, tails of every
/// tile, vector and column block; `k` past the AVX2 outer kernel's blocks of 512 (f32) and 256
/// (bf16); several 64-row tiles) at about a fortieth of the work. The AMX shapes are left out:
/// QEMU has no AMX (nor AVX-512), so those paths run natively only.
const EMULATED_SHAPES: &[(usize, usize, usize)] = &[
    (0, 5, 7),
    (1, 1, 1),
    (2, 1, 0),
    (3, 5, 7),
    (4, 4, 16),
    (4, 4, 32),
    (5, 9, 33),
    (7, 13, 31),
    (17, 3, 100),
    (1, 20, 1030),
    (1, 171, 70),
    (9, 130, 65),
    (26, 7, 600),
    (69, 19, 257),
    (104, 7, 40),
    (256, 33, 7),
    (49, 50, 30),
    (200, 30, 33),
];

/// [`SHAPES`], or [`EMULATED_SHAPES`] under emulation.
fn shapes() -> &'static [(usize, usize, usize)] {
    if std::env::var_os("OCCULT_TEST_EMULATED").is_some_and(|v| v == "1") {
        EMULATED_SHAPES
    } else {
        SHAPES
    }
}

/// Activation and weight dtypes: one dtype, or f32 activations with bf16 weights.
const DTYPES: &[(DType, DType)] = &[
    (DType::F32, DType::F32),
    (DType::BF16, DType::BF16),
    (DType::F32, DType::BF16),
];

fn check_forward(path: Path) {
    for (level, isa) in levels() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        for &(dtype, wdtype) in DTYPES {
            for &(m, n, k) in shapes() {
                let (a, x) = operand(&mut rng, m, k, dtype);
                let (b, w) = operand(&mut rng, n, k, wdtype);
                let y = linear_on(&x, &w, path, isa).unwrap();
                assert_eq!(y.dims(), [m, n]);
                assert_eq!(y.dtype(), dtype);
                let (want, mag) = reference_nt(&a, &b, m, n, k);
                assert_close(
                    &values(&y),
                    &want,
                    &mag,
                    k,
                    dtype,
                    rounds_activations(isa, path, dtype, wdtype),
                    &format!("{level} {path:?} {dtype:?} x {wdtype:?} {m}x{n}x{k}"),
                );
            }
        }
    }
}

#[test]
fn fast_forward_equals_plain_loops() {
    check_forward(Path::Auto);
}

#[test]
fn forced_portable_forward_equals_plain_loops() {
    check_forward(Path::Portable);
}

/// Each kernel at every shape, whatever the row count would pick.
#[test]
fn each_kernel_forward_equals_plain_loops() {
    // Say which levels ran, so that a log shows what was held (without AMX the AMX kernel is
    // the outer one).
    eprintln!("levels: {:?}", Level::supported());
    check_forward(Path::Kernel(Kernel::Rows));
    check_forward(Path::Kernel(Kernel::Dot));
    check_forward(Path::Kernel(Kernel::Outer));
    check_forward(Path::Kernel(Kernel::Amx));
    check_forward(Path::Kernel(Kernel::OuterDp));
}

/// Gradients of `Σ r ⊙ (x · wᵀ)`: `dx = r · w`, `dw = rᵀ · x`.
fn check_backward(path: Path) {
    for (level, isa) in levels() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        for &(dtype, wdtype) in DTYPES {
            for &(m, n, k) in shapes() {
                let (a, x) = operand(&mut rng, m, k, dtype);
                let (b, w) = operand(&mut rng, n, k, wdtype);
                let (r, rt) = operand(&mut rng, m, n, dtype);
                let (xv, wv) = (Var::from_tensor(&x).unwrap(), Var::from_tensor(&w).unwrap());
                let y = linear_on(xv.as_tensor(), wv.as_tensor(), path, isa).unwrap();
                let loss = (y * rt)
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
                    .sum_all()
                    .unwrap();
                let grads = loss.backward().unwrap();
                let what = format!("{level} {path:?} {dtype:?} x {wdtype:?} {m}x{n}x{k}");
                // dx [m, k] = r [m, n] · (wᵀ [k, n])ᵀ
                let (dx, dx_mag) = reference_nt(&r, &transpose(&b, n, k), m, k, n);
                let got = grads
                    .get(xv.as_tensor())
                    .map(values)
                    .unwrap_or(vec![0.0; m * k]);
                let rounded = rounds_activations(isa, path, dtype, wdtype);
                let dx_what = format!("{what} dx");
                assert_close(&got, &dx, &dx_mag, n, dtype, rounded, &dx_what);
                // dw [n, k] = rᵀ [n, m] · (xᵀ [k, m])ᵀ
                let (dw, dw_mag) =
                    reference_nt(&transpose(&r, m, n), &transpose(&a, m, k), n, k, m);
                let got = grads
                    .get(wv.as_tensor())
                    .map(values)
                    .unwrap_or(vec![0.0; n * k]);
                assert_close(&got, &dw, &dw_mag, m, wdtype, false, &format!("{what} dw"));
            }
        }
    }
}

#[test]
fn fast_backward_equals_plain_loops() {
    check_backward(Path::Auto);
}

#[test]
fn forced_portable_backward_equals_plain_loops() {
    check_backward(Path::Portable);
}

#[test]
fn each_kernel_backward_equals_plain_loops() {
    check_backward(Path::Kernel(Kernel::Rows));
    check_backward(Path::Kernel(Kernel::Dot));
    check_backward(Path::Kernel(Kernel::Outer));
    check_backward(Path::Kernel(Kernel::Amx));
    check_backward(Path::Kernel(Kernel::OuterDp));
}

#[test]
fn leading_dimensions_and_strided_operands_are_accepted() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    for dtype in [DType::F32, DType::BF16] {
        let (a, x) = operand(&mut rng, 6, 10, dtype);
        let (b, w) = operand(&mut rng, 10, 5, dtype);
        // x as [2, 3, 10]; w given transposed (a strided view of [10, 5]).
        let y = kernels::linear(&x.reshape((2, 3, 10)).unwrap(), &w.t().unwrap()).unwrap();
        assert_eq!(y.dims(), [2, 3, 5]);
        let (want, mag) = reference_nt(&a, &transpose(&b, 10, 5), 6, 5, 10);
        assert_close(
            &values(&y),
            &want,
            &mag,
            10,
            dtype,
            false,
            &format!("{dtype:?} 3-d"),
        );
    }
    let x = Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap();
    let w = Tensor::zeros((4, 5), DType::F32, &Device::Cpu).unwrap();
    let err = kernels::linear(&x, &w).unwrap_err().to_string();
    assert!(err.contains("shape mismatch"), "{err}");
    // bf16 activations with f32 weights have no meaning here: refused, not guessed.
    let x = Tensor::zeros((2, 5), DType::BF16, &Device::Cpu).unwrap();
    let err = kernels::linear(&x, &w).unwrap_err().to_string();
    assert!(err.contains("dtype mismatch"), "{err}");
}

/// The process's path is what `OCCULT_KERNELS` says, and the fast path names its kernel.
#[test]
fn the_path_in_use_is_reported() {
    let d = kernels::describe(DType::BF16);
    let isa = kernels::isa();
    match (kernels::process_path(), isa.avx512bf16, isa.avx2) {
        (Path::Auto, true, _) => assert!(d.starts_with("avx512-bf16"), "{d}"),
        (Path::Auto, false, true) => assert!(d.starts_with("avx2-bf16"), "{d}"),
        _ => assert!(d.starts_with("portable"), "{d}"),
    }
    if let Ok(asked) = std::env::var("OCCULT_KERNELS") {
        if let Some(level) = Level::parse(&asked) {
            assert_eq!(
                kernels::process_level(),
                level.min(Isa::detect().level()),
                "OCCULT_KERNELS={asked}"
            );
        }
    }
}

/// The level `/proc/cpuinfo`'s flags call for: AMX (with the AVX-512 sets its path packs
/// with), AVX-512 F with BF16, AVX-512 F, AVX2 with FMA, or portable.
fn level_from_cpuinfo(flags: &[&str]) -> Level {
    let has = |f: &str| flags.contains(&f);
    if has("amx_tile") && has("amx_bf16") && has("avx512bw") && has("avx512_bf16") {
        Level::Amx
    } else if has("avx512f") && has("avx512_bf16") {
        Level::Avx512Bf16
    } else if has("avx512f") {
        Level::Avx512
    } else if has("avx2") && has("fma") {
        Level::Avx2
    } else {
        Level::Portable
    }
}

/// Detection picks the level the CPU has. Natively that is what `/proc/cpuinfo` says; under
/// qemu-user, which shows the host's `/proc/cpuinfo` but answers CPUID as the emulated model,
/// the run names the model's level in `OCCULT_EXPECT_LEVEL` (as `.ci/run` does).
#[test]
fn the_detected_level_is_the_cpus() {
    let detected = Isa::detect().level();
    let expected = match std::env::var("OCCULT_EXPECT_LEVEL") {
        Ok(name) => Level::parse(&name)
            .unwrap_or_else(|| panic!("OCCULT_EXPECT_LEVEL={name:?} names no level")),
        Err(_) => {
            if !cfg!(target_arch = "x86_64") {
                assert_eq!(detected, Level::Portable);
                return;
            }
            let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") else {
                eprintln!("no /proc/cpuinfo here: detected {detected}, nothing to hold it to");
                return;
            };
            let line = info
                .lines()
                .find(|l| l.starts_with("flags"))
                .expect("/proc/cpuinfo has a flags line");
            let flags: Vec<&str> = line.split_whitespace().collect();
            let from_flags = level_from_cpuinfo(&flags);
            // AMX also needs the kernel's grant of the tile state; a CPU that lists AMX under
            // a kernel that refuses it runs AVX-512.
            if from_flags == Level::Amx && detected == Level::Avx512Bf16 {
                eprintln!("AMX listed but not granted by the OS: AVX-512 with BF16");
                Level::Avx512Bf16
            } else {
                from_flags
            }
        }
    };
    eprintln!("detected {detected}, expected {expected}");
    assert_eq!(detected, expected);
    assert_eq!(*Level::supported().last().unwrap(), detected);
}
