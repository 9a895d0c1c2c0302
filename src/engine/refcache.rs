//! Code2Wav's reference caches.
//!
//! [`RefCache`]: content-addressed LRU of prepared references (key = the normalized audio's hash).
//! An entry has **owners** (live requests whose chunk 0 used it) and **pins** (requests whose
//! reference was prefetched and whose chunk 0 has not come yet), kept in separate sets so that
//! releasing one can never release the other; an entry is evictable only with neither.
//!
//! [`SetupCache`]: the flow's setup caches for the most recent references (default 1 entry).

use std::collections::{HashMap, HashSet};

use antiphon_models::code2wav::flow::FlowState;
use antiphon_models::code2wav::prompt::{PromptFeatures, Reference};

use super::types::RequestId;

#[derive(Debug)]
pub struct Entry {
    pub reference: Reference,
    pub features: Option<PromptFeatures>,
    pub owners: HashSet<RequestId>,
    pub pins: HashSet<RequestId>,
    last_used: u64,
}

impl Entry {
    pub fn evictable(&self) -> bool {
        self.owners.is_empty() && self.pins.is_empty()
    }
}

#[derive(Debug, Default)]
pub struct RefCache {
    capacity: usize,
    entries: HashMap<String, Entry>,
    clock: u64,
}

impl RefCache {
    pub fn new(capacity: usize) -> Self {
        Self { capacity, ..Default::default() }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    pub fn get(&self, key: &str) -> Option<&Entry> {
        self.entries.get(key)
    }

    /// The entry for `reference` (created empty if absent), marked most recently used.
    pub fn entry(&mut self, reference: Reference) -> &mut Entry {
        let t = self.tick();
        let e = self.entries.entry(reference.key.clone()).or_insert_with(|| Entry {
            reference,
            features: None,
            owners: HashSet::new(),
            pins: HashSet::new(),
            last_used: t,
        });
        e.last_used = t;
        e
    }

    pub fn entry_mut(&mut self, key: &str) -> Option<&mut Entry> {
        let t = self.tick();
        let e = self.entries.get_mut(key)?;
        e.last_used = t;
        Some(e)
    }

    /// Pins held across all entries.
    pub fn pin_count(&self) -> usize {
        self.entries.values().map(|e| e.pins.len()).sum()
    }

    /// The key `req` has pinned, if any.
    pub fn pinned_by(&self, req: &RequestId) -> Option<String> {
        self.entries.iter().find(|(_, e)| e.pins.contains(req)).map(|(k, _)| k.clone())
    }

    pub fn pin(&mut self, key: &str, req: &RequestId) {
        if let Some(e) = self.entry_mut(key) {
            e.pins.insert(req.clone());
        }
    }

    pub fn own(&mut self, key: &str, req: &RequestId) {
        if let Some(e) = self.entry_mut(key) {
            e.owners.insert(req.clone());
        }
    }

    /// Drops `req`'s pins only (its ownerships stay).
    pub fn unpin(&mut self, req: &RequestId) {
        for e in self.entries.values_mut() {
            e.pins.remove(req);
        }
    }

    /// Drops everything `req` holds (end of the request), then trims.
    pub fn release(&mut self, req: &RequestId) -> Vec<String> {
        for e in self.entries.values_mut() {
            e.owners.remove(req);
            e.pins.remove(req);
        }
        self.trim()
    }

    /// Removes an entry now if nobody holds it; returns whether it went.
    pub fn evict(&mut self, key: &str) -> bool {
        if self.entries.get(key).is_some_and(Entry::evictable) {
            self.entries.remove(key);
            true
        } else {
            false
        }
    }

    /// Evicts least-recently-used evictable entries beyond capacity; returns their keys.
    pub fn trim(&mut self) -> Vec<String> {
        let mut gone = Vec::new();
        while self.entries.len() > self.capacity {
            let victim = self
                .entries
                .iter()
                .filter(|(_, e)| e.evictable())
                .min_by_key(|(_, e)| e.last_used)
                .map(|(k, _)| k.clone());
            match victim {
                Some(k) => {
                    self.entries.remove(&k);
                    gone.push(k);
                }
                None => break,
            }
        }
        gone
    }
}

/// Setup caches of the most recently set-up references (LRU, `capacity` entries).
#[derive(Debug, Default)]
pub struct SetupCache {
    capacity: usize,
    entries: Vec<(String, FlowState)>,
}

impl SetupCache {
    pub fn new(capacity: usize) -> Self {
        Self { capacity, entries: Vec::new() }
    }

    pub fn get(&mut self, key: &str) -> Option<FlowState> {
        let i = self.entries.iter().position(|(k, _)| k == key)?;
        let e = self.entries.remove(i);
        let state = e.1.clone();
        self.entries.push(e);
        Some(state)
    }

    pub fn contains(&self, key: &str) -> bool {
        self.entries.iter().any(|(k, _)| k == key)
    }

    /// The most setup states kept.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn put(&mut self, key: String, state: FlowState) {
        if self.capacity == 0 {
            return;
        }
        self.entries.retain(|(k, _)| *k != key);
        self.entries.push((key, state));
        while self.entries.len() > self.capacity {
            self.entries.remove(0);
        }
    }

    pub fn remove(&mut self, key: &str) {
        self.entries.retain(|(k, _)| k != key);
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(n: u8) -> Reference {
        Reference { samples: vec![n as f32], key: format!("key{n}") }
    }

    fn id(s: &str) -> RequestId {
        RequestId(s.into())
    }

    #[test]
    fn lru_evicts_only_unheld_entries() {
        let mut c = RefCache::new(2);
        c.entry(r(1));
        c.entry(r(2));
        c.own("key1", &id("a"));
        c.entry(r(3)); // over capacity; key2 is the LRU evictable one
        assert_eq!(c.trim(), vec!["key2".to_string()]);
        c.pin("key3", &id("b"));
        c.entry(r(4));
        // key1 (owned) and key3 (pinned) are held: the unheld key4 is the one to go
        assert_eq!(c.trim(), vec!["key4".to_string()]);
        assert_eq!(c.len(), 2);
        // with every entry held, the cache holds more than its capacity rather than drop one
        c.entry(r(5));
        c.own("key5", &id("c"));
        assert!(c.trim().is_empty(), "held entries stay even beyond capacity");
        assert_eq!(c.len(), 3);
        assert!(c.get("key1").is_some() && c.get("key3").is_some());
    }

    #[test]
    fn owners_and_pins_cannot_release_each_other() {
        let mut c = RefCache::new(1);
        c.entry(r(1));
        // a request pins; another request whose id is spelled like a pin key owns the same entry
        c.pin("key1", &id("req-7"));
        c.own("key1", &id("pin:req-7"));
        c.own("key1", &id("req-7x"));
        c.unpin(&id("pin:req-7"));
        assert!(
            c.get("key1").unwrap().pins.contains(&id("req-7")),
            "unpinning another id leaves the pin"
        );
        c.release(&id("req-7"));
        let e = c.get("key1").unwrap();
        assert!(e.pins.is_empty());
        assert_eq!(e.owners.len(), 2, "releasing the pinning request leaves the owners");
        assert!(!c.evict("key1"));
        c.release(&id("pin:req-7"));
        c.release(&id("req-7x"));
        assert!(c.evict("key1"));
    }

    #[test]
    fn setup_cache_keeps_the_most_recent() {
        use antiphon_assets::synth::{code2wav_in_memory, Preset};
        // FlowState values are only moved around here; a real one is cheap at the tiny size
        let c2w =
            code2wav_in_memory(Preset::Tiny, 1, candle_core::DType::F32, &candle_core::Device::Cpu)
                .unwrap();
        let x: Vec<f32> = (0..16000).map(|i| (i as f32 * 0.01).sin() * 0.2).collect();
        let f = c2w.prepare(&Reference::materialize(&x, 16000).unwrap()).unwrap();
        let st = c2w.setup(&f).unwrap();
        let mut s = SetupCache::new(1);
        s.put("a".into(), st.clone());
        s.put("b".into(), st.clone());
        assert!(!s.contains("a") && s.contains("b"));
        assert!(s.get("b").is_some());
        let mut none = SetupCache::new(0);
        none.put("a".into(), st);
        assert!(none.is_empty());
    }
}
