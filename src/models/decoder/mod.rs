//! The decoder-only transformer shared by the Thinker LLM (Qwen3: per-head q/k RMSNorm) and the
//! Talker backbone (Llama: no q/k norm): pre-norm blocks, RoPE (rotate-half), grouped-query
//! attention, SwiGLU MLP.
//!
//! Checkpoint names below `<prefix>.model.`: `layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj,
//! self_attn.{q,k}_norm, post_attention_layernorm, mlp.{gate,up,down}_proj}`, `norm`.
//!
//! Batching: one call advances any number of streams, each with its own KV cache and any number of
//! new positions (prefill and decode mix freely). The rows of all streams are packed into one
//! matrix for every position-wise op (projections, norms, MLP); only attention runs per stream,
//! against that stream's own cache.

use candle_core::{DType, Device, Module, Result, Tensor};

mod batch;
mod kv_cache;
mod ragged_attention;
mod snapshot;

pub use super::cache_pool::{CachePool, PooledCache};
pub use batch::SlotPool;
use candle_nn::{Linear, VarBuilder};
pub use kv_cache::KvCache;

use super::attention::{attend, causal_mask, CausalMask, Rope};
use super::fused::{add_rmsnorm, silu_mul, Norm};

/// Shape of one decoder stack.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecoderConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub max_positions: usize,
    /// Qwen3's per-head RMSNorm of q and k before RoPE.
    pub qk_norm: bool,
}
/// How a decoder runs a step that advances exactly one stream by one position (every decode
/// step at concurrency 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DecodeMode {
    /// Like any other step: attention over the held positions, the cache grown by appending.
    #[default]
    Eager,
    /// Over fixed-address buffers: the input row, the position and the output row live in
    /// buffers owned by the stream's cache; the new K/V are scattered to the position read from
    /// device memory, and attention reads the positions up to it, the length also read from
    /// device memory (`decode_attention`: our own kernel on CUDA). Nothing in the step depends on
    /// a host value, so the same kernels serve every position until the capacity grows. On the
    /// CPU this is only a check of that path.
    Static,
    /// [`DecodeMode::Static`], captured once per stream and capacity as a CUDA graph and replayed
    /// (one launch instead of ~700 on the Thinker). Without CUDA it runs as `Static`.
    Graph,
}

/// The fixed-address buffers of one stream's static decode step (see [`DecodeMode::Static`]).
struct StaticStep {
    cap: usize,
    /// `[1, hidden]`: the new position's embedding, copied in before each step.
    x_in: Tensor,
    /// `[1]` u32: the new position.
    pos: Tensor,
    /// `[1]` u32 zero: the cache as a pool of one slot, for the batched step's kernels.
    slot0: Tensor,
    /// `[1, hidden]`: the last layer's output after the final norm.
    out: Tensor,
    graph: Option<super::cuda_graph::Graph>,
    /// Capture failed once for this stream: run the static step uncaptured.
    no_graph: bool,
}

impl std::fmt::Debug for StaticStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StaticStep")
            .field("cap", &self.cap)
            .field("graph", &self.graph.is_some())
            .finish()
    }
}

impl StaticStep {
    fn new(cap: usize, hidden: usize, dtype: DType, dev: &Device) -> Result<Self> {
        Ok(Self {
            cap,
            x_in: Tensor::zeros((1, hidden), dtype, dev)?,
            pos: Tensor::zeros(1, DType::U32, dev)?,
            slot0: Tensor::zeros(1, DType::U32, dev)?,
            out: Tensor::zeros((1, hidden), dtype, dev)?,
            graph: None,
            no_graph: false,
        })
    }
}

/// CUDA graph capture of one step (the `cuda` build on a CUDA device, event tracking off).
/// Self-attention with the q, k, v projections fused into one matrix (rows: q heads, k heads, v
/// heads) and the 1/sqrt(d) scale folded into the q side at load: into `q_norm`'s weight (Qwen3)
/// or into the q rows of the projection (Llama). One step per layer is then one matmul, one norm
/// of q and k together, and one RoPE kernel for both.
#[derive(Debug, Clone)]
struct Attention {
    qkv_proj: Linear,
    o_proj: Linear,
    /// Per-head RMSNorm weights of q (pre-scaled) and k, as one `[hq + hkv, d]` table.
    qk_norm: Option<Tensor>,
    /// `[d]` ones: the norm's own weight (the real weights are applied per head afterwards).
    ones: Tensor,
    eps: f64,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
}

fn linear_no_bias(vb: &VarBuilder, name: &str, in_dim: usize, out_dim: usize) -> Result<Linear> {
    Ok(Linear::new(vb.get((out_dim, in_dim), &format!("{name}.weight"))?, None))
}

impl Attention {
    fn load(vb: VarBuilder, cfg: &DecoderConfig) -> Result<Self> {
        let (h, hq, hkv, d) = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let scale = (d as f64).powf(-0.5);
        let mut wq = vb.get((hq * d, h), "q_proj.weight")?;
        let wk = vb.get((hkv * d, h), "k_proj.weight")?;
        let wv = vb.get((hkv * d, h), "v_proj.weight")?;
        let qk_norm = if cfg.qk_norm {
            let qn = (vb.get(d, "q_norm.weight")? * scale)?;
            let kn = vb.get(d, "k_norm.weight")?;
            Some(Tensor::cat(
                &[qn.unsqueeze(0)?.repeat((hq, 1))?, kn.unsqueeze(0)?.repeat((hkv, 1))?],
                0,
            )?)
        } else {
            wq = (wq * scale)?;
            None
        };
        Ok(Self {
            qkv_proj: Linear::new(Tensor::cat(&[wq, wk, wv], 0)?, None),
            o_proj: linear_no_bias(&vb, "o_proj", hq * d, h)?,
            qk_norm,
            ones: Tensor::ones(d, vb.dtype(), vb.device())?,
            eps: cfg.rms_norm_eps,
            num_heads: hq,
            num_kv_heads: hkv,
            head_dim: d,
        })
    }

    /// `x: [N, hidden]` packed rows of all streams; `spans[i] = (start, n)` rows of stream i.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        layer: usize,
        caches: &mut [&mut KvCache],
        spans: &[(usize, usize)],
        masks: &[CausalMask],
    ) -> Result<Tensor> {
        let (d, hq) = (self.head_dim, self.num_heads);
        let (q, k, v) = self.project(x, cos, sin)?;
        // 3. attention per stream against its own cache
        let mut outs = Vec::with_capacity(spans.len());
        for ((cache, &(start, n)), mask) in caches.iter_mut().zip(spans).zip(masks) {
            let qs = q.narrow(0, start, n)?.transpose(0, 1)?;
            let ks = k.narrow(0, start, n)?.transpose(0, 1)?;
            let vs = v.narrow(0, start, n)?.transpose(0, 1)?;
            let (ka, va) = cache.append(layer, &ks, &vs)?;
            let o = attend(&qs, &ka, &va, mask)?;
            outs.push(o.transpose(0, 1)?.reshape((n, hq * d))?);
        }
        let o = if outs.len() == 1 { outs.pop().expect("one") } else { Tensor::cat(&outs, 0)? };
        self.o_proj.forward(&o)
    }
}

impl Attention {
    /// Steps 1–2 of a step: `q: [N, hq, d]`, `k`, `v: [N, hkv, d]` of the packed rows `x`.
    fn project(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let total = x.dim(0)?;
        let (d, hq, hkv) = (self.head_dim, self.num_heads, self.num_kv_heads);
        // 1. one projection for q, k and v
        let qkv = self.qkv_proj.forward(x)?.reshape((total, hq + 2 * hkv, d))?;
        // 2. q and k: per-head RMSNorm (Qwen3), then RoPE, in one pass over both
        let qk = super::fused::qk_norm_rope(
            &qkv.narrow(1, 0, hq + hkv)?,
            self.qk_norm.as_ref().map(|w| (w, &self.ones)),
            self.eps,
            cos,
            sin,
        )?;
        Ok((qk.narrow(1, 0, hq)?, qk.narrow(1, hq, hkv)?, qkv.narrow(1, hq + hkv, hkv)?))
    }

    /// One position of one stream over fixed-capacity buffers `kv` (`[hkv, cap, d]` each): the
    /// batched step's kernels over a pool of one slot (`slot0`: `[1]` u32 zero), the new K/V at
    /// the position in `pos` (`[1]` u32, on the device), attention over the positions up to it.
    fn forward_static(
        &self,
        x: &Tensor,
        rope: &Rope,
        kv: &(Tensor, Tensor),
        slot0: &Tensor,
        pos: &Tensor,
    ) -> Result<Tensor> {
        let one = (kv.0.unsqueeze(0)?, kv.1.unsqueeze(0)?);
        self.forward_batch(x, rope, &one, slot0, pos, batch::RowAttention::Kernel { max_pos: None })
    }
}

/// SwiGLU MLP with `gate_proj` and `up_proj` fused into one matrix.
#[derive(Debug, Clone)]
struct Mlp {
    gate_up_proj: Linear,
    down_proj: Linear,
    intermediate: usize,
}

impl Mlp {
    fn load(vb: VarBuilder, cfg: &DecoderConfig) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let gate = vb.get((i, h), "gate_proj.weight")?;
        let up = vb.get((i, h), "up_proj.weight")?;
        Ok(Self {
            gate_up_proj: Linear::new(Tensor::cat(&[gate, up], 0)?, None),
            down_proj: linear_no_bias(&vb, "down_proj", i, h)?,
            intermediate: i,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let gu = self.gate_up_proj.forward(x)?;
        self.down_proj.forward(&silu_mul(&gu, self.intermediate)?)
    }
}

#[derive(Debug, Clone)]
struct Layer {
    input_layernorm: Norm,
    self_attn: Attention,
    post_attention_layernorm: Norm,
    mlp: Mlp,
}

/// One stream's share of a batched step: its cache and the embeddings of its new positions.
pub struct StreamStep<'a> {
    pub cache: &'a mut KvCache,
    /// `[n, hidden]`, n >= 1.
    pub embeds: Tensor,
}

/// The decoder stack (`<prefix>.model.layers.*` and `<prefix>.model.norm`).
#[derive(Debug, Clone)]
pub struct Decoder {
    layers: Vec<Layer>,
    norm: Norm,
    rope: Rope,
    cfg: DecoderConfig,
    device: Device,
    /// The dtype of activations and KV.
    dtype: DType,
    mode: DecodeMode,
    /// Streams in slots that advance by several positions (prompt chunks) join the batched
    /// step's rows ([`Decoder::set_ragged_prefill`]).
    ragged: bool,
    /// Steps with prompt rows of at most this many rows, all in slots, run through a bucket's
    /// fixed buffers (and captured graph) ([`Decoder::set_prefill_graph_rows`]); 0: never.
    prefill_graph_rows: usize,
    /// Whether those buckets' graphs (beyond the decode buckets) run at the stage's raised
    /// priority ([`Decoder::set_prefill_graph_raised`]).
    prefill_graph_raised: bool,
}

impl Decoder {
    /// `vb` points at `<prefix>.model`.
    pub fn load(vb: VarBuilder, cfg: &DecoderConfig) -> Result<Self> {
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let lvb = vb.pp("layers").pp(i);
            layers.push(Layer {
                input_layernorm: Norm::load(
                    lvb.pp("input_layernorm"),
                    cfg.hidden_size,
                    cfg.rms_norm_eps,
                )?,
                self_attn: Attention::load(lvb.pp("self_attn"), cfg)?,
                post_attention_layernorm: Norm::load(
                    lvb.pp("post_attention_layernorm"),
                    cfg.hidden_size,
                    cfg.rms_norm_eps,
                )?,
                mlp: Mlp::load(lvb.pp("mlp"), cfg)?,
            });
        }
        let norm = Norm::load(vb.pp("norm"), cfg.hidden_size, cfg.rms_norm_eps)?;
        let rope =
            Rope::new(cfg.head_dim, cfg.rope_theta, cfg.max_positions, vb.dtype(), vb.device())?;
        let ragged = vb.device().is_cuda();
        Ok(Self {
            layers,
            norm,
            rope,
            cfg: *cfg,
            device: vb.device().clone(),
            dtype: vb.dtype(),
            mode: DecodeMode::Eager,
            ragged,
            prefill_graph_rows: 0,
            prefill_graph_raised: true,
        })
    }

    /// How one-stream, one-position steps run (see [`DecodeMode`]).
    pub fn set_decode_mode(&mut self, mode: DecodeMode) {
        self.mode = mode;
    }

    /// Whether prompt chunks of streams in slots run in the batched step's rows (one ragged batch,
    /// `batch.rs`) rather than op by op with attention stream by stream. On by default on CUDA,
    /// where it is one set of kernel launches for the whole step; off on the CPU, whose twin of
    /// the batched attention goes row by row and is slower there than attention per stream.
    pub fn set_ragged_prefill(&mut self, on: bool) {
        self.ragged = on;
    }

    /// With a graph decode mode, a step whose rows are all in slots of one pool, some of them a
    /// prompt chunk, and at most `rows` of them (or the pool's slots, if more), runs as the rows
    /// of a bucket's step (powers of two beyond the decode steps' buckets): on CUDA its captured
    /// graph, at the stage's raised priority, where op by op every stream of the step waited for
    /// hundreds of kernel launches at the default one. 0: never (the ragged step, op by op).
    pub fn set_prefill_graph_rows(&mut self, rows: usize) {
        self.prefill_graph_rows = rows;
    }

    /// Whether the graphs of the buckets beyond the decode buckets
    /// ([`Decoder::set_prefill_graph_rows`]) run at the stage's raised priority (the default) or at
    /// the default one, beside the other stages' kernels as an op-by-op step would.
    pub fn set_prefill_graph_raised(&mut self, raised: bool) {
        self.prefill_graph_raised = raised;
    }

    pub fn prefill_graph_rows(&self) -> usize {
        self.prefill_graph_rows
    }

    pub fn config(&self) -> &DecoderConfig {
        &self.cfg
    }

    pub fn decode_mode(&self) -> DecodeMode {
        self.mode
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn new_cache(&self) -> KvCache {
        KvCache::new(self.cfg.num_layers)
    }

    /// An empty cache whose buffers already hold `cap` positions in every layer.
    pub fn cache_with_capacity(&self, cap: usize) -> Result<KvCache> {
        let mut c = self.new_cache();
        for li in 0..self.layers.len() {
            c.reserve(
                li,
                cap,
                (self.cfg.num_kv_heads, self.cfg.head_dim),
                self.dtype,
                &self.device,
            )?;
        }
        Ok(c)
    }

    /// Advances every stream by its new positions and returns, per stream, the last layer's
    /// hidden states after the final norm (`[n, hidden]`).
    ///
    /// Outside [`DecodeMode::Eager`], the streams that advance one position over slots of a pool
    /// go through the batched step (see [`SlotPool`]) and the others op by op beside it.
    pub fn forward(&self, streams: &mut [StreamStep<'_>]) -> Result<Vec<Tensor>> {
        if streams.is_empty() {
            return Ok(vec![]);
        }
        if let Some(pool) = self.batchable(streams) {
            return self.decode_batch(&pool, streams);
        }
        if let Some(pool) =
            self.mode.ne(&DecodeMode::Eager).then(|| batch::pool_of_slots(streams)).flatten()
        {
            return self.forward_slots(&pool, streams);
        }
        self.forward_eager(streams)
    }

    /// [`Decoder::forward`] without the batched step: one stream by one position over its own
    /// cache's fixed buffers ([`DecodeMode::Static`] / [`DecodeMode::Graph`]), or op by op.
    pub(super) fn forward_eager(&self, streams: &mut [StreamStep<'_>]) -> Result<Vec<Tensor>> {
        if streams.is_empty() {
            return Ok(vec![]);
        }
        if self.mode != DecodeMode::Eager && streams.len() == 1 && streams[0].embeds.dim(0)? == 1 {
            let s = &mut streams[0];
            return Ok(vec![self.decode_static(s.cache, &s.embeds)?]);
        }
        let mut spans = Vec::with_capacity(streams.len());
        let mut positions: Vec<u32> = Vec::new();
        let mut start = 0;
        for s in streams.iter() {
            let n = s.embeds.dim(0)?;
            if n == 0 {
                candle_core::bail!("a stream step needs at least one new position");
            }
            let offset = s.cache.len();
            if offset + n > self.rope.max_positions() {
                candle_core::bail!(
                    "context of {} positions exceeds max_position_embeddings {}",
                    offset + n,
                    self.rope.max_positions()
                );
            }
            positions.extend((offset..offset + n).map(|p| p as u32));
            spans.push((start, n));
            start += n;
        }
        let embeds: Vec<&Tensor> = streams.iter().map(|s| &s.embeds).collect();
        let x = if embeds.len() == 1 { embeds[0].clone() } else { Tensor::cat(&embeds, 0)? };
        let positions = Tensor::from_vec(positions, start, &self.device)?;
        let (cos, sin) = self.rope.tables_fused(&positions)?;
        let mut caches: Vec<&mut KvCache> = streams.iter_mut().map(|s| &mut *s.cache).collect();
        let masks: Vec<CausalMask> = caches
            .iter()
            .zip(&spans)
            .map(|(c, &(_, n))| causal_mask(n, c.len() + n, x.dtype(), &self.device))
            .collect::<Result<_>>()?;
        let h = self.run_layers(x, |li, attn, h| {
            attn.forward(h, &cos, &sin, li, &mut caches, &spans, &masks)
        })?;
        for (cache, &(_, n)) in caches.iter_mut().zip(&spans) {
            cache.advance(n);
        }
        spans.iter().map(|&(s, n)| h.narrow(0, s, n)).collect()
    }

    /// One position of one stream through the fixed-address buffers of its cache (see
    /// [`DecodeMode::Static`]); with [`DecodeMode::Graph`] on CUDA, a replay of the captured step.
    fn decode_static(&self, cache: &mut KvCache, embeds: &Tensor) -> Result<Tensor> {
        let len = cache.len();
        if len + 1 > self.rope.max_positions() {
            candle_core::bail!(
                "context of {} positions exceeds max_position_embeddings {}",
                len + 1,
                self.rope.max_positions()
            );
        }
        let (hkv, d, dtype) = (self.cfg.num_kv_heads, self.cfg.head_dim, embeds.dtype());
        // 1. room for this position in every layer; new buffers (a larger capacity) need a new step
        for li in 0..self.layers.len() {
            cache.reserve(li, len + 1, (hkv, d), dtype, &self.device)?;
        }
        let cap = cache.capacity();
        if cache.step.as_ref().map(|s| s.cap) != Some(cap) {
            cache.step = Some(StaticStep::new(cap, self.cfg.hidden_size, dtype, &self.device)?);
        }
        let KvCache { layers, step, .. } = cache;
        let st = step.as_mut().expect("made above");
        let kv: Vec<&(Tensor, Tensor)> =
            layers.iter().map(|l| l.as_ref().expect("reserved")).collect();
        // 2. this step's inputs into the fixed buffers
        st.x_in.slice_set(&embeds.contiguous()?, 0, 0)?;
        st.pos.slice_set(&Tensor::new(&[len as u32], &self.device)?, 0, 0)?;
        // 3. the step: replayed; or run once and recorded; or run op by op
        if st.graph.is_none()
            && !st.no_graph
            && self.mode == DecodeMode::Graph
            && super::cuda_graph::can_capture(&self.device)
        {
            match super::cuda_graph::record(&self.device, || self.static_body(&kv, st)) {
                Ok(g) => st.graph = Some(g),
                Err(e) => {
                    tracing::warn!("decode step capture failed, running it uncaptured: {e}");
                    st.no_graph = true;
                    self.static_body(&kv, st)?;
                }
            }
        } else {
            match &st.graph {
                Some(g) => g.launch()?,
                None => self.static_body(&kv, st)?,
            }
        }
        cache.advance(1);
        let st = cache.step.as_ref().expect("made above");
        st.out.copy()
    }

    /// The static step's kernels: reads only `st`'s buffers and the caches, writes the caches at
    /// `st.pos` and `st.out`.
    fn static_body(&self, kv: &[&(Tensor, Tensor)], st: &StaticStep) -> Result<()> {
        let h = self.run_layers(st.x_in.clone(), |li, attn, h| {
            attn.forward_static(h, &self.rope, kv[li], &st.slot0, &st.pos)
        })?;
        st.out.slice_set(&h, 0, 0)
    }

    /// The layer stack over the rows `x`, `attend(layer index, attention, normed rows)` standing
    /// for each layer's attention; returns the rows after the final norm. Each residual add is
    /// fused with the norm after it (the next layer's input norm, or the final norm).
    fn run_layers(
        &self,
        mut x: Tensor,
        mut attend: impl FnMut(usize, &Attention, &Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let mut h = self.layers.first().map_or(&self.norm, |l| &l.input_layernorm).forward(&x)?;
        for (li, layer) in self.layers.iter().enumerate() {
            let a = attend(li, &layer.self_attn, &h)?;
            let (x1, h1) = add_rmsnorm(&x, &a, &layer.post_attention_layernorm)?;
            let next = self.layers.get(li + 1).map_or(&self.norm, |l| &l.input_layernorm);
            (x, h) = add_rmsnorm(&x1, &layer.mlp.forward(&h1)?, next)?;
        }
        Ok(h)
    }
}
