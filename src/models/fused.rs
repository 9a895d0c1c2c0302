//! Fused position-wise ops of the decoder step. Each is one kernel of ours on CUDA
//! (`kernels/fused.cu`) where the op-by-op path launches two to six; on the CPU (and as the
//! definition of the result) each is the tensor-op sequence it replaces.
//!
//! - [`add_rmsnorm`]: the residual add and the next RMSNorm.
//! - [`silu_mul`]: SwiGLU's `silu(gate) * up` over the fused gate/up projection.
//! - [`qk_norm_rope_store`]: one position's heads after the fused q/k/v projection — per-head
//!   RMSNorm of q and k (Qwen3), RoPE at a position read from device memory, and the new K and V
//!   written into the cache there (the static decode step, see `decoder::DecodeMode::Static`).

use candle_core::{Result, Tensor};
use candle_nn::VarBuilder;

use super::attention::Rope;

/// An RMSNorm (`weight`, `eps`), as `candle_nn::RmsNorm` computes it.
#[derive(Debug, Clone)]
pub struct Norm {
    pub weight: Tensor,
    pub eps: f64,
}

impl Norm {
    /// `<vb>.weight` of `size`.
    pub fn load(vb: VarBuilder, size: usize, eps: f64) -> Result<Self> {
        Ok(Self { weight: vb.get(size, "weight")?, eps })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        candle_nn::ops::rms_norm(&x.contiguous()?, &self.weight, self.eps as f32)
    }
}

/// `(x + a, norm(x + a))` for `x`, `a: [n, h]`.
pub fn add_rmsnorm(x: &Tensor, a: &Tensor, norm: &Norm) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && x.rank() == 2 && x.shape() == a.shape() && x.dim(1)? <= cuda::NORM_MAX {
        let both = x.contiguous()?.apply_op2_no_bwd(&a.contiguous()?, &cuda::AddRmsNorm { w: norm.weight.clone(), eps: norm.eps as f32 })?;
        return Ok((both.get(0)?, both.get(1)?));
    }
    let s = (x + a)?;
    let h = norm.forward(&s)?;
    Ok((s, h))
}

/// `silu(gu[:, ..inter]) * gu[:, inter..]` for `gu: [n, 2 inter]`.
pub fn silu_mul(gu: &Tensor, inter: usize) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if gu.device().is_cuda() && gu.rank() == 2 && gu.dim(1)? == 2 * inter {
        return gu.contiguous()?.apply_op1_no_bwd(&cuda::SiluMul { inter });
    }
    candle_nn::ops::silu(&gu.narrow(1, 0, inter)?)? * gu.narrow(1, inter, inter)?
}

/// Per-head RMSNorm (when `norm` = (per-head weights `[heads, d]`, `[d]` ones) is given) and
/// rotate-half RoPE of `qk: [n, heads, d]`, `cos`, `sin` from [`Rope::tables_fused`]: the op-by-op
/// q/k path of every step, and the definition of [`qk_norm_rope_store`]'s kernel.
pub fn qk_norm_rope(qk: &Tensor, norm: Option<(&Tensor, &Tensor)>, eps: f64, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let qk = match norm {
        Some((w, ones)) => candle_nn::ops::rms_norm(&qk.contiguous()?, ones, eps as f32)?.broadcast_mul(w)?,
        None => qk.clone(),
    };
    Rope::apply_fused(&qk, cos, sin)
}

/// The heads of one position, `qkv: [hq + 2 hkv, d]` (q heads, k heads, v heads): q and k heads
/// normed per head with the rows of `w` (`[hq + hkv, d]`, when given), both rotated by `rope` at
/// the position in `pos` (`[1]` u32); k and v heads written into `kc`, `vc` (`[hkv, cap, d]`) at
/// that position. Returns the heads `[hq + 2 hkv, d]` in that order.
#[allow(clippy::too_many_arguments)]
pub fn qk_norm_rope_store(
    qkv: &Tensor,
    hq: usize,
    hkv: usize,
    w: Option<&Tensor>,
    eps: f64,
    rope: &Rope,
    pos: &Tensor,
    kc: &Tensor,
    vc: &Tensor,
) -> Result<Tensor> {
    let (rows, d) = qkv.dims2()?;
    if rows != hq + 2 * hkv || kc.dim(0)? != hkv || kc.dim(2)? != d || d % 2 != 0 {
        candle_core::bail!("qk_norm_rope_store: qkv {:?} for {hq} + 2 x {hkv} heads, cache {:?}", qkv.shape(), kc.shape());
    }
    #[cfg(feature = "cuda")]
    if qkv.device().is_cuda() {
        let (cos, sin) = rope.full_tables();
        let op = cuda::QkNormRopeStore {
            w: w.cloned(),
            cos: cos.clone(),
            sin: sin.clone(),
            pos: pos.clone(),
            kc: kc.clone(),
            vc: vc.clone(),
            hq,
            hkv,
            eps: eps as f32,
        };
        return qkv.contiguous()?.apply_op1_no_bwd(&op);
    }
    let heads = qk_norm_rope_store_twin(qkv, hq, hkv, w, eps, rope, pos)?;
    let at = pos.reshape((1, 1, 1))?.broadcast_as((hkv, 1, d))?.contiguous()?;
    kc.scatter_set(&at, &heads.narrow(0, hq, hkv)?.unsqueeze(1)?.contiguous()?, 1)?;
    vc.scatter_set(&at, &heads.narrow(0, hq + hkv, hkv)?.unsqueeze(1)?.contiguous()?, 1)?;
    Ok(heads)
}

/// [`qk_norm_rope_store`]'s heads with tensor ops, without the cache write (`pos`: `[1]` u32).
pub(crate) fn qk_norm_rope_store_twin(
    qkv: &Tensor,
    hq: usize,
    hkv: usize,
    w: Option<&Tensor>,
    eps: f64,
    rope: &Rope,
    pos: &Tensor,
) -> Result<Tensor> {
    let d = qkv.dim(1)?;
    let ones = Tensor::ones(d, qkv.dtype(), qkv.device())?;
    let (cos, sin) = rope.tables_fused(pos)?;
    let qk = qk_norm_rope(&qkv.narrow(0, 0, hq + hkv)?.unsqueeze(0)?, w.map(|w| (w, &ones)), eps, &cos, &sin)?.squeeze(0)?;
    let v = qkv.narrow(0, hq + hkv, hkv)?;
    Tensor::cat(&[qk, v.contiguous()?], 0)
}

/// `$body` with the type `$t` standing for the Rust type of the storage dtype `$dtype` (f32, bf16,
/// f16: the types our kernels exist for); any other dtype is an error naming `$what`.
#[cfg(feature = "cuda")]
macro_rules! by_dtype {
    ($what:expr, $dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            candle_core::DType::F32 => {
                type $t = f32;
                $body
            }
            candle_core::DType::BF16 => {
                type $t = half::bf16;
                $body
            }
            candle_core::DType::F16 => {
                type $t = half::f16;
                $body
            }
            other => candle_core::bail!("{}: no kernel for {other:?}", $what),
        }
    };
}
#[cfg(feature = "cuda")]
pub(crate) use by_dtype;

/// What the CUDA ops share: our PTX modules and how they see a tensor's memory.
#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{CudaView, DeviceRepr, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::{CudaDType, CudaStorage};
    use candle_core::{CustomOp1, CustomOp2, DType, Layout, Result, Shape, Storage, Tensor};

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/fused.ptx"));

    pub(crate) fn err(e: impl std::error::Error + Send + Sync + 'static) -> candle_core::Error {
        candle_core::Error::Cuda(Box::new(e))
    }

    /// A contiguous tensor's elements as a device view (from its layout's start).
    pub(crate) fn view<'a, T: CudaDType>(s: &'a Storage, l: &Layout, what: &str) -> Result<CudaView<'a, T>> {
        let Storage::Cuda(s) = s else { candle_core::bail!("{what}: not on the GPU") };
        if !l.is_contiguous() {
            candle_core::bail!("{what}: not contiguous");
        }
        Ok(s.as_cuda_slice::<T>()?.slice(l.start_offset()..))
    }

    /// The kernel `name` + `_` + the dtype's suffix.
    pub(crate) fn kernel(name: &str, dtype: DType) -> Result<String> {
        let suffix = match dtype {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            other => candle_core::bail!("{name}: no kernel for {other:?}"),
        };
        Ok(format!("{name}_{suffix}"))
    }

    const MODULE: &str = "antiphon_fused";

    /// The widest row `add_rmsnorm`'s kernel holds (`NORM_THREADS * NORM_PER` there).
    pub(super) const NORM_MAX: usize = 1024 * 8;

    pub(super) struct AddRmsNorm {
        pub w: Tensor,
        pub eps: f32,
    }

    impl AddRmsNorm {
        fn run<T: CudaDType + DeviceRepr>(&self, x: &CudaStorage, xl: &Layout, a: &CudaStorage, al: &Layout) -> Result<(CudaStorage, Shape)> {
            let dev = x.device().clone();
            let (n, h) = xl.shape().dims2()?;
            let xv = x.as_cuda_slice::<T>()?.slice(xl.start_offset()..);
            let av = a.as_cuda_slice::<T>()?.slice(al.start_offset()..);
            let (ws, wl) = self.w.storage_and_layout();
            let wv = view::<T>(&ws, wl, "add_rmsnorm weight")?;
            // SAFETY: the kernel writes every element of both halves.
            let out = unsafe { dev.alloc::<T>(2 * n * h) }?;
            let (xo, ho) = (out.slice(..n * h), out.slice(n * h..));
            let f = dev.get_or_load_custom_func(&kernel("add_rmsnorm", x.dtype())?, MODULE, PTX)?;
            let mut b = f.builder();
            let h_i = h as i32;
            b.arg(&xv).arg(&av).arg(&wv).arg(&xo).arg(&ho).arg(&h_i).arg(&self.eps);
            // SAFETY: arguments as the kernel declares them; one block of 1024 per row (h <= NORM_MAX).
            unsafe { b.launch(LaunchConfig { grid_dim: (n as u32, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 }) }.map_err(err)?;
            Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((2, n, h))))
        }
    }

    impl CustomOp2 for AddRmsNorm {
        fn name(&self) -> &'static str {
            "add-rmsnorm"
        }

        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &Layout,
            _: &candle_core::CpuStorage,
            _: &Layout,
        ) -> Result<(candle_core::CpuStorage, Shape)> {
            candle_core::bail!("add_rmsnorm: the CUDA op ran on the CPU")
        }

        fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout, a: &CudaStorage, al: &Layout) -> Result<(CudaStorage, Shape)> {
            super::by_dtype!("add_rmsnorm", x.dtype(), T => self.run::<T>(x, xl, a, al))
        }
    }

    pub(super) struct SiluMul {
        pub inter: usize,
    }

    impl SiluMul {
        fn run<T: CudaDType + DeviceRepr>(&self, gu: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
            let dev = gu.device().clone();
            let n = l.shape().dims2()?.0;
            let total = n * self.inter;
            let gv = gu.as_cuda_slice::<T>()?.slice(l.start_offset()..);
            // SAFETY: the kernel writes every element.
            let out = unsafe { dev.alloc::<T>(total) }?;
            let f = dev.get_or_load_custom_func(&kernel("silu_mul", gu.dtype())?, MODULE, PTX)?;
            let mut b = f.builder();
            let (inter, total_u) = (self.inter as i32, total as u64);
            b.arg(&gv).arg(&out).arg(&inter).arg(&total_u);
            let blocks = total.div_ceil(256).min(4096) as u32;
            // SAFETY: arguments as the kernel declares them; a grid-stride loop covers `total`.
            unsafe { b.launch(LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }) }.map_err(err)?;
            Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((n, self.inter))))
        }
    }

    impl CustomOp1 for SiluMul {
        fn name(&self) -> &'static str {
            "silu-mul"
        }

        fn cpu_fwd(&self, _: &candle_core::CpuStorage, _: &Layout) -> Result<(candle_core::CpuStorage, Shape)> {
            candle_core::bail!("silu_mul: the CUDA op ran on the CPU")
        }

        fn cuda_fwd(&self, gu: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
            super::by_dtype!("silu_mul", gu.dtype(), T => self.run::<T>(gu, l))
        }
    }

    pub(super) struct QkNormRopeStore {
        pub w: Option<Tensor>,
        pub cos: Tensor,
        pub sin: Tensor,
        pub pos: Tensor,
        pub kc: Tensor,
        pub vc: Tensor,
        pub hq: usize,
        pub hkv: usize,
        pub eps: f32,
    }

    impl QkNormRopeStore {
        fn run<T: CudaDType + DeviceRepr>(&self, qkv: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
            let dev = qkv.device().clone();
            let (rows, d) = l.shape().dims2()?;
            let cap = self.kc.dim(1)?;
            let qv = qkv.as_cuda_slice::<T>()?.slice(l.start_offset()..);
            let g = [&self.cos, &self.sin, &self.kc, &self.vc].map(|t| t.storage_and_layout());
            let cos = view::<T>(&g[0].0, g[0].1, "rope cos")?;
            let sin = view::<T>(&g[1].0, g[1].1, "rope sin")?;
            let kc = view::<T>(&g[2].0, g[2].1, "k cache")?;
            let vc = view::<T>(&g[3].0, g[3].1, "v cache")?;
            let (ps, pl) = self.pos.storage_and_layout();
            let pos = view::<u32>(&ps, pl, "position")?;
            let wg = self.w.as_ref().map(|w| w.storage_and_layout());
            let wv = match &wg {
                Some((s, l)) => Some(view::<T>(s, l, "q/k norm weight")?),
                None => None,
            };
            // SAFETY: the kernel writes every element.
            let out = unsafe { dev.alloc::<T>(rows * d) }?;
            let f = dev.get_or_load_custom_func(&kernel("qk_norm_rope_store", qkv.dtype())?, MODULE, PTX)?;
            let mut b = f.builder();
            let null = 0u64;
            b.arg(&qv);
            match &wv {
                Some(w) => b.arg(w),
                None => b.arg(&null),
            };
            let (hq, hkv, d_i, cap_i) = (self.hq as i32, self.hkv as i32, d as i32, cap as i32);
            b.arg(&cos).arg(&sin).arg(&pos).arg(&out).arg(&kc).arg(&vc).arg(&hq).arg(&hkv).arg(&d_i).arg(&cap_i).arg(&self.eps);
            // SAFETY: arguments as the kernel declares them; one 32-thread block per head.
            unsafe { b.launch(LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: 0 }) }.map_err(err)?;
            Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((rows, d))))
        }
    }

    impl CustomOp1 for QkNormRopeStore {
        fn name(&self) -> &'static str {
            "qk-norm-rope-store"
        }

        fn cpu_fwd(&self, _: &candle_core::CpuStorage, _: &Layout) -> Result<(candle_core::CpuStorage, Shape)> {
            candle_core::bail!("qk_norm_rope_store: the CUDA op ran on the CPU")
        }

        fn cuda_fwd(&self, qkv: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
            if !l.is_contiguous() {
                candle_core::bail!("qk_norm_rope_store: qkv is not contiguous");
            }
            super::by_dtype!("qk_norm_rope_store", qkv.dtype(), T => self.run::<T>(qkv, l))
        }
    }
}
