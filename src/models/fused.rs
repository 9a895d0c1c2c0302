//! Fused position-wise ops of the decoder step. Each is one kernel of ours on CUDA
//! (`kernels/fused.cu`) where the op-by-op path launches two to six; on the CPU (and as the
//! definition of the result) each is the tensor-op sequence it replaces.
//!
//! - [`add_rmsnorm`]: the residual add and the next RMSNorm.
//! - [`silu_mul`]: SwiGLU's `silu(gate) * up` over the fused gate/up projection.
//! - [`snake`]: the vocoder's activation (`x + sin²(αx) / (α + 1e-9)`, six ops op by op).
//! - [`qk_norm_rope_store_twin`]: one position's heads after the fused q/k/v projection —
//!   per-head RMSNorm of q and k (Qwen3) and RoPE (the definition of the batched step's kernel,
//!   which also writes K and V into the cache; see `batch_decode`).

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
    if x.device().is_cuda()
        && x.rank() == 2
        && x.shape() == a.shape()
        && x.dim(1)? <= cuda::NORM_MAX
    {
        let both = x.contiguous()?.apply_op2_no_bwd(
            &a.contiguous()?,
            &cuda::AddRmsNorm { w: norm.weight.clone(), eps: norm.eps as f32 },
        )?;
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

/// Snake, the vocoder's activation: `x + sin²(αx) / (α + 1e-9)` for `x: [B, C, T]`, `alpha:
/// [C]`.
pub fn snake(x: &Tensor, alpha: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && x.rank() == 3 && x.dtype() == alpha.dtype() {
        return x.contiguous()?.apply_op2_no_bwd(&alpha.contiguous()?, &cuda::Snake);
    }
    snake_twin(x, alpha)
}

/// The tensor-op definition of [`snake`].
pub fn snake_twin(x: &Tensor, alpha: &Tensor) -> Result<Tensor> {
    let a = alpha.reshape((1, (), 1))?;
    let s = x.broadcast_mul(&a)?.sin()?.sqr()?;
    x + s.broadcast_div(&(a + 1e-9)?)?
}

/// Per-head RMSNorm (when `norm` = (per-head weights `[heads, d]`, `[d]` ones) is given) and
/// rotate-half RoPE of `qk: [n, heads, d]`, `cos`, `sin` from [`Rope::tables_fused`]: the op-by-op
/// q/k path of every step, and the definition of the batched step's q/k kernel.
pub fn qk_norm_rope(
    qk: &Tensor,
    norm: Option<(&Tensor, &Tensor)>,
    eps: f64,
    cos: &Tensor,
    sin: &Tensor,
) -> Result<Tensor> {
    let qk = match norm {
        Some((w, ones)) => {
            candle_nn::ops::rms_norm(&qk.contiguous()?, ones, eps as f32)?.broadcast_mul(w)?
        }
        None => qk.clone(),
    };
    Rope::apply_fused(&qk, cos, sin)
}

/// The heads of one position, `qkv: [hq + 2 hkv, d]` (q heads, k heads, v heads): q and k heads
/// normed per head with the rows of `w` (`[hq + hkv, d]`, when given), both rotated by `rope` at
/// the position in `pos` (`[1]` u32); v heads as they are. The definition of the batched step's
/// `qk_store_batch` kernel for one row (see [`crate::batch_decode`]), which also writes K and V.
pub fn qk_norm_rope_store_twin(
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
    let qk = qk_norm_rope(
        &qkv.narrow(0, 0, hq + hkv)?.unsqueeze(0)?,
        w.map(|w| (w, &ones)),
        eps,
        &cos,
        &sin,
    )?
    .squeeze(0)?;
    let v = qkv.narrow(0, hq + hkv, hkv)?;
    Tensor::cat(&[qk, v.contiguous()?], 0)
}

/// The flow's slot-pool store: new keys and values `k`, `v: [P, N, h, T, d]` written into the pools
/// `kp`, `vp: [P, R, h, cap, d]` (contiguous; views of a larger pool are fine) at row `rows[n]`
/// (`[N]` u32) and position `pos[n, t]` (`[N, T]` u32), in place. One kernel on CUDA; elsewhere
/// slice copies (one per run of consecutive positions), which define the result.
pub fn kv_rows_store(
    kp: &Tensor,
    vp: &Tensor,
    k: &Tensor,
    v: &Tensor,
    rows: &Tensor,
    pos: &Tensor,
) -> Result<()> {
    let (p, n, h, t, d) = k.dims5()?;
    let (pp, _, ph, _, pd) = kp.dims5()?;
    if v.shape() != k.shape()
        || vp.shape() != kp.shape()
        || pp != p
        || ph != h
        || pd != d
        || rows.dims1()? != n
        || pos.dims2()? != (n, t)
    {
        candle_core::bail!(
            "kv_rows_store: k {:?} into pool {:?} with {:?} rows, {:?} positions",
            k.shape(),
            kp.shape(),
            rows.shape(),
            pos.shape()
        );
    }
    if !kp.is_contiguous() || !vp.is_contiguous() || kp.dtype() != k.dtype() {
        candle_core::bail!("kv_rows_store: the pools must be contiguous and of the keys' dtype");
    }
    #[cfg(feature = "cuda")]
    if kp.device().is_cuda() {
        let op = cuda::KvRowsStore {
            vp: vp.clone(),
            k: k.contiguous()?,
            v: v.contiguous()?,
            rows: rows.contiguous()?,
            pos: pos.contiguous()?,
        };
        return kp.inplace_op1(&op);
    }
    let cpu = candle_core::Device::Cpu;
    let rows = rows.to_device(&cpu)?.to_vec1::<u32>()?;
    let pos = pos.to_device(&cpu)?.to_vec2::<u32>()?;
    for pl in 0..p {
        for (r, (&row, ps)) in rows.iter().zip(&pos).enumerate() {
            let (kd, vd) = (kp.get(pl)?.get(row as usize)?, vp.get(pl)?.get(row as usize)?);
            let (ks, vs) = (k.get(pl)?.get(r)?, v.get(pl)?.get(r)?);
            // runs of frames whose positions step by +1 (copied as they are) or -1 (reversed)
            let mut a = 0;
            while a < t {
                let mut b = a + 1;
                let step = if b < t { ps[b] as i64 - ps[a] as i64 } else { 1 };
                let step = if step == 1 || step == -1 { step } else { 1 };
                while b < t && ps[b] as i64 - ps[b - 1] as i64 == step {
                    b += 1;
                }
                let frames: Vec<u32> = if step == 1 {
                    (a as u32..b as u32).collect()
                } else {
                    (a as u32..b as u32).rev().collect()
                };
                let idx = Tensor::new(frames.as_slice(), k.device())?;
                let at = if step == 1 { ps[a] } else { ps[b - 1] } as usize;
                kd.slice_set(&ks.index_select(&idx, 1)?.contiguous()?, 1, at)?;
                vd.slice_set(&vs.index_select(&idx, 1)?.contiguous()?, 1, at)?;
                a = b;
            }
        }
    }
    Ok(())
}

/// `src.index_select(rows, 0)` for a contiguous `src: [S, …]` and `rows: [N]` u32: on CUDA one
/// kernel copying 16 bytes a thread (candle's index_select moves one element a thread with its
/// index arithmetic: 25 % of the flow's B8 kernel time, gathering the pool's slots), elsewhere
/// (or for rows not of whole 16-byte pieces) index_select itself, which defines the result.
pub fn rows_gather(src: &Tensor, rows: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if src.device().is_cuda()
        && src.is_contiguous()
        && src.rank() >= 1
        && rows.dtype() == candle_core::DType::U32
        && matches!(
            src.dtype(),
            candle_core::DType::F32 | candle_core::DType::BF16 | candle_core::DType::F16
        )
    {
        let row_bytes = src.elem_count() / src.dim(0)?.max(1) * src.dtype().size_in_bytes();
        let start = src.layout().start_offset() * src.dtype().size_in_bytes();
        if row_bytes > 0
            && row_bytes.is_multiple_of(16)
            && start.is_multiple_of(16)
            && rows.dims1()? > 0
        {
            return src.apply_op1_no_bwd(&cuda::RowsGather { rows: rows.contiguous()?, row_bytes });
        }
    }
    src.index_select(rows, 0)
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
    use candle_core::cuda_backend::cudarc::driver::{
        CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::{CudaDType, CudaStorage};
    use candle_core::{CustomOp1, CustomOp2, DType, Layout, Result, Shape, Storage, Tensor};

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/fused.ptx"));

    pub(crate) fn err(e: impl std::error::Error + Send + Sync + 'static) -> candle_core::Error {
        candle_core::Error::Cuda(Box::new(e))
    }

    /// A contiguous tensor's elements as a device view (from its layout's start).
    pub(crate) fn view<'a, T: CudaDType>(
        s: &'a Storage,
        l: &Layout,
        what: &str,
    ) -> Result<CudaView<'a, T>> {
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
        fn run<T: CudaDType + DeviceRepr>(
            &self,
            x: &CudaStorage,
            xl: &Layout,
            a: &CudaStorage,
            al: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
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
            // SAFETY: arguments as the kernel declares them; one block of 1024 per row (h <=
            // NORM_MAX).
            unsafe {
                b.launch(LaunchConfig {
                    grid_dim: (n as u32, 1, 1),
                    block_dim: (1024, 1, 1),
                    shared_mem_bytes: 0,
                })
            }
            .map_err(err)?;
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

        fn cuda_fwd(
            &self,
            x: &CudaStorage,
            xl: &Layout,
            a: &CudaStorage,
            al: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            super::by_dtype!("add_rmsnorm", x.dtype(), T => self.run::<T>(x, xl, a, al))
        }
    }

    pub(super) struct SiluMul {
        pub inter: usize,
    }

    impl SiluMul {
        fn run<T: CudaDType + DeviceRepr>(
            &self,
            gu: &CudaStorage,
            l: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
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
            unsafe {
                b.launch(LaunchConfig {
                    grid_dim: (blocks, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                })
            }
            .map_err(err)?;
            Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((n, self.inter))))
        }
    }

    pub(super) struct Snake;

    impl Snake {
        fn run<T: CudaDType + DeviceRepr>(
            &self,
            x: &CudaStorage,
            xl: &Layout,
            a: &CudaStorage,
            al: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let dev = x.device().clone();
            let (_, c, t) = xl.shape().dims3()?;
            if al.shape().elem_count() != c {
                candle_core::bail!("snake: {} alphas for {c} channels", al.shape().elem_count());
            }
            let total = xl.shape().elem_count();
            let xv = x.as_cuda_slice::<T>()?.slice(xl.start_offset()..);
            let av = a.as_cuda_slice::<T>()?.slice(al.start_offset()..);
            // SAFETY: the kernel writes every element.
            let out = unsafe { dev.alloc::<T>(total) }?;
            let f = dev.get_or_load_custom_func(&kernel("snake", x.dtype())?, MODULE, PTX)?;
            let mut b = f.builder();
            let (c_i, t_i, total_u) = (c as i32, t as i32, total as u64);
            b.arg(&xv).arg(&av).arg(&out).arg(&c_i).arg(&t_i).arg(&total_u);
            let blocks = total.div_ceil(256).min(8192) as u32;
            // SAFETY: arguments as the kernel declares them; a grid-stride loop covers `total`.
            unsafe {
                b.launch(LaunchConfig {
                    grid_dim: (blocks, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                })
            }
            .map_err(err)?;
            Ok((CudaStorage::wrap_cuda_slice(out, dev), xl.shape().clone()))
        }
    }

    impl CustomOp2 for Snake {
        fn name(&self) -> &'static str {
            "snake"
        }

        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &Layout,
            _: &candle_core::CpuStorage,
            _: &Layout,
        ) -> Result<(candle_core::CpuStorage, Shape)> {
            candle_core::bail!("snake: the CUDA op ran on the CPU")
        }

        fn cuda_fwd(
            &self,
            x: &CudaStorage,
            xl: &Layout,
            a: &CudaStorage,
            al: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            super::by_dtype!("snake", x.dtype(), T => self.run::<T>(x, xl, a, al))
        }
    }

    pub(super) struct KvRowsStore {
        pub vp: Tensor,
        pub k: Tensor,
        pub v: Tensor,
        pub rows: Tensor,
        pub pos: Tensor,
    }

    impl KvRowsStore {
        fn run<T: CudaDType + DeviceRepr>(&self, kp: &CudaStorage, l: &Layout) -> Result<()> {
            let dev = kp.device().clone();
            if !l.is_contiguous() {
                candle_core::bail!("kv_rows_store: the key pool is not contiguous");
            }
            let (_, r_all, h, cap, d) = l.shape().dims5()?;
            let (_, n, _, t, _) = self.k.dims5()?;
            let kpv = kp.as_cuda_slice::<T>()?.slice(l.start_offset()..);
            let g = [&self.vp, &self.k, &self.v].map(|t| t.storage_and_layout());
            let vpv = view::<T>(&g[0].0, g[0].1, "v pool")?;
            let kv = view::<T>(&g[1].0, g[1].1, "new keys")?;
            let vv = view::<T>(&g[2].0, g[2].1, "new values")?;
            let (rs, rl) = self.rows.storage_and_layout();
            let rows = view::<u32>(&rs, rl, "rows")?;
            let (ps, pl) = self.pos.storage_and_layout();
            let pos = view::<u32>(&ps, pl, "positions")?;
            let total = self.k.elem_count();
            let plane = (r_all * h * cap * d) as u64;
            let f = dev.get_or_load_custom_func(
                &kernel("kv_rows_store", self.k.dtype())?,
                MODULE,
                PTX,
            )?;
            let mut b = f.builder();
            let (n_i, h_i, t_i, d_i, cap_i, total_u) =
                (n as i32, h as i32, t as i32, d as i32, cap as i32, total as u64);
            b.arg(&kv).arg(&vv).arg(&kpv).arg(&vpv).arg(&rows).arg(&pos);
            b.arg(&n_i).arg(&h_i).arg(&t_i).arg(&d_i).arg(&cap_i).arg(&plane).arg(&total_u);
            let blocks = total.div_ceil(256).min(8192) as u32;
            // SAFETY: arguments as the kernel declares them; the caller checked the shapes (every
            // row and position inside the pool); a grid-stride loop covers `total`.
            unsafe {
                b.launch(LaunchConfig {
                    grid_dim: (blocks, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                })
            }
            .map_err(err)?;
            Ok(())
        }
    }

    impl candle_core::InplaceOp1 for KvRowsStore {
        fn name(&self) -> &'static str {
            "kv-rows-store"
        }

        fn cpu_fwd(&self, _: &mut candle_core::CpuStorage, _: &Layout) -> Result<()> {
            candle_core::bail!("kv_rows_store: the CUDA op ran on the CPU")
        }

        fn cuda_fwd(&self, kp: &mut CudaStorage, l: &Layout) -> Result<()> {
            super::by_dtype!("kv_rows_store", kp.dtype(), T => self.run::<T>(kp, l))
        }
    }

    pub(super) struct RowsGather {
        pub rows: Tensor,
        pub row_bytes: usize,
    }

    impl RowsGather {
        fn run<T: CudaDType + DeviceRepr>(
            &self,
            src: &CudaStorage,
            l: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let dev = src.device().clone();
            let n = self.rows.dims1()?;
            let s = src.as_cuda_slice::<T>()?.slice(l.start_offset()..);
            let (rs, rl) = self.rows.storage_and_layout();
            let rows = view::<u32>(&rs, rl, "rows")?;
            let mut dims = l.shape().dims().to_vec();
            dims[0] = n;
            let shape = Shape::from(dims);
            // SAFETY: the kernel writes every element (n rows of row_bytes each).
            let out = unsafe { dev.alloc::<T>(shape.elem_count()) }?;
            let f = dev.get_or_load_custom_func("rows_gather_u4", MODULE, PTX)?;
            let mut b = f.builder();
            let row_vecs = (self.row_bytes / 16) as u64;
            b.arg(&s).arg(&rows).arg(&out).arg(&row_vecs);
            let blocks = (row_vecs as usize).div_ceil(256).clamp(1, 1024) as u32;
            // SAFETY: arguments as the kernel declares them; the caller checked that rows are
            // whole 16-byte pieces from an aligned start; the rows are the caller's (inside the
            // pool, as index_select would require); a grid-stride loop covers each row.
            unsafe {
                b.launch(LaunchConfig {
                    grid_dim: (blocks, n as u32, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                })
            }
            .map_err(err)?;
            Ok((CudaStorage::wrap_cuda_slice(out, dev), shape))
        }
    }

    impl CustomOp1 for RowsGather {
        fn name(&self) -> &'static str {
            "rows-gather"
        }

        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &Layout,
        ) -> Result<(candle_core::CpuStorage, Shape)> {
            candle_core::bail!("rows_gather: the CUDA op ran on the CPU")
        }

        fn cuda_fwd(&self, src: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
            super::by_dtype!("rows_gather", src.dtype(), T => self.run::<T>(src, l))
        }
    }

    impl CustomOp1 for SiluMul {
        fn name(&self) -> &'static str {
            "silu-mul"
        }

        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &Layout,
        ) -> Result<(candle_core::CpuStorage, Shape)> {
            candle_core::bail!("silu_mul: the CUDA op ran on the CPU")
        }

        fn cuda_fwd(&self, gu: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
            super::by_dtype!("silu_mul", gu.dtype(), T => self.run::<T>(gu, l))
        }
    }
}
