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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::values;
    use candle::Device;

    fn step(t: usize, seed: f32) -> Tensor {
        let v: Vec<f32> = (0..2 * t * 4).map(|i| seed + i as f32).collect();
        Tensor::from_vec(v, (1, 2, t, 4), &Device::Cpu).unwrap()
    }

    /// A step that extended only some layers before it failed is undone by restoring the
    /// mark taken before it; a cache the step made its layers for goes back to none.
    #[test]
    fn restoring_a_mark_undoes_a_step_that_failed_part_way() {
        let mut c = KvCache {
            layers: vec![LayerCache::default(); 3],
        };
        let prompt = step(4, 0.0);
        for l in &mut c.layers {
            l.append(&prompt, &prompt).unwrap();
        }
        let mark = c.mark();
        // Two of three layers take the next position, then the step fails.
        let next = step(1, 100.0);
        for l in &mut c.layers[..2] {
            l.append(&next, &next).unwrap();
        }
        c.restore(mark);
        for l in &c.layers {
            assert_eq!(l.len(), 4);
            assert_eq!(values(&l.kv().unwrap().unwrap().0), values(&prompt));
        }
        // The step again, on every layer: each holds the prompt and then it.
        let again = step(1, 200.0);
        for l in &mut c.layers {
            l.append(&again, &again).unwrap();
        }
        let want = values(&Tensor::cat(&[&prompt, &again], 2).unwrap());
        for l in &c.layers {
            assert_eq!(values(&l.kv().unwrap().unwrap().1), want);
        }
        // Made by the step: back to no layers.
        let mut fresh = KvCache::default();
        let mark = fresh.mark();
        fresh.layers = vec![LayerCache::default(); 3];
        fresh.layers[0].append(&next, &next).unwrap();
        fresh.restore(mark);
        assert!(fresh.layers.is_empty() && fresh.is_empty());
    }
}
