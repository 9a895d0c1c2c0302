//! A KV cache's snapshot: what a store of prefixes keeps.

use candle_core::{Result, Tensor};

use super::KvCache;

impl KvCache {
    /// A deep copy of exactly the first `len` positions (one allocation and one copy per buffer,
    /// never shared with this cache), to be loaded into another cache's own buffers
    /// ([`KvCache::load_prefix`]) rather than grown. Half the work of [`KvCache::copy_prefix`],
    /// which zeroes buffers with room and copies twice.
    pub fn snapshot(&self, len: usize) -> Result<Self> {
        let len = len.min(self.len);
        let own = |x: &Tensor| -> Result<Tensor> {
            let part = x.narrow(1, 0, len)?;
            // (a whole buffer is contiguous already: contiguous() would share its storage)
            if part.is_contiguous() {
                part.copy()
            } else {
                part.contiguous()
            }
        };
        let layers = self
            .layers
            .iter()
            .map(|l| {
                l.as_ref()
                    .map(|(k, v)| -> Result<(Tensor, Tensor)> { Ok((own(k)?, own(v)?)) })
                    .transpose()
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { layers, len, step: None, slot: None })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    fn cache(len: usize) -> KvCache {
        let k = Tensor::arange(0f32, 16.0, &Device::Cpu).unwrap().reshape((1, 8, 2)).unwrap();
        let v = (k.clone() * 10.0).unwrap();
        KvCache { layers: vec![Some((k, v)), None], len, step: None, slot: None }
    }

    fn rows(t: &Tensor) -> Vec<Vec<f32>> {
        t.squeeze(0).unwrap().to_vec2().unwrap()
    }

    /// The held positions, exactly, in storage of their own: writing the cache afterwards (as its
    /// stream goes on) leaves the snapshot as it was, also when the cache is full.
    #[test]
    fn a_snapshot_holds_the_positions_and_shares_nothing() {
        for len in [5, 8] {
            let c = cache(len);
            let s = c.snapshot(len).unwrap();
            let (k, v) = c.layers[0].as_ref().unwrap();
            let (sk, sv) = s.layers[0].as_ref().unwrap();
            assert_eq!((s.len(), sk.dims()), (len, &[1, len, 2][..]));
            assert!(s.layers[1].is_none());
            assert_eq!(rows(sk), rows(&k.narrow(1, 0, len).unwrap()));
            assert_eq!(rows(sv), rows(&v.narrow(1, 0, len).unwrap()));
            let before = rows(sk);
            k.slice_set(
                &Tensor::full(-1f32, (1, len, 2), &Device::Cpu)
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap(),
                1,
                0,
            )
            .unwrap();
            assert_eq!(rows(sk), before, "the snapshot moved with the cache (len {len})");
        }
    }
}
