//! KV caches as a pool of fixed slots, and the batched decode step over them.
//!
//! A [`SlotPool`] holds, for every layer, K and V of `slots + 1` streams as one tensor
//! `[slots + 1, hkv, cap, d]`, allocated once. A stream takes a slot ([`SlotPool::take`]) and gets
//! a [`KvCache`] whose buffers are views of its slot: prefill and every other step work on it as on
//! any cache (it cannot grow past `cap`). A step in which every stream advances one position over
//! slots of one pool runs batched: the rows are copied into fixed buffers of the step's batch-size
//! bucket (1, 2, 4, ...), the slot of each row and its position go to device memory, and one set of
//! kernels serves the whole batch (`batch_decode`). Nothing in that step depends on a host value,
//! so on CUDA it is captured once per bucket as a graph and replayed. The rows of a bucket beyond
//! the batch point at the extra slot (the pool's scratch slot) at position 0.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Module, Result, Tensor};

use super::ragged_attention::{RaggedPlan, StreamRows};
use super::{Attention, DecodeMode, Decoder, KvCache};
use crate::attention::Rope;
use crate::batch_decode::{decode_attention_batch, qk_norm_rope_store_batch};
use crate::cuda_graph::Graph;

/// The fixed buffers (and, on CUDA, the graph) of the batched step for one bucket.
struct BatchStep {
    /// `[bucket, hidden]`: the rows fed.
    x_in: Tensor,
    /// `[bucket]` u32: each row's slot and position.
    slots: Tensor,
    pos: Tensor,
    /// `[bucket, hidden]`: the last layer's output after the final norm.
    out: Tensor,
    /// The positions its attention covers: the slot's capacity for the decode steps' buckets; for
    /// a prompt's bucket beyond them, a power of two that holds every row's position (the
    /// attention kernel's blocks beyond it, most of them for a short prompt, are not launched).
    span: usize,
    graph: Option<Graph>,
    no_graph: bool,
}

/// The least span a prompt's bucket attends over (fewer steps to capture).
const MIN_SPAN: usize = 256;

/// A prompt chunk goes through a bucket's step only while it ends within this many positions:
/// there each of its rows reads its whole history, where the ragged step's plan attends by matrix
/// products (measured faster for the prompts of long conversations, docs/performance.md run 65).
const GRAPH_PROMPT_POSITIONS: usize = 2048;

pub(crate) struct PoolInner {
    /// Per layer: K and V `[slots + 1, hkv, cap, d]`.
    layers: Vec<(Tensor, Tensor)>,
    slots: usize,
    cap: usize,
    free: Mutex<Vec<usize>>,
    /// By bucket and span.
    steps: Mutex<HashMap<(usize, usize), BatchStep>>,
}

/// A stream's hold on its slot; the slot goes back to the pool when the cache drops.
pub(crate) struct SlotLease {
    index: usize,
    pool: Arc<PoolInner>,
}

impl std::fmt::Debug for SlotLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "slot {}", self.index)
    }
}

impl Drop for SlotLease {
    fn drop(&mut self) {
        self.pool.free.lock().expect("slot pool").push(self.index);
    }
}

/// KV caches of a fixed number of streams, each with room for `capacity` positions.
#[derive(Clone)]
pub struct SlotPool {
    inner: Arc<PoolInner>,
}

impl std::fmt::Debug for SlotPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SlotPool({} slots x {} positions)", self.inner.slots, self.inner.cap)
    }
}

impl SlotPool {
    pub fn slots(&self) -> usize {
        self.inner.slots
    }

    pub fn capacity(&self) -> usize {
        self.inner.cap
    }

    /// Slots not taken.
    pub fn free(&self) -> usize {
        self.inner.free.lock().expect("slot pool").len()
    }

    /// A free slot as an empty cache, or `None` when every slot is taken.
    pub fn take(&self) -> Result<Option<KvCache>> {
        let Some(index) = self.inner.free.lock().expect("slot pool").pop() else { return Ok(None) };
        let layers = self
            .inner
            .layers
            .iter()
            .map(|(k, v)| Ok(Some((k.get(index)?, v.get(index)?))))
            .collect::<Result<Vec<_>>>()?;
        Ok(Some(KvCache {
            layers,
            len: 0,
            step: None,
            slot: Some(SlotLease { index, pool: self.inner.clone() }),
        }))
    }

    /// The bucket sizes whose batched step exists (made by a step of that many rows, or the
    /// warm-up), in ascending order.
    pub fn buckets(&self) -> Vec<usize> {
        let mut b: Vec<usize> =
            self.inner.steps.lock().expect("slot pool steps").keys().map(|k| k.0).collect();
        b.sort_unstable();
        b.dedup();
        b
    }

    /// Bytes held by the pool's buffers.
    pub fn bytes(&self) -> usize {
        self.inner
            .layers
            .iter()
            .map(|(k, v)| (k.elem_count() + v.elem_count()) * k.dtype().size_in_bytes())
            .sum()
    }
}

/// The pool of the first stream whose cache is a slot, if any.
pub(super) fn pool_of_slots(streams: &[super::StreamStep<'_>]) -> Option<Arc<PoolInner>> {
    streams.iter().find_map(|s| s.cache.slot.as_ref()).map(|l| l.pool.clone())
}

/// Whether the stream's cache is a slot of `pool` (it advances by any number of positions).
pub(super) fn in_slots_of(s: &super::StreamStep<'_>, pool: &Arc<PoolInner>) -> bool {
    s.cache.slot.as_ref().is_some_and(|l| Arc::ptr_eq(&l.pool, pool))
}

/// Whether the stream advances one position over a slot of `pool`.
pub(super) fn in_pool(s: &super::StreamStep<'_>, pool: &Arc<PoolInner>) -> bool {
    s.embeds.dim(0).ok() == Some(1)
        && s.cache.slot.as_ref().is_some_and(|l| Arc::ptr_eq(&l.pool, pool))
}

/// The smallest bucket that holds `n` rows: a power of two, at most `max`.
fn bucket(n: usize, max: usize) -> usize {
    n.next_power_of_two().min(max.max(n))
}

impl Decoder {
    /// What one slot of `capacity` positions takes of the device's memory (keys and values of
    /// every layer), as [`Decoder::slot_pool`] allocates it.
    pub fn slot_bytes(&self, capacity: usize) -> usize {
        2 * self.layers.len()
            * self.slot_shape(1, capacity).iter().product::<usize>()
            * self.dtype.size_in_bytes()
    }

    /// A layer's keys' (and values') shape for `slots` slots of `capacity` positions.
    fn slot_shape(&self, slots: usize, capacity: usize) -> [usize; 4] {
        [slots, self.cfg.num_kv_heads, capacity, self.cfg.head_dim]
    }

    /// A pool of `slots` caches with room for `capacity` positions each (plus a scratch slot).
    pub fn slot_pool(&self, slots: usize, capacity: usize) -> Result<SlotPool> {
        if slots == 0 || capacity == 0 || capacity > self.rope.max_positions() {
            candle_core::bail!(
                "slot pool: {slots} slots of {capacity} positions (the context holds {})",
                self.rope.max_positions()
            );
        }
        // (and the scratch slot)
        let shape = self.slot_shape(slots + 1, capacity);
        let layers = (0..self.layers.len())
            .map(|_| {
                let k = Tensor::zeros(&shape, self.dtype, &self.device)?;
                let v = Tensor::zeros(&shape, self.dtype, &self.device)?;
                Ok((k, v))
            })
            .collect::<Result<Vec<_>>>()?;
        let free = Mutex::new((0..slots).rev().collect());
        Ok(SlotPool {
            inner: Arc::new(PoolInner {
                layers,
                slots,
                cap: capacity,
                free,
                steps: Mutex::new(HashMap::new()),
            }),
        })
    }

    /// The pool every stream's cache is a slot of, when each stream advances one position and
    /// all of them hold slots of one pool (the batched step serves them).
    pub(super) fn batchable(&self, streams: &[super::StreamStep<'_>]) -> Option<Arc<PoolInner>> {
        if self.mode == DecodeMode::Eager || streams.is_empty() {
            return None;
        }
        let first = streams[0].cache.slot.as_ref()?.pool.clone();
        streams.iter().all(|s| in_pool(s, &first)).then_some(first)
    }

    /// Captures the batched step of every bucket up to the pool's size, and of every prompt
    /// bucket and span up to [`Decoder::prefill_graph_rows`] (a warm-up, so no request pays a
    /// capture). Uses the scratch slot only.
    pub fn warm_pool(&self, pool: &SlotPool) -> Result<()> {
        let inner = &pool.inner;
        for b_now in warm_buckets(inner.slots, self.prefill_graph_rows) {
            let spans = if b_now > inner.slots { prompt_spans(inner.cap) } else { vec![inner.cap] };
            for span in spans {
                let mut steps = inner.steps.lock().expect("slot pool steps");
                let st = step_entry(&mut steps, b_now, span, || self.batch_step(b_now, span))?;
                let scratch = vec![inner.slots as u32; b_now];
                st.slots.slice_set(&Tensor::new(scratch.as_slice(), &self.device)?, 0, 0)?;
                st.pos.slice_set(
                    &Tensor::new(vec![0u32; b_now].as_slice(), &self.device)?,
                    0,
                    0,
                )?;
                self.run_batch_step(inner, st)?;
                self.run_batch_step(inner, st)?;
            }
        }
        self.device.synchronize()
    }

    fn batch_step(&self, bucket: usize, span: usize) -> Result<BatchStep> {
        let h = self.cfg.hidden_size;
        Ok(BatchStep {
            x_in: Tensor::zeros((bucket, h), self.dtype, &self.device)?,
            slots: Tensor::zeros(bucket, DType::U32, &self.device)?,
            pos: Tensor::zeros(bucket, DType::U32, &self.device)?,
            out: Tensor::zeros((bucket, h), self.dtype, &self.device)?,
            span,
            graph: None,
            no_graph: false,
        })
    }

    /// Runs (or replays, or records) the step over `st`'s buffers.
    fn run_batch_step(&self, pool: &PoolInner, st: &mut BatchStep) -> Result<()> {
        if st.graph.is_none()
            && !st.no_graph
            && self.mode == DecodeMode::Graph
            && crate::cuda_graph::can_capture(&self.device)
        {
            // (a prompt's bucket, beyond the decode buckets, at the raised priority or not)
            let raised = self.prefill_graph_raised || st.x_in.dim(0)? <= pool.slots;
            match crate::cuda_graph::record_at(&self.device, raised, || self.batch_body(pool, st)) {
                Ok(g) => st.graph = Some(g),
                Err(e) => {
                    tracing::warn!(
                        "batched decode step capture failed, running it uncaptured: {e}"
                    );
                    st.no_graph = true;
                    self.batch_body(pool, st)?;
                }
            }
            return Ok(());
        }
        match &st.graph {
            Some(g) => g.launch(),
            None => self.batch_body(pool, st),
        }
    }

    /// The batched step's kernels: reads only `st`'s buffers and the pool, writes the pool at
    /// each row's slot and position, and `st.out`.
    fn batch_body(&self, pool: &PoolInner, st: &BatchStep) -> Result<()> {
        let h = self.run_layers(st.x_in.clone(), |li, attn, h| {
            let max_pos = (st.span < pool.cap).then(|| st.span - 1);
            let kernel = RowAttention::Kernel { max_pos };
            attn.forward_batch(h, &self.rope, &pool.layers[li], &st.slots, &st.pos, kernel)
        })?;
        st.out.slice_set(&h, 0, 0)
    }

    /// Every stream one position, batched over the pool's slots (see the module documentation).
    pub(super) fn decode_batch(
        &self,
        pool: &PoolInner,
        streams: &mut [super::StreamStep<'_>],
    ) -> Result<Vec<Tensor>> {
        self.step_rows(pool, streams, pool.slots)
    }

    /// Streams in slots of `pool`, each advancing by its embeddings' rows (one position when
    /// decoding, a prompt chunk when prefilling), as the rows of one bucket's step (a power of two
    /// up to `max_bucket`): its fixed buffers, and on CUDA its graph. The step writes every row's
    /// K/V before attention reads them, so a prompt chunk attends causally within itself, as in
    /// [`Self::ragged_batch`].
    pub(super) fn step_rows(
        &self,
        pool: &PoolInner,
        streams: &mut [super::StreamStep<'_>],
        max_bucket: usize,
    ) -> Result<Vec<Tensor>> {
        let Rows { mut slots, mut pos, spans, .. } = rows_of(pool, streams)?;
        let rows = slots.len();
        if rows > max_bucket {
            candle_core::bail!("a step of {rows} rows does not fit a bucket of {max_bucket}");
        }
        let b = bucket(rows, max_bucket);
        let span = if b > pool.slots {
            let last = pos.iter().max().map_or(0, |&p| p as usize);
            (last + 1).next_power_of_two().clamp(MIN_SPAN.min(pool.cap), pool.cap)
        } else {
            pool.cap
        };
        // the rows beyond the batch: the scratch slot at position 0
        slots.resize(b, pool.slots as u32);
        pos.resize(b, 0);
        let mut steps = pool.steps.lock().expect("slot pool steps");
        let st = step_entry(&mut steps, b, span, || self.batch_step(b, span))?;
        let x: Vec<&Tensor> = streams.iter().map(|s| &s.embeds).collect();
        let x = if x.len() == 1 { x[0].contiguous()? } else { Tensor::cat(&x, 0)? };
        st.x_in.slice_set(&x.to_dtype(self.dtype)?, 0, 0)?;
        st.slots.slice_set(&Tensor::new(slots.as_slice(), &self.device)?, 0, 0)?;
        st.pos.slice_set(&Tensor::new(pos.as_slice(), &self.device)?, 0, 0)?;
        self.run_batch_step(pool, st)?;
        for (s, &(_, n)) in streams.iter_mut().zip(&spans) {
            s.cache.advance(n);
        }
        let out = st.out.narrow(0, 0, rows)?.copy()?;
        spans.iter().map(|&(start, n)| out.narrow(0, start, n)).collect()
    }
}

/// Whether `n` rows of a stream holding `len` positions may go through a bucket's step: one
/// position always (a decode row), a prompt chunk while it ends within
/// [`GRAPH_PROMPT_POSITIONS`].
fn rows_go_in_a_bucket(len: usize, n: usize) -> bool {
    n == 1 || len + n <= GRAPH_PROMPT_POSITIONS
}

/// The bucket's step of `span` positions, made by `make` if there is none yet.
fn step_entry(
    steps: &mut HashMap<(usize, usize), BatchStep>,
    bucket: usize,
    span: usize,
    make: impl FnOnce() -> Result<BatchStep>,
) -> Result<&mut BatchStep> {
    Ok(match steps.entry((bucket, span)) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => e.insert(make()?),
    })
}

/// The buckets a pool of `slots` makes steps of: powers of two below `slots`, then `slots` (the
/// decode steps'), then powers of two beyond it below `prefill_rows`, then `prefill_rows` (a
/// prompt's, [`bucket`] up to `prefill_rows`).
fn warm_buckets(slots: usize, prefill_rows: usize) -> Vec<usize> {
    let below = |top: usize, from: usize| {
        std::iter::successors(Some(from), |&b| Some(b * 2)).take_while(move |&b| b < top)
    };
    let mut buckets: Vec<usize> = below(slots, 1).chain([slots]).collect();
    if prefill_rows > slots {
        let first = (slots + 1).next_power_of_two();
        buckets.extend(below(prefill_rows, first).chain([prefill_rows]));
    }
    buckets
}

/// The spans a prompt's bucket may attend over in slots of `cap` positions: powers of two from
/// [`MIN_SPAN`], then `cap`.
fn prompt_spans(cap: usize) -> Vec<usize> {
    let mut spans: Vec<usize> = std::iter::successors(Some(MIN_SPAN.min(cap)), |&s| Some(s * 2))
        .take_while(|&s| s < cap)
        .collect();
    spans.push(cap);
    spans
}

/// A step's rows over slots of one pool: each row's slot and position, each stream's span of
/// rows, and the streams as the ragged attention plans them.
struct Rows {
    slots: Vec<u32>,
    pos: Vec<u32>,
    spans: Vec<(usize, usize)>,
    streams: Vec<StreamRows>,
}

/// [`Rows`] of streams in slots of `pool` advancing by their embeddings' rows. Fails on a stream
/// with no row or one that outgrows its slot.
fn rows_of(pool: &PoolInner, streams: &[super::StreamStep<'_>]) -> Result<Rows> {
    let mut r = Rows { slots: Vec::new(), pos: Vec::new(), spans: Vec::new(), streams: Vec::new() };
    for s in streams {
        let (len, n) = (s.cache.len(), s.embeds.dim(0)?);
        if n == 0 {
            candle_core::bail!("a stream step needs at least one new position");
        }
        if len + n > pool.cap {
            candle_core::bail!(
                "a stream's slot holds {} positions; {} do not fit",
                pool.cap,
                len + n
            );
        }
        let slot = s.cache.slot.as_ref().expect("in the pool").index as u32;
        r.streams.push(StreamRows { start: r.slots.len(), n, slot: slot as usize, first: len });
        r.spans.push((r.slots.len(), n));
        r.slots.extend(std::iter::repeat_n(slot, n));
        r.pos.extend((len..len + n).map(|p| p as u32));
    }
    Ok(r)
}

impl Decoder {
    /// A step where some streams hold slots of `pool`: those in one batch (one-position steps, and
    /// with ragged prefill the prompt chunks too), the others op by op beside it.
    pub(super) fn forward_slots(
        &self,
        pool: &Arc<PoolInner>,
        streams: &mut [super::StreamStep<'_>],
    ) -> Result<Vec<Tensor>> {
        use super::StreamStep;
        // (a lone stream in a slot prefilling runs op by op: measured no faster batched; as rows
        // of a bucket's graph it runs at the graph's priority, `prefill_graph_rows`)
        let prefill_bucket = self.prefill_graph_rows.max(pool.slots);
        let in_graph = self.in_one_bucket(pool, streams);
        let ragged = in_graph
            || (self.ragged && streams.iter().filter(|s| in_slots_of(s, pool)).count() > 1);
        let joins =
            |s: &StreamStep<'_>| if ragged { in_slots_of(s, pool) } else { in_pool(s, pool) };
        if !streams.iter().any(&joins) {
            return self.forward_eager(streams);
        }
        let mut batched = Vec::new();
        let mut rest = Vec::new();
        let mut order = Vec::with_capacity(streams.len());
        for s in streams.iter_mut() {
            let one = StreamStep { cache: &mut *s.cache, embeds: s.embeds.clone() };
            if joins(&one) {
                order.push((true, batched.len()));
                batched.push(one);
            } else {
                order.push((false, rest.len()));
                rest.push(one);
            }
        }
        let a = if batched.iter().all(|s| in_pool(s, pool)) {
            self.decode_batch(pool, &mut batched)?
        } else if in_graph {
            self.step_rows(pool, &mut batched, prefill_bucket)?
        } else {
            self.ragged_batch(pool, &mut batched)?
        };
        let b = self.forward_eager(&mut rest)?;
        Ok(order
            .into_iter()
            .map(|(fast, i)| if fast { a[i].clone() } else { b[i].clone() })
            .collect())
    }

    /// Whether a step of `streams` runs as the rows of one bucket's step
    /// ([`Decoder::set_prefill_graph_rows`]): every stream in slots of one pool, their rows within
    /// the largest bucket, every prompt chunk short enough ([`rows_go_in_a_bucket`]).
    pub fn rows_fit_a_bucket(&self, streams: &[super::StreamStep<'_>]) -> bool {
        pool_of_slots(streams).is_some_and(|pool| self.in_one_bucket(&pool, streams))
    }

    fn in_one_bucket(&self, pool: &Arc<PoolInner>, streams: &[super::StreamStep<'_>]) -> bool {
        let rows: usize = streams.iter().map(|s| s.embeds.dim(0).unwrap_or(1)).sum();
        self.prefill_graph_rows > 0
            && self.mode == DecodeMode::Graph
            && rows <= self.prefill_graph_rows.max(pool.slots)
            && streams.iter().all(|s| {
                in_slots_of(s, pool)
                    && rows_go_in_a_bucket(s.cache.len(), s.embeds.dim(0).unwrap_or(1))
            })
    }

    /// Streams in slots of `pool` advancing by any number of positions (prompt chunks beside
    /// one-position steps) as one batch of rows: row r is a position of its stream, its K/V go to
    /// the stream's slot at that position before attention reads the positions up to it, so a
    /// prompt chunk attends causally within itself. The same kernels as the decode step, run op by
    /// op over the step's rows (no bucket, no graph): one set of launches for every stream of the
    /// step, where the op-by-op path attended stream by stream.
    pub(super) fn ragged_batch(
        &self,
        pool: &PoolInner,
        streams: &mut [super::StreamStep<'_>],
    ) -> Result<Vec<Tensor>> {
        let Rows { slots, pos, spans, streams: rows_of } = rows_of(pool, streams)?;
        let rows: Vec<&Tensor> = streams.iter().map(|s| &s.embeds).collect();
        let x = if rows.len() == 1 { rows[0].contiguous()? } else { Tensor::cat(&rows, 0)? }
            .to_dtype(self.dtype)?;
        let max_pos = pos.iter().max().map(|&p| p as usize);
        let slots = Tensor::new(slots.as_slice(), &self.device)?;
        let pos = Tensor::new(pos.as_slice(), &self.device)?;
        let plan = RaggedPlan::new(&rows_of, self.cfg.num_heads, self.dtype, &self.device)?;
        let h = self.run_layers(x, |li, attn, h| {
            let attention = match &plan {
                Some(plan) => RowAttention::Plan(plan),
                None => RowAttention::Kernel { max_pos },
            };
            attn.forward_batch(h, &self.rope, &pool.layers[li], &slots, &pos, attention)
        })?;
        for (s, &(_, n)) in streams.iter_mut().zip(&spans) {
            s.cache.advance(n);
        }
        spans.iter().map(|&(start, n)| h.narrow(0, start, n)).collect()
    }
}

/// How a batched step's rows attend: all through the decode kernel (`max_pos`: the highest
/// position of any row, when known on the host, not in a graph), or by a ragged step's plan.
pub(super) enum RowAttention<'a> {
    Kernel { max_pos: Option<usize> },
    Plan(&'a RaggedPlan),
}

impl Attention {
    /// One position of each row's stream over its slot of the pool `kv` (`[slots + 1, hkv, cap,
    /// d]` each), or a ragged step's rows: the new K/V go to the rows' positions, attention reads
    /// the positions up to each row.
    pub(super) fn forward_batch(
        &self,
        x: &Tensor,
        rope: &Rope,
        kv: &(Tensor, Tensor),
        slots: &Tensor,
        pos: &Tensor,
        attention: RowAttention<'_>,
    ) -> Result<Tensor> {
        let (d, hq, hkv) = (self.head_dim, self.num_heads, self.num_kv_heads);
        let b = x.dim(0)?;
        let qkv = self.qkv_proj.forward(x)?.reshape((b, hq + 2 * hkv, d))?;
        let heads = qk_norm_rope_store_batch(
            &qkv,
            hq,
            hkv,
            self.qk_norm.as_ref(),
            self.eps,
            rope,
            slots,
            pos,
            &kv.0,
            &kv.1,
        )?;
        let o = match attention {
            RowAttention::Kernel { max_pos } => {
                decode_attention_batch(&heads, hq, hkv, &kv.0, &kv.1, slots, pos, max_pos)?
            }
            RowAttention::Plan(plan) => plan.attend(&heads, hq, hkv, &kv.0, &kv.1, slots, pos)?,
        };
        self.o_proj.forward(&o.reshape((b, hq * d))?)
    }
}

#[cfg(test)]
#[path = "batch_tests.rs"]
mod tests;
