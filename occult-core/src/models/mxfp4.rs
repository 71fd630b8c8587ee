//! MXFP4 expert weights, as gpt-oss checkpoints store them, dequantized as transformers
//! dequantizes them on load (`transformers.integrations.mxfp4.convert_moe_packed_tensors`).
//!
//! A projection `P` of the experts is stored as `P_blocks`, uint8 `[experts, rows, groups,
//! 16]` (32 four-bit E2M1 codes a group, two a byte, the low nibble first), and `P_scales`,
//! uint8 `[experts, rows, groups]` (one E8M0 exponent a group, biased by 127). Value `j` of a
//! group is `FP4_VALUES[code_j] * 2^(scale - 127)`, computed exactly (as `ldexp` does) and
//! rounded to the dtype, so past 2^128 it is infinite; the result is laid out `[experts,
//! groups * 32, rows]`, the input dimension first, as gpt-oss's experts multiply by it.
//! Held to transformers' own function bit for bit, both dtypes, every code under every
//! exponent (`tests/fixtures/mxfp4/`, `scripts/make_mxfp4_fixtures.py`).

use crate::{bail, Result};
use candle::{DType, Device, Tensor};

/// The E2M1 value of each 4-bit code (transformers' `FP4_VALUES`; code 8 is -0).
pub const FP4_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// Bytes a group of 32 values packs into.
pub const GROUP_BYTES: usize = 16;

/// Dequantizes `blocks` (`[experts, rows, groups, 16]`, flat) with `scales` (`[experts, rows,
/// groups]`) into f32 `[experts, groups * 32, rows]`.
pub fn dequantize(
    blocks: &[u8],
    scales: &[u8],
    experts: usize,
    rows: usize,
    groups: usize,
) -> Result<Vec<f32>> {
    let n_scales = experts
        .checked_mul(rows)
        .and_then(|x| x.checked_mul(groups))
        .ok_or_else(|| crate::Error::invalid("MXFP4 shape overflows"))?;
    if scales.len() != n_scales || blocks.len() != n_scales.saturating_mul(GROUP_BYTES) {
        bail!(
            "MXFP4: {} block bytes and {} scales for [{experts}, {rows}, {groups}] groups \
             (expected {} and {n_scales})",
            blocks.len(),
            scales.len(),
            n_scales * GROUP_BYTES
        );
    }
    let cols = groups * 2 * GROUP_BYTES;
    let mut out = vec![0f32; experts * cols * rows];
    for e in 0..experts {
        for r in 0..rows {
            for g in 0..groups {
                let at = (e * rows + r) * groups + g;
                let scale = (scales[at] as i32 - 127) as f64;
                let bytes = &blocks[at * GROUP_BYTES..(at + 1) * GROUP_BYTES];
                for (b, &byte) in bytes.iter().enumerate() {
                    for (half, code) in [(0, byte & 0x0F), (1, byte >> 4)] {
                        // Exact in f64 (2 significant bits times a power of two), then rounded.
                        let v = FP4_VALUES[code as usize] as f64 * scale.exp2();
                        let col = g * 2 * GROUP_BYTES + 2 * b + half;
                        out[(e * cols + col) * rows + r] = v as f32;
                    }
                }
            }
        }
    }
    Ok(out)
}

/// [`dequantize`] on a checkpoint's two uint8 tensors, into `dtype` on `device`.
pub fn dequantize_tensors(
    blocks: &Tensor,
    scales: &Tensor,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let (experts, rows, groups, bytes) = blocks.dims4()?;
    if bytes != GROUP_BYTES || blocks.dtype() != DType::U8 || scales.dtype() != DType::U8 {
        bail!(
            "MXFP4 blocks must be uint8 [experts, rows, groups, {GROUP_BYTES}] and scales uint8 \
             [experts, rows, groups]; got {:?} {:?} and {:?} {:?}",
            blocks.dtype(),
            blocks.dims(),
            scales.dtype(),
            scales.dims()
        );
    }
    if scales.dims() != [experts, rows, groups] {
        bail!(
            "MXFP4 scales are {:?}, the blocks need [{experts}, {rows}, {groups}]",
            scales.dims()
        );
    }
    let b = blocks.flatten_all()?.to_vec1::<u8>()?;
    let s = scales.flatten_all()?.to_vec1::<u8>()?;
    let out = dequantize(&b, &s, experts, rows, groups)?;
    let t = Tensor::from_vec(out, (experts, groups * 2 * GROUP_BYTES, rows), device)?;
    Ok(t.to_dtype(dtype)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// transformers' own dequantization (fixture) equals ours bit for bit, in f32 and bf16,
    /// every code under every exponent included (subnormals, infinities, signed zeros).
    #[test]
    fn held_to_transformers_bit_for_bit() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/mxfp4/cases.safetensors"
        );
        let dev = Device::Cpu;
        let t = candle::safetensors::load(path, &dev).unwrap();
        for case in ["random", "every_exponent", "gate_up"] {
            let (b, s) = (&t[&format!("{case}.blocks")], &t[&format!("{case}.scales")]);
            for (key, dtype) in [("f32", DType::F32), ("bf16", DType::BF16)] {
                let want = &t[&format!("{case}.{key}")];
                let got = dequantize_tensors(b, s, dtype, &dev).unwrap();
                assert_eq!(got.dims(), want.dims(), "{case} {key}");
                // Bits, so that -0, inf and NaN compare as they are.
                let bits = |x: &Tensor| -> Vec<u32> {
                    match x.dtype() {
                        DType::F32 => x
                            .flatten_all()
                            .unwrap()
                            .to_vec1::<f32>()
                            .unwrap()
                            .iter()
                            .map(|v| v.to_bits())
                            .collect(),
                        _ => x
                            .flatten_all()
                            .unwrap()
                            .to_vec1::<half::bf16>()
                            .unwrap()
                            .iter()
                            .map(|v| v.to_bits() as u32)
                            .collect(),
                    }
                };
                assert_eq!(bits(&got), bits(want), "{case} {key}");
            }
        }
    }

    #[test]
    fn misshapen_inputs_are_refused() {
        assert!(dequantize(&[0; 16], &[127, 127], 1, 2, 1).is_err());
        let dev = Device::Cpu;
        let b = Tensor::zeros((1, 2, 1, 8), DType::U8, &dev).unwrap();
        let s = Tensor::zeros((1, 2, 1), DType::U8, &dev).unwrap();
        assert!(dequantize_tensors(&b, &s, DType::F32, &dev).is_err());
        let b = Tensor::zeros((1, 2, 1, 16), DType::U8, &dev).unwrap();
        let s = Tensor::zeros((1, 3, 1), DType::U8, &dev).unwrap();
        let err = dequantize_tensors(&b, &s, DType::F32, &dev).unwrap_err();
        assert!(err.to_string().contains("need [1, 2, 1]"), "{err}");
        // One group: code 3 (1.5) low, 15 (-6) high, at scale 2^1.
        let mut g = [0u8; 16];
        g[0] = 0xF3;
        let v = dequantize(&g, &[128], 1, 1, 1).unwrap();
        assert_eq!(&v[..2], &[3.0, -12.0]);
    }
}
