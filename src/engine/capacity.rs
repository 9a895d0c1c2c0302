//! Capacity from memory: how many streams one GPU holds.
//!
//! A stream (a turn reply from the Thinker to its last audio, or a duplex session) holds a KV slot
//! of the Thinker and of the Talker and a flow slot of Code2Wav for as long as it plays
//! (admission.rs), and a stream without one would run beside the batched step and slow every
//! stream down. The slot pools are allocated once, at start-up. With
//! `engine.streams_from_memory` their size comes from the device's free memory then (after the
//! weights), not from a fixed count: as many streams as fit beside the memory the engine needs for
//! everything else, at most the configured slots. So one configuration fills an H200 and still
//! starts on a card with half its memory, with fewer places.
//!
//! What is kept beside the slots: `memory_headroom_mib` (activations, CUDA graphs, the voices'
//! setups), the prefix store's budget (`thinker.prefix_mib`), the idle caches' budget of the
//! Thinker and of the Talker (`idle_cache_mib` each), and each pool's scratch slot.

use antiphon_models::Models;
use anyhow::Result;

use super::EngineConfig;

/// What one stream's slots take of the device's memory, per stage (0 for a stage without slots).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamBytes {
    pub thinker: u64,
    pub talker: u64,
    pub code2wav: u64,
}

impl StreamBytes {
    pub fn total(&self) -> u64 {
        self.thinker + self.talker + self.code2wav
    }
}

/// How the streams were sized, for the log and the tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sizing {
    /// The device's free memory when the engine started (bytes).
    pub free: u64,
    /// What is kept beside the slots (bytes; the scratch slots included).
    pub reserve: u64,
    pub per_stream: StreamBytes,
    /// The streams the configuration asked for at most (its fewest slots of a stage).
    pub asked: usize,
    /// The streams that fit, at most `asked`: every stage's slots now.
    pub streams: usize,
}

/// The memory kept beside the slots, in bytes (each pool's scratch slot included).
pub fn reserve_bytes(cfg: &EngineConfig, per_stream: &StreamBytes) -> u64 {
    let mib = cfg.memory_headroom_mib + cfg.thinker.prefix_mib + 2 * cfg.idle_cache_mib;
    ((mib as u64) << 20) + per_stream.total()
}

/// Streams of `per_stream` bytes that fit in `free` bytes beside `reserve`, at most `at_most`.
pub fn streams_that_fit(free: u64, reserve: u64, per_stream: u64, at_most: usize) -> usize {
    if per_stream == 0 {
        return at_most;
    }
    let fit = free.saturating_sub(reserve) / per_stream;
    usize::try_from(fit).unwrap_or(usize::MAX).min(at_most)
}

/// Sizes every stage's slots (and the batches and the stream limit that follow them) to the
/// streams that fit in `free` bytes; `call_headroom` keeps its share of the places. An error when
/// not one fits: the engine cannot serve on this device with this configuration, and says what it
/// would need.
pub fn size_streams(
    cfg: &mut EngineConfig,
    free: u64,
    per_stream: StreamBytes,
) -> Result<Sizing, String> {
    let asked = [cfg.thinker.slots, cfg.talker.slots, cfg.code2wav.slots]
        .into_iter()
        .filter(|&n| n > 0)
        .min()
        .unwrap_or(0);
    let reserve = reserve_bytes(cfg, &per_stream);
    if asked == 0 {
        return Ok(Sizing { free, reserve, per_stream, asked, streams: 0 });
    }
    let streams = streams_that_fit(free, reserve, per_stream.total(), asked);
    if streams == 0 {
        return Err(format!(
            "engine.streams_from_memory: {} MiB free on the device hold no stream ({} MiB a \
            stream beside {} MiB kept for the rest: \
            engine.memory_headroom_mib, thinker_prefix_mib and idle_cache_mib twice); lower \
            those, or the slots' context",
            free >> 20,
            per_stream.total() >> 20,
            reserve >> 20
        ));
    }
    for slots in [&mut cfg.thinker.slots, &mut cfg.talker.slots, &mut cfg.code2wav.slots] {
        if *slots > 0 {
            *slots = streams;
        }
    }
    for batch in
        [&mut cfg.thinker.max_batch, &mut cfg.talker.max_batch, &mut cfg.code2wav.max_batch]
    {
        *batch = (*batch).min(streams);
    }
    cfg.code2wav.early_batch = cfg.code2wav.early_batch.min(streams);
    if let Some(m) = cfg.max_streams.as_mut() {
        *m = (*m).min(streams);
    }
    // the places kept for admitted calls' next turns: the same share of fewer places
    cfg.call_headroom = (cfg.call_headroom * streams).div_ceil(asked);
    Ok(Sizing { free, reserve, per_stream, asked, streams })
}

/// `engine.streams_from_memory`: every stage's slots as many as the GPU's free memory holds now
/// (capacity.rs), when the stages share one GPU; otherwise the slots as configured.
pub(crate) fn size_streams_from_memory(models: &Models, cfg: &mut EngineConfig) -> Result<()> {
    let (d0, d1, d2) = (
        models.thinker.llm.decoder().device(),
        models.talker.decoder().device(),
        models.code2wav.device(),
    );
    let Some(free) = antiphon_models::gpu::free_memory(d0) else {
        tracing::info!("engine.streams_from_memory: not on a GPU; the slots as configured");
        return Ok(());
    };
    // (each stage may have a stream of its own on the one GPU: its own `Device`, the same card)
    if !(d0.location() == d1.location() && d0.location() == d2.location()) {
        tracing::warn!(
            "engine.streams_from_memory: the stages are on different GPUs; the slots as configured"
        );
        return Ok(());
    }
    let bytes = |slots: usize, b: usize| if slots > 0 { b as u64 } else { 0 };
    let thinker = models.thinker.llm.decoder();
    let talker = models.talker.decoder();
    let per_stream = StreamBytes {
        thinker: bytes(
            cfg.thinker.slots,
            thinker.slot_bytes(cfg.thinker.slot_context.min(thinker.config().max_positions)),
        ),
        talker: bytes(
            cfg.talker.slots,
            talker.slot_bytes(cfg.talker.slot_context.min(talker.config().max_positions)),
        ),
        code2wav: bytes(cfg.code2wav.slots, models.code2wav.slot_bytes(cfg.code2wav.slot_frames)),
    };
    let s = size_streams(cfg, free, per_stream).map_err(anyhow::Error::msg)?;
    tracing::info!(
        free_mib = s.free >> 20,
        kept_mib = s.reserve >> 20,
        stream_mib = s.per_stream.total() >> 20,
        asked = s.asked,
        streams = s.streams,
        "engine.streams_from_memory: the slots of every stage"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn gpu_config() -> EngineConfig {
        EngineConfig::default().with(|c| {
            c.thinker.slots = 64;
            c.talker.slots = 64;
            c.code2wav.slots = 64;
            c.thinker.max_batch = 64;
            c.talker.max_batch = 64;
            c.code2wav.max_batch = 64;
            c.code2wav.early_batch = 64;
            c.thinker.prefix_mib = 8192;
            c.idle_cache_mib = 8192;
            c.memory_headroom_mib = 16384;
            c.streams_from_memory = true;
            c.call_headroom = 4;
        })
    }

    /// The full-size model's slots (the H200's log: 37440 and 15600 MiB for 64 slots and a
    /// scratch one each; the flow's 480 positions).
    fn full_size() -> StreamBytes {
        StreamBytes { thinker: 576 * MIB, talker: 240 * MIB, code2wav: 300 * MIB }
    }

    #[test]
    fn a_card_with_half_the_memory_gets_fewer_places_and_a_large_one_what_was_asked() {
        // an H200 after the weights: ~120 GiB free, every stream asked for fits
        let mut big = gpu_config();
        let s = size_streams(&mut big, 120 * 1024 * MIB, full_size()).unwrap();
        assert_eq!((s.asked, s.streams), (64, 64));
        assert_eq!(
            (big.thinker.slots, big.talker.slots, big.code2wav.slots, big.thinker.max_batch),
            (64, 64, 64, 64)
        );
        // an H100 after the weights: ~60 GiB free; kept: 16 GiB of headroom, the prefix store's
        // 8 and the idle caches' 2 × 8, and a scratch slot of each pool (1116 MiB)
        let mut small = gpu_config();
        let s = size_streams(&mut small, 60 * 1024 * MIB, full_size()).unwrap();
        assert_eq!(s.reserve, (40 * 1024 + 1116) * MIB);
        let expect = ((60 * 1024 - 40 * 1024 - 1116) / 1116) as usize;
        assert_eq!(s.streams, expect);
        assert!((10..64).contains(&s.streams), "{s:?}");
        assert_eq!(
            (small.thinker.slots, small.talker.slots, small.code2wav.slots),
            (expect, expect, expect)
        );
        assert_eq!(
            (
                small.thinker.max_batch,
                small.talker.max_batch,
                small.code2wav.max_batch,
                small.code2wav.early_batch
            ),
            (expect, expect, expect, expect)
        );
        assert_eq!(small.stream_places(), expect, "admission follows the slots");
        assert_eq!(
            (big.call_headroom, small.call_headroom),
            (4, (4 * expect).div_ceil(64)),
            "the same share of the places"
        );
    }

    #[test]
    fn a_stage_without_slots_stays_without_and_a_set_stream_limit_is_never_raised() {
        let mut cfg = gpu_config().with(|c| {
            c.code2wav.slots = 0;
            c.max_streams = Some(40);
        });
        let s = size_streams(&mut cfg, 80 * 1024 * MIB, StreamBytes { code2wav: 0, ..full_size() })
            .unwrap();
        assert_eq!(cfg.code2wav.slots, 0);
        assert_eq!(cfg.thinker.slots, s.streams);
        assert_eq!(cfg.max_streams, Some(40.min(s.streams)));
    }

    #[test]
    fn a_device_that_holds_no_stream_is_an_error_that_names_the_keys() {
        let mut cfg = gpu_config();
        let before = cfg.thinker.slots;
        let e = size_streams(&mut cfg, 20 * 1024 * MIB, full_size()).unwrap_err();
        assert!(e.contains("memory_headroom_mib") && e.contains("20480 MiB free"), "{e}");
        assert_eq!(cfg.thinker.slots, before, "nothing changed");
    }

    #[test]
    fn the_fit_rounds_down_and_stops_at_what_was_asked() {
        assert_eq!(streams_that_fit(10 * MIB, 2 * MIB, 3 * MIB, 64), 2);
        assert_eq!(streams_that_fit(1000 * MIB, 0, MIB, 64), 64);
        assert_eq!(streams_that_fit(MIB, 2 * MIB, MIB, 64), 0, "less free than kept");
        assert_eq!(streams_that_fit(MIB, 0, 0, 8), 8, "nothing to allocate");
    }
}
