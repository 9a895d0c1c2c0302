//! A convolution as a product: its input's columns (every tap of every channel at every output
//! position, a ones row for the bias) times the weight laid out as `[O, rows]`. The vocoder runs
//! all its convolutions this way on a GPU: one kernel writes the columns (Snake folded in), one
//! batched product makes the output. On CUDA the f32 vocoder's columns may be written in f16
//! ([`conv_cols_half`]) and multiplied by an f16 weight into f32 sums ([`half_columns_product`]):
//! half the bytes of the columns, which were half of the vocoder's GPU time (run 49), and the
//! products' inputs rounded to the same 10-bit mantissa the f32 products' TF32 already used.

use candle_core::{DType, Result, Tensor};

/// Rows of a convolution's columns: `C k`, the ones row, then zero rows up to a multiple of 8, so
/// that the product's leading dimension is 16-byte aligned in f32 and in f16 (cuBLAS takes its
/// vectorized kernels; with `C k + 1` rows every product of the vocoder ran an `align1` kernel, 46
/// % of its B8 time).
pub fn cols_rows(c: usize, k: usize) -> usize {
    (c * k + 1).next_multiple_of(8)
}

/// The weight `[O, C, k]` and bias `[O]` (zero if none) as the columns' left factor: `[O,
/// cols_rows(C, k)]`, the bias as column `C k`, zeros after.
pub fn cols_weight(w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let (o, c, k) = w.dims3()?;
    let bias = match bias {
        Some(b) => b.reshape((o, 1))?,
        None => Tensor::zeros((o, 1), w.dtype(), w.device())?,
    };
    let pad = cols_rows(c, k) - c * k - 1;
    let mut parts = vec![w.reshape((o, c * k))?, bias];
    if pad > 0 {
        parts.push(Tensor::zeros((o, pad), w.dtype(), w.device())?);
    }
    Tensor::cat(&parts, 1)?.contiguous()
}

/// A stride-1 convolution's columns with a ones row for its bias: `x: [B, C, T]` padded with
/// `pad_l` zeros before and `pad_r` after, kernel `k`, dilation `d` -> `[B, cols_rows(C, k), L]` (L
/// = T + pad_l + pad_r - d (k - 1)), row `c k + j` = the padded input at `t + j d`, row `C k` ones,
/// zeros after; [`cols_weight`] times it is the convolution.
pub fn conv_cols(x: &Tensor, k: usize, d: usize, pad_l: usize, pad_r: usize) -> Result<Tensor> {
    conv_cols_with(x, Cols { k, d, pad_l, pad_r, stride: 1, up: 1 })
}

/// The shape of a convolution for [`conv_cols_with`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cols {
    /// Kernel size and dilation.
    pub k: usize,
    pub d: usize,
    /// Zeros before and after the (upsampled) input.
    pub pad_l: usize,
    pub pad_r: usize,
    /// The convolution's stride.
    pub stride: usize,
    /// Nearest upsampling of the input first: every sample `up` times (1: none).
    pub up: usize,
}

/// [`conv_cols`] for any stride and a nearest upsampling of the input first: row `c k + j`,
/// column `t` is the upsampled, padded input at `t · stride + j d`; L = (T · up + pad_l + pad_r
/// − d (k − 1) − 1) / stride + 1.
pub fn conv_cols_with(x: &Tensor, p: Cols) -> Result<Tensor> {
    conv_cols_snake(x, p, None)
}

/// [`conv_cols_with`] of `snake(x, alpha)` (`alpha: [C]`, see [`crate::fused::snake`]) when
/// `alpha` is given: on a GPU in the same kernel, so the activation is never written out.
pub fn conv_cols_snake(x: &Tensor, p: Cols, alpha: Option<&Tensor>) -> Result<Tensor> {
    let l = cols_len(x, p, alpha)?;
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        let (ints, grid, shape) = cuda::cols_launch(x.dims3()?, p, l);
        let alpha = alpha.map(|a| a.to_dtype(x.dtype())?.contiguous()).transpose()?;
        return crate::code2wav::dit_ops::cuda::launch_shaped(
            "conv_cols",
            x,
            &[alpha.as_ref()],
            &ints,
            &[],
            &[],
            grid,
            Some(shape),
        );
    }
    let (b, c, t) = x.dims3()?;
    let Cols { k, d, pad_l, pad_r, stride, up } = p;
    let x = match alpha {
        Some(a) => crate::fused::snake_twin(x, &a.to_dtype(x.dtype())?)?,
        None => x.clone(),
    };
    let t_up = t * up;
    let x = if up > 1 {
        x.unsqueeze(3)?.broadcast_as((b, c, t, up))?.reshape((b, c, t_up))?
    } else {
        x.clone()
    };
    let xp = x.pad_with_zeros(2, pad_l, pad_r)?;
    // every (j, t): the padded input's position t · stride + j d, gathered at once
    let idx: Vec<u32> =
        (0..k).flat_map(|j| (0..l).map(move |t| (t * stride + j * d) as u32)).collect();
    let idx = Tensor::from_vec(idx, k * l, x.device())?;
    // [B, C, k L] -> [B, C k, L], then the ones row and the zero rows
    let cols = xp.contiguous()?.index_select(&idx, 2)?.reshape((b, c * k, l))?;
    let mut parts = vec![cols, Tensor::ones((b, 1, l), x.dtype(), x.device())?];
    let pad = cols_rows(c, k) - c * k - 1;
    if pad > 0 {
        parts.push(Tensor::zeros((b, pad, l), x.dtype(), x.device())?);
    }
    Tensor::cat(&parts, 1)
}

/// [`conv_cols_snake`] of an f32 input, the columns rounded to f16: on CUDA one kernel writes
/// them in f16; elsewhere the f32 columns are cast (the same values).
pub fn conv_cols_half(x: &Tensor, p: Cols, alpha: Option<&Tensor>) -> Result<Tensor> {
    if x.dtype() != DType::F32 {
        candle_core::bail!("conv_cols_half: an f32 input, not {:?}", x.dtype());
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        let l = cols_len(x, p, alpha)?;
        let alpha = alpha.map(|a| a.to_dtype(DType::F32)?.contiguous()).transpose()?;
        return x.contiguous()?.apply_op1_no_bwd(&cuda::ColsHalf { p, l, alpha });
    }
    conv_cols_snake(x, p, alpha)?.to_dtype(DType::F16)
}

/// The output length of `p`'s convolution over `x: [B, C, T]`, after checking `p` and `alpha`.
fn cols_len(x: &Tensor, p: Cols, alpha: Option<&Tensor>) -> Result<usize> {
    let (_b, c, t) = x.dims3()?;
    if let Some(a) = alpha {
        if a.dims() != [c] {
            candle_core::bail!("conv_cols: Snake's alpha {:?} for {c} channels", a.shape());
        }
    }
    let Cols { k, d, pad_l, pad_r, stride, up } = p;
    let t_up = t * up;
    let span = d * k.saturating_sub(1);
    if k == 0 || stride == 0 || up == 0 || t_up + pad_l + pad_r <= span {
        candle_core::bail!(
            "conv_cols: {t} frames (× {up}, + {pad_l} + {pad_r}) for a kernel of \
            {k} at dilation {d}, stride {stride}"
        );
    }
    Ok((t_up + pad_l + pad_r - span - 1) / stride + 1)
}

/// `w · cols[b]` for every `b`: `w: [O, R]` and `cols: [B, R, L]`, both f16 -> `[B, O, L]` f32,
/// every sum in f32. On CUDA one strided-batched cuBLAS product (f16 × f16 into f32, the weight
/// shared by the batch); elsewhere the f32 product of the same f16 values.
pub fn half_columns_product(w: &Tensor, cols: &Tensor) -> Result<Tensor> {
    let (_, r) = w.dims2()?;
    let (b, r2, _) = cols.dims3()?;
    if r != r2 || w.dtype() != DType::F16 || cols.dtype() != DType::F16 {
        candle_core::bail!(
            "half_columns_product: {:?} {:?} times {:?} {:?}",
            w.shape(),
            w.dtype(),
            cols.shape(),
            cols.dtype()
        );
    }
    #[cfg(feature = "cuda")]
    if cols.device().is_cuda() {
        return w.contiguous()?.apply_op2_no_bwd(&cols.contiguous()?, &cuda::HalfProduct);
    }
    let w = w.to_dtype(DType::F32)?.broadcast_left(b)?.contiguous()?;
    w.matmul(&cols.to_dtype(DType::F32)?)
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::cublas::{result::gemm_strided_batched_ex, sys};
    use candle_core::cuda_backend::cudarc::driver::{
        DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::CudaStorage;
    use candle_core::{CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};
    use half::f16;

    use super::{cols_rows, Cols};
    use crate::code2wav::dit_ops::cuda::{MODULE, PTX};
    use crate::fused::cuda::err;

    /// The columns kernel's integer arguments, its grid and the columns' shape, for an input of
    /// `(B, C, T)`.
    pub(super) fn cols_launch(
        (b, c, t): (usize, usize, usize),
        p: Cols,
        l: usize,
    ) -> ([i32; 10], (u32, u32), Shape) {
        let per = cols_rows(c, p.k);
        let rows = b * per;
        let ints = [c, t, p.k, p.d, p.pad_l, l, p.stride, p.up, per, rows].map(|v| v as i32);
        (ints, (rows.clamp(1, 65535) as u32, 256), Shape::from((b, per, l)))
    }

    /// `conv_cols_half_f32`: f32 input (and Snake's alpha), f16 columns.
    pub(super) struct ColsHalf {
        pub(super) p: Cols,
        pub(super) l: usize,
        pub(super) alpha: Option<Tensor>,
    }

    impl CustomOp1 for ColsHalf {
        fn name(&self) -> &'static str {
            "conv_cols_half"
        }

        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &Layout,
        ) -> Result<(candle_core::CpuStorage, Shape)> {
            candle_core::bail!("conv_cols_half: the CUDA op ran on the CPU")
        }

        fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
            if !l.is_contiguous() || s.dtype() != DType::F32 {
                candle_core::bail!("conv_cols_half: a contiguous f32 input");
            }
            let (ints, (grid, block), shape) = cols_launch(l.shape().dims3()?, self.p, self.l);
            let dev = s.device().clone();
            let input = s.as_cuda_slice::<f32>()?.slice(l.start_offset()..);
            let guard = self.alpha.as_ref().map(|a| a.storage_and_layout());
            let alpha = guard
                .as_ref()
                .map(|(s, l)| crate::fused::cuda::view::<f32>(s, l, "conv_cols_half"))
                .transpose()?;
            // SAFETY: the kernel writes every element of the columns.
            let out = unsafe { dev.alloc::<f16>(shape.elem_count()) }?;
            let f = dev.get_or_load_custom_func("conv_cols_half_f32", MODULE, PTX)?;
            let mut b = f.builder();
            let null = 0u64;
            b.arg(&input);
            match &alpha {
                Some(a) => b.arg(a),
                None => b.arg(&null),
            };
            b.arg(&out);
            for i in &ints {
                b.arg(i);
            }
            let cfg = LaunchConfig {
                grid_dim: (grid, 1, 1),
                block_dim: (block, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the arguments are the kernel's, in its order; the grid strides over every
            // row.
            unsafe { b.launch(cfg) }.map_err(err)?;
            Ok((CudaStorage::wrap_cuda_slice(out, dev), shape))
        }
    }

    /// `w [O, R] f16 · cols [B, R, L] f16 -> [B, O, L] f32` as one strided-batched product.
    pub(super) struct HalfProduct;

    impl CustomOp2 for HalfProduct {
        fn name(&self) -> &'static str {
            "half_columns_product"
        }

        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &Layout,
            _: &candle_core::CpuStorage,
            _: &Layout,
        ) -> Result<(candle_core::CpuStorage, Shape)> {
            candle_core::bail!("half_columns_product: the CUDA op ran on the CPU")
        }

        fn cuda_fwd(
            &self,
            ws: &CudaStorage,
            wl: &Layout,
            cs: &CudaStorage,
            cl: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            if !wl.is_contiguous() || !cl.is_contiguous() {
                candle_core::bail!("half_columns_product: contiguous factors");
            }
            let (o, r) = wl.shape().dims2()?;
            let (b, _, l) = cl.shape().dims3()?;
            let dev = ws.device().clone();
            let w = ws.as_cuda_slice::<f16>()?.slice(wl.start_offset()..);
            let c = cs.as_cuda_slice::<f16>()?.slice(cl.start_offset()..);
            // SAFETY: the product writes every element (beta = 0).
            let mut out = unsafe { dev.alloc::<f32>(b * o * l) }?;
            let blas = dev.cublas_handle();
            let stream = out.stream().clone();
            let (alpha, beta) = (1f32, 0f32);
            {
                let (wp, _gw) = w.device_ptr(&stream);
                let (cp, _gc) = c.device_ptr(&stream);
                let (op, _go) = out.device_ptr_mut(&stream);
                // Column-major: out[b]ᵀ (L × O) = cols[b]ᵀ (L × R) · wᵀ (R × O); the
                // row-major buffers are those column-major matrices as they lie (leading dimensions
                // L, R, L), the weight shared (stride 0).
                // SAFETY: the pointers hold b · R · L, O · R and b · O · L elements of the
                // declared types, alive until the guards drop after the call is queued on the
                // stream every operand belongs to.
                unsafe {
                    gemm_strided_batched_ex(
                        *blas.handle(),
                        sys::cublasOperation_t::CUBLAS_OP_N,
                        sys::cublasOperation_t::CUBLAS_OP_N,
                        l as i32,
                        o as i32,
                        r as i32,
                        &alpha as *const f32 as *const _,
                        cp as *const _,
                        sys::cudaDataType_t::CUDA_R_16F,
                        l as i32,
                        (r * l) as i64,
                        wp as *const _,
                        sys::cudaDataType_t::CUDA_R_16F,
                        r as i32,
                        0,
                        &beta as *const f32 as *const _,
                        op as *mut _,
                        sys::cudaDataType_t::CUDA_R_32F,
                        l as i32,
                        (o * l) as i64,
                        b as i32,
                        sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP,
                    )
                }
                .map_err(err)?;
            }
            Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((b, o, l))))
        }
    }
}
