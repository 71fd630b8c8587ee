//! [`Model::forward_ragged`]: one step of several sequences at once, each of its own length
//! and with its own key/value cache, as continuous batching runs them. Nothing is padded: the
//! new tokens of every sequence are laid end to end, every layer's norms, MLP or MoE block
//! and the LM head run over all of them together (the MoE block's exchange too, under expert
//! parallelism), so do grouped attention's projections and rotation (each row at its own
//! position), and attention runs each sequence against its own cache: at inference on CPU all
//! of them in one parallel pass ([`crate::models::attention_ragged`]), otherwise sequence by
//! sequence. A sequence's logits are the ones [`Model::forward`] gives it alone.

use super::cache::KvCache;
use super::decoder::Model;
use super::recorder::RoutingRecorder;
use crate::ep::residual_add;
use crate::models::layers::{linear, rms_norm};
use crate::{bail, Result};
use candle::Tensor;

impl Model {
    /// The logits `[n, V]` of the last new token of each of `n` sequences, whose new tokens
    /// `seqs[i]` continue `caches[i]` (empty for a prompt's first step), which are extended.
    /// `rec` collects this rank's routing of every new token. Collective under expert
    /// parallelism, as [`Model::forward`] is. On failure every cache is as it was.
    pub fn forward_ragged(
        &self,
        seqs: &[&[u32]],
        caches: &mut [KvCache],
        rec: Option<&mut RoutingRecorder>,
    ) -> Result<Tensor> {
        if seqs.is_empty() || seqs.len() != caches.len() {
            bail!(
                "a ragged step needs one cache per sequence and at least one sequence ({} \
                 sequences, {} caches)",
                seqs.len(),
                caches.len()
            );
        }
        for (s, c) in seqs.iter().zip(caches.iter()) {
            if s.is_empty() {
                bail!("nothing to run: a sequence of the step has no new tokens");
            }
            self.check_step(s, c.len(), s.len())?;
        }
        self.announce(true)?;
        let before: Vec<_> = caches.iter().map(KvCache::mark).collect();
        let r = self.ragged_inner(seqs, caches, rec);
        if r.is_err() {
            for (c, m) in caches.iter_mut().zip(before) {
                c.restore(m);
            }
        }
        r
    }

    fn ragged_inner(
        &self,
        seqs: &[&[u32]],
        caches: &mut [KvCache],
        mut rec: Option<&mut RoutingRecorder>,
    ) -> Result<Tensor> {
        for c in caches.iter_mut() {
            if c.layers.len() != self.layers.len() {
                *c = self.new_cache();
            }
        }
        let lens: Vec<usize> = seqs.iter().map(|s| s.len()).collect();
        let all: Vec<u32> = seqs.iter().flat_map(|s| s.iter().copied()).collect();
        let n = all.len();
        let device = self.embed.device();
        let ids = Tensor::from_vec(all, n, device)?;
        let mut x = self
            .embed
            .index_select(&ids, 0)?
            .reshape((1, n, self.cfg.hidden_size))?;
        let (eps, fused) = (self.cfg.rms_norm_eps, self.fused);
        for (l, layer) in self.layers.iter().enumerate() {
            let h = rms_norm(&x, &layer.input_norm, eps, fused)?;
            let mut lc: Vec<_> = caches.iter_mut().map(|c| &mut c.layers[l]).collect();
            let a = layer
                .attn
                .forward_ragged(&h, &lens, &self.rope, &mut lc, fused)?;
            x = residual_add(&x, &a)?;
            x = self.mlp_step(layer, &x, rec.as_deref_mut())?;
        }
        // Each sequence's last new token.
        let last: Vec<u32> = seqs
            .iter()
            .scan(0usize, |end, s| {
                *end += s.len();
                Some(*end as u32 - 1)
            })
            .collect();
        let last = Tensor::from_vec(last, seqs.len(), device)?;
        let x = x.squeeze(0)?.index_select(&last, 0)?;
        let x = rms_norm(&x, &self.norm, eps, fused)?;
        linear(&x, &self.lm_head, None)
    }
}

#[cfg(test)]
mod tests {
    use crate::models::model::{KvCache, Logits, Model};
    use crate::models::synth::SynthModel;
    use candle::{Device, Tensor};

    /// Sequences of different lengths stepped together, prompts and then single tokens, give
    /// each the logits it gets alone, and leave the same caches: grouped attention with
    /// per-head norms (Qwen3-MoE), with sinks and a sliding window (gpt-oss), and latent
    /// attention (DeepSeek-V3).
    #[test]
    fn a_ragged_step_gives_each_sequence_its_own_logits() {
        for name in ["qwen3_moe", "gpt_oss", "deepseek_v3"] {
            one_family(name);
        }
    }

    fn one_family(name: &str) {
        let dir = tempfile::tempdir().unwrap();
        let family = crate::models::family::family(name).unwrap();
        SynthModel::tiny(family).write(dir.path()).unwrap();
        let ck = crate::models::loader::Checkpoint::open(
            dir.path().to_str().unwrap(),
            None,
            candle::DType::F32,
        )
        .unwrap();
        let model = Model::load_reference(&ck.weights, &ck.cfg).unwrap();
        let prompts: [&[u32]; 3] = [&[1, 5, 9, 2, 7], &[3], &[4, 4, 8]];
        let alone = |seq: &[&[u32]]| -> Vec<Vec<f32>> {
            let mut cache = model.new_cache();
            seq.iter()
                .map(|ids| {
                    let t = Tensor::from_slice(ids, (1, ids.len()), &Device::Cpu).unwrap();
                    let l = model.forward(&t, Some(&mut cache), None, Logits::Last);
                    l.unwrap().flatten_all().unwrap().to_vec1().unwrap()
                })
                .collect()
        };
        let mut caches = vec![KvCache::default(); 3];
        let first = model.forward_ragged(&prompts, &mut caches, None).unwrap();
        let next: [&[u32]; 3] = [&[6], &[2], &[0]];
        let second = model.forward_ragged(&next, &mut caches, None).unwrap();
        for i in 0..3 {
            let want = alone(&[prompts[i], next[i]]);
            for (step, got) in [&first, &second].into_iter().enumerate() {
                let got: Vec<f32> = got.get(i).unwrap().to_vec1().unwrap();
                let worst = got
                    .iter()
                    .zip(&want[step])
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(worst < 1e-5, "{name} sequence {i} step {step}: {worst}");
            }
            assert_eq!(caches[i].len(), prompts[i].len() + 1);
        }
        // A bad id fails the step and leaves the caches as they were.
        let bad: [&[u32]; 3] = [&[1], &[u32::MAX], &[1]];
        assert!(model.forward_ragged(&bad, &mut caches, None).is_err());
        assert_eq!(caches[0].len(), prompts[0].len() + 1);
        assert!(model.forward_ragged(&[], &mut [], None).is_err());
    }
}
