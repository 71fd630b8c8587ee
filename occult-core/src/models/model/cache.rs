//! The key/value caches of all layers of a model ([`KvCache`]), which a forward with a cache
//! continues and extends.

use crate::models::attention::LayerCache;
use crate::{bail, Result};
use candle::Tensor;

/// A cache's shape at one moment ([`KvCache::mark`]).
#[derive(Clone, Copy, Debug)]
pub struct CacheMark {
    layers: usize,
    len: usize,
}

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

    /// Where the cache stands, for [`KvCache::restore`]: a step that fails part-way leaves
    /// some layers extended, and restoring undoes that without copying the cache.
    pub fn mark(&self) -> CacheMark {
        CacheMark {
            layers: self.layers.len(),
            len: self.len(),
        }
    }

    /// Undoes every position appended since `mark` was taken of this cache.
    pub fn restore(&mut self, mark: CacheMark) {
        if self.layers.len() != mark.layers {
            // The step made the layers' caches; before it there were none to keep.
            *self = KvCache::default();
        }
        for l in &mut self.layers {
            l.truncate(mark.len);
        }
    }

    /// A cache of one sequence copied `n` times along the batch, so that `n` continuations
    /// can run on one shared prefix in a single batch.
    pub fn repeat(&self, n: usize) -> Result<Self> {
        let layers = self
            .layers
            .iter()
            .map(|l| match l.kv()? {
                Some((k, v)) => {
                    let rep = |t: &Tensor| -> Result<Tensor> {
                        let (b, h, s, d) = t.dims4()?;
                        if b != 1 {
                            bail!("only a one-sequence cache can be repeated (it holds {b})");
                        }
                        Ok(t.broadcast_as((n, h, s, d))?.contiguous()?)
                    };
                    LayerCache::holding(rep(&k)?, rep(&v)?)
                }
                None => Ok(LayerCache::default()),
            })
            .collect::<Result<_>>()?;
        Ok(KvCache { layers })
    }
}
