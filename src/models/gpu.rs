//! Device set-up. On CUDA, candle allocates every tensor from the driver's stream-ordered memory
//! pool (`cuMemAllocAsync`). That pool's release threshold is 0 by default: at every
//! synchronisation (each step copies its logits to the host) the pool hands its free memory back
//! to the driver, and the next step maps it again. With three stage threads synchronising at
//! different moments, one stage's sync trims the memory the others are about to reuse. We keep it:
//! the pool grows to the working set once and stays there.
//!
//! Streams: a candle CUDA device is one stream. By default each stage gets its own device on the
//! same GPU (its own stream, same context and memory pool), so one stage's kernels never queue
//! behind another's: a Thinker decode step no longer waits for a Code2Wav chunk's kernels ahead
//! of it in a shared queue. Tensors cross stages only through the host (the Thinker sends the
//! Talker its hidden rows as host memory), so no tensor is ever used on two streams.
//!
//! Architecture invariant: a tensor is used only on the stream (candle device) that made it.
//! That is what lets us switch off cudarc's per-allocation event tracking (two CUDA events per
//! buffer, a wait and a record per kernel argument): it only guards buffers shared between
//! streams, adds several driver calls to every launch, and breaks graph capture.

use anyhow::{Context, Result};
use candle_core::Device;

/// The device of each stage (the same one on the CPU or with `streams = "one"`).
#[derive(Debug, Clone)]
pub struct StageDevices {
    pub thinker: Device,
    pub talker: Device,
    pub code2wav: Device,
}

impl StageDevices {
    /// All three stages on `dev`.
    pub fn same(dev: &Device) -> Self {
        Self { thinker: dev.clone(), talker: dev.clone(), code2wav: dev.clone() }
    }
}

/// A device as a configuration names it: `cpu`, `cuda` (= `cuda:0`) or `cuda:N`. Parsed once,
/// where it is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceSpec {
    Cpu,
    Cuda(usize),
}

impl std::str::FromStr for DeviceSpec {
    type Err = String;

    fn from_str(spec: &str) -> std::result::Result<Self, String> {
        if spec == "cpu" {
            return Ok(DeviceSpec::Cpu);
        }
        let bad = || format!("device {spec:?}: expected cpu, cuda or cuda:N");
        let rest = spec.strip_prefix("cuda").ok_or_else(bad)?;
        if rest.is_empty() {
            return Ok(DeviceSpec::Cuda(0));
        }
        rest.strip_prefix(':').and_then(|n| n.parse().ok()).map(DeviceSpec::Cuda).ok_or_else(bad)
    }
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl<'de> serde::Deserialize<'de> for DeviceSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

/// The dtype of the weights and activations: `f32` or `bf16`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    #[default]
    F32,
    Bf16,
}

impl Precision {
    pub fn dtype(self) -> candle_core::DType {
        match self {
            Precision::F32 => candle_core::DType::F32,
            Precision::Bf16 => candle_core::DType::BF16,
        }
    }
}

impl std::str::FromStr for Precision {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "f32" => Ok(Precision::F32),
            "bf16" => Ok(Precision::Bf16),
            other => Err(format!("dtype {other:?}: expected f32 or bf16")),
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
        })
    }
}

/// The device a configuration names, tuned for serving.
pub fn open(spec: DeviceSpec) -> Result<Device> {
    let DeviceSpec::Cuda(ordinal) = spec else { return Ok(Device::Cpu) };
    let dev = Device::new_cuda(ordinal)
        .with_context(|| format!("device {spec}: this build has no CUDA, or no GPU is present"))?;
    no_event_tracking(&dev);
    keep_pool_memory(&dev)?;
    Ok(dev)
}

/// The stages' devices: on CUDA with `per_stage_streams`, one stream per stage on the same GPU.
pub fn open_stages(spec: DeviceSpec, per_stage_streams: bool) -> Result<StageDevices> {
    let first = open(spec)?;
    if first.is_cpu() || !per_stage_streams {
        return Ok(StageDevices::same(&first));
    }
    Ok(StageDevices { thinker: first, talker: open(spec)?, code2wav: open(spec)? })
}

#[cfg(feature = "cuda")]
fn no_event_tracking(dev: &Device) {
    let Device::Cuda(d) = dev else { return };
    if std::env::var("ANTIPHON_CUDA_EVENT_TRACKING").is_ok_and(|v| v == "1") {
        tracing::info!("cuda: event tracking kept on (ANTIPHON_CUDA_EVENT_TRACKING=1)");
        return;
    }
    // SAFETY: called before this device has made any tensor, and every tensor of it is used only
    // on its own stream (the invariant above), so stream order alone orders every use and free.
    unsafe { d.disable_event_tracking() };
}

#[cfg(not(feature = "cuda"))]
fn no_event_tracking(_dev: &Device) {}

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
        anyhow::ensure!(
            r == sys::CUresult::CUDA_SUCCESS,
            "cuMemPoolSetAttribute(release threshold): {r:?}"
        );
    }
    tracing::info!("cuda: memory pool keeps freed memory (release threshold = max)");
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn keep_pool_memory(_dev: &Device) -> Result<()> {
    Ok(())
}

/// Marks the start (`on`) or end of a range for an attached CUDA profiler (`ncu
/// --profile-from-start off` profiles only such ranges); without one, or without CUDA, nothing.
#[cfg(feature = "cuda")]
pub fn profiler_range(dev: &Device, on: bool) {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let Device::Cuda(d) = dev else { return };
    if d.cuda_stream().context().bind_to_thread().is_err() {
        return;
    }
    // SAFETY: argument-less driver calls on the context just made current.
    let _ = unsafe {
        if on {
            sys::cuProfilerStart()
        } else {
            sys::cuProfilerStop()
        }
    };
}

#[cfg(not(feature = "cuda"))]
pub fn profiler_range(_dev: &Device, _on: bool) {}

/// The GPU's memory in bytes, `(used, total)`; `None` without CUDA or for the CPU.
#[cfg(feature = "cuda")]
pub fn cuda_memory(spec: DeviceSpec) -> Option<(u64, u64)> {
    use candle_core::cuda_backend::cudarc::driver::CudaContext;
    use std::sync::{Arc, OnceLock};
    static CONTEXT: OnceLock<Option<Arc<CudaContext>>> = OnceLock::new();
    let DeviceSpec::Cuda(ordinal) = spec else { return None };
    let ctx = CONTEXT.get_or_init(|| CudaContext::new(ordinal).ok()).as_ref()?;
    let (free, total) = ctx.mem_get_info().ok()?;
    Some(((total - free) as u64, total as u64))
}

#[cfg(not(feature = "cuda"))]
pub fn cuda_memory(_spec: DeviceSpec) -> Option<(u64, u64)> {
    None
}

/// The free memory of the GPU `dev` is on, in bytes; `None` for the CPU.
pub fn free_memory(dev: &Device) -> Option<u64> {
    match dev.location() {
        candle_core::DeviceLocation::Cuda { gpu_id } => {
            cuda_memory(DeviceSpec::Cuda(gpu_id)).map(|(used, total)| total.saturating_sub(used))
        }
        _ => None,
    }
}
