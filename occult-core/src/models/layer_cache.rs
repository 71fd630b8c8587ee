//! One layer's key/value cache: keys and values `[B, kv_heads, S, head_dim]` in buffers with
//! room for more positions, so that a decode step writes its own position in place
//! (`Tensor::slice_set`) instead of concatenating the whole cache again (a copy of all `S`
//! positions every step, as llama.cpp's preallocated cache avoids). A buffer that is full
//! grows to twice its positions, so appends copy the cache O(log S) times in all.
//!
//! [`LayerCache::kv`] hands out views of the first `S` positions: strided across heads where
//! the buffers have room left, which the inference paths read in place
//! ([`super::attention_infer::strided_heads`]) and the tensor path copies as candle needs.
//!
//! Clones share the buffers until one of them appends: an append to buffers another clone
//! still holds copies them first (copy on write), so no clone sees another's positions. The
//! first append adopts the step's own keys and values (no copy: a prompt scored once never
//! pays for room it does not use).

use crate::{bail, Result};
use candle::Tensor;
use std::sync::Arc;

/// The cached keys and values of one layer: `[B, kv_heads, S, head_dim]` each.
#[derive(Clone, Debug, Default)]
pub struct LayerCache {
    /// Keys and values `[B, kv_heads, capacity, head_dim]`; positions from `len` on are free.
    store: Option<(Tensor, Tensor)>,
    len: usize,
    /// Shared by the clones that share `store`.
    owners: Arc<()>,
}

/// Room for positions after a buffer of `cap` fills with `need`: twice as many, in whole
/// blocks of 16.
fn grown(cap: usize, need: usize) -> usize {
    need.max(2 * cap).next_multiple_of(16)
}

impl LayerCache {
    /// A cache holding `k` and `v` (`[B, kv_heads, S, head_dim]` each) as its positions.
    pub fn holding(k: Tensor, v: Tensor) -> Result<Self> {
        let mut c = LayerCache::default();
        c.append(&k, &v)?;
        Ok(c)
    }

    /// Positions already cached.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The cached keys and values, `[B, kv_heads, S, head_dim]` each (views of the buffers),
    /// or `None` while nothing is cached.
    pub fn kv(&self) -> Result<Option<(Tensor, Tensor)>> {
        match &self.store {
            Some((k, v)) if self.len > 0 => {
                Ok(Some((k.narrow(2, 0, self.len)?, v.narrow(2, 0, self.len)?)))
            }
            _ => Ok(None),
        }
    }

    /// Appends a step's keys and values `[B, kv_heads, t, head_dim]` after the cached
    /// positions, and returns all of them as [`LayerCache::kv`] does. A step that does not
    /// match the cache (batch, heads, features, dtype or device) is an error, and the cache
    /// is left as it was.
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (b, h, t, d) = k.dims4()?;
        if v.dims4()? != (b, h, t, d) || v.dtype() != k.dtype() {
            bail!(
                "keys {:?} ({:?}) and values {:?} ({:?}) of a step differ",
                k.dims(),
                k.dtype(),
                v.dims(),
                v.dtype()
            );
        }
        let Some((ks, vs)) = self.store.as_ref().filter(|_| self.len > 0) else {
            // Nothing cached: adopt the step's own (full, so the next append grows them).
            let (k, v) = (k.contiguous()?, v.contiguous()?);
            self.store = Some((k.clone(), v.clone()));
            self.len = t;
            self.owners = Arc::new(());
            return Ok((k, v));
        };
        let (cb, ch, cap, cd) = ks.dims4()?;
        if (cb, ch, cd) != (b, h, d)
            || ks.dtype() != k.dtype()
            || !ks.device().same_device(k.device())
        {
            bail!(
                "a step's keys [{b}, {h}, {t}, {d}] ({:?}) do not continue a cache of [{cb}, \
                 {ch}, {}, {cd}] ({:?})",
                k.dtype(),
                self.len,
                ks.dtype()
            );
        }
        let need = self.len + t;
        if need > cap || Arc::strong_count(&self.owners) > 1 {
            // New buffers: the cached positions, the step's, then free room.
            let room = if need > cap { grown(cap, need) } else { cap };
            let fill = |cached: &Tensor, new: &Tensor| -> Result<Tensor> {
                let mut parts = vec![cached.narrow(2, 0, self.len)?, new.clone()];
                if room > need {
                    parts.push(Tensor::zeros(
                        (b, h, room - need, d),
                        new.dtype(),
                        new.device(),
                    )?);
                }
                Ok(Tensor::cat(&parts, 2)?)
            };
            let store = (fill(ks, k)?, fill(vs, v)?);
            self.store = Some(store);
            self.owners = Arc::new(());
        } else {
            ks.slice_set(&k.contiguous()?, 2, self.len)?;
            vs.slice_set(&v.contiguous()?, 2, self.len)?;
        }
        self.len = need;
        Ok(self.kv()?.expect("positions were just appended"))
    }

    /// Forgets every position from `len` on (a step that failed part-way is undone with it).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::values;
    use candle::{DType, Device};

    fn step(b: usize, t: usize, seed: f32) -> (Tensor, Tensor) {
        let n = b * 2 * t * 3;
        let k: Vec<f32> = (0..n).map(|i| seed + i as f32).collect();
        let v: Vec<f32> = (0..n).map(|i| -seed - i as f32).collect();
        (
            Tensor::from_vec(k, (b, 2, t, 3), &Device::Cpu).unwrap(),
            Tensor::from_vec(v, (b, 2, t, 3), &Device::Cpu).unwrap(),
        )
    }

    /// The concatenation the cache replaces: every step's keys (or values) along positions.
    fn concat(steps: &[&Tensor]) -> Vec<f64> {
        values(&Tensor::cat(steps, 2).unwrap())
    }

    #[test]
    fn appends_equal_the_concatenation_of_every_step() {
        for b in [1, 2] {
            let mut c = LayerCache::default();
            let mut ks = Vec::new();
            let mut vs = Vec::new();
            // A prompt, then single positions past the first growth, then a longer step.
            for (i, t) in [5, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 9, 1]
                .into_iter()
                .enumerate()
            {
                let (k, v) = step(b, t, 100.0 * i as f32);
                let (gk, gv) = c.append(&k, &v).unwrap();
                ks.push(k);
                vs.push(v);
                assert_eq!(values(&gk), concat(&ks.iter().collect::<Vec<_>>()));
                assert_eq!(values(&gv), concat(&vs.iter().collect::<Vec<_>>()));
                assert_eq!(c.len(), gk.dim(2).unwrap());
            }
            assert_eq!(c.len(), 26);
        }
    }

    #[test]
    fn a_clone_never_sees_another_clones_positions() {
        let mut a = LayerCache::default();
        let (k, v) = step(1, 4, 0.0);
        a.append(&k, &v).unwrap();
        let (k1, v1) = step(1, 1, 1000.0);
        a.append(&k1, &v1).unwrap(); // grown: room after position 5
        let mut b = a.clone();
        let (k2, v2) = step(1, 1, 2000.0);
        let (k3, v3) = step(1, 1, 3000.0);
        a.append(&k2, &v2).unwrap();
        b.append(&k3, &v3).unwrap();
        let (ak, _) = a.kv().unwrap().unwrap();
        let (bk, bv) = b.kv().unwrap().unwrap();
        assert_eq!(values(&ak), concat(&[&k, &k1, &k2]));
        assert_eq!(values(&bk), concat(&[&k, &k1, &k3]));
        assert_eq!(values(&bv), concat(&[&v, &v1, &v3]));
    }

    #[test]
    fn truncating_undoes_a_step_and_the_next_append_overwrites_it() {
        let mut c = LayerCache::default();
        let (k, v) = step(1, 3, 0.0);
        c.append(&k, &v).unwrap();
        let (k1, v1) = step(1, 1, 10.0);
        c.append(&k1, &v1).unwrap();
        let (k2, v2) = step(1, 1, 20.0);
        c.append(&k2, &v2).unwrap();
        c.truncate(4);
        let (k3, v3) = step(1, 1, 30.0);
        let (gk, gv) = c.append(&k3, &v3).unwrap();
        assert_eq!(values(&gk), concat(&[&k, &k1, &k3]));
        assert_eq!(values(&gv), concat(&[&v, &v1, &v3]));
        c.truncate(0);
        assert!(c.is_empty() && c.kv().unwrap().is_none());
    }

    #[test]
    fn a_step_that_does_not_fit_the_cache_is_refused_and_changes_nothing() {
        let mut c = LayerCache::default();
        let (k, v) = step(1, 3, 0.0);
        c.append(&k, &v).unwrap();
        let (k2, v2) = step(2, 1, 5.0);
        let err = c.append(&k2, &v2).unwrap_err().to_string();
        assert!(err.contains("do not continue"), "{err}");
        let (k3, _) = step(1, 1, 5.0);
        let bf = k3.to_dtype(DType::BF16).unwrap();
        assert!(c.append(&bf, &bf).is_err());
        assert!(c.append(&k3, &bf).is_err());
        assert_eq!(c.len(), 3);
        assert_eq!(values(&c.kv().unwrap().unwrap().0), values(&k));
    }
}
