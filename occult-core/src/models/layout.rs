//! The tensors a checkpoint of a given configuration holds, by name and shape, in the names
//! Hugging Face checkpoints use: what synthetic checkpoints write and what loading checks a
//! checkpoint against (a tensor the configuration does not explain means the two disagree).

use super::config::{MlaConfig, ModelConfig, QkNorm};
use std::collections::BTreeSet;

/// Every tensor's name and shape in a checkpoint of `cfg`, with experts per expert or fused
/// (gpt-oss's, always fused: unquantized, or with `fused` as MXFP4 blocks and scales).
pub fn tensors(cfg: &ModelConfig, fused: bool) -> Vec<(String, Vec<usize>)> {
    let (v, h) = (cfg.vocab_size, cfg.hidden_size);
    let names = cfg.family.names;
    let mut out = vec![
        ("model.embed_tokens.weight".to_string(), vec![v, h]),
        ("model.norm.weight".to_string(), vec![h]),
    ];
    if !cfg.tie_word_embeddings {
        out.push(("lm_head.weight".to_string(), vec![v, h]));
    }
    let mlp = |out: &mut Vec<(String, Vec<usize>)>, p: &str, i: usize, n: [&str; 3]| {
        out.push((format!("{p}.{}.weight", n[0]), vec![i, h]));
        out.push((format!("{p}.{}.weight", n[1]), vec![i, h]));
        out.push((format!("{p}.{}.weight", n[2]), vec![h, i]));
    };
    let plain = ["gate_proj", "up_proj", "down_proj"];
    for l in 0..cfg.num_layers {
        let p = format!("model.layers.{l}");
        out.push((format!("{p}.input_layernorm.weight"), vec![h]));
        out.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
        let a = format!("{p}.self_attn");
        if let Some(m) = &cfg.mla {
            latent_attention(&mut out, &a, cfg, m);
        } else {
            grouped_attention(&mut out, &a, cfg);
        }
        if !cfg.moe_layers[l] {
            mlp(&mut out, &format!("{p}.mlp"), cfg.dense_intermediate, plain);
            continue;
        }
        let b = format!("{p}.{}", names.block);
        let (e, i) = (cfg.moe.num_experts, cfg.moe.expert_intermediate);
        out.push((format!("{b}.{}.weight", names.router), vec![e, h]));
        if cfg.moe.router.selection_bias {
            out.push((
                format!("{b}.{}.e_score_correction_bias", names.router),
                vec![e],
            ));
        }
        if cfg.moe.router.logit_bias {
            out.push((format!("{b}.{}.bias", names.router), vec![e]));
        }
        if cfg.moe.experts.interleaved_gate_up {
            gpt_oss_experts(&mut out, &b, cfg, fused);
        } else if fused {
            out.push((format!("{b}.experts.gate_up_proj"), vec![e, 2 * i, h]));
            out.push((format!("{b}.experts.down_proj"), vec![e, h, i]));
        } else {
            let n = names.experts;
            for j in 0..e {
                mlp(
                    &mut out,
                    &format!("{b}.experts.{j}"),
                    i,
                    [n.gate, n.up, n.down],
                );
            }
        }
        if let (Some(s), Some(sn)) = (cfg.moe.shared, names.shared) {
            mlp(&mut out, &format!("{b}.{sn}"), s.intermediate, plain);
            if let (true, Some(g)) = (s.gated, names.shared_gate) {
                out.push((format!("{b}.{g}.weight"), vec![1, h]));
            }
        }
    }
    out
}

/// gpt-oss's experts under `b` (`model.layers.{l}.mlp`): `[E, H, 2I]` and `[E, I, H]`, or
/// with `mxfp4` their blocks and scales (32 inputs a group, 16 bytes); biases always.
fn gpt_oss_experts(out: &mut Vec<(String, Vec<usize>)>, b: &str, cfg: &ModelConfig, mxfp4: bool) {
    let (e, h, i) = (
        cfg.moe.num_experts,
        cfg.hidden_size,
        cfg.moe.expert_intermediate,
    );
    for (name, inputs, outputs) in [("gate_up_proj", h, 2 * i), ("down_proj", i, h)] {
        if mxfp4 {
            let groups = inputs.div_ceil(32);
            out.push((
                format!("{b}.experts.{name}_blocks"),
                vec![e, outputs, groups, 16],
            ));
            out.push((
                format!("{b}.experts.{name}_scales"),
                vec![e, outputs, groups],
            ));
        } else {
            out.push((format!("{b}.experts.{name}"), vec![e, inputs, outputs]));
        }
    }
    out.push((format!("{b}.experts.gate_up_proj_bias"), vec![e, 2 * i]));
    out.push((format!("{b}.experts.down_proj_bias"), vec![e, h]));
}

/// Grouped-query attention's tensors under `a` (`model.layers.{l}.self_attn`).
fn grouped_attention(out: &mut Vec<(String, Vec<usize>)>, a: &str, cfg: &ModelConfig) {
    let (h, nh, nkv, hd) = (
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
    );
    out.push((format!("{a}.q_proj.weight"), vec![nh * hd, h]));
    out.push((format!("{a}.k_proj.weight"), vec![nkv * hd, h]));
    out.push((format!("{a}.v_proj.weight"), vec![nkv * hd, h]));
    out.push((format!("{a}.o_proj.weight"), vec![h, nh * hd]));
    if cfg.attention_bias {
        out.push((format!("{a}.q_proj.bias"), vec![nh * hd]));
        out.push((format!("{a}.k_proj.bias"), vec![nkv * hd]));
        out.push((format!("{a}.v_proj.bias"), vec![nkv * hd]));
    }
    if cfg.attention.output_bias {
        out.push((format!("{a}.o_proj.bias"), vec![h]));
    }
    if cfg.attention.sinks {
        out.push((format!("{a}.sinks"), vec![nh]));
    }
    match cfg.qk_norm {
        QkNorm::None => {}
        QkNorm::Full => {
            out.push((format!("{a}.q_norm.weight"), vec![nh * hd]));
            out.push((format!("{a}.k_norm.weight"), vec![nkv * hd]));
        }
        QkNorm::PerHead => {
            out.push((format!("{a}.q_norm.weight"), vec![hd]));
            out.push((format!("{a}.k_norm.weight"), vec![hd]));
        }
    }
}

/// Latent attention's tensors under `a` (DeepSeek-V3's names).
fn latent_attention(
    out: &mut Vec<(String, Vec<usize>)>,
    a: &str,
    cfg: &ModelConfig,
    m: &MlaConfig,
) {
    let (h, nh) = (cfg.hidden_size, cfg.num_heads);
    let rope = m.qk_rope_head_dim;
    match m.q_lora_rank {
        None => out.push((format!("{a}.q_proj.weight"), vec![nh * m.qk_head_dim(), h])),
        Some(r) => {
            out.push((format!("{a}.q_a_proj.weight"), vec![r, h]));
            if cfg.attention_bias {
                out.push((format!("{a}.q_a_proj.bias"), vec![r]));
            }
            out.push((format!("{a}.q_a_layernorm.weight"), vec![r]));
            out.push((
                format!("{a}.q_b_proj.weight"),
                vec![nh * m.qk_head_dim(), r],
            ));
        }
    }
    out.push((
        format!("{a}.kv_a_proj_with_mqa.weight"),
        vec![m.kv_lora_rank + rope, h],
    ));
    if cfg.attention_bias {
        out.push((
            format!("{a}.kv_a_proj_with_mqa.bias"),
            vec![m.kv_lora_rank + rope],
        ));
    }
    out.push((format!("{a}.kv_a_layernorm.weight"), vec![m.kv_lora_rank]));
    out.push((
        format!("{a}.kv_b_proj.weight"),
        vec![nh * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank],
    ));
    out.push((format!("{a}.o_proj.weight"), vec![h, nh * m.v_head_dim]));
    if cfg.attention_bias {
        out.push((format!("{a}.o_proj.bias"), vec![h]));
    }
}

/// Tensors some checkpoints carry that no model reads.
const IGNORED_SUFFIXES: [&str; 1] = ["rotary_emb.inv_freq"];

/// How a checkpoint stores one tensor: its dtype and shape.
pub type StoredAs = (safetensors::Dtype, Vec<usize>);

/// The first tensor the configuration needs that the checkpoint lacks, holds in another shape,
/// or stores as something other than floating point: `(name, what is wrong)`. Per-expert or
/// fused experts are taken as the checkpoint stores them. Header reads only; nothing is loaded.
pub fn first_misfit(
    cfg: &ModelConfig,
    shape_of: &dyn Fn(&str) -> Option<StoredAs>,
) -> Option<(String, String)> {
    let per_expert: BTreeSet<String> = tensors(cfg, false).into_iter().map(|t| t.0).collect();
    let fused = tensors(cfg, true)
        .into_iter()
        .any(|(n, _)| !per_expert.contains(&n) && shape_of(&n).is_some());
    for (name, expected) in tensors(cfg, fused) {
        let Some((dtype, shape)) = shape_of(&name) else {
            return Some((name, "is missing".into()));
        };
        // Fused experts may also be stored transposed (`[E, H, 2I]` and `[E, I, H]`), as the
        // loader reads them (`weights::Weights::experts` checks the pair together).
        let transposed = |s: &[usize]| s.len() == 3 && [s[0], s[2], s[1]] == expected[..];
        let fused_experts =
            name.ends_with(".experts.gate_up_proj") || name.ends_with(".experts.down_proj");
        if shape != expected && !(fused_experts && transposed(&shape)) {
            return Some((name, format!("has shape {shape:?}, expected {expected:?}")));
        }
        use safetensors::Dtype::{BF16, F16, F32, F64, U8};
        let packed = name.ends_with("_blocks") || name.ends_with("_scales");
        if packed && dtype != U8 {
            return Some((
                name,
                format!("is stored as {dtype:?}; MXFP4 blocks and scales are uint8"),
            ));
        }
        if !packed && !matches!(dtype, F32 | F16 | BF16 | F64) {
            return Some((
                name,
                format!("is stored as {dtype:?}; weights must be floating point"),
            ));
        }
    }
    None
}

/// Whether `name` belongs to a multi-token-prediction layer stored after the decoder's
/// (`model.layers.{l}` with `num_layers <= l < num_layers + mtp_layers`), which is not run.
fn is_mtp_layer(cfg: &ModelConfig, name: &str) -> bool {
    name.strip_prefix("model.layers.")
        .and_then(|rest| rest.split('.').next())
        .and_then(|l| l.parse::<usize>().ok())
        .is_some_and(|l| l >= cfg.num_layers && l - cfg.num_layers < cfg.mtp_layers)
}

/// The checkpoint's tensors that `cfg` does not explain (either expert layout is accepted), in
/// name order.
pub fn unexplained<'a>(cfg: &ModelConfig, names: impl Iterator<Item = &'a str>) -> Vec<String> {
    let mut known: BTreeSet<String> = tensors(cfg, false).into_iter().map(|t| t.0).collect();
    known.extend(tensors(cfg, true).into_iter().map(|t| t.0));
    if cfg.tie_word_embeddings {
        known.insert("lm_head.weight".into());
    }
    let mut out: Vec<String> = names
        .filter(|n| {
            !known.contains(*n)
                && !IGNORED_SUFFIXES.iter().any(|s| n.ends_with(s))
                && !is_mtp_layer(cfg, n)
        })
        .map(String::from)
        .collect();
    out.sort();
    out
}
