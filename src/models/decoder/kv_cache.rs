//! [`KvCache`]: one stream's keys and values, layer by layer, in buffers that grow by doubling or
//! in a pool slot's views.

use candle_core::{DType, Device, Result, Tensor};

use super::{batch, StaticStep};

/// Per-stream KV cache of one decoder stack: for every layer, K and V as `[kv_heads, len,
/// head_dim]` in a buffer that grows by doubling.
///
/// Not `Clone`: appends write into the buffer in place, so two owners would corrupt each other.
#[derive(Debug)]
pub struct KvCache {
    pub(super) layers: Vec<Option<(Tensor, Tensor)>>,
    pub(super) len: usize,
    /// The fixed-address buffers (and, on CUDA, the captured graph) of this stream's one-token
    /// decode step, for the current capacity; see [`DecodeMode`](super::DecodeMode).
    pub(super) step: Option<StaticStep>,
    /// The pool slot these buffers are views of (see [`SlotPool`](super::SlotPool)); such a cache
    /// never grows.
    pub(super) slot: Option<batch::SlotLease>,
}

impl KvCache {
    pub fn new(num_layers: usize) -> Self {
        Self { layers: (0..num_layers).map(|_| None).collect(), len: 0, step: None, slot: None }
    }

    /// Positions held (= the position of the next token).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets everything; the buffers are released.
    pub fn reset(&mut self) {
        self.step = None;
        if self.slot.is_some() {
            self.len = 0;
            return;
        }
        for l in self.layers.iter_mut() {
            *l = None;
        }
        self.len = 0;
        self.step = None;
    }

    /// Marks `n` more positions as held, once every layer has appended them.
    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }

    /// Drops the positions from `len` on (keeps the buffers).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// A deep copy of the first `len` positions, in buffers with room for `headroom` more (the
    /// copy and this cache never share storage).
    pub fn copy_prefix(&self, len: usize, headroom: usize) -> Result<Self> {
        let len = len.min(self.len);
        let cap = (len + headroom).max(64).next_multiple_of(64);
        let layers = self
            .layers
            .iter()
            .map(|l| {
                l.as_ref()
                    .map(|(k, v)| -> Result<(Tensor, Tensor)> {
                        let (h, _, d) = k.dims3()?;
                        let nk = Tensor::zeros((h, cap, d), k.dtype(), k.device())?;
                        let nv = Tensor::zeros((h, cap, d), v.dtype(), v.device())?;
                        if len > 0 {
                            nk.slice_set(&k.narrow(1, 0, len)?.contiguous()?, 1, 0)?;
                            nv.slice_set(&v.narrow(1, 0, len)?.contiguous()?, 1, 0)?;
                        }
                        Ok((nk, nv))
                    })
                    .transpose()
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { layers, len, step: None, slot: None })
    }

    /// Replaces this cache's contents with the first `len` positions of `src`, copied into this
    /// cache's own buffers (grown only if they are too small), so that a captured decode step of
    /// this cache stays valid.
    pub fn load_prefix(&mut self, src: &KvCache, len: usize) -> Result<()> {
        let len = len.min(src.len);
        self.len = 0;
        for (li, l) in src.layers.iter().enumerate() {
            let Some((k, v)) = l else { continue };
            let (h, _, d) = k.dims3()?;
            let (bk, bv) = self.reserve(li, len, (h, d), k.dtype(), k.device())?;
            if len > 0 {
                bk.slice_set(&k.narrow(1, 0, len)?.contiguous()?, 1, 0)?;
                bv.slice_set(&v.narrow(1, 0, len)?.contiguous()?, 1, 0)?;
            }
        }
        self.len = len;
        Ok(())
    }

    /// Bytes held by the buffers (capacity, not length).
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(|(k, v)| (k.elem_count() + v.elem_count()) * k.dtype().size_in_bytes())
            .sum()
    }

    /// Makes `layer`'s buffers hold at least `need` positions (growing by doubling, the held
    /// positions copied over).
    pub(super) fn reserve(
        &mut self,
        layer: usize,
        need: usize,
        shape: (usize, usize),
        dtype: DType,
        dev: &Device,
    ) -> Result<&(Tensor, Tensor)> {
        let (h, d) = shape;
        let slot = &mut self.layers[layer];
        let cap = slot.as_ref().map(|(k, _)| k.dim(1)).transpose()?.unwrap_or(0);
        if need > cap && self.slot.is_some() {
            candle_core::bail!("the stream's slot holds {cap} positions; {need} do not fit");
        }
        if need > cap {
            let new_cap = need.max(cap * 2).max(64).next_multiple_of(64);
            let nk = Tensor::zeros((h, new_cap, d), dtype, dev)?;
            let nv = Tensor::zeros((h, new_cap, d), dtype, dev)?;
            if let Some((ok, ov)) = slot.as_ref() {
                if self.len > 0 {
                    nk.slice_set(&ok.narrow(1, 0, self.len)?.contiguous()?, 1, 0)?;
                    nv.slice_set(&ov.narrow(1, 0, self.len)?.contiguous()?, 1, 0)?;
                }
            }
            *slot = Some((nk, nv));
        }
        Ok(slot.as_ref().expect("allocated above"))
    }

    /// Writes `k`, `v` (`[kv_heads, n, head_dim]`) of `layer` at position `self.len` and returns
    /// views of the whole history including them.
    pub(crate) fn append(
        &mut self,
        layer: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let (h, n, d) = k.dims3()?;
        let need = self.len + n;
        let at = self.len;
        let (bk, bv) = self.reserve(layer, need, (h, d), k.dtype(), k.device())?;
        bk.slice_set(&k.contiguous()?, 1, at)?;
        bv.slice_set(&v.contiguous()?, 1, at)?;
        Ok((bk.narrow(1, 0, need)?, bv.narrow(1, 0, need)?))
    }

    /// The capacity the static decode step (and its graph) was made for, if there is one.
    pub fn decode_step_capacity(&self) -> Option<usize> {
        self.step.as_ref().map(|s| s.cap)
    }

    /// The positions this cache can ever hold, when it cannot grow (a pool slot's views).
    pub fn fixed_capacity(&self) -> Option<usize> {
        self.slot.as_ref().map(|_| self.capacity())
    }

    /// Capacity of the buffers (positions), 0 before the first append.
    pub fn capacity(&self) -> usize {
        self.layers.iter().flatten().map(|(k, _)| k.dim(1).unwrap_or(0)).min().unwrap_or(0)
    }
}
