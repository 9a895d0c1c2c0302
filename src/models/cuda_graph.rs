//! CUDA graphs over candle: record a step's kernels once, replay them with one launch. A recorded
//! body must read and write only buffers that outlive the graph (fixed addresses), and must issue
//! nothing to the host (no uploads of new data, no copies to the host) while it is recorded.

use candle_core::{Device, Result};

/// A captured, instantiated graph: cudarc's, or (for kernels at a raised priority, which must be
/// set between the capture and the instantiation) one made here by the same driver calls.
#[cfg(feature = "cuda")]
pub struct Graph(GraphKind);
#[cfg(not(feature = "cuda"))]
pub struct Graph(());

#[cfg(feature = "cuda")]
enum GraphKind {
    Cudarc(candle_core::cuda_backend::cudarc::driver::CudaGraph),
    Raised(RaisedGraph),
}

/// A graph whose kernel nodes carry a priority, and the stream it was captured on (and is
/// launched into).
#[cfg(feature = "cuda")]
struct RaisedGraph {
    graph: candle_core::cuda_backend::cudarc::driver::sys::CUgraph,
    exec: candle_core::cuda_backend::cudarc::driver::sys::CUgraphExec,
    stream: std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>,
}

// SAFETY: a graph is used only by the thread that owns its stream's cache at the time (caches
// move between threads only with their stage, never concurrently).
#[cfg(feature = "cuda")]
unsafe impl Send for Graph {}
#[cfg(feature = "cuda")]
unsafe impl Sync for Graph {}

#[cfg(feature = "cuda")]
impl Drop for RaisedGraph {
    fn drop(&mut self) {
        use candle_core::cuda_backend::cudarc::driver::sys;
        if self.stream.context().bind_to_thread().is_err() {
            return;
        }
        // SAFETY: both handles were made by `record_raised` and are destroyed only here.
        unsafe {
            let _ = sys::cuGraphExecDestroy(self.exec);
            let _ = sys::cuGraphDestroy(self.graph);
        }
    }
}

/// Whether steps on `dev` can be captured. Not with cudarc's per-buffer event tracking on:
/// events recorded inside a capture never fire, and a later wait on one outside the graph
/// would hang the stream (gpu.rs switches tracking off on every device it opens).
#[cfg(feature = "cuda")]
pub fn can_capture(dev: &Device) -> bool {
    matches!(dev, Device::Cuda(d) if !d.is_event_tracking())
}

#[cfg(not(feature = "cuda"))]
pub fn can_capture(_dev: &Device) -> bool {
    false
}

/// The devices (each a stage's stream) whose graphs run at a raised stream priority, and the
/// levels below the GPU's highest each one runs at: when their kernels wait beside another
/// stage's, the GPU's block scheduler starts the higher ones first.
#[cfg(feature = "cuda")]
static RAISED: std::sync::Mutex<Vec<(candle_core::cuda_backend::DeviceId, i32)>> =
    std::sync::Mutex::new(Vec::new());

/// Graphs captured on `dev` from now on run at the GPU's highest stream priority, or `below`
/// levels under it (at least one above the default; kernels outside graphs, and other devices'
/// graphs, keep the default, the lowest). Returns that priority, or `None` where there is nothing
/// to raise (no CUDA).
#[cfg(feature = "cuda")]
pub fn raise_priority(dev: &Device, below: i32) -> Option<i32> {
    let Device::Cuda(d) = dev else { return None };
    // (the range is the current context's: without one bound to this thread the query fails)
    d.cuda_stream().context().bind_to_thread().ok()?;
    let (least, greatest) =
        candle_core::cuda_backend::cudarc::driver::result::stream::get_priority_range().ok()?;
    let mut raised = RAISED.lock().unwrap_or_else(|e| e.into_inner());
    raised.retain(|(id, _)| *id != d.id());
    raised.push((d.id(), below.max(0)));
    Some(level(least, greatest, below))
}

#[cfg(not(feature = "cuda"))]
pub fn raise_priority(_dev: &Device, _below: i32) -> Option<i32> {
    None
}

/// The priority `below` levels under `greatest`, kept above `least` where the range has room
/// (CUDA: lower numbers are higher priorities).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn level(least: i32, greatest: i32, below: i32) -> i32 {
    let floor = if least > greatest { least - 1 } else { greatest };
    (greatest + below.max(0)).min(floor.max(greatest))
}

#[cfg(feature = "cuda")]
fn raised_priority(d: &candle_core::cuda_backend::CudaDevice) -> Option<i32> {
    let below = RAISED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .find(|(id, _)| *id == d.id())
        .map(|(_, b)| *b)?;
    candle_core::cuda_backend::cudarc::driver::result::stream::get_priority_range()
        .ok()
        .map(|(least, greatest)| level(least, greatest, below))
}

/// Sets `priority` on every kernel node of `graph`; the number of nodes set.
///
/// # Safety
/// `graph` must be a valid graph of the current context.
#[cfg(feature = "cuda")]
unsafe fn set_kernel_priority(
    graph: candle_core::cuda_backend::cudarc::driver::sys::CUgraph,
    priority: i32,
) -> Result<usize> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let check = |r: sys::CUresult, what: &str| -> Result<()> {
        if r == sys::CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            candle_core::bail!("{what}: {r:?}")
        }
    };
    let mut n = 0usize;
    check(unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut n) }, "cuGraphGetNodes")?;
    let mut nodes: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); n];
    check(unsafe { sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut n) }, "cuGraphGetNodes")?;
    let mut set = 0;
    for &node in &nodes[..n] {
        let mut kind = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        check(unsafe { sys::cuGraphNodeGetType(node, &mut kind) }, "cuGraphNodeGetType")?;
        if kind != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL {
            continue;
        }
        // SAFETY: a zeroed union is a valid value of every member; `priority` is then set.
        let mut value: sys::CUkernelNodeAttrValue = unsafe { std::mem::zeroed() };
        value.priority = priority;
        check(
            unsafe {
                sys::cuGraphKernelNodeSetAttribute(
                    node,
                    sys::CUkernelNodeAttrID::CU_LAUNCH_ATTRIBUTE_PRIORITY,
                    &value,
                )
            },
            "cuGraphKernelNodeSetAttribute(priority)",
        )?;
        set += 1;
    }
    Ok(set)
}

/// Runs `body` once (the step itself), then records its kernels as a graph. Candle uploads
/// the shapes and strides of strided kernels from host memory at each launch; a recorded
/// upload would read that (freed) host memory again at every replay. With candle's upload
/// cache on, the first run leaves each upload in a device buffer that lives as long as this
/// thread, and the recording copies from there. `body` must be idempotent (it is run twice
/// here and once per replay). On a device given [`raise_priority`], every kernel of the graph
/// runs at that priority.
#[cfg(feature = "cuda")]
pub fn record(dev: &Device, body: impl Fn() -> Result<()>) -> Result<Graph> {
    record_at(dev, true, body)
}

/// [`record`], with the graph's kernels at the device's raised priority only if `raised` (else
/// at the default, the lowest: beside other stages' kernels as if run op by op).
#[cfg(feature = "cuda")]
pub fn record_at(dev: &Device, raised: bool, body: impl Fn() -> Result<()>) -> Result<Graph> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let Device::Cuda(d) = dev else { candle_core::bail!("not a CUDA device") };
    let _uploads = d.enable_cuda_graph_htod_cache();
    body()?;
    let stream = d.cuda_stream();
    // (asked before the capture: no driver query inside it)
    let raised = if raised { raised_priority(d) } else { None };
    // relaxed: the other stages keep making their own driver calls meanwhile
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .map_err(candle_core::Error::wrap)?;
    let ran = body();
    if let Some(p) = raised {
        return record_raised(stream, ran, p).map(|g| Graph(GraphKind::Raised(g)));
    }
    let ended = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    ran?;
    match ended.map_err(candle_core::Error::wrap)? {
        Some(g) => {
            g.upload().map_err(candle_core::Error::wrap)?;
            Ok(Graph(GraphKind::Cudarc(g)))
        }
        None => candle_core::bail!("the capture recorded nothing"),
    }
}

/// Ends the capture on `stream` (whose body gave `ran`), sets `priority` on every kernel node and
/// instantiates the graph to run with those priorities.
#[cfg(feature = "cuda")]
fn record_raised(
    stream: std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>,
    ran: Result<()>,
    priority: i32,
) -> Result<RaisedGraph> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: ends the capture begun on the same stream, from the same thread.
    let ended = unsafe { sys::cuStreamEndCapture(stream.cu_stream(), &mut graph) };
    let destroy = |g: sys::CUgraph| {
        if !g.is_null() {
            // SAFETY: `g` was made by the capture above and is not used after this.
            let _ = unsafe { sys::cuGraphDestroy(g) };
        }
    };
    if let Err(e) = ran {
        destroy(graph);
        return Err(e);
    }
    if ended != sys::CUresult::CUDA_SUCCESS {
        destroy(graph);
        candle_core::bail!("cuStreamEndCapture: {ended:?}");
    }
    if graph.is_null() {
        candle_core::bail!("the capture recorded nothing");
    }
    let mut flags = 0u64;
    // SAFETY: `graph` is the valid graph just captured in this context.
    match unsafe { set_kernel_priority(graph, priority) } {
        Ok(_) => {
            flags |= sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY.0
                as u64
        }
        Err(e) => tracing::warn!("graph kernels keep the stream's priority: {e}"),
    }
    let mut exec: sys::CUgraphExec = std::ptr::null_mut();
    // SAFETY: instantiates the valid `graph`; `exec` is written on success.
    let r = unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, flags) };
    if r != sys::CUresult::CUDA_SUCCESS {
        destroy(graph);
        candle_core::bail!("cuGraphInstantiateWithFlags: {r:?}");
    }
    let g = RaisedGraph { graph, exec, stream };
    // SAFETY: `exec` was just instantiated; the stream is the one it runs on.
    let r = unsafe { sys::cuGraphUpload(g.exec, g.stream.cu_stream()) };
    if r != sys::CUresult::CUDA_SUCCESS {
        candle_core::bail!("cuGraphUpload: {r:?}");
    }
    Ok(g)
}

#[cfg(not(feature = "cuda"))]
pub fn record_at(dev: &Device, _raised: bool, body: impl Fn() -> Result<()>) -> Result<Graph> {
    record(dev, body)
}

#[cfg(not(feature = "cuda"))]
pub fn record(_dev: &Device, _body: impl Fn() -> Result<()>) -> Result<Graph> {
    candle_core::bail!("no CUDA in this build")
}

impl Graph {
    #[cfg(feature = "cuda")]
    pub fn launch(&self) -> Result<()> {
        use candle_core::cuda_backend::cudarc::driver::sys;
        match &self.0 {
            GraphKind::Cudarc(g) => g.launch().map_err(candle_core::Error::wrap),
            GraphKind::Raised(g) => {
                g.stream.context().bind_to_thread().map_err(candle_core::Error::wrap)?;
                // SAFETY: `exec` lives as long as `g`; it is launched into the stream it was made
                // on.
                let r = unsafe { sys::cuGraphLaunch(g.exec, g.stream.cu_stream()) };
                if r != sys::CUresult::CUDA_SUCCESS {
                    candle_core::bail!("cuGraphLaunch: {r:?}");
                }
                Ok(())
            }
        }
    }
    #[cfg(not(feature = "cuda"))]
    pub fn launch(&self) -> Result<()> {
        candle_core::bail!("no CUDA in this build")
    }
}

/// Replays of a pure function of tensors, one captured graph per input shape: the inputs are
/// copied into fixed buffers, the graph replayed, the outputs copied out (the next replay
/// overwrites them). A shape is captured the second time it comes (a one-off shape is not worth a
/// capture); at most `max` are held, the least recently used dropped first. Where the device cannot
/// capture, the same fixed-buffer path runs op by op (so tests on the CPU exercise it).
///
/// The function must issue nothing to the host while it runs once its inputs are on the device:
/// no uploads of data made on the host (memoise such tensors), no copies to the host.
pub struct GraphCache {
    entries: Vec<CachedShape>,
    max: usize,
    tick: u64,
}

struct CachedShape {
    key: Vec<usize>,
    last_used: u64,
    seen: usize,
    failed: bool,
    held: Option<Held>,
}

struct Held {
    inputs: Vec<candle_core::Tensor>,
    outputs: Vec<candle_core::Tensor>,
    graph: Option<Graph>,
}

/// Shapes remembered beyond the captured ones (only their sightings are counted).
const SEEN_KEYS: usize = 64;

impl GraphCache {
    pub fn new(max: usize) -> Self {
        Self { entries: Vec::new(), max, tick: 0 }
    }

    /// Shapes with a graph (or, without capture, fixed buffers) held now.
    pub fn held(&self) -> usize {
        self.entries.iter().filter(|e| e.held.is_some()).count()
    }

    /// `f(inputs)`, through a graph when this `tag` and these input shapes were seen before.
    pub fn run(
        &mut self,
        tag: usize,
        inputs: &[&candle_core::Tensor],
        f: &dyn Fn(&[candle_core::Tensor]) -> Result<Vec<candle_core::Tensor>>,
    ) -> Result<Vec<candle_core::Tensor>> {
        use candle_core::Tensor;
        let eager = |ins: &[&Tensor]| f(&ins.iter().map(|t| (*t).clone()).collect::<Vec<_>>());
        let Some(dev) = inputs.first().map(|t| t.device().clone()) else { return eager(inputs) };
        let mut key = vec![tag];
        for t in inputs {
            key.push(t.dtype() as usize);
            key.push(t.rank());
            key.extend_from_slice(t.dims());
        }
        self.tick += 1;
        let tick = self.tick;
        let i = match self.entries.iter().position(|e| e.key == key) {
            Some(i) => i,
            None => {
                if self.entries.len() >= SEEN_KEYS {
                    if let Some(old) = self
                        .entries
                        .iter()
                        .enumerate()
                        .filter(|(_, e)| e.held.is_none())
                        .min_by_key(|(_, e)| e.last_used)
                        .map(|(i, _)| i)
                    {
                        self.entries.swap_remove(old);
                    }
                }
                self.entries.push(CachedShape {
                    key,
                    last_used: tick,
                    seen: 0,
                    failed: false,
                    held: None,
                });
                self.entries.len() - 1
            }
        };
        let e = &mut self.entries[i];
        e.seen += 1;
        e.last_used = tick;
        if e.failed || self.max == 0 || (e.held.is_none() && e.seen < 2) {
            return eager(inputs);
        }
        let body = |h: &Held| -> Result<()> {
            let outs = f(&h.inputs)?;
            if outs.len() != h.outputs.len() {
                candle_core::bail!(
                    "graphed function gave {} outputs, not {}",
                    outs.len(),
                    h.outputs.len()
                );
            }
            for (o, b) in outs.iter().zip(&h.outputs) {
                b.slice_set(&o.contiguous()?, 0, 0)?;
            }
            Ok(())
        };
        if let Some(h) = &e.held {
            for (b, t) in h.inputs.iter().zip(inputs) {
                b.slice_set(&t.contiguous()?, 0, 0)?;
            }
            match &h.graph {
                Some(g) => g.launch()?,
                None => body(h)?,
            }
            return h.outputs.iter().map(|t| t.copy()).collect();
        }
        // a first capture for this shape: make room, run once for the outputs' shapes, record
        let held: Vec<usize> =
            (0..self.entries.len()).filter(|&j| self.entries[j].held.is_some()).collect();
        if held.len() >= self.max {
            if let Some(j) = held.iter().copied().min_by_key(|&j| self.entries[j].last_used) {
                self.entries[j].held = None;
            }
        }
        let ins: Vec<Tensor> =
            inputs.iter().map(|t| t.contiguous().and_then(|t| t.copy())).collect::<Result<_>>()?;
        let outs: Vec<Tensor> = f(&ins)?
            .iter()
            .map(|t| t.contiguous().and_then(|t| t.copy()))
            .collect::<Result<_>>()?;
        let mut h = Held { inputs: ins, outputs: outs, graph: None };
        if can_capture(&dev) {
            let t0 = std::time::Instant::now();
            match record(&dev, || body(&h)) {
                Ok(g) => {
                    h.graph = Some(g);
                    // (a capture outside warm-up costs its step this much more)
                    tracing::debug!(tag, shape = ?&self.entries[i].key, held = held.len() + 1,
                        ms = t0.elapsed().as_secs_f64() * 1e3, "graph captured");
                }
                Err(err) => {
                    tracing::warn!("graph capture failed (tag {tag}), running op by op: {err}");
                    self.entries[i].failed = true;
                    return h.outputs.iter().map(|t| t.copy()).collect();
                }
            }
        }
        let out = h.outputs.iter().map(|t| t.copy()).collect::<Result<Vec<_>>>();
        self.entries[i].held = Some(h);
        out
    }
}

/// A [`GraphCache`] owned by a model, or none (op by op). A clone starts empty: graphs are bound to
/// their owner's buffers.
pub struct GraphSlot(Option<std::sync::Mutex<GraphCache>>);

impl GraphSlot {
    pub fn off() -> Self {
        Self(None)
    }

    pub fn on(max: usize) -> Self {
        Self(Some(std::sync::Mutex::new(GraphCache::new(max))))
    }

    pub fn is_on(&self) -> bool {
        self.0.is_some()
    }

    pub fn held(&self) -> usize {
        self.0.as_ref().map(|m| m.lock().unwrap_or_else(|e| e.into_inner()).held()).unwrap_or(0)
    }

    /// `f(inputs)`: through the cache when on, else directly.
    pub fn run(
        &self,
        tag: usize,
        inputs: &[&candle_core::Tensor],
        f: &dyn Fn(&[candle_core::Tensor]) -> Result<Vec<candle_core::Tensor>>,
    ) -> Result<Vec<candle_core::Tensor>> {
        match &self.0 {
            Some(m) => m.lock().unwrap_or_else(|e| e.into_inner()).run(tag, inputs, f),
            None => f(&inputs.iter().map(|t| (*t).clone()).collect::<Vec<_>>()),
        }
    }
}

impl Clone for GraphSlot {
    fn clone(&self) -> Self {
        match &self.0 {
            Some(m) => Self::on(m.lock().unwrap_or_else(|e| e.into_inner()).max),
            None => Self::off(),
        }
    }
}

impl std::fmt::Debug for GraphSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GraphSlot({})", if self.is_on() { "on" } else { "off" })
    }
}

#[cfg(test)]
mod tests {
    use super::level;

    #[test]
    fn a_stage_below_the_highest_priority_stays_above_the_default() {
        // CUDA's range on recent GPUs: 0 (the default, the lowest) to -5
        assert_eq!(level(0, -5, 0), -5);
        assert_eq!(level(0, -5, 1), -4);
        assert_eq!(level(0, -5, 9), -1, "never down to the default kernels' level");
        // a range of two levels: both raised stages share the one above the default
        assert_eq!(level(0, -1, 1), -1);
        // no range at all
        assert_eq!(level(0, 0, 1), 0);
        assert_eq!(level(0, -5, -3), -5, "never above the highest");
    }
}
