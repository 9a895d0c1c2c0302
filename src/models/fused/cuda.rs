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

/// Each row's softmax under the causal mask of its query (`n` queries, the last of `l`
/// positions): see `kernels/fused.cu`.
pub(super) struct CausalSoftmax {
    pub n: usize,
}

impl CausalSoftmax {
    fn run<T: CudaDType + DeviceRepr>(
        &self,
        x: &CudaStorage,
        l: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let dev = x.device().clone();
        let cols = *l.shape().dims().last().expect("rank checked by the caller");
        let rows = l.shape().elem_count() / cols;
        let xv = x.as_cuda_slice::<T>()?.slice(l.start_offset()..);
        // SAFETY: the kernel writes every element.
        let out = unsafe { dev.alloc::<T>(rows * cols) }?;
        let f = dev.get_or_load_custom_func(&kernel("causal_softmax", x.dtype())?, MODULE, PTX)?;
        let mut b = f.builder();
        let (cols_i, n_i) = (cols as i32, self.n as i32);
        b.arg(&xv).arg(&out).arg(&cols_i).arg(&n_i);
        // SAFETY: arguments as the kernel declares them; a block a row.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (rows as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(err)?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev), l.shape().clone()))
    }
}

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "causal-softmax"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("causal_softmax: the CUDA op ran on the CPU")
    }

    fn cuda_fwd(&self, x: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        super::by_dtype!("causal_softmax", x.dtype(), T => self.run::<T>(x, l))
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
        let f =
            dev.get_or_load_custom_func(&kernel("kv_rows_store", self.k.dtype())?, MODULE, PTX)?;
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
