//! A batch of logits rows where they were computed, with each row's best few entries on the host.
//!
//! A Thinker step used to copy every row's logits to the host (32 × 151 936 floats, ~19 MB at
//! B = 32) and scan them there. Greedy decoding with a repetition penalty ≥ 1 only needs the
//! row's best entries: the penalty and the forbidden tokens only lower a logit, so when the best of
//! the candidates after them still beats the last candidate's raw logit, no token outside them can
//! win ([`crate::sampling::Sampler::sample_row`]). On CUDA one kernel (`kernels/sample.cu`) finds
//! each row's best [`TOP_K`]; only those come to the host. The whole row still comes on demand
//! ([`LogitsRow::full`]) for sampling with a temperature, or when the candidates do not decide.
//!
//! Order: `f32::total_cmp` on the value, ties to the larger id (what the host's argmax picks).

use candle_core::{DType, Result, Tensor};

/// How many of each row's best entries come to the host.
pub const TOP_K: usize = 16;

/// Logits `[n, vocab]` on their device, and each row's best entries (id, logit) on the host.
pub struct Logits {
    all: Tensor,
    top: Vec<Vec<(u32, f32)>>,
}

impl Logits {
    /// Finds each row's best `k` (all of them when the row is shorter).
    pub fn new(all: Tensor, k: usize) -> Result<Self> {
        let (_, vocab) = all.dims2()?;
        let top = top_k(&all, k.clamp(1, vocab.max(1)))?;
        Ok(Self { all, top })
    }

    pub fn len(&self) -> usize {
        self.top.len()
    }

    pub fn is_empty(&self) -> bool {
        self.top.is_empty()
    }

    pub fn row(&self, i: usize) -> LogitsRow<'_> {
        LogitsRow { logits: self, i }
    }
}

/// One row of a [`Logits`].
#[derive(Clone, Copy)]
pub struct LogitsRow<'a> {
    logits: &'a Logits,
    i: usize,
}

impl LogitsRow<'_> {
    /// Its best entries, best first.
    pub fn top(&self) -> &[(u32, f32)] {
        &self.logits.top[self.i]
    }

    pub fn vocab(&self) -> usize {
        self.logits.all.dim(1).unwrap_or(0)
    }

    /// The whole row as f32 (a copy from the device).
    pub fn full(&self) -> Result<Vec<f32>> {
        self.logits.all.get(self.i)?.to_dtype(DType::F32)?.to_vec1::<f32>()
    }
}

/// The sort key of a logit: `total_cmp` order as an unsigned integer.
fn ordered_bits(v: f32) -> u32 {
    let b = v.to_bits();
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// Each row's best `k` entries (`k` ≤ the row's length), best first.
pub fn top_k(logits: &Tensor, k: usize) -> Result<Vec<Vec<(u32, f32)>>> {
    let (n, vocab) = logits.dims2()?;
    if k == 0 || k > vocab {
        candle_core::bail!("top_k: {k} of rows of {vocab}");
    }
    #[cfg(feature = "cuda")]
    if logits.device().is_cuda() {
        let packed = logits.contiguous()?.apply_op1_no_bwd(&cuda::TopK { k })?.to_vec2::<u32>()?;
        return Ok(packed
            .into_iter()
            .map(|r| (0..k).map(|j| (r[j], f32::from_bits(r[k + j]))).collect())
            .collect());
    }
    let rows = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let _ = n;
    Ok(rows.iter().map(|r| top_k_host(r, k)).collect())
}

/// The host twin: the best `k` of `row`, best first.
pub fn top_k_host(row: &[f32], k: usize) -> Vec<(u32, f32)> {
    let key = |i: usize| (ordered_bits(row[i]), i);
    let mut idx: Vec<usize> = (0..row.len()).collect();
    let k = k.min(row.len());
    if k == 0 {
        return Vec::new();
    }
    let desc = |a: &usize, b: &usize| key(*b).cmp(&key(*a));
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, desc);
        idx.truncate(k);
    }
    idx.sort_by(desc);
    idx.into_iter().map(|i| (i as u32, row[i])).collect()
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::{CudaDType, CudaStorage};
    use candle_core::{CustomOp1, Layout, Result, Shape};

    use crate::fused::cuda::{err, kernel};

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/sample.ptx"));
    const MODULE: &str = "antiphon_sample";

    pub(super) struct TopK {
        pub k: usize,
    }

    impl TopK {
        fn run<T: CudaDType + DeviceRepr>(
            &self,
            s: &CudaStorage,
            l: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let dev = s.device().clone();
            let (n, v) = l.shape().dims2()?;
            let x = s.as_cuda_slice::<T>()?.slice(l.start_offset()..);
            // SAFETY: the kernel writes all 2k entries of every row.
            let out = unsafe { dev.alloc::<u32>(n * 2 * self.k) }?;
            let f = dev.get_or_load_custom_func(&kernel("top_k", s.dtype())?, MODULE, PTX)?;
            let mut b = f.builder();
            let (v_i, k_i) = (v as i32, self.k as i32);
            b.arg(&x).arg(&out).arg(&v_i).arg(&k_i);
            // SAFETY: arguments as the kernel declares them; one block of 1024 per row.
            unsafe {
                b.launch(LaunchConfig {
                    grid_dim: (n as u32, 1, 1),
                    block_dim: (1024, 1, 1),
                    shared_mem_bytes: 0,
                })
            }
            .map_err(err)?;
            Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((n, 2 * self.k))))
        }
    }

    impl CustomOp1 for TopK {
        fn name(&self) -> &'static str {
            "top_k"
        }

        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &Layout,
        ) -> Result<(candle_core::CpuStorage, Shape)> {
            candle_core::bail!("top_k: the CUDA op ran on the CPU")
        }

        fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
            if !l.is_contiguous() {
                candle_core::bail!("top_k: logits not contiguous");
            }
            crate::fused::by_dtype!("top_k", s.dtype(), T => self.run::<T>(s, l))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn keys_order_as_total_cmp() {
        let vals =
            [f32::NEG_INFINITY, -3.5, -0.0, 0.0, 1e-30, 2.0, f32::INFINITY, f32::NAN, -f32::NAN];
        for a in vals {
            for b in vals {
                assert_eq!(ordered_bits(a).cmp(&ordered_bits(b)), a.total_cmp(&b), "{a} vs {b}");
            }
        }
    }

    #[test]
    fn host_top_k_is_a_full_sort_prefix_ties_to_the_larger_id() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        for trial in 0..100 {
            let n = 1 + trial * 13 % 300;
            let row: Vec<f32> = (0..n).map(|_| (rng.random::<f32>() * 6.0).floor()).collect();
            let mut all: Vec<u32> = (0..n as u32).collect();
            all.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(b.cmp(&a)));
            for k in [1, 2, 16, n] {
                let got: Vec<u32> = top_k_host(&row, k).into_iter().map(|(i, _)| i).collect();
                assert_eq!(got, all[..k.min(n)], "n {n} k {k}");
            }
            // the first is what the host's argmax picks
            let argmax =
                row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i as u32);
            assert_eq!(Some(top_k_host(&row, 1)[0].0), argmax);
        }
    }

    #[test]
    fn tensor_top_k_matches_the_host_twin() -> Result<()> {
        // (on a GPU: tests/integration/parity_lm.rs, `top_k_on_the_device_matches_the_host_twin`)
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        let (n, v) = (3, 500);
        let data: Vec<f32> =
            (0..n * v).map(|_| (rng.random::<f32>() * 40.0).floor() / 4.0 - 5.0).collect();
        let t = Tensor::from_vec(data, (n, v), &candle_core::Device::Cpu)?.to_dtype(DType::BF16)?;
        let logits = Logits::new(t.clone(), TOP_K)?;
        let rows = t.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        for (i, r) in rows.iter().enumerate() {
            assert_eq!(logits.row(i).top(), &top_k_host(r, TOP_K)[..]);
            assert_eq!(&logits.row(i).full()?, r);
        }
        Ok(())
    }
}
