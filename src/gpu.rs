//! Device set-up. On CUDA, candle allocates every tensor from the driver's stream-ordered memory
//! pool (`cuMemAllocAsync`). That pool's release threshold is 0 by default: at every
//! synchronisation (each step copies its logits to the host) the pool hands its free memory back
//! to the driver, and the next step maps it again. With three stage threads synchronising at
//! different moments, one stage's sync trims the memory the others are about to reuse. We keep it:
//! the pool grows to the working set once and stays there.

use anyhow::{Context, Result};
use candle_core::Device;

/// The device a configuration names (`cpu`, `cuda`, `cuda:N`), tuned for serving.
pub fn open(spec: &str) -> Result<Device> {
    if spec == "cpu" {
        return Ok(Device::Cpu);
    }
    let ordinal = spec.strip_prefix("cuda").map(|r| r.trim_start_matches(':')).unwrap_or("0");
    let ordinal: usize = if ordinal.is_empty() { 0 } else { ordinal.parse().context("cuda device ordinal")? };
    let dev = Device::new_cuda(ordinal).with_context(|| format!("device {spec}: this build has no CUDA, or no GPU is present"))?;
    keep_pool_memory(&dev)?;
    Ok(dev)
}

#[cfg(feature = "cuda")]
fn keep_pool_memory(dev: &Device) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let Device::Cuda(d) = dev else { return Ok(()) };
    let cu_dev = d.cuda_stream().context().cu_device();
    // SAFETY: plain driver calls on a device whose context candle holds; `threshold` outlives them.
    unsafe {
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        let r = sys::cuDeviceGetDefaultMemPool(&mut pool, cu_dev);
        anyhow::ensure!(r == sys::CUresult::CUDA_SUCCESS, "cuDeviceGetDefaultMemPool: {r:?}");
        let mut threshold: u64 = u64::MAX;
        let r = sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut threshold as *mut u64 as *mut std::ffi::c_void,
        );
        anyhow::ensure!(r == sys::CUresult::CUDA_SUCCESS, "cuMemPoolSetAttribute(release threshold): {r:?}");
    }
    tracing::info!("cuda: memory pool keeps freed memory (release threshold = max)");
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn keep_pool_memory(_dev: &Device) -> Result<()> {
    Ok(())
}
