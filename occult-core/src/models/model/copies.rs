//! Replicated experts in training: the copies of an expert (its slots on every rank, two on
//! one rank included) are one expert. After the backward pass their gradients are summed and
//! every copy gets the sum ([`Model::sum_copy_grads`]), so that identical copies take identical
//! steps; and the gradient norm counts each expert once ([`Model::expert_params_once`]).

use super::decoder::{Mlp, Model};
use super::moe::MoeExec;
use crate::ep::EpMoe;
use crate::{bail, Result};
use candle::backprop::GradStore;
use candle::{DType, Tensor};

impl Model {
    /// This rank's EP layers that hold replicas.
    fn replicated_layers(&self) -> impl Iterator<Item = &EpMoe> {
        self.layers.iter().filter_map(|layer| match &layer.mlp {
            Mlp::Moe(b) => match &b.exec {
                MoeExec::Parallel(ep) if ep.settings.replicas.is_some() => Some(&**ep),
                _ => None,
            },
            Mlp::Dense(_) => None,
        })
    }

    /// Gives every copy of each replicated expert the sum of its copies' gradients (a copy
    /// without a gradient counts as zeros): the expert's gradient on one device. Summed in f32,
    /// in the same order for every copy (the group's all-reduce gives every rank the same
    /// bits), so copies stay bit-identical through the optimizer. Collective; one all-reduce
    /// per layer with replicas. Does nothing without replicas.
    pub fn sum_copy_grads(&self, grads: &mut GradStore) -> Result<()> {
        for ep in self.replicated_layers() {
            let r = ep
                .settings
                .replicas
                .as_ref()
                .expect("a layer with replicas");
            let shared = r.map.replicated_experts();
            let mine = r.map.device_slots(ep.comm().rank());
            let x = &ep.weights.experts;
            let tensors: Vec<&Tensor> = [&x.gate, &x.up, &x.down]
                .into_iter()
                .filter(|t| t.is_variable())
                .collect();
            if shared.is_empty() || tensors.is_empty() {
                continue;
            }
            // Per tensor: this rank's gradient, flat, and the per-expert sums' offset.
            let mut own = Vec::with_capacity(tensors.len());
            let mut sums = Vec::new();
            for t in &tensors {
                let per = t.elem_count() / mine.len().max(1);
                let g = match grads.get(t) {
                    Some(g) if g.dims() != t.dims() => bail!(
                        "a gradient of shape {:?} for experts of shape {:?}",
                        g.dims(),
                        t.dims()
                    ),
                    Some(g) => g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
                    None => vec![0.0; t.elem_count()],
                };
                let at = sums.len();
                sums.resize(at + shared.len() * per, 0.0);
                for (slot, e) in mine.iter().enumerate() {
                    if let Ok(i) = shared.binary_search(e) {
                        let dst = &mut sums[at + i * per..at + (i + 1) * per];
                        for (s, v) in dst.iter_mut().zip(&g[slot * per..(slot + 1) * per]) {
                            *s += v;
                        }
                    }
                }
                own.push((g, per, at));
            }
            if ep.comm().size() > 1 {
                ep.comm().all_reduce_sum_f32(&mut sums)?;
            }
            for (t, (mut g, per, at)) in tensors.into_iter().zip(own) {
                for (slot, e) in mine.iter().enumerate() {
                    if let Ok(i) = shared.binary_search(e) {
                        g[slot * per..(slot + 1) * per]
                            .copy_from_slice(&sums[at + i * per..at + (i + 1) * per]);
                    }
                }
                let g = Tensor::from_vec(g, t.dims(), t.device())?.to_dtype(t.dtype())?;
                grads.insert(t, g);
            }
        }
        Ok(())
    }

    /// This rank's routed expert tensors, each with the local slots that count when every
    /// expert is counted once over the group: under replicas, the slots holding their expert's
    /// first copy (lowest rank, then first slot); `None`: every slot.
    pub fn expert_params_once(&self) -> Vec<(Tensor, Option<Vec<u32>>)> {
        let mut out = Vec::new();
        for layer in &self.layers {
            let Mlp::Moe(b) = &layer.mlp else { continue };
            let (x, first) = match &b.exec {
                MoeExec::Reference { weights, .. } => (&weights.experts, None),
                MoeExec::Parallel(ep) => {
                    let first = ep.settings.replicas.as_ref().map(|r| {
                        let per = r.map.slots_per_device();
                        let start = ep.comm().rank() * per;
                        r.map
                            .device_slots(ep.comm().rank())
                            .iter()
                            .enumerate()
                            .filter(|&(j, e)| {
                                r.map.slot_expert.iter().position(|x| x == e) == Some(start + j)
                            })
                            .map(|(j, _)| j as u32)
                            .collect()
                    });
                    (&ep.weights.experts, first)
                }
            };
            for t in [&x.gate, &x.up, &x.down] {
                out.push((t.clone(), first.clone()));
            }
        }
        out
    }
}
