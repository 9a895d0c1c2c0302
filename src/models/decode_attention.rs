//! Attention of one new position against a fixed-capacity KV cache, with tensor ops: the
//! definition of the decode steps' attention kernel for one stream (`batch_decode`'s split-KV
//! kernel, which reads only the held positions `0..=pos` with the length read from device memory),
//! and what runs in its place on the CPU. f32 throughout, as in the kernel; reads the position to
//! the host.
//!
//! Contract: `q: [hq, d]` (already scaled), `k_new`, `v_new: [hkv, d]` (this position's K and V),
//! `kc`, `vc: [hkv, cap, d]`, `pos: [1]` u32. Position `pos` is taken from `k_new` / `v_new`,
//! never from the cache; positions beyond it are not read. Returns `[hq, d]` in `q`'s dtype.

use candle_core::{DType, Result, Tensor};

/// See the module documentation.
pub fn decode_attention(
    q: &Tensor,
    k_new: &Tensor,
    v_new: &Tensor,
    kc: &Tensor,
    vc: &Tensor,
    pos: &Tensor,
) -> Result<Tensor> {
    let (hq, d) = q.dims2()?;
    let (hkv, cap, dk) = kc.dims3()?;
    if dk != d
        || vc.dims3()? != (hkv, cap, d)
        || k_new.dims2()? != (hkv, d)
        || v_new.dims2()? != (hkv, d)
        || hq % hkv != 0
    {
        candle_core::bail!(
            "decode_attention: q {:?}, k_new {:?}, v_new {:?}, kc {:?}, vc {:?}",
            q.shape(),
            k_new.shape(),
            v_new.shape(),
            kc.shape(),
            vc.shape()
        );
    }
    if hq / hkv > 8 || d > 128 {
        candle_core::bail!(
            "decode_attention: {} query heads per KV head (at most 8), head_dim {d} (at most 128)",
            hq / hkv
        );
    }
    let p = (pos.to_device(&candle_core::Device::Cpu)?.to_vec1::<u32>()?[0] as usize).min(cap - 1);
    let f = |t: &Tensor| t.to_dtype(DType::F32);
    // [hkv, p + 1, d]: the held positions, then this one
    let k = Tensor::cat(&[f(&kc.narrow(1, 0, p)?)?, f(k_new)?.unsqueeze(1)?], 1)?;
    let v = Tensor::cat(&[f(&vc.narrow(1, 0, p)?)?, f(v_new)?.unsqueeze(1)?], 1)?;
    let qg = f(q)?.reshape((hkv, hq / hkv, d))?;
    let att = candle_nn::ops::softmax_last_dim(&qg.matmul(&k.t()?)?)?;
    att.matmul(&v)?.reshape((hq, d))?.to_dtype(q.dtype())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The op against plain masked attention over a cache that already holds the new position.
    #[test]
    fn equals_masked_attention_over_the_held_positions() -> Result<()> {
        let dev = Device::Cpu;
        let (hq, hkv, cap, d) = (8, 2, 16, 8);
        let kc = Tensor::randn(0f32, 1.0, (hkv, cap, d), &dev)?;
        let vc = Tensor::randn(0f32, 1.0, (hkv, cap, d), &dev)?;
        let q = Tensor::randn(0f32, 0.3, (hq, d), &dev)?;
        for p in [0usize, 5, cap - 1] {
            let k_new = Tensor::randn(0f32, 1.0, (hkv, d), &dev)?;
            let v_new = Tensor::randn(0f32, 1.0, (hkv, d), &dev)?;
            let pos = Tensor::new(&[p as u32], &dev)?;
            let got = decode_attention(&q, &k_new, &v_new, &kc, &vc, &pos)?;
            // reference: the cache with this position written, attention over 0..=p
            let k = Tensor::cat(&[kc.narrow(1, 0, p)?, k_new.unsqueeze(1)?], 1)?;
            let v = Tensor::cat(&[vc.narrow(1, 0, p)?, v_new.unsqueeze(1)?], 1)?;
            let want = crate::attention::attend(
                &q.reshape((hq, 1, d))?,
                &k,
                &v,
                &crate::attention::CausalMask::Open,
            )?
            .reshape((hq, d))?;
            // (a NaN anywhere fails: max_all alone could pass over it)
            let diff: Vec<f32> = (got - want)?.abs()?.flatten_all()?.to_vec1()?;
            let diff = diff.iter().fold(0f32, |m, &d| {
                if d.is_finite() && m.is_finite() {
                    m.max(d)
                } else {
                    f32::INFINITY
                }
            });
            assert!(diff < 1e-5, "pos {p}: max abs difference {diff}");
        }
        Ok(())
    }

    #[test]
    fn rejects_mismatched_shapes() {
        let dev = Device::Cpu;
        let kc = Tensor::zeros((2, 4, 8), DType::F32, &dev).unwrap();
        let q = Tensor::zeros((3, 8), DType::F32, &dev).unwrap();
        let kv = Tensor::zeros((2, 8), DType::F32, &dev).unwrap();
        let pos = Tensor::new(&[1u32], &dev).unwrap();
        assert!(
            decode_attention(&q, &kv, &kv, &kc, &kc, &pos).is_err(),
            "3 query heads over 2 KV heads"
        );
    }
}
