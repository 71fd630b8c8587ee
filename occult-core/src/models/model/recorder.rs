//! What forwards record of their routing: per MoE layer on the host, as traces store it
//! ([`RoutingRecorder`], for `occult profile` and traced evaluation, movable between ranks as
//! bytes), and on candle's graph ([`RouterTap`], for a loss on the routers).

use crate::ep::Routed;
use crate::Result;
use candle::{DType, Tensor};
use std::collections::BTreeMap;

/// The routing of the tokens a rank routed, per MoE layer, as traces store it.
#[derive(Clone, Debug, Default)]
pub struct LayerRouting {
    pub tokens: usize,
    pub ids: Vec<u32>,
    pub weights: Vec<f32>,
    pub logits: Vec<f32>,
}

/// Collects routing over forward passes (for `occult profile` and traced evaluation).
#[derive(Clone, Debug, Default)]
pub struct RoutingRecorder {
    pub layers: BTreeMap<usize, LayerRouting>,
}

impl RoutingRecorder {
    /// Appends `other`'s tokens after this recorder's, layer by layer.
    pub fn append(&mut self, other: RoutingRecorder) {
        for (layer, r) in other.layers {
            let mine = self.layers.entry(layer).or_default();
            mine.tokens += r.tokens;
            mine.ids.extend(r.ids);
            mine.weights.extend(r.weights);
            mine.logits.extend(r.logits);
        }
    }

    /// A compact little-endian encoding, to move a recorder between ranks.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        let mut put = |v: u64| out.extend_from_slice(&v.to_le_bytes());
        put(self.layers.len() as u64);
        for (&layer, r) in &self.layers {
            put(layer as u64);
            put(r.tokens as u64);
            put(r.ids.len() as u64);
            put(r.weights.len() as u64);
            put(r.logits.len() as u64);
        }
        for r in self.layers.values() {
            out.extend(r.ids.iter().flat_map(|x| x.to_le_bytes()));
            out.extend(r.weights.iter().flat_map(|x| x.to_le_bytes()));
            out.extend(r.logits.iter().flat_map(|x| x.to_le_bytes()));
        }
        out
    }

    /// Reads [`RoutingRecorder::to_bytes`].
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let bad = || crate::Error::Comm("a routing record that does not decode".into());
        let mut at = 0usize;
        let mut word = || -> Result<u64> {
            let b = bytes.get(at..at.saturating_add(8)).ok_or_else(bad)?;
            at += 8;
            Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
        };
        let n = word()? as usize;
        let mut heads = Vec::new();
        for _ in 0..n.min(bytes.len() / 40) {
            let h: Vec<usize> = (0..5)
                .map(|_| word().map(|w| w as usize))
                .collect::<Result<_>>()?;
            heads.push(h);
        }
        if heads.len() != n {
            return Err(bad());
        }
        let mut rec = RoutingRecorder::default();
        let mut take4 = |len: usize| -> Result<&[u8]> {
            let end = len
                .checked_mul(4)
                .and_then(|n| at.checked_add(n))
                .ok_or_else(bad)?;
            let b = bytes.get(at..end).ok_or_else(bad)?;
            at = end;
            Ok(b)
        };
        for h in heads {
            let ids = take4(h[2])?
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes(b.try_into().expect("4")))
                .collect();
            let weights = take4(h[3])?
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().expect("4")))
                .collect();
            let logits = take4(h[4])?
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().expect("4")))
                .collect();
            rec.layers.insert(
                h[0],
                LayerRouting {
                    tokens: h[1],
                    ids,
                    weights,
                    logits,
                },
            );
        }
        // Every byte read, every layer once, and no more logits than a row per token allows.
        if at != bytes.len() || rec.layers.len() != n {
            return Err(bad());
        }
        Ok(rec)
    }

    pub(super) fn add(&mut self, layer: usize, routed: &Routed, tokens: usize) -> Result<()> {
        let r = self.layers.entry(layer).or_default();
        r.tokens += tokens;
        r.ids.extend_from_slice(&routed.ids);
        if tokens > 0 {
            r.weights.extend(
                routed
                    .weights
                    .to_dtype(DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()?,
            );
        }
        r.logits.extend_from_slice(&routed.logits);
        Ok(())
    }
}

/// One MoE layer's routing of one forward, kept on the graph for a loss on the routers.
#[derive(Clone, Debug)]
pub struct RouterTap {
    pub layer: usize,
    /// `[T, E]` f32, on the graph.
    pub logits: Tensor,
    /// The experts each token was sent to, `[T, k]` row-major (after pruning, if on).
    pub ids: Vec<u32>,
}

#[cfg(test)]
mod tests {
    use super::{LayerRouting, RoutingRecorder};

    #[test]
    fn routing_records_round_trip_and_refuse_garbage() {
        let mut rec = RoutingRecorder::default();
        rec.layers.insert(
            1,
            LayerRouting {
                tokens: 2,
                ids: vec![3, 1, 0, 2],
                weights: vec![0.5, 0.25, 0.75, 0.125],
                logits: vec![1.0; 8],
            },
        );
        rec.layers.insert(4, LayerRouting::default());
        let bytes = rec.to_bytes();
        let back = RoutingRecorder::from_bytes(&bytes).unwrap();
        assert_eq!(back.layers.len(), 2);
        assert_eq!(back.layers[&1].ids, rec.layers[&1].ids);
        assert_eq!(back.layers[&1].weights, rec.layers[&1].weights);
        assert_eq!(back.layers[&1].tokens, 2);
        // Truncated, extended, or claiming huge sizes: an error, never a panic.
        assert!(RoutingRecorder::from_bytes(&bytes[..bytes.len() - 1]).is_err());
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(RoutingRecorder::from_bytes(&longer).is_err());
        let mut huge = bytes.clone();
        huge[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(RoutingRecorder::from_bytes(&huge).is_err());
        assert!(RoutingRecorder::from_bytes(&u64::MAX.to_le_bytes()).is_err());
        // Appending keeps layer order and concatenates tokens.
        let mut both = rec.clone();
        both.append(back);
        assert_eq!(both.layers[&1].tokens, 4);
        assert_eq!(both.layers[&1].ids.len(), 8);
    }
}
