//! Attention of one new position against a fixed-capacity KV cache whose length lives in device
//! memory: the core of the static decode step (see `decoder::DecodeMode::Static`), where nothing
//! may depend on a host value so that one CUDA graph serves every position.
//!
//! On CUDA it is our own split-KV kernel (`kernels/decode_attention.cu`): it reads only the held
//! positions `0..=pos`, where the masked attention it replaces read the whole capacity in five
//! kernels (scores, split-K reduce, mask, softmax, weighted sum). Elsewhere the same function is
//! computed with tensor ops, f32 throughout as in the kernel.
//!
//! Contract: `q: [hq, d]` (already scaled), `k_new`, `v_new: [hkv, d]` (this position's K and V),
//! `kc`, `vc: [hkv, cap, d]`, `pos: [1]` u32. Position `pos` is taken from `k_new` / `v_new`,
//! never from the cache; positions beyond it are not read. Returns `[hq, d]` in `q`'s dtype.

use candle_core::{DType, Result, Tensor};

/// See the module documentation.
pub fn decode_attention(q: &Tensor, k_new: &Tensor, v_new: &Tensor, kc: &Tensor, vc: &Tensor, pos: &Tensor) -> Result<Tensor> {
    let (hq, d) = q.dims2()?;
    let (hkv, cap, dk) = kc.dims3()?;
    if dk != d || vc.dims3()? != (hkv, cap, d) || k_new.dims2()? != (hkv, d) || v_new.dims2()? != (hkv, d) || hq % hkv != 0 {
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
        candle_core::bail!("decode_attention: {} query heads per KV head (at most 8), head_dim {d} (at most 128)", hq / hkv);
    }
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() {
        let op =
            cuda::DecodeAttention { k_new: k_new.contiguous()?, v_new: v_new.contiguous()?, kc: kc.clone(), vc: vc.clone(), pos: pos.contiguous()? };
        return q.contiguous()?.apply_op1_no_bwd(&op);
    }
    by_ops(q, k_new, v_new, kc, vc, pos)
}

/// The same with tensor ops (reads the position to the host; not for a captured step).
fn by_ops(q: &Tensor, k_new: &Tensor, v_new: &Tensor, kc: &Tensor, vc: &Tensor, pos: &Tensor) -> Result<Tensor> {
    let (hq, d) = q.dims2()?;
    let (hkv, cap, _) = kc.dims3()?;
    let p = (pos.to_vec1::<u32>()?[0] as usize).min(cap - 1);
    let f = |t: &Tensor| t.to_dtype(DType::F32);
    // [hkv, p + 1, d]: the held positions, then this one
    let k = Tensor::cat(&[f(&kc.narrow(1, 0, p)?)?, f(k_new)?.unsqueeze(1)?], 1)?;
    let v = Tensor::cat(&[f(&vc.narrow(1, 0, p)?)?, f(v_new)?.unsqueeze(1)?], 1)?;
    let qg = f(q)?.reshape((hkv, hq / hkv, d))?;
    let att = candle_nn::ops::softmax_last_dim(&qg.matmul(&k.t()?)?)?;
    att.matmul(&v)?.reshape((hq, d))?.to_dtype(q.dtype())
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::{CudaDType, CudaStorage};
    use candle_core::{CustomOp1, DType, Layout, Result, Shape, Tensor};

    use crate::fused::cuda::{err, kernel, view};

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/decode_attention.ptx"));
    const MODULE: &str = "antiphon_decode_attention";
    const THREADS: u32 = 128;

    pub(super) struct DecodeAttention {
        pub k_new: Tensor,
        pub v_new: Tensor,
        pub kc: Tensor,
        pub vc: Tensor,
        pub pos: Tensor,
    }

    /// Positions per block of the first pass (`CHUNK` in the kernel).
    const CHUNK: usize = 16;

    impl DecodeAttention {
        fn launch<T: CudaDType + DeviceRepr>(&self, q: &CudaStorage, ql: &Layout) -> Result<(CudaStorage, Shape)> {
            let dev = q.device().clone();
            let (hq, d) = ql.shape().dims2()?;
            let (hkv, cap, _) = self.kc.dims3()?;
            let guards = [&self.k_new, &self.v_new, &self.kc, &self.vc].map(|t| t.storage_and_layout());
            let views = guards.iter().map(|(s, l)| view::<T>(s, l, "decode_attention: K/V")).collect::<Result<Vec<_>>>()?;
            let (ps, pl) = self.pos.storage_and_layout();
            if self.pos.dtype() != DType::U32 {
                candle_core::bail!("decode_attention: pos must be u32");
            }
            let pos = view::<u32>(&ps, pl, "decode_attention: pos")?;
            let qv = q.as_cuda_slice::<T>()?.slice(ql.start_offset()..);
            let s = cap.div_ceil(CHUNK);
            // SAFETY: the combine kernel reads only the splits that hold positions, each written
            // whole by the partial kernel; `out` is written whole by the combine kernel.
            let part_acc = unsafe { dev.alloc::<f32>(hq * s * d) }?;
            let part_ml = unsafe { dev.alloc::<f32>(hq * s * 2) }?;
            let out = unsafe { dev.alloc::<T>(hq * d) }?;
            let (hq_i, hkv_i, cap_i, d_i, s_i) = (hq as i32, hkv as i32, cap as i32, d as i32, s as i32);
            let partial = dev.get_or_load_custom_func(&kernel("decode_attn_partial", q.dtype())?, MODULE, PTX)?;
            let mut b = partial.builder();
            b.arg(&qv).arg(&views[0]).arg(&views[1]).arg(&views[2]).arg(&views[3]).arg(&pos);
            b.arg(&part_acc).arg(&part_ml).arg(&hq_i).arg(&hkv_i).arg(&cap_i).arg(&d_i);
            let cfg = LaunchConfig { grid_dim: (hkv as u32, s as u32, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: the arguments match the kernel's signature; shapes were checked by the caller.
            unsafe { b.launch(cfg) }.map_err(err)?;
            let combine = dev.get_or_load_custom_func(&kernel("decode_attn_combine", q.dtype())?, MODULE, PTX)?;
            let mut b = combine.builder();
            b.arg(&part_acc).arg(&part_ml).arg(&pos).arg(&out).arg(&d_i).arg(&s_i).arg(&cap_i);
            let cfg = LaunchConfig { grid_dim: (hq as u32, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: (s * 4) as u32 };
            // SAFETY: as above.
            unsafe { b.launch(cfg) }.map_err(err)?;
            drop(guards);
            Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((hq, d))))
        }
    }

    impl CustomOp1 for DecodeAttention {
        fn name(&self) -> &'static str {
            "decode-attention"
        }

        fn cpu_fwd(&self, _: &candle_core::CpuStorage, _: &Layout) -> Result<(candle_core::CpuStorage, Shape)> {
            candle_core::bail!("decode_attention: the CUDA op ran on the CPU")
        }

        fn cuda_fwd(&self, q: &CudaStorage, ql: &Layout) -> Result<(CudaStorage, Shape)> {
            if !ql.is_contiguous() {
                candle_core::bail!("decode_attention: q is not contiguous");
            }
            crate::fused::by_dtype!("decode_attention", q.dtype(), T => self.launch::<T>(q, ql))
        }
    }
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
            let want = crate::attention::attend(&q.reshape((hq, 1, d))?, &k, &v, None)?.reshape((hq, d))?;
            let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
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
        assert!(decode_attention(&q, &kv, &kv, &kc, &kc, &pos).is_err(), "3 query heads over 2 KV heads");
    }
}
