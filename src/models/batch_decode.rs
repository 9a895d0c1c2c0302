//! The ops of the batched decode step over a slot pool (see [`crate::slots`]): B streams advance
//! one position each, stream b's K/V in slot `slots[b]` of the pool at position `pos[b]`, both
//! read from device memory so that one CUDA graph serves every batch of a size.
//!
//! On CUDA each is our own kernel (`kernels/batch_decode.cu`); elsewhere the same function is
//! computed with tensor ops (the twins below, which read `slots` and `pos` to the host), and that
//! twin defines the result.
//!
//! Contracts: `qkv`, `heads: [B, hq + 2 hkv, d]` (q heads, k heads, v heads); `kc`, `vc:
//! [slots, hkv, cap, d]`; `slots`, `pos: [B]` u32; `w: [hq + hkv, d]`.

use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::{Result, Tensor};

use super::attention::Rope;

/// Whether [`decode_attention_batch`]'s first pass runs in teams on CUDA.
static TEAMS: AtomicBool = AtomicBool::new(false);

/// Process-wide: on CUDA, [`decode_attention_batch`]'s first pass reads each K and V row with a
/// team of lanes, 16 bytes a lane, a score summed over its team (`batch_attn_teams`), instead of
/// a warp a row, 2 bytes a lane (`batch_attn_partial`, whose loads ran at a third of an H100's
/// bandwidth late in a long call: docs/performance.md, run 85). Set before any graph is captured.
pub fn set_decode_attention_teams(on: bool) {
    TEAMS.store(on, Ordering::Relaxed);
}

fn host_u32(t: &Tensor) -> Result<Vec<u32>> {
    t.to_device(&candle_core::Device::Cpu)?.to_vec1::<u32>()
}

/// Per stream b: q and k heads normed per head with the rows of `w` (when given) and rotated at
/// `pos[b]`; k and v heads written into slot `slots[b]` at `pos[b]`. Returns the heads.
#[allow(clippy::too_many_arguments)]
pub fn qk_norm_rope_store_batch(
    qkv: &Tensor,
    hq: usize,
    hkv: usize,
    w: Option<&Tensor>,
    eps: f64,
    rope: &Rope,
    slots: &Tensor,
    pos: &Tensor,
    kc: &Tensor,
    vc: &Tensor,
) -> Result<Tensor> {
    let (b, rows, d) = qkv.dims3()?;
    let (_, khv, _, kd) = kc.dims4()?;
    if rows != hq + 2 * hkv
        || khv != hkv
        || kd != d
        || !d.is_multiple_of(2)
        || slots.dims1()? != b
        || pos.dims1()? != b
    {
        candle_core::bail!(
            "qk_norm_rope_store_batch: qkv {:?} for {hq} + 2 x {hkv} heads, pool {:?}, {} slots",
            qkv.shape(),
            kc.shape(),
            b
        );
    }
    #[cfg(feature = "cuda")]
    if qkv.device().is_cuda() {
        let (cos, sin) = rope.full_tables();
        let op = cuda::QkStoreBatch {
            w: w.cloned(),
            cos: cos.clone(),
            sin: sin.clone(),
            slots: slots.clone(),
            pos: pos.clone(),
            kc: kc.clone(),
            vc: vc.clone(),
            hq,
            hkv,
            eps: eps as f32,
        };
        return qkv.contiguous()?.apply_op1_no_bwd(&op);
    }
    let (slots, pos) = (host_u32(slots)?, host_u32(pos)?);
    let mut out = Vec::with_capacity(b);
    for i in 0..b {
        let (s, p) = (slots[i] as usize, pos[i]);
        let p_t = Tensor::new(&[p], qkv.device())?;
        let heads =
            super::fused::qk_norm_rope_store_twin(&qkv.get(i)?, hq, hkv, w, eps, rope, &p_t)?;
        let cap = kc.dim(2)?;
        let at = (p as usize).min(cap - 1);
        let k = heads.narrow(0, hq, hkv)?.unsqueeze(1)?.contiguous()?;
        let v = heads.narrow(0, hq + hkv, hkv)?.unsqueeze(1)?.contiguous()?;
        kc.get(s)?.slice_set(&k, 1, at)?;
        vc.get(s)?.slice_set(&v, 1, at)?;
        out.push(heads);
    }
    Tensor::stack(&out, 0)
}

/// Attention of each stream's new position (its q, k, v heads in `heads`) against the positions
/// `0..pos[b]` of its slot and itself. Returns `[B, hq, d]` in `heads`' dtype. `max_pos`, when the
/// caller knows every `pos[b]` is at most it: the work is split over those positions only, not
/// the whole capacity (a graph, replayed at any positions, passes `None`).
#[allow(clippy::too_many_arguments)]
pub fn decode_attention_batch(
    heads: &Tensor,
    hq: usize,
    hkv: usize,
    kc: &Tensor,
    vc: &Tensor,
    slots: &Tensor,
    pos: &Tensor,
    max_pos: Option<usize>,
) -> Result<Tensor> {
    let (b, rows, d) = heads.dims3()?;
    let (_, khv, _, kd) = kc.dims4()?;
    if rows != hq + 2 * hkv
        || khv != hkv
        || kd != d
        || vc.shape() != kc.shape()
        || !hq.is_multiple_of(hkv)
        || slots.dims1()? != b
        || pos.dims1()? != b
    {
        candle_core::bail!(
            "decode_attention_batch: heads {:?} for {hq} + 2 x {hkv}, pool {:?}",
            heads.shape(),
            kc.shape()
        );
    }
    if hq / hkv > 8 || d > 128 {
        candle_core::bail!(
            "decode_attention_batch: {} query heads per KV head (at most 8), \
            head_dim {d} (at most 128)",
            hq / hkv
        );
    }
    #[cfg(feature = "cuda")]
    if heads.device().is_cuda() {
        let op = cuda::AttnBatch {
            teams: TEAMS.load(Ordering::Relaxed),
            kc: kc.clone(),
            vc: vc.clone(),
            slots: slots.contiguous()?,
            pos: pos.contiguous()?,
            hq,
            hkv,
            max_pos,
        };
        return heads.contiguous()?.apply_op1_no_bwd(&op);
    }
    // (the twin reads each row's own position)
    let _ = max_pos;
    let (slots, pos) = (host_u32(slots)?, host_u32(pos)?);
    let mut out = Vec::with_capacity(b);
    for i in 0..b {
        let h = heads.get(i)?;
        let p = Tensor::new(&[pos[i]], heads.device())?;
        let s = slots[i] as usize;
        let (q, k, v) = (h.narrow(0, 0, hq)?, h.narrow(0, hq, hkv)?, h.narrow(0, hq + hkv, hkv)?);
        out.push(super::decode_attention::decode_attention(
            &q,
            &k,
            &v,
            &kc.get(s)?,
            &vc.get(s)?,
            &p,
        )?);
    }
    Tensor::stack(&out, 0)
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::{CudaDType, CudaStorage};
    use candle_core::{CustomOp1, Layout, Result, Shape, Tensor};

    use crate::fused::cuda::{err, kernel, view};

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/batch_decode.ptx"));
    const MODULE: &str = "antiphon_batch_decode";
    /// Threads a block of the first attention pass has (`THREADS` in the kernel).
    const THREADS: usize = 128;
    /// Positions each team of a block's lanes takes at a time (`PER` in the kernel).
    const PER: usize = 4;
    /// Positions a block takes at a time in warps (`WARP_CHUNK` in the kernel).
    const WARP_CHUNK: usize = 16;
    /// Blocks the first attention pass aims at (KV heads × splits × streams): a stream's positions
    /// are cut in as many spans as that allows, [`MAX_SPLITS`] at most (each a whole number of
    /// chunks, one at the least), each block looping over its span (docs/design/engine.md,
    /// "Our own CUDA kernels for the decode step").
    const SPLIT_BLOCKS: usize = 4096;
    /// Spans a row's positions are cut in at most: the second pass reads them one after the other
    /// (a row at position 8192 in spans of one 16-position chunk had 513 to combine, in 32 blocks
    /// for a lone stream).
    const MAX_SPLITS: usize = 64;

    pub(super) struct QkStoreBatch {
        pub w: Option<Tensor>,
        pub cos: Tensor,
        pub sin: Tensor,
        pub slots: Tensor,
        pub pos: Tensor,
        pub kc: Tensor,
        pub vc: Tensor,
        pub hq: usize,
        pub hkv: usize,
        pub eps: f32,
    }

    impl QkStoreBatch {
        fn run<T: CudaDType + DeviceRepr>(
            &self,
            qkv: &CudaStorage,
            l: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let dev = qkv.device().clone();
            let (b, rows, d) = l.shape().dims3()?;
            let cap = self.kc.dim(2)?;
            let qv = qkv.as_cuda_slice::<T>()?.slice(l.start_offset()..);
            let g = [&self.cos, &self.sin, &self.kc, &self.vc].map(|t| t.storage_and_layout());
            let cos = view::<T>(&g[0].0, g[0].1, "rope cos")?;
            let sin = view::<T>(&g[1].0, g[1].1, "rope sin")?;
            let kc = view::<T>(&g[2].0, g[2].1, "k pool")?;
            let vc = view::<T>(&g[3].0, g[3].1, "v pool")?;
            let (ss, sl) = self.slots.storage_and_layout();
            let slots = view::<u32>(&ss, sl, "slots")?;
            let (ps, pl) = self.pos.storage_and_layout();
            let pos = view::<u32>(&ps, pl, "positions")?;
            let wg = self.w.as_ref().map(|w| w.storage_and_layout());
            let wv = match &wg {
                Some((s, l)) => Some(view::<T>(s, l, "q/k norm weight")?),
                None => None,
            };
            // SAFETY: the kernel writes every element.
            let out = unsafe { dev.alloc::<T>(b * rows * d) }?;
            let f =
                dev.get_or_load_custom_func(&kernel("qk_store_batch", qkv.dtype())?, MODULE, PTX)?;
            let mut bl = f.builder();
            let null = 0u64;
            bl.arg(&qv);
            match &wv {
                Some(w) => bl.arg(w),
                None => bl.arg(&null),
            };
            let (hq, hkv, d_i, cap_i) = (self.hq as i32, self.hkv as i32, d as i32, cap as i32);
            bl.arg(&cos).arg(&sin).arg(&slots).arg(&pos).arg(&out).arg(&kc).arg(&vc);
            bl.arg(&hq).arg(&hkv).arg(&d_i).arg(&cap_i).arg(&self.eps);
            let cfg = LaunchConfig {
                grid_dim: (rows as u32, b as u32, 1),
                block_dim: (32, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: arguments as the kernel declares them; one 32-thread block per head and
            // stream.
            unsafe { bl.launch(cfg) }.map_err(err)?;
            Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((b, rows, d))))
        }
    }

    impl CustomOp1 for QkStoreBatch {
        fn name(&self) -> &'static str {
            "qk-norm-rope-store-batch"
        }

        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &Layout,
        ) -> Result<(candle_core::CpuStorage, Shape)> {
            candle_core::bail!("qk_norm_rope_store_batch: the CUDA op ran on the CPU")
        }

        fn cuda_fwd(&self, qkv: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
            if !l.is_contiguous() {
                candle_core::bail!("qk_norm_rope_store_batch: qkv is not contiguous");
            }
            crate::fused::by_dtype!("qk_norm_rope_store_batch", qkv.dtype(), T => self.run::<T>(qkv,
                l))
        }
    }

    pub(super) struct AttnBatch {
        pub kc: Tensor,
        pub vc: Tensor,
        pub slots: Tensor,
        pub pos: Tensor,
        pub hq: usize,
        pub hkv: usize,
        pub max_pos: Option<usize>,
        /// The first pass in teams (`batch_attn_teams`), else in warps (`batch_attn_partial`).
        pub teams: bool,
    }

    impl AttnBatch {
        fn run<T: CudaDType + DeviceRepr>(
            &self,
            heads: &CudaStorage,
            l: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let dev = heads.device().clone();
            let (b, _, d) = l.shape().dims3()?;
            let (hq, hkv) = (self.hq, self.hkv);
            let cap = self.kc.dim(2)?;
            let g = [&self.kc, &self.vc].map(|t| t.storage_and_layout());
            // (in teams each lane reads 8 elements of a row at once: every row starts 16-byte
            // aligned)
            let aligned = d.is_multiple_of(8)
                && l.start_offset().is_multiple_of(8)
                && g.iter().all(|(_, gl)| gl.start_offset().is_multiple_of(8));
            if self.teams && !aligned {
                candle_core::bail!(
                    "decode_attention_batch: head_dim {d} or an offset is not a multiple of 8"
                );
            }
            let hv = heads.as_cuda_slice::<T>()?.slice(l.start_offset()..);
            let kc = view::<T>(&g[0].0, g[0].1, "k pool")?;
            let vc = view::<T>(&g[1].0, g[1].1, "v pool")?;
            let (ss, sl) = self.slots.storage_and_layout();
            let slots = view::<u32>(&ss, sl, "slots")?;
            let (ps, pl) = self.pos.storage_and_layout();
            let pos = view::<u32>(&ps, pl, "positions")?;
            // in teams a row is read by a team of `lanes` threads, 8 elements each, and a block
            // takes a chunk of `PER` positions a team at a time
            let lanes = (d / 8).next_power_of_two();
            let chunk = if self.teams { THREADS / lanes * PER } else { WARP_CHUNK };
            // splits: for the blocks the pass aims at, at most one a chunk of the capacity, or of
            // the positions up to `max_pos` (the kernels size each split's span from the row's
            // position, so any count covers it)
            let most = match self.max_pos {
                Some(m) => m.min(cap - 1) / chunk + 1,
                None => cap.div_ceil(chunk),
            };
            let s = SPLIT_BLOCKS.div_ceil(hkv * b).clamp(1, most.min(MAX_SPLITS));
            // SAFETY: the combine kernel reads only the splits that hold positions, each written
            // whole by the partial kernel; `out` is written whole by the combine kernel.
            let part_acc = unsafe { dev.alloc::<f32>(b * hq * s * d) }?;
            let part_ml = unsafe { dev.alloc::<f32>(b * hq * s * 2) }?;
            let out = unsafe { dev.alloc::<T>(b * hq * d) }?;
            let (hq_i, hkv_i, cap_i, d_i, s_i) =
                (hq as i32, hkv as i32, cap as i32, d as i32, s as i32);
            let (lanes_i, chunk_i) = (lanes as i32, chunk as i32);
            // (the kernel for the fewest query heads per KV head, 1, 2, 4 or 8, that holds them)
            let group = (hq / hkv).next_power_of_two();
            let form = if self.teams { "batch_attn_teams" } else { "batch_attn_partial" };
            let partial = dev.get_or_load_custom_func(
                &kernel(&format!("{form}_g{group}"), heads.dtype())?,
                MODULE,
                PTX,
            )?;
            let mut bl = partial.builder();
            bl.arg(&hv).arg(&kc).arg(&vc).arg(&slots).arg(&pos).arg(&part_acc).arg(&part_ml);
            bl.arg(&hq_i).arg(&hkv_i).arg(&cap_i).arg(&d_i);
            if self.teams {
                bl.arg(&lanes_i);
            }
            let cfg = LaunchConfig {
                grid_dim: (hkv as u32, s as u32, b as u32),
                block_dim: (THREADS as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the arguments match the kernel's signature; shapes were checked by the
            // caller.
            unsafe { bl.launch(cfg) }.map_err(err)?;
            let combine = dev.get_or_load_custom_func(
                &kernel("batch_attn_combine", heads.dtype())?,
                MODULE,
                PTX,
            )?;
            let mut bl = combine.builder();
            bl.arg(&part_acc)
                .arg(&part_ml)
                .arg(&pos)
                .arg(&out)
                .arg(&hq_i)
                .arg(&d_i)
                .arg(&s_i)
                .arg(&cap_i)
                .arg(&chunk_i);
            let cfg = LaunchConfig {
                grid_dim: (hq as u32, b as u32, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: (s * 4) as u32,
            };
            // SAFETY: as above.
            unsafe { bl.launch(cfg) }.map_err(err)?;
            drop(g);
            Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((b, hq, d))))
        }
    }

    impl CustomOp1 for AttnBatch {
        fn name(&self) -> &'static str {
            "decode-attention-batch"
        }

        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &Layout,
        ) -> Result<(candle_core::CpuStorage, Shape)> {
            candle_core::bail!("decode_attention_batch: the CUDA op ran on the CPU")
        }

        fn cuda_fwd(&self, heads: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
            if !l.is_contiguous() {
                candle_core::bail!("decode_attention_batch: heads are not contiguous");
            }
            crate::fused::by_dtype!("decode_attention_batch", heads.dtype(),
                T => self.run::<T>(heads, l))
        }
    }
}
