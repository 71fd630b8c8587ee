//! The parts of a model every rank holds in full: everything but the routed experts
//! ([`DenseParts`]: embeddings, norms, attention, dense MLPs, routers and shared experts), read
//! from a checkpoint.

use crate::analysis::routing::LayerRouters;
use crate::ep::SharedExperts;
use crate::models::attention::Attention;
use crate::models::config::ModelConfig;
use crate::models::layers::Rope;
use crate::models::weights::Weights;
use crate::Result;
use candle::Tensor;

/// A dense SwiGLU MLP.
#[derive(Clone, Debug)]
pub struct DenseMlp {
    pub gate: Tensor,
    pub up: Tensor,
    pub down: Tensor,
}

/// The parts every rank holds in full: everything but the routed experts.
#[derive(Clone)]
pub struct DenseParts {
    pub cfg: ModelConfig,
    pub embed: Tensor,
    pub norm: Tensor,
    pub lm_head: Tensor,
    pub layers: Vec<DenseLayer>,
    pub rope: Rope,
}

/// A layer without its routed experts.
#[derive(Clone)]
pub struct DenseLayer {
    pub input_norm: Tensor,
    pub attn: Attention,
    pub post_norm: Tensor,
    pub dense: Option<DenseMlp>,
    /// `[E, H]` for MoE layers.
    pub router: Option<Tensor>,
    /// `[E]`, added to the router's logits, where the family's router has one (gpt-oss).
    pub router_bias: Option<Tensor>,
    /// The router's `e_score_correction_bias` `[E]`, where the family's router has one: added
    /// to the scores to choose experts, never to their weights, and never trained.
    pub selection_bias: Option<Vec<f32>>,
    pub shared: Option<SharedExperts>,
}

impl DenseParts {
    /// Reads everything but the routed experts.
    pub fn load(w: &Weights, cfg: &ModelConfig) -> Result<Self> {
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        let names = cfg.family.names;
        let embed = w.get("model.embed_tokens.weight", &[v, h])?;
        let lm_head = if cfg.tie_word_embeddings {
            embed.clone()
        } else {
            w.get("lm_head.weight", &[v, h])?
        };
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for l in 0..cfg.num_layers {
            let p = format!("model.layers.{l}");
            let mlp3 = |prefix: &str, i: usize| -> Result<DenseMlp> {
                Ok(DenseMlp {
                    gate: w.get(&format!("{prefix}.gate_proj.weight"), &[i, h])?,
                    up: w.get(&format!("{prefix}.up_proj.weight"), &[i, h])?,
                    down: w.get(&format!("{prefix}.down_proj.weight"), &[h, i])?,
                })
            };
            let mut router_bias = None;
            let (dense, router, shared, selection_bias) = if cfg.moe_layers[l] {
                let b = format!("{p}.{}", names.block);
                let router = w.get(
                    &format!("{b}.{}.weight", names.router),
                    &[cfg.moe.num_experts, h],
                )?;
                if cfg.moe.router.logit_bias {
                    router_bias = Some(w.get(
                        &format!("{b}.{}.bias", names.router),
                        &[cfg.moe.num_experts],
                    )?);
                }
                let selection_bias = selection_bias(w, cfg, l)?;
                let shared = match (cfg.moe.shared, names.shared) {
                    (Some(s), Some(sn)) => {
                        let m = mlp3(&format!("{b}.{sn}"), s.intermediate)?;
                        let gate = match (s.gated, names.shared_gate) {
                            (true, Some(g)) => Some(w.get(&format!("{b}.{g}.weight"), &[1, h])?),
                            _ => None,
                        };
                        Some(SharedExperts {
                            gate_proj: m.gate,
                            up_proj: m.up,
                            down_proj: m.down,
                            gate,
                        })
                    }
                    _ => None,
                };
                (None, Some(router), shared, selection_bias)
            } else {
                (
                    Some(mlp3(&format!("{p}.mlp"), cfg.dense_intermediate)?),
                    None,
                    None,
                    None,
                )
            };
            layers.push(DenseLayer {
                input_norm: w.get(&format!("{p}.input_layernorm.weight"), &[h])?,
                attn: Attention::load(w, cfg, l)?,
                post_norm: w.get(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
                dense,
                router,
                router_bias,
                selection_bias,
                shared,
            });
        }
        let rope = Rope::scaled(
            cfg.rotary_dim,
            cfg.rope_theta,
            &cfg.rope_scaling,
            cfg.positions(),
            w.dtype(),
            embed.device(),
        )?;
        Ok(DenseParts {
            cfg: cfg.clone(),
            embed,
            norm: w.get("model.norm.weight", &[h])?,
            lm_head,
            layers,
            rope,
        })
    }
}

/// Layer `l`'s router's `e_score_correction_bias` `[E]` in f32, where the family's routers
/// carry one; checked finite.
pub fn selection_bias(w: &Weights, cfg: &ModelConfig, l: usize) -> Result<Option<Vec<f32>>> {
    if !cfg.moe.router.selection_bias || !cfg.moe_layers.get(l).copied().unwrap_or(false) {
        return Ok(None);
    }
    let names = cfg.family.names;
    let name = format!(
        "model.layers.{l}.{}.{}.e_score_correction_bias",
        names.block, names.router
    );
    let bias = w
        .get_frozen(&name, &[cfg.moe.num_experts])?
        .to_vec1::<f32>()?;
    if let Some(j) = bias.iter().position(|b| !b.is_finite()) {
        return Err(crate::Error::bad_file(
            w.origin(),
            format!("{name}[{j}] = {} is not a finite number", bias[j]),
        ));
    }
    Ok(Some(bias))
}

/// Every MoE layer's router rule: the family's, with each layer's own selection bias (what
/// pruning a recorded trace needs of the model, as a trace does not hold the bias).
pub fn layer_routers(w: &Weights, cfg: &ModelConfig) -> Result<LayerRouters> {
    let mut routers = LayerRouters::same(cfg.router_rule());
    for l in 0..cfg.num_layers {
        if let Some(b) = selection_bias(w, cfg, l)? {
            routers.selection_bias.insert(l, b);
        }
    }
    Ok(routers)
}
