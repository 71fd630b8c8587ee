//! The key/value caches of all layers of a model ([`KvCache`]), which a forward with a cache
//! continues and extends.

use crate::models::attention::LayerCache;
use crate::{bail, Result};
use candle::Tensor;

/// The key/value caches of all layers.
#[derive(Clone, Debug, Default)]
pub struct KvCache {
    pub layers: Vec<LayerCache>,
}

impl KvCache {
    /// Positions already cached.
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, LayerCache::len)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A cache of one sequence copied `n` times along the batch, so that `n` continuations
    /// can run on one shared prefix in a single batch.
    pub fn repeat(&self, n: usize) -> Result<Self> {
        let layers = self
            .layers
            .iter()
            .map(|l| {
                let kv = match &l.kv {
                    Some((k, v)) => {
                        let rep = |t: &Tensor| -> Result<Tensor> {
                            let (b, h, s, d) = t.dims4()?;
                            if b != 1 {
                                bail!("only a one-sequence cache can be repeated (it holds {b})");
                            }
                            Ok(t.broadcast_as((n, h, s, d))?.contiguous()?)
                        };
                        Some((rep(k)?, rep(v)?))
                    }
                    None => None,
                };
                Ok(LayerCache { kv })
            })
            .collect::<Result<_>>()?;
        Ok(KvCache { layers })
    }
}
