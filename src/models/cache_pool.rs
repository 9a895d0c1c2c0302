//! A pool of finished streams' KV caches, for the next streams: a cache keeps its buffers and
//! its captured decode step (see [`crate::decoder::DecodeMode`]), so a stream that starts
//! in a pooled cache replays its predecessor's graph instead of capturing its own.

use candle_core::Result;

use super::decoder::{Decoder, KvCache};

/// Caches of finished streams, kept with their buffers and their captured decode step for the
/// next streams: a CUDA graph is bound to its cache's buffers, so a stream that starts in a pooled
/// cache replays the graph its predecessor captured instead of capturing its own.
#[derive(Clone)]
pub struct CachePool {
    inner: std::sync::Arc<std::sync::Mutex<Vec<KvCache>>>,
    max: usize,
    /// New caches get a capacity rounded up to this many positions, so that they fit later streams.
    quantum: usize,
    /// The idle caches hold at most this many bytes together.
    max_bytes: usize,
}

impl CachePool {
    /// Keeps at most `max` idle caches (0: no pooling).
    pub fn new(max: usize) -> Self {
        Self::with_quantum(max, 256)
    }

    /// As [`CachePool::new`], new caches' capacities rounded up to `quantum` positions.
    pub fn with_quantum(max: usize, quantum: usize) -> Self {
        Self::with_budget(max, quantum, usize::MAX)
    }

    /// As [`CachePool::with_quantum`], the idle caches holding at most `max_bytes` together: a
    /// cache that would pass it is freed, smaller ones first kept.
    pub fn with_budget(max: usize, quantum: usize, max_bytes: usize) -> Self {
        Self { inner: Default::default(), max, quantum: quantum.max(1), max_bytes }
    }

    /// Bytes the idle caches hold.
    pub fn idle_bytes(&self) -> usize {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).iter().map(KvCache::bytes).sum()
    }

    /// Idle caches held.
    pub fn idle(&self) -> usize {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// An empty cache with room for `need` positions: the smallest idle one that fits, or a new
    /// one (its capacity rounded up to the pool's quantum). It returns to the pool when dropped.
    pub fn take(&self, dec: &Decoder, need: usize) -> Result<PooledCache> {
        let found = {
            let mut free = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            let best = free
                .iter()
                .enumerate()
                .filter(|(_, c)| c.capacity() >= need)
                .min_by_key(|(_, c)| c.capacity())
                .map(|(i, _)| i);
            best.map(|i| free.swap_remove(i))
        };
        let cache = match found {
            Some(c) => c,
            None if self.max == 0 => dec.new_cache(),
            None => dec.cache_with_capacity(need.max(1).next_multiple_of(self.quantum))?,
        };
        Ok(PooledCache { cache, pool: (self.max > 0).then(|| self.clone()) })
    }

    fn give(&self, mut c: KvCache) {
        if c.capacity() == 0 {
            return;
        }
        c.truncate(0);
        let mut free = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if free.len() < self.max {
            free.push(c);
        } else if let Some(i) = free
            .iter()
            .enumerate()
            .filter(|(_, f)| f.capacity() < c.capacity())
            .min_by_key(|(_, f)| f.capacity())
            .map(|(i, _)| i)
        {
            // full: the larger cache stays (it fits more streams)
            free[i] = c;
        }
        // within the byte budget: the largest go first
        while free.iter().map(KvCache::bytes).sum::<usize>() > self.max_bytes {
            let Some(i) = free.iter().enumerate().max_by_key(|(_, f)| f.bytes()).map(|(i, _)| i)
            else {
                break;
            };
            free.swap_remove(i);
        }
    }
}

/// A stream's cache taken from a [`CachePool`] (or standing alone); back to its pool on drop.
pub struct PooledCache {
    cache: KvCache,
    pool: Option<CachePool>,
}

impl PooledCache {
    /// A cache that belongs to no pool.
    pub fn alone(cache: KvCache) -> Self {
        Self { cache, pool: None }
    }
}

impl std::ops::Deref for PooledCache {
    type Target = KvCache;
    fn deref(&self) -> &KvCache {
        &self.cache
    }
}

impl std::ops::DerefMut for PooledCache {
    fn deref_mut(&mut self) -> &mut KvCache {
        &mut self.cache
    }
}

impl Drop for PooledCache {
    fn drop(&mut self) {
        if let Some(p) = self.pool.take() {
            p.give(std::mem::replace(&mut self.cache, KvCache::new(0)));
        }
    }
}
