//! A model's tensors named as in the checkpoint, each tagged as a routed expert or not: all of
//! them, the trainable ones, the replicated ones (every rank holds them in full) and the
//! routed experts (this rank's own under expert parallelism).

use super::decoder::{Mlp, Model};
use super::moe::MoeExec;
use crate::ep::MoeWeights;
use candle::Tensor;

impl Model {
    /// Every tensor of this rank, named as in the checkpoint, but the routed experts, which
    /// are stacked as `...experts.{gate,up,down}` and, with biases, `...experts.{gate,up,
    /// down}_bias` (this rank's, in slot order).
    pub fn params(&self) -> Vec<(String, Tensor)> {
        self.tagged_params()
            .into_iter()
            .map(|(name, t, _)| (name, t))
            .collect()
    }

    /// This rank's trainable tensors, in the order of [`Model::params`].
    pub fn trainable_params(&self) -> Vec<Tensor> {
        self.params()
            .into_iter()
            .map(|(_, t)| t)
            .filter(|t| t.is_variable())
            .collect()
    }

    /// The tensors every rank holds in full: all but the routed experts.
    pub fn replicated_params(&self) -> Vec<(String, Tensor)> {
        self.tagged_params()
            .into_iter()
            .filter(|(_, _, expert)| !expert)
            .map(|(name, t, _)| (name, t))
            .collect()
    }

    /// This rank's routed experts (its own, under expert parallelism).
    pub fn expert_params(&self) -> Vec<(String, Tensor)> {
        self.tagged_params()
            .into_iter()
            .filter(|(_, _, expert)| *expert)
            .map(|(name, t, _)| (name, t))
            .collect()
    }

    /// [`Model::params`], each marked `true` if it holds routed experts.
    fn tagged_params(&self) -> Vec<(String, Tensor, bool)> {
        let mut out = vec![("model.embed_tokens.weight".to_string(), self.embed.clone())];
        let mut experts_at = Vec::new();
        let names = self.cfg.family.names;
        for (l, layer) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{l}");
            out.push((
                format!("{p}.input_layernorm.weight"),
                layer.input_norm.clone(),
            ));
            out.push((
                format!("{p}.post_attention_layernorm.weight"),
                layer.post_norm.clone(),
            ));
            for (n, t) in layer.attn.params() {
                out.push((format!("{p}.self_attn.{n}"), t.clone()));
            }
            match &layer.mlp {
                Mlp::Dense(m) => {
                    for (n, t) in [
                        ("gate_proj", &m.gate),
                        ("up_proj", &m.up),
                        ("down_proj", &m.down),
                    ] {
                        out.push((format!("{p}.mlp.{n}.weight"), t.clone()));
                    }
                }
                Mlp::Moe(b) => {
                    let MoeWeights {
                        router,
                        router_bias,
                        experts,
                        shared,
                    } = match &b.exec {
                        MoeExec::Reference { weights, .. } => weights,
                        MoeExec::Parallel(ep) => &ep.weights,
                    };
                    let q = format!("{p}.{}", names.block);
                    out.push((format!("{q}.{}.weight", names.router), router.clone()));
                    if let Some(b) = router_bias {
                        out.push((format!("{q}.{}.bias", names.router), b.clone()));
                    }
                    for (n, t) in experts.tensors() {
                        experts_at.push(out.len());
                        out.push((format!("{q}.experts.{n}"), t.clone()));
                    }
                    if let (Some(s), Some(sn)) = (shared, names.shared) {
                        for (n, t) in [
                            ("gate_proj", &s.gate_proj),
                            ("up_proj", &s.up_proj),
                            ("down_proj", &s.down_proj),
                        ] {
                            out.push((format!("{q}.{sn}.{n}.weight"), t.clone()));
                        }
                        if let (Some(g), Some(gn)) = (&s.gate, names.shared_gate) {
                            out.push((format!("{q}.{gn}.weight"), g.clone()));
                        }
                    }
                }
            }
        }
        out.push(("model.norm.weight".into(), self.norm.clone()));
        if !self.cfg.tie_word_embeddings {
            out.push(("lm_head.weight".into(), self.lm_head.clone()));
        }
        out.into_iter()
            .enumerate()
            .map(|(i, (name, t))| (name, t, experts_at.contains(&i)))
            .collect()
    }
}
