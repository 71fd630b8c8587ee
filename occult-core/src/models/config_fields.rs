//! The parts of `config.json` that each family reads in its own way: the typed reader of its
//! fields ([`ConfigFields`], whose errors name the file and the field), and the settings those
//! parts become and [`super::config::ModelConfig`] holds: query/key norms, shared experts, the
//! auxiliary loss and the MoE blocks' configuration.

use crate::analysis::routing::{GroupLimit, GroupScore, Scoring};
use crate::{Error, Result};
use serde_json::Value;

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

/// How a family's router scores and selects, beyond top-k: softmax over all experts for the
/// five families of 2024, DeepSeek-V3's sigmoid with groups for GLM-4.5.
#[derive(Clone, Debug, PartialEq)]
pub struct RouterConfig {
    pub scoring: Scoring,
    /// `n_group` groups of which each token keeps `topk_group` (none when `n_group` is 1).
    pub group_limit: Option<GroupLimit>,
    /// `routed_scaling_factor`.
    pub scaling_factor: f32,
    /// Each MoE layer's router carries `e_score_correction_bias` `[E]`, added to the scores
    /// for selection only.
    pub selection_bias: bool,
    /// Each MoE layer's router has a bias `[E]` added to its logits (gpt-oss's
    /// `mlp.router.bias`): it moves the weights as well as the choice.
    pub logit_bias: bool,
}

impl Default for RouterConfig {
    /// Softmax over all experts, no groups, no scaling, no selection bias.
    fn default() -> Self {
        RouterConfig {
            scoring: Scoring::Softmax,
            group_limit: None,
            scaling_factor: 1.0,
            selection_bias: false,
            logit_bias: false,
        }
    }
}

impl RouterConfig {
    /// DeepSeek-V3's router (`topk_method` `noaux_tc`): sigmoid scores, `e_score_correction_bias`
    /// for selection, groups scored by the sum of their two best biased scores (`n_group`,
    /// `topk_group`), `routed_scaling_factor`; `defaults` are the family's for those three when
    /// absent.
    pub fn read_noaux_tc(
        f: &ConfigFields,
        num_experts: usize,
        defaults: (usize, usize, f64),
    ) -> Result<Self> {
        let (n_group, topk_group) = read_groups(f, num_experts, (defaults.0, defaults.1))?;
        if n_group > 1 && num_experts / n_group < 2 {
            return Err(f.bad(
                "n_group",
                "a group size of at least 2 (groups are scored by their two best experts)",
            ));
        }
        let scaling_factor = f.f64_or("routed_scaling_factor", defaults.2)?;
        if !(scaling_factor.is_finite() && scaling_factor > 0.0) {
            return Err(f.bad("routed_scaling_factor", "a positive number"));
        }
        Ok(RouterConfig {
            scoring: Scoring::Sigmoid,
            group_limit: (n_group > 1).then_some(GroupLimit {
                num_groups: n_group,
                topk_groups: topk_group,
                score: GroupScore::Top2Sum,
            }),
            scaling_factor: scaling_factor as f32,
            selection_bias: true,
            logit_bias: false,
        })
    }
}

/// What some families add to grouped-query attention (gpt-oss: all three).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AttentionExtras {
    /// Each head's learned sink logit (`self_attn.sinks` `[heads]`): one more entry in the
    /// softmax's denominator, attending to nothing.
    pub sinks: bool,
    /// `o_proj` has a bias too (gpt-oss's `attention_bias` covers all four projections).
    pub output_bias: bool,
    /// Which layers use the sliding window (`layer_types`: `sliding_attention` or
    /// `full_attention`); `None`: every layer, when there is a window.
    pub sliding_layers: Option<Vec<bool>>,
}

/// How the routed experts compute: the activation between their projections and whether the
/// projections have biases (gpt-oss: the clamped SwiGLU, with biases).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ExpertForm {
    pub activation: crate::ep::swiglu::Activation,
    pub biases: bool,
    /// Stored as gpt-oss stores them ([`super::gpt_oss_experts`]): `gate_up_proj` `[E, H, 2I]`
    /// with gate and up columns alternating, or as MXFP4 blocks and scales.
    pub interleaved_gate_up: bool,
}

impl Default for ExpertForm {
    /// SiLU, no biases.
    fn default() -> Self {
        ExpertForm {
            activation: crate::ep::swiglu::Activation::Silu,
            biases: false,
            interleaved_gate_up: false,
        }
    }
}

/// DeepSeek-V3's multi-head latent attention: queries through a low-rank projection (or
/// directly), keys and values from one shared latent of `kv_lora_rank` features plus one
/// rotated key of `qk_rope_head_dim` shared by every head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlaConfig {
    /// `None`: one `q_proj`.
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// `rope_interleave`: the rotated features come in pairs `(x0, x1), (x2, x3), ...`.
    pub rope_interleave: bool,
}

impl MlaConfig {
    /// A query's and a key's features: `qk_nope_head_dim + qk_rope_head_dim`.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }
}

/// `n_group` and `topk_group` (`defaults` when absent), checked: the groups divide the
/// experts, and a token keeps between 1 and all of them.
pub fn read_groups(
    f: &ConfigFields,
    num_experts: usize,
    defaults: (usize, usize),
) -> Result<(usize, usize)> {
    let n_group = f.usize_or("n_group", defaults.0)?;
    let topk_group = f.usize_or("topk_group", defaults.1)?;
    if n_group == 0 || !num_experts.is_multiple_of(n_group) {
        return Err(f.bad(
            "n_group",
            &format!("a divisor of the {num_experts} experts"),
        ));
    }
    if topk_group == 0 || topk_group > n_group {
        return Err(f.bad("topk_group", &format!("in 1..={n_group} (n_group)")));
    }
    Ok((n_group, topk_group))
}

/// The MoE blocks' configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub top_k: usize,
    pub expert_intermediate: usize,
    pub renormalize: bool,
    pub router: RouterConfig,
    pub shared: Option<SharedConfig>,
    pub aux_loss: AuxLoss,
    pub experts: ExpertForm,
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
