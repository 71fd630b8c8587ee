//! gpt-oss's routed experts as its checkpoints store them, both ways: read into a
//! [`SwigluStack`] ([`read`]) and written back in the same layout ([`fused_tensors`]).
//!
//! In `{prefix}.experts` (`model.layers.{l}.mlp.experts`):
//! - `gate_up_proj` `[E, H, 2I]`, the input dimension first, gate and up columns alternating
//!   (transformers' `gate_up[..., ::2]` is the gate, `[..., 1::2]` the up projection), and
//!   `down_proj` `[E, I, H]`; in bf16 (the published `-bf16` checkpoints) or any float dtype;
//! - or, as the published checkpoints store them, MXFP4: `gate_up_proj_blocks` `[E, 2I, H/32,
//!   16]` with `gate_up_proj_scales` `[E, 2I, H/32]`, and `down_proj_blocks` / `_scales`, which
//!   dequantize ([`super::mxfp4`], bit for bit as transformers) to the layouts above;
//! - `gate_up_proj_bias` `[E, 2I]` (alternating too) and `down_proj_bias` `[E, H]`, always
//!   plain floats.
//!
//! Only the rank's own experts are read (rows of the first dimension), MXFP4 ones included.

use super::config::ModelConfig;
use super::mxfp4;
use super::weights::Weights;
use crate::ep::swiglu::{ExpertBiases, SwigluStack};
use crate::{Error, Result};
use candle::Tensor;

/// The names of layer `prefix`'s expert tensors.
struct Names {
    gate_up: String,
    down: String,
    gate_up_bias: String,
    down_bias: String,
}

fn names(prefix: &str) -> Names {
    let p = format!("{prefix}.experts");
    Names {
        gate_up: format!("{p}.gate_up_proj"),
        down: format!("{p}.down_proj"),
        gate_up_bias: format!("{p}.gate_up_proj_bias"),
        down_bias: format!("{p}.down_proj_bias"),
    }
}

/// Whether the checkpoint stores `prefix`'s experts as MXFP4 blocks and scales.
pub fn is_mxfp4(w: &Weights, prefix: &str) -> bool {
    w.contains(&format!("{}_blocks", names(prefix).gate_up))
}

/// Rows `ids` of projection `name` (`[E, cols, rows]` once dequantized, `cols` the input
/// dimension): stored as it is, or as MXFP4 `{name}_blocks` and `{name}_scales`, dequantized
/// in the model's dtype.
fn projection(w: &Weights, name: &str, ids: &[u32], shape: [usize; 3]) -> Result<Tensor> {
    let [e, cols, rows] = shape;
    let blocks = format!("{name}_blocks");
    if !w.contains(&blocks) {
        return Ok(w.get_raw_rows(name, &shape, ids)?.to_dtype(w.dtype())?);
    }
    if !cols.is_multiple_of(32) {
        return Err(Error::bad_file(
            w.origin(),
            format!("{blocks}: MXFP4 packs groups of 32 inputs, and {cols} is not a multiple"),
        ));
    }
    let groups = cols / 32;
    let scales = format!("{name}_scales");
    let b = w.get_raw_rows(&blocks, &[e, rows, groups, mxfp4::GROUP_BYTES], ids)?;
    let s = w.get_raw_rows(&scales, &[e, rows, groups], ids)?;
    mxfp4::dequantize_tensors(&b, &s, w.dtype(), w.device())
        .map_err(|err| Error::bad_file(w.origin(), format!("{blocks}: {err}")))
}

/// Columns `[n, .., 2X]` alternating gate and up: the gate's `[n, .., X]` and the up's.
fn deinterleave(t: &Tensor) -> Result<(Tensor, Tensor)> {
    let mut dims = t.dims().to_vec();
    let last = dims.pop().unwrap_or(0);
    let half = last / 2;
    dims.extend([half, 2]);
    let pairs = t.reshape(dims)?;
    let last = pairs.rank() - 1;
    Ok((
        pairs.narrow(last, 0, 1)?.squeeze(last)?.contiguous()?,
        pairs.narrow(last, 1, 1)?.squeeze(last)?.contiguous()?,
    ))
}

/// The experts `ids` (in that order) of the MoE block at `prefix`, as `cfg` sizes them.
pub fn read(w: &Weights, prefix: &str, cfg: &ModelConfig, ids: &[u32]) -> Result<SwigluStack> {
    let (e, h, i) = (
        cfg.moe.num_experts,
        cfg.hidden_size,
        cfg.moe.expert_intermediate,
    );
    if let Some(&bad) = ids.iter().find(|&&x| x as usize >= e) {
        return Err(Error::invalid(format!("expert {bad} requested of {e}")));
    }
    let n = names(prefix);
    if !w.contains(&n.gate_up) && !is_mxfp4(w, prefix) {
        return Err(Error::bad_file(
            w.origin(),
            format!(
                "no experts for {prefix}: neither {} nor {}_blocks",
                n.gate_up, n.gate_up
            ),
        ));
    }
    // [n, H, 2I] and [n, I, H]: (in, out), brought to (out, in).
    let gate_up = projection(w, &n.gate_up, ids, [e, h, 2 * i])?;
    let down = projection(w, &n.down, ids, [e, i, h])?;
    let (gate, up) = deinterleave(&gate_up)?;
    let stacked = format!("{prefix}.experts");
    let leaf = |t: Tensor| w.leaf_of(&stacked, t);
    let mut stack = SwigluStack::new(
        leaf(gate.transpose(1, 2)?.contiguous()?)?,
        leaf(up.transpose(1, 2)?.contiguous()?)?,
        leaf(down.transpose(1, 2)?.contiguous()?)?,
    )?;
    let biases = if cfg.moe.experts.biases {
        // Read as stored and made trainable after the rearrangement, as the weights are.
        let raw = |name: &str, shape: &[usize]| -> Result<Tensor> {
            Ok(w.get_raw_rows(name, shape, ids)?.to_dtype(w.dtype())?)
        };
        let (bg, bu) = deinterleave(&raw(&n.gate_up_bias, &[e, 2 * i])?)?;
        let bd = raw(&n.down_bias, &[e, h])?;
        Some(ExpertBiases {
            gate: leaf(bg)?,
            up: leaf(bu)?,
            down: leaf(bd)?,
        })
    } else {
        None
    };
    stack = stack.with_form(cfg.moe.experts.activation, biases)?;
    Ok(stack)
}

/// All experts of a layer (`stack` in global order) as gpt-oss stores them unquantized:
/// `(suffix, tensor)` for `gate_up_proj` `[E, H, 2I]`, `down_proj` `[E, I, H]` and, with
/// biases, `gate_up_proj_bias` `[E, 2I]` and `down_proj_bias` `[E, H]`; the inverse of
/// [`read`].
pub fn fused_tensors(stack: &SwigluStack) -> Result<Vec<(&'static str, Tensor)>> {
    let interleave = |a: &Tensor, b: &Tensor| -> Result<Tensor> {
        // [.., X] and [.., X] -> [.., X, 2] -> [.., 2X].
        let last = a.rank();
        let both = Tensor::stack(&[a, b], last)?;
        let mut dims = a.dims().to_vec();
        let x = dims.pop().unwrap_or(0);
        dims.push(2 * x);
        Ok(both.reshape(dims)?)
    };
    let gate = stack.gate.transpose(1, 2)?; // [E, H, I]
    let up = stack.up.transpose(1, 2)?;
    let mut out = vec![
        ("gate_up_proj", interleave(&gate, &up)?.contiguous()?),
        ("down_proj", stack.down.transpose(1, 2)?.contiguous()?),
    ];
    if let Some(b) = &stack.bias {
        out.push(("gate_up_proj_bias", interleave(&b.gate, &b.up)?));
        out.push(("down_proj_bias", b.down.clone()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ep::swiglu::Activation;
    use candle::Device;

    /// [`fused_tensors`] undoes [`deinterleave`]: gate columns even, up odd, biases too.
    #[test]
    fn interleaving_round_trips() {
        let dev = Device::Cpu;
        let (e, h, i) = (2, 3, 4);
        let gu = Tensor::arange(0f32, (e * h * 2 * i) as f32, &dev)
            .unwrap()
            .reshape((e, h, 2 * i))
            .unwrap();
        let (g, u) = deinterleave(&gu).unwrap();
        assert_eq!(g.dims(), [e, h, i]);
        // Column 2j is gate j, 2j + 1 up j.
        let (gv, uv) = (g.to_vec3::<f32>().unwrap(), u.to_vec3::<f32>().unwrap());
        assert_eq!(
            (gv[1][2][3], uv[1][2][3]),
            (24.0 + 16.0 + 6.0, 24.0 + 16.0 + 7.0)
        );
        let (g, u) = deinterleave(&gu).unwrap();
        let bias = Tensor::arange(0f32, (e * 2 * i) as f32, &dev)
            .unwrap()
            .reshape((e, 2 * i))
            .unwrap();
        let (bg, bu) = deinterleave(&bias).unwrap();
        let down = Tensor::zeros((e, h, i), candle::DType::F32, &dev).unwrap();
        let stack = SwigluStack::new(
            g.transpose(1, 2).unwrap().contiguous().unwrap(),
            u.transpose(1, 2).unwrap().contiguous().unwrap(),
            down.clone(),
        )
        .unwrap()
        .with_form(
            Activation::Silu,
            Some(ExpertBiases {
                gate: bg,
                up: bu,
                down: Tensor::zeros((e, h), candle::DType::F32, &dev).unwrap(),
            }),
        )
        .unwrap();
        let back = fused_tensors(&stack).unwrap();
        let same = |a: &Tensor, b: &Tensor| {
            assert_eq!(a.dims(), b.dims());
            let d = (a - b).unwrap().abs().unwrap().max_all().unwrap();
            assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0);
        };
        same(&back[0].1, &gu);
        same(&back[2].1, &bias);
    }
}
