use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, CudaStorage};
use candle_core::{CustomOp1, Layout, Result, Shape, Tensor};

use crate::fused::cuda::{err, kernel, view};

pub(crate) const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/dit.ptx"));
pub(crate) const MODULE: &str = "antiphon_dit";

/// A grid-stride launch over `total` elements.
pub(crate) fn grid(total: usize) -> (u32, u32) {
    (total.div_ceil(256).clamp(1, 8192) as u32, 256)
}

/// Runs kernel `name` (`_` + dtype suffix) with arguments `(x, others… (null where None),
/// out, ints…, u64s…, floats…)`, the output shaped like `x`; every tensor of `x`'s dtype
/// and contiguous. `(grid, block)`: one-dimensional.
pub(crate) fn launch(
    name: &'static str,
    x: &Tensor,
    others: &[Option<&Tensor>],
    ints: &[i32],
    u64s: &[u64],
    floats: &[f32],
    grid: (u32, u32),
) -> Result<Tensor> {
    launch_shaped(name, x, others, ints, u64s, floats, grid, None)
}

/// [`launch`] with an output of shape `out` (`None`: `x`'s shape).
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_shaped(
    name: &'static str,
    x: &Tensor,
    others: &[Option<&Tensor>],
    ints: &[i32],
    u64s: &[u64],
    floats: &[f32],
    (grid, block): (u32, u32),
    out: Option<Shape>,
) -> Result<Tensor> {
    let op = Launch {
        name,
        out,
        others: others.iter().map(|t| t.cloned()).collect(),
        ints: ints.to_vec(),
        u64s: u64s.to_vec(),
        floats: floats.to_vec(),
        cfg: LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (block, 1, 1), shared_mem_bytes: 0 },
    };
    x.contiguous()?.apply_op1_no_bwd(&op)
}

/// Runs kernel `name` writing into `dst` in place (contiguous; a view's offset is honoured):
/// arguments `(srcs…, index (u32, when given), dst, ints…, u64s…)`, every other tensor of
/// `dst`'s dtype, contiguous, and none sharing `dst`'s storage.
pub(crate) fn launch_into(
    name: &'static str,
    dst: &Tensor,
    srcs: &[&Tensor],
    index: Option<&Tensor>,
    ints: &[i32],
    u64s: &[u64],
    (grid, block): (u32, u32),
) -> Result<()> {
    let op = LaunchInto {
        name,
        srcs: srcs.iter().map(|t| (*t).clone()).collect(),
        index: index.cloned(),
        ints: ints.to_vec(),
        u64s: u64s.to_vec(),
        cfg: LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (block, 1, 1), shared_mem_bytes: 0 },
    };
    dst.inplace_op1(&op)
}

struct LaunchInto {
    name: &'static str,
    srcs: Vec<Tensor>,
    index: Option<Tensor>,
    ints: Vec<i32>,
    u64s: Vec<u64>,
    cfg: LaunchConfig,
}

impl LaunchInto {
    fn run<T: CudaDType + DeviceRepr>(&self, s: &mut CudaStorage, l: &Layout) -> Result<()> {
        let dev = s.device().clone();
        let dst = s.as_cuda_slice::<T>()?.slice(l.start_offset()..);
        let guards: Vec<_> = self.srcs.iter().map(|t| t.storage_and_layout()).collect();
        let views = guards
            .iter()
            .map(|(s, l)| view::<T>(s, l, self.name))
            .collect::<Result<Vec<CudaView<T>>>>()?;
        let index_guard = self.index.as_ref().map(|t| t.storage_and_layout());
        let index = index_guard.as_ref().map(|(s, l)| view::<u32>(s, l, self.name)).transpose()?;
        let f = dev.get_or_load_custom_func(&kernel(self.name, s.dtype())?, MODULE, PTX)?;
        let mut b = f.builder();
        for v in &views {
            b.arg(v);
        }
        if let Some(ix) = &index {
            b.arg(ix);
        }
        b.arg(&dst);
        for i in &self.ints {
            b.arg(i);
        }
        for u in &self.u64s {
            b.arg(u);
        }
        // SAFETY: the callers pass the arguments each kernel declares, in its order, with
        // shapes they checked (the destination holds every element the kernel writes).
        unsafe { b.launch(self.cfg) }.map_err(err)?;
        Ok(())
    }
}

impl candle_core::InplaceOp1 for LaunchInto {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(&self, _: &mut candle_core::CpuStorage, _: &Layout) -> Result<()> {
        candle_core::bail!("{}: the CUDA op ran on the CPU", self.name)
    }

    fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> Result<()> {
        if !l.is_contiguous() {
            candle_core::bail!("{}: destination not contiguous", self.name);
        }
        crate::fused::by_dtype!(self.name, s.dtype(), T => self.run::<T>(s, l))
    }
}

struct Launch {
    name: &'static str,
    out: Option<Shape>,
    others: Vec<Option<Tensor>>,
    ints: Vec<i32>,
    u64s: Vec<u64>,
    floats: Vec<f32>,
    cfg: LaunchConfig,
}

impl Launch {
    fn run<T: CudaDType + DeviceRepr>(
        &self,
        s: &CudaStorage,
        l: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let dev = s.device().clone();
        let x = s.as_cuda_slice::<T>()?.slice(l.start_offset()..);
        let guards: Vec<_> =
            self.others.iter().map(|t| t.as_ref().map(|t| t.storage_and_layout())).collect();
        let views = guards
            .iter()
            .map(|g| g.as_ref().map(|(s, l)| view::<T>(s, l, self.name)).transpose())
            .collect::<Result<Vec<Option<CudaView<T>>>>>()?;
        let shape = self.out.clone().unwrap_or_else(|| l.shape().clone());
        // SAFETY: the kernel writes every element.
        let out = unsafe { dev.alloc::<T>(shape.elem_count()) }?;
        let f = dev.get_or_load_custom_func(&kernel(self.name, s.dtype())?, MODULE, PTX)?;
        let mut b = f.builder();
        let null = 0u64;
        b.arg(&x);
        for v in &views {
            match v {
                Some(v) => b.arg(v),
                None => b.arg(&null),
            };
        }
        b.arg(&out);
        for i in &self.ints {
            b.arg(i);
        }
        for u in &self.u64s {
            b.arg(u);
        }
        for f in &self.floats {
            b.arg(f);
        }
        // SAFETY: the callers pass the arguments each kernel declares, in its order, with
        // shapes they checked; grid-stride loops or one block per row cover the output.
        unsafe { b.launch(self.cfg) }.map_err(err)?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev), shape))
    }
}

impl CustomOp1 for Launch {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("{}: the CUDA op ran on the CPU", self.name)
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        if !l.is_contiguous() {
            candle_core::bail!("{}: input not contiguous", self.name);
        }
        crate::fused::by_dtype!(self.name, s.dtype(), T => self.run::<T>(s, l))
    }
}
