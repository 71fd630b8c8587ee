//! `config.json` of the supported MoE families, normalised into one typed [`ModelConfig`]. The
//! fields every family shares are read here; each family reads the rest in its own file (see
//! [`super::family_types::Family`]), with the field names and defaults transformers gives it.
//! Which family a `config.json` is of is the registry's to say ([`super::family`]).

use super::family_types::{Family, FamilyConfig};
use super::rope_scaling::RopeScaling;
use crate::analysis::routing::RouterRule;
use crate::{Error, Result};
use serde_json::Value;

pub use super::config_fields::{
    AttentionExtras, AuxForm, AuxLoss, ConfigFields, ExpertForm, MlaConfig, MoeConfig, QkNorm,
    RouterConfig, SharedConfig,
};

/// One model's configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub family: &'static Family,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// The features of each head RoPE rotates, the first ones (`head_dim` times GLM-4.5's
    /// `partial_rotary_factor`; all of them elsewhere).
    pub rotary_dim: usize,
    /// Intermediate size of dense MLP layers.
    pub dense_intermediate: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    /// Plain RoPE or YaRN (`rope_scaling`, or `rope_parameters` in transformers v5).
    pub rope_scaling: RopeScaling,
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
    pub qk_norm: QkNorm,
    pub clip_qkv: Option<f64>,
    /// Keys further back than this many positions are not attended to (Mixtral's
    /// `sliding_window`, Qwen's when `use_sliding_window`).
    pub sliding_window: Option<usize>,
    /// `max_position_embeddings`.
    pub max_positions: Option<usize>,
    pub bos_token_id: Option<u32>,
    /// `eos_token_id`, a number or a list.
    pub eos_token_ids: Vec<u32>,
    pub moe: MoeConfig,
    /// Whether each layer's MLP is an MoE block (else a dense MLP).
    pub moe_layers: Vec<bool>,
    /// Latent attention (DeepSeek-V3); `head_dim` is then its query/key width and `rotary_dim`
    /// its rotated part.
    pub mla: Option<MlaConfig>,
    /// Multi-token-prediction layers stored after the decoder's (`num_nextn_predict_layers`,
    /// as `model.layers.{num_layers}...`): not run, their tensors left unread.
    pub mtp_layers: usize,
    /// Attention sinks, an output bias and per-layer windows (gpt-oss).
    pub attention: AttentionExtras,
}
/// Positions a model covers when its config does not say (`max_position_embeddings`).
pub const DEFAULT_MAX_POSITIONS: usize = 4096;

/// The most layers a config may declare (the deepest released MoE models have under 100).
pub const MAX_LAYERS: usize = 1 << 16;

impl ModelConfig {
    /// The positions the model's RoPE tables cover: `max_position_embeddings`, or
    /// [`DEFAULT_MAX_POSITIONS`].
    pub fn positions(&self) -> usize {
        self.max_positions.unwrap_or(DEFAULT_MAX_POSITIONS)
    }

    /// Parses a `config.json` value of `family` (whose `model_type` the caller has matched);
    /// `origin` names it in errors. [`ModelConfig::from_json`] finds the family.
    pub fn from_family_json(v: &Value, origin: &str, family: &'static Family) -> Result<Self> {
        let model_type = family.model_type;
        let f = ConfigFields {
            v,
            origin,
            model_type,
        };
        let hidden_size = f.usize("hidden_size")?;
        let num_layers = f.usize("num_hidden_layers")?;
        // Sizes that make an empty model are named before anything is derived from them.
        for (key, value) in [
            ("vocab_size", f.usize("vocab_size")?),
            ("hidden_size", hidden_size),
            ("num_hidden_layers", num_layers),
        ] {
            if value == 0 {
                return Err(f.bad(key, "at least 1"));
            }
        }
        // Per-layer tables are sized from the layer count before any weight is read (a fuzzed
        // config asked for 66,600,001,232 layers, and the allocation aborted the process).
        if num_layers > MAX_LAYERS {
            return Err(f.bad("num_hidden_layers", &format!("at most {MAX_LAYERS}")));
        }
        let num_heads = f.usize("num_attention_heads")?;
        let num_kv_heads = f.usize_or("num_key_value_heads", num_heads)?;
        if num_heads == 0 || num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            return Err(Error::bad_file(
                origin,
                format!("{num_heads} attention heads cannot share {num_kv_heads} key/value heads"),
            ));
        }
        let FamilyConfig {
            head_dim,
            num_experts,
            expert_intermediate,
            renormalize,
            shared,
            moe_layers,
            sliding_window,
            attention_bias,
            aux_loss,
            qk_norm,
            partial_rotary_factor,
            router,
            mla,
            attention,
            experts,
        } = (family.read_config)(&f, num_layers)?;
        if let Some(layers) = &attention.sliding_layers {
            if layers.len() != num_layers {
                return Err(f.bad(
                    "layer_types",
                    &format!("a list of {num_layers} layer types (num_hidden_layers)"),
                ));
            }
        }
        let head_dim = head_dim.unwrap_or(hidden_size / num_heads);
        if head_dim == 0 || head_dim % 2 == 1 {
            return Err(Error::bad_file(
                origin,
                format!("head_dim {head_dim} must be even and positive (RoPE rotates pairs)"),
            ));
        }
        // As transformers sizes the rotation: int(head_dim * partial_rotary_factor).
        let rotary_dim = match &mla {
            Some(m) => m.qk_rope_head_dim,
            None => (head_dim as f64 * partial_rotary_factor) as usize,
        };
        if !(partial_rotary_factor > 0.0 && partial_rotary_factor <= 1.0)
            || rotary_dim == 0
            || rotary_dim % 2 == 1
        {
            return Err(Error::bad_file(
                origin,
                format!(
                    "partial_rotary_factor {partial_rotary_factor} of head_dim {head_dim} \
                     rotates {rotary_dim} features: it must be in (0, 1] and rotate an even \
                     number of them"
                ),
            ));
        }
        let dense_intermediate = f.usize_or("intermediate_size", 0)?;
        let top_k = f.usize("num_experts_per_tok")?;
        crate::analysis::trace::check_experts_top_k(num_experts, top_k)
            .map_err(|m| Error::bad_file(origin, m))?;
        // transformers v5 moves RoPE settings into `rope_parameters`.
        let rope_params = v.get("rope_parameters").filter(|p| p.is_object());
        let rope_scaling = RopeScaling::read(
            v,
            origin,
            v.get("max_position_embeddings")
                .and_then(Value::as_u64)
                .map(|n| n as usize),
        )?;
        if sliding_window == Some(0) {
            return Err(f.bad("sliding_window", "a positive window"));
        }
        let rms_norm_eps = f.f64_or("rms_norm_eps", family.default_rms_norm_eps)?;
        if !(rms_norm_eps >= 0.0 && rms_norm_eps.is_finite()) {
            return Err(f.bad("rms_norm_eps", "a finite number >= 0"));
        }
        let clip_qkv = if f.present("clip_qkv") {
            let c = f.f64_or("clip_qkv", 0.0)?;
            if !(c.is_finite() && c > 0.0) {
                return Err(f.bad("clip_qkv", "a positive number or null"));
            }
            Some(c)
        } else {
            None
        };
        let rope_theta = match rope_params.and_then(|p| p.get("rope_theta")) {
            Some(t) if !f.present("rope_theta") => t.as_f64().ok_or_else(|| {
                Error::bad_file(origin, "rope_parameters.rope_theta is not a number")
            })?,
            _ => f.f64_or("rope_theta", family.default_rope_theta)?,
        };
        if !(rope_theta > 0.0 && rope_theta.is_finite()) {
            return Err(Error::bad_file(
                origin,
                format!("rope_theta = {rope_theta} is not a positive number"),
            ));
        }
        if moe_layers.len() != num_layers {
            return Err(Error::bad_file(
                origin,
                format!(
                    "{model_type} describes {} layers, the config has {num_layers}",
                    moe_layers.len()
                ),
            ));
        }
        if !moe_layers.contains(&true) {
            return Err(Error::bad_file(
                origin,
                format!(
                    "every one of the {num_layers} layers is dense (first_k_dense_replace, \
                     mlp_only_layers or decoder_sparse_step leave no MoE layer): this is not \
                     a mixture-of-experts model"
                ),
            ));
        }
        if moe_layers.contains(&false) && dense_intermediate == 0 {
            return Err(f.missing("intermediate_size"));
        }
        let max_positions = if f.present("max_position_embeddings") {
            Some(f.usize("max_position_embeddings")?)
        } else {
            None
        };
        if max_positions.is_some_and(|n| n < 2) {
            return Err(Error::bad_file(
                origin,
                format!(
                    "max_position_embeddings = {} leaves no room for a prompt and a token",
                    max_positions.unwrap_or(0)
                ),
            ));
        }
        Ok(ModelConfig {
            family,
            vocab_size: f.usize("vocab_size")?,
            hidden_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rotary_dim,
            dense_intermediate,
            rms_norm_eps,
            rope_theta,
            rope_scaling,
            tie_word_embeddings: f.bool_or("tie_word_embeddings", false)?,
            attention_bias,
            qk_norm: qk_norm.unwrap_or(family.qk_norm),
            clip_qkv,
            sliding_window,
            max_positions,
            bos_token_id: if f.present("bos_token_id") {
                Some(f.usize("bos_token_id")? as u32)
            } else {
                None
            },
            eos_token_ids: match v.get("eos_token_id") {
                Some(Value::Array(_)) => f
                    .usize_list("eos_token_id")?
                    .into_iter()
                    .map(|x| x as u32)
                    .collect(),
                Some(Value::Null) | None => Vec::new(),
                Some(_) => vec![f.usize("eos_token_id")? as u32],
            },
            moe: MoeConfig {
                num_experts,
                top_k,
                expert_intermediate,
                renormalize,
                router,
                shared,
                aux_loss,
                experts,
            },
            moe_layers,
            mla,
            attention,
            mtp_layers: f.usize_or("num_nextn_predict_layers", 0)?,
        })
    }

    /// The name prefixes of the MoE blocks' tensors (routers, experts, shared experts), one per
    /// MoE layer: what fine-tuning trains by default.
    pub fn moe_prefixes(&self) -> Vec<String> {
        (0..self.num_layers)
            .filter(|&l| self.moe_layers[l])
            .map(|l| format!("model.layers.{l}.{}.", self.family.names.block))
            .collect()
    }

    /// Layer `l`'s sliding window: `sliding_window` on the layers `layer_types` marks sliding
    /// (every layer when it marks none).
    pub fn window(&self, l: usize) -> Option<usize> {
        match &self.attention.sliding_layers {
            Some(sliding) if !sliding.get(l).copied().unwrap_or(false) => None,
            _ => self.sliding_window,
        }
    }

    /// The router rule of the model's MoE blocks (the family's).
    pub fn router_rule(&self) -> RouterRule {
        (self.family.router_rule)(&self.moe)
    }
}
