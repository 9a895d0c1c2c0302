//! The in-place pool attention on CUDA ([`super::dit_attention::pool_attention_in_place`]): per
//! (row, head), the scores as the row's key plane in the pool times its queries, the masked
//! softmax, then the row's value plane times the probabilities written straight into the
//! heads-side-by-side output. Both products are one pointer-array batched cuBLAS call each
//! (`cublasGemmBatchedEx`): a kernel of ours writes the arrays on the device from the rows, so a
//! captured graph replays with whatever rows the step has.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::cublas::sys;
use candle_core::cuda_backend::cudarc::driver::{
    DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, CudaStorage};
use candle_core::{CustomOp1, DType, Layout, Result, Shape, Tensor};

use super::dit_ops::cuda::{MODULE, PTX};
use super::dit_ops::MASKED_SOFTMAX_WARP_ROW;
use crate::fused::cuda::{err, kernel, view};

/// `q: [N, h, T, d]` (any layout) over the pool's planes `pk`, `pv: [R, h, cap, d]` (contiguous),
/// `rows: [N]` u32, `mask: [N, 1, 1, cap]` -> `[N, T, h d]`; the caller checked the shapes.
pub(super) fn attend(
    q: &Tensor,
    pk: &Tensor,
    pv: &Tensor,
    rows: &Tensor,
    mask: &Tensor,
) -> Result<Tensor> {
    let op = InPlace {
        pk: pk.clone(),
        pv: pv.clone(),
        rows: rows.contiguous()?,
        mask: mask.to_dtype(q.dtype())?.contiguous()?,
    };
    q.contiguous()?.apply_op1_no_bwd(&op)
}

struct InPlace {
    pk: Tensor,
    pv: Tensor,
    rows: Tensor,
    mask: Tensor,
}

impl InPlace {
    fn run<T: CudaDType + DeviceRepr>(
        &self,
        s: &CudaStorage,
        l: &Layout,
        ty: sys::cudaDataType_t,
    ) -> Result<(CudaStorage, Shape)> {
        let (n, h, t, d) = l.shape().dims4()?;
        let cap = self.pk.dim(2)?;
        let (nh, es) = (n * h, std::mem::size_of::<T>());
        let dev = s.device().clone();
        let q = s.as_cuda_slice::<T>()?.slice(l.start_offset()..);
        let (pks, pkl) = self.pk.storage_and_layout();
        let (pvs, pvl) = self.pv.storage_and_layout();
        let (rs, rl) = self.rows.storage_and_layout();
        let (ms, ml) = self.mask.storage_and_layout();
        let (pk, pv) = (
            view::<T>(&pks, pkl, "in-place attention")?,
            view::<T>(&pvs, pvl, "in-place attention")?,
        );
        let (rows, mask) = (
            view::<u32>(&rs, rl, "in-place attention")?,
            view::<T>(&ms, ml, "in-place attention")?,
        );
        // SAFETY: the first product writes every score, the softmax every probability, the second
        // product every output element (each head its d columns of each of its rows' T positions).
        let (scores, probs, out) = unsafe {
            (
                dev.alloc::<T>(nh * t * cap)?,
                dev.alloc::<T>(nh * t * cap)?,
                dev.alloc::<T>(n * t * h * d)?,
            )
        };
        // SAFETY: attention_pointers writes all 6 nh entries.
        let ptrs = unsafe { dev.alloc::<u64>(6 * nh) }?;
        let stream = dev.cuda_stream();
        {
            let (qp, _g0) = q.device_ptr(&stream);
            let (kp, _g1) = pk.device_ptr(&stream);
            let (vp, _g2) = pv.device_ptr(&stream);
            let (sp, _g3) = scores.device_ptr(&stream);
            let (pp, _g4) = probs.device_ptr(&stream);
            let (op, _g5) = out.device_ptr(&stream);
            let f = dev.get_or_load_custom_func("attention_pointers", MODULE, PTX)?;
            let mut b = f.builder();
            let ints = [n, h, t, cap, d, es].map(|v| v as i32);
            b.arg(&qp).arg(&kp).arg(&vp).arg(&sp).arg(&pp).arg(&op).arg(&rows).arg(&ptrs);
            for i in &ints {
                b.arg(i);
            }
            let cfg = LaunchConfig {
                grid_dim: (nh.div_ceil(128) as u32, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the kernel's arguments in its order; rows index the pool's planes (the
            // caller's slots, as the gathered path would read them).
            unsafe { b.launch(cfg) }.map_err(err)?;
        }
        let (alpha, beta) = (1f32, 0f32);
        let blas = dev.cublas_handle();
        let gemm = |transa: sys::cublasOperation_t,
                    (m, nn, k): (usize, usize, usize),
                    a: usize,
                    lda: usize,
                    bb: usize,
                    ldb: usize,
                    c: usize,
                    ldc: usize|
         -> Result<()> {
            let (base, _g) = ptrs.device_ptr(&stream);
            let at = |i: usize| (base + (i * nh * 8) as u64) as *const *const std::ffi::c_void;
            // SAFETY: the arrays hold nh device addresses each, of planes the shapes above bound:
            // A m x k (or k x m transposed) with leading dimension lda, B k x n with ldb, C m x n
            // with ldc, all of type `ty`; the buffers outlive the call, queued on their stream.
            let status = unsafe {
                sys::cublasGemmBatchedEx(
                    *blas.handle(),
                    transa,
                    sys::cublasOperation_t::CUBLAS_OP_N,
                    m as i32,
                    nn as i32,
                    k as i32,
                    &alpha as *const f32 as *const _,
                    at(a),
                    ty,
                    lda as i32,
                    at(bb),
                    ty,
                    ldb as i32,
                    &beta as *const f32 as *const _,
                    at(c) as *const *mut std::ffi::c_void,
                    ty,
                    ldc as i32,
                    nh as i32,
                    sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP,
                )
            };
            match status {
                sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS => Ok(()),
                other => candle_core::bail!("in-place attention: cublasGemmBatchedEx: {other:?}"),
            }
        };
        // scores (column-major cap x T, i.e. [T, cap]) = key plane (d x cap)ᵀ · queries (d x T)
        gemm(sys::cublasOperation_t::CUBLAS_OP_T, (cap, t, d), 1, d, 0, d, 3, cap)?;
        // the masked softmax over each row of cap scores (the mask's row for every head and
        // position)
        let rows_all = nh * t;
        let f = dev.get_or_load_custom_func(
            &kernel(
                if cap <= MASKED_SOFTMAX_WARP_ROW {
                    "masked_softmax_rows"
                } else {
                    "masked_softmax"
                },
                s.dtype(),
            )?,
            MODULE,
            PTX,
        )?;
        let mut b = f.builder();
        let (l_i, per_mask, all) = (cap as i32, (h * t) as i32, rows_all as i32);
        b.arg(&scores).arg(&mask).arg(&probs).arg(&l_i).arg(&per_mask);
        let grid = if cap <= MASKED_SOFTMAX_WARP_ROW {
            b.arg(&all);
            rows_all.div_ceil(8)
        } else {
            rows_all
        };
        let cfg = LaunchConfig {
            grid_dim: (grid as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: masked_softmax(_rows)'s arguments in its order over rows_all rows of cap.
        unsafe { b.launch(cfg) }.map_err(err)?;
        // output (column-major d x T at leading dimension h d, i.e. head h's columns of [T, h d]) =
        // value plane (d x cap) · probabilities (cap x T)
        gemm(sys::cublasOperation_t::CUBLAS_OP_N, (d, t, cap), 2, d, 4, cap, 5, h * d)?;
        drop((scores, probs, ptrs));
        Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((n, t, h * d))))
    }
}

impl CustomOp1 for InPlace {
    fn name(&self) -> &'static str {
        "pool-attention-in-place"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("pool_attention_in_place: the CUDA op ran on the CPU")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        if !l.is_contiguous() {
            candle_core::bail!("pool_attention_in_place: queries not contiguous");
        }
        match s.dtype() {
            DType::BF16 => self.run::<half::bf16>(s, l, sys::cudaDataType_t::CUDA_R_16BF),
            DType::F16 => self.run::<half::f16>(s, l, sys::cudaDataType_t::CUDA_R_16F),
            DType::F32 => self.run::<f32>(s, l, sys::cudaDataType_t::CUDA_R_32F),
            other => candle_core::bail!("pool_attention_in_place: no path for {other:?}"),
        }
    }
}
