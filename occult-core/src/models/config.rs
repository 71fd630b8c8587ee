//! `config.json` of the supported MoE families, normalised into one typed [`ModelConfig`]. The
//! fields every family shares are read here; each family reads the rest in its own file (see
//! [`super::family`]), with the field names and defaults transformers gives it.

use super::family::{self, Family, FamilyConfig};
use crate::analysis::routing::RouterRule;
use crate::{Error, Result};
use serde_json::Value;
use std::path::Path;

/// How queries and keys are normalised before RoPE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// RMSNorm over the whole projection (OLMoE).
    Full,
    /// RMSNorm over each head (Qwen3).
    PerHead,
}

/// Shared experts, fused into one MLP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedConfig {
    pub intermediate: usize,
    /// Scaled by `sigmoid(x . shared_expert_gate)` (Qwen-MoE).
    pub gated: bool,
}

/// The load-balancing auxiliary loss the family's own training code adds, with the config's
/// coefficient (fine-tuning adds it on request).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AuxLoss {
    pub form: AuxForm,
    /// `router_aux_loss_coef`, or DeepSeek's `aux_loss_alpha`.
    pub coef: f64,
}

/// How the auxiliary loss pools tokens. With `f_i` the share of routed slots that went to
/// expert `i` and `P_i` its mean router probability (softmax over all experts):
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AuxForm {
    /// transformers' `load_balancing_loss_func`: `E * sum_i f_i * P_i` over the tokens of all
    /// MoE layers together (OLMoE, Qwen-MoE, Mixtral, Qwen3-MoE).
    AllLayers,
    /// DeepSeek-MoE with `seq_aux` false: `E * sum_i f_i * P_i` per layer over the batch,
    /// summed over layers.
    PerLayer,
    /// DeepSeek-MoE with `seq_aux` true: the same per layer and per sequence, averaged over
    /// sequences and summed over layers.
    PerSequence,
}

impl AuxLoss {
    /// transformers' form with `router_aux_loss_coef` (or `default`).
    pub fn read_all_layers(f: &ConfigFields, default: f64) -> Result<Self> {
        let coef = f.f64_or("router_aux_loss_coef", default)?;
        if !(coef >= 0.0 && coef.is_finite()) {
            return Err(f.bad("router_aux_loss_coef", "a finite number >= 0"));
        }
        Ok(AuxLoss {
            form: AuxForm::AllLayers,
            coef,
        })
    }
}

/// The MoE blocks' configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub top_k: usize,
    pub expert_intermediate: usize,
    pub renormalize: bool,
    pub scaling_factor: f32,
    pub shared: Option<SharedConfig>,
    pub aux_loss: AuxLoss,
}

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
    /// Intermediate size of dense MLP layers.
    pub dense_intermediate: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
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
}

/// `config.json` being read, with typed accessors whose errors name the file and the field.
pub struct ConfigFields<'a> {
    pub v: &'a Value,
    /// Names the file in errors.
    pub origin: &'a str,
    pub model_type: &'a str,
}

impl ConfigFields<'_> {
    /// The error for a required field that is absent.
    pub fn missing(&self, key: &str) -> Error {
        Error::bad_file(
            self.origin,
            format!("missing field `{key}` ({})", self.model_type),
        )
    }
    /// The error for a field whose value is not `want`.
    pub fn bad(&self, key: &str, want: &str) -> Error {
        Error::bad_file(
            self.origin,
            format!("field `{key}` = {} is not {want}", self.v[key]),
        )
    }
    /// Whether the field is there and not null.
    pub fn present(&self, key: &str) -> bool {
        !self.v.get(key).is_none_or(Value::is_null)
    }
    /// A required non-negative integer.
    pub fn usize(&self, key: &str) -> Result<usize> {
        if !self.present(key) {
            return Err(self.missing(key));
        }
        self.v[key]
            .as_u64()
            .map(|x| x as usize)
            .ok_or_else(|| self.bad(key, "a non-negative integer"))
    }
    /// A non-negative integer, or `default` when absent.
    pub fn usize_or(&self, key: &str, default: usize) -> Result<usize> {
        if self.present(key) {
            self.usize(key)
        } else {
            Ok(default)
        }
    }
    /// A number, or `default` when absent.
    pub fn f64_or(&self, key: &str, default: f64) -> Result<f64> {
        if !self.present(key) {
            return Ok(default);
        }
        self.v[key]
            .as_f64()
            .ok_or_else(|| self.bad(key, "a number"))
    }
    /// A boolean, or `default` when absent.
    pub fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        if !self.present(key) {
            return Ok(default);
        }
        self.v[key]
            .as_bool()
            .ok_or_else(|| self.bad(key, "true or false"))
    }
    /// A list of non-negative integers (empty when absent).
    pub fn usize_list(&self, key: &str) -> Result<Vec<usize>> {
        if !self.present(key) {
            return Ok(Vec::new());
        }
        self.v[key]
            .as_array()
            .and_then(|a| a.iter().map(|x| x.as_u64().map(|x| x as usize)).collect())
            .ok_or_else(|| self.bad(key, "a list of layer indices"))
    }
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

    /// Reads and checks `config.json`.
    pub fn read(path: &Path) -> Result<Self> {
        let text = crate::input::read_text(path)?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| Error::bad_file(path, format!("not valid JSON: {e}")))?;
        Self::from_json(&v, &path.display().to_string())
    }

    /// Parses a `config.json` value; `origin` names it in errors.
    pub fn from_json(v: &Value, origin: &str) -> Result<Self> {
        let model_type = v
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| Error::bad_file(origin, "missing field `model_type`"))?;
        let family = family::family(model_type).ok_or_else(|| {
            Error::bad_file(
                origin,
                format!(
                    "model_type {model_type:?} is not supported (supported: {})",
                    family::supported()
                ),
            )
        })?;
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
        } = (family.read_config)(&f, num_layers)?;
        let head_dim = head_dim.unwrap_or(hidden_size / num_heads);
        if head_dim == 0 || head_dim % 2 == 1 {
            return Err(Error::bad_file(
                origin,
                format!("head_dim {head_dim} must be even and positive (RoPE rotates pairs)"),
            ));
        }
        let dense_intermediate = f.usize_or("intermediate_size", 0)?;
        let top_k = f.usize("num_experts_per_tok")?;
        crate::analysis::trace::check_experts_top_k(num_experts, top_k)
            .map_err(|m| Error::bad_file(origin, m))?;
        // transformers v5 moves RoPE settings into `rope_parameters`.
        let rope_params = v.get("rope_parameters").filter(|p| p.is_object());
        for (scaling, untyped) in [(v.get("rope_scaling"), "?"), (rope_params, "default")] {
            let Some(scaling) = scaling.filter(|s| !s.is_null()) else {
                continue;
            };
            let kind = scaling
                .get("rope_type")
                .or_else(|| scaling.get("type"))
                .and_then(Value::as_str)
                .unwrap_or(untyped);
            if kind != "default" {
                return Err(Error::bad_file(
                    origin,
                    format!("rope_scaling of type {kind:?} is not supported (only plain RoPE)"),
                ));
            }
        }
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
            dense_intermediate,
            rms_norm_eps,
            rope_theta,
            tie_word_embeddings: f.bool_or("tie_word_embeddings", false)?,
            attention_bias,
            qk_norm: family.qk_norm,
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
                // None of the five families scales routed outputs.
                scaling_factor: 1.0,
                shared,
                aux_loss,
            },
            moe_layers,
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

    /// The router rule of the model's MoE blocks (the family's).
    pub fn router_rule(&self) -> RouterRule {
        (self.family.router_rule)(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<ModelConfig> {
        ModelConfig::from_json(&v, "config.json")
    }

    #[test]
    fn the_five_families() {
        let olmoe = parse(json!({"model_type": "olmoe", "vocab_size": 50304, "hidden_size": 2048,
            "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
            "intermediate_size": 1024, "num_experts": 64, "num_experts_per_tok": 8,
            "norm_topk_prob": false, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "clip_qkv": null}))
        .unwrap();
        assert_eq!(
            (
                olmoe.moe.num_experts,
                olmoe.moe.top_k,
                olmoe.moe.expert_intermediate
            ),
            (64, 8, 1024)
        );
        assert_eq!(olmoe.qk_norm, QkNorm::Full);
        assert!(olmoe.moe_layers.iter().all(|&m| m) && olmoe.clip_qkv.is_none());
        assert!(!olmoe.router_rule().renormalize);

        let qwen2 = parse(
            json!({"model_type": "qwen2_moe", "vocab_size": 151936, "hidden_size": 2048,
            "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 16,
            "intermediate_size": 5632, "moe_intermediate_size": 1408, "num_experts": 60,
            "num_experts_per_tok": 4, "shared_expert_intermediate_size": 5632,
            "decoder_sparse_step": 2, "mlp_only_layers": [3]}),
        )
        .unwrap();
        assert_eq!(qwen2.moe_layers, vec![false, true, false, false]);
        assert_eq!(
            qwen2.moe.shared,
            Some(SharedConfig {
                intermediate: 5632,
                gated: true
            })
        );
        assert!(qwen2.attention_bias);

        let ds = parse(
            json!({"model_type": "deepseek", "vocab_size": 102400, "hidden_size": 2048,
            "num_hidden_layers": 4, "num_attention_heads": 16, "intermediate_size": 10944,
            "moe_intermediate_size": 1408, "n_routed_experts": 64, "num_experts_per_tok": 6,
            "n_shared_experts": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1}),
        )
        .unwrap();
        assert_eq!(ds.moe_layers, vec![false, true, true, true]);
        assert_eq!(
            ds.moe.shared,
            Some(SharedConfig {
                intermediate: 2816,
                gated: false
            })
        );
        assert_eq!(ds.num_kv_heads, 16);

        let mix = parse(
            json!({"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
            "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 8,
            "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2}),
        )
        .unwrap();
        assert!(mix.router_rule().renormalize);
        assert_eq!(mix.head_dim, 128);

        let q3 = parse(
            json!({"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
            "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 4,
            "head_dim": 128, "moe_intermediate_size": 768, "num_experts": 128,
            "num_experts_per_tok": 8, "norm_topk_prob": true, "intermediate_size": 6144}),
        )
        .unwrap();
        assert_eq!((q3.head_dim, q3.qk_norm), (128, QkNorm::PerHead));
        assert!(q3.router_rule().renormalize);
        // transformers v5 layout: experts under `num_local_experts`, RoPE in
        // `rope_parameters`, and norm_topk_prob defaulting to false.
        let v5 = parse(
            json!({"model_type": "qwen3_moe", "vocab_size": 10, "hidden_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "moe_intermediate_size": 16,
            "num_local_experts": 8, "num_experts_per_tok": 2,
            "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}),
        )
        .unwrap();
        assert_eq!(v5.moe.num_experts, 8);
        assert_eq!(v5.rope_theta, 1e6);
        assert!(!v5.moe.renormalize);
        let yarn = parse(
            json!({"model_type": "qwen3_moe", "vocab_size": 10, "hidden_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "moe_intermediate_size": 16,
            "num_experts": 8, "num_experts_per_tok": 2,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}),
        )
        .unwrap_err()
        .to_string();
        assert!(yarn.contains("\"yarn\" is not supported"), "{yarn}");
    }

    #[test]
    fn bad_configs_are_named() {
        // Found by fuzzing: the layer count sized a table before anything else was checked.
        let e = parse(
            json!({"model_type": "olmoe", "hidden_size": 8, "intermediate_size": 4,
            "num_attention_heads": 2, "num_key_value_heads": 1, "num_experts": 4,
            "num_experts_per_tok": 2, "num_hidden_layers": 66600001232u64, "vocab_size": 304}),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("field `num_hidden_layers` = 66600001232 is not at most 65536"),
            "{e}"
        );
        let e = parse(json!({"model_type": "llama"}))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("\"llama\" is not supported") && e.contains("olmoe, qwen2_moe"),
            "{e}"
        );
        let e = parse(json!({"model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 4, "intermediate_size": 32, "num_experts_per_tok": 2, "vocab_size": 10}))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("missing field `num_local_experts` (mixtral)"),
            "{e}"
        );
        let e = parse(json!({"model_type": "olmoe", "hidden_size": "big"}))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`hidden_size` = \"big\" is not a non-negative integer"),
            "{e}"
        );
        let e = parse(
            json!({"model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 3, "intermediate_size": 32,
            "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 10}),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("cannot share 3"), "{e}");
        let e = parse(
            json!({"model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 4, "intermediate_size": 32, "num_local_experts": 2,
            "num_experts_per_tok": 3, "vocab_size": 10}),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("top_k = 3"), "{e}");
        assert!(parse(json!({}))
            .unwrap_err()
            .to_string()
            .contains("`model_type`"));
    }
}
