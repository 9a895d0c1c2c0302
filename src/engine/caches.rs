//! Where a stage's streams get their KV caches: a slot of the stage's [`SlotPool`] (allocated at
//! start-up; streams in slots decode in one batched step, a CUDA graph per batch size), or, when
//! every slot is taken or a stream needs more positions than a slot holds, a cache of the
//! [`CachePool`] (a stream of its own, decoded beside the batch).

use anyhow::{Context, Result};

use antiphon_models::decoder::{CachePool, DecodeMode, Decoder, PooledCache, SlotPool};

pub struct StageCaches {
    pooled: CachePool,
    slots: Option<SlotPool>,
}

impl StageCaches {
    /// `slots` streams of `slot_context` positions (clamped to the model's context; 0 slots: none),
    /// and a pool of `pooled` idle caches rounded to `quantum` positions, holding at most
    /// `idle_bytes` together. With a batched decode mode, every batch size's step is captured now,
    /// so no request pays a capture.
    pub fn new(
        dec: &Decoder,
        pooled: usize,
        quantum: usize,
        idle_bytes: usize,
        slots: usize,
        slot_context: usize,
    ) -> Result<Self> {
        let slots = if slots == 0 {
            None
        } else {
            let ctx = slot_context.min(dec.config().max_positions);
            let pool = dec
                .slot_pool(slots, ctx)
                .with_context(|| format!("allocating {slots} KV slots of {ctx} positions"))?;
            if dec.decode_mode() != DecodeMode::Eager {
                dec.warm_pool(&pool).context("capturing the batched decode steps")?;
            }
            tracing::info!(slots, positions = ctx, mib = pool.bytes() >> 20, "KV slot pool");
            Some(pool)
        };
        Ok(Self { pooled: CachePool::with_budget(pooled, quantum, idle_bytes), slots })
    }

    /// An empty cache with room for `need` positions.
    pub fn take(&self, dec: &Decoder, need: usize) -> Result<PooledCache> {
        if let Some(pool) = self.slots.as_ref().filter(|p| need <= p.capacity()) {
            if let Some(c) = pool.take()? {
                return Ok(PooledCache::alone(c));
            }
        }
        Ok(self.pooled.take(dec, need)?)
    }
}
