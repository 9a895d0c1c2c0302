//! Reference prefetch in Code2Wav, one rule per test, driving the stage step by step (no threads,
//! no timing): the double-idle rule, the busy gate, a burst prefetched together, the pin cap, phase
//! B off by default, claim / retire / inline / evict at chunk 0, failures, aborts, duplex,
//! owner/pin separation, and bit-identical chunk 0; and the Talker told after each batch.

use std::sync::{Arc, Mutex};

use antiphon_assets::synth::{code2wav_in_memory, Preset};
use antiphon_engine::chunker::Chunker;
use antiphon_engine::code2wav::{Code2WavStage, IdleOutcome};
use antiphon_engine::metric_labels::{PrefetchEvent, PrefetchSkip};
use antiphon_engine::{
    Code2WavMsg, EngineConfig, EngineEvent, EngineMetrics, RefInput, Registry, RequestId,
    StageLoop, TalkerMsg, TalkerWake,
};
use antiphon_models::code2wav::prompt::Reference;
use antiphon_models::code2wav::{Code2Wav, SILENCE_CODE};
use candle_core::{DType, Device};

fn model() -> Code2Wav {
    static M: std::sync::OnceLock<Code2Wav> = std::sync::OnceLock::new();
    M.get_or_init(|| code2wav_in_memory(Preset::Tiny, 21, DType::F32, &Device::Cpu).unwrap())
        .clone()
}

fn voice(freq: f32) -> RefInput {
    RefInput::new(
        (0..16_000 * 2)
            .map(|i| 0.3 * (i as f32 * freq / 16_000.0 * std::f32::consts::TAU).sin())
            .collect(),
        16_000,
    )
}

type Log = Arc<Mutex<Vec<EngineEvent>>>;

struct Rig {
    stage: Code2WavStage,
    registry: Registry,
    metrics: EngineMetrics,
}

impl Rig {
    fn new(cfg: EngineConfig) -> Self {
        let registry = Registry::default();
        let metrics = EngineMetrics::new();
        Self {
            stage: Code2WavStage::new(model(), Arc::new(cfg), registry.clone(), metrics.clone()),
            registry,
            metrics,
        }
    }

    fn admit(&mut self, id: &str, reference: Option<RefInput>) -> Log {
        let log: Log = Arc::default();
        let l = log.clone();
        assert!(self
            .registry
            .insert(RequestId(id.into()), Arc::new(move |e| l.lock().unwrap().push(e))));
        self.stage
            .on_message(Code2WavMsg::Placeholder { id: RequestId(id.into()), prefetch: reference });
        log
    }

    fn chunk(
        &mut self,
        id: &str,
        seq: usize,
        codes: Vec<u32>,
        last: bool,
        reference: Option<RefInput>,
    ) {
        self.stage.on_message(Code2WavMsg::Chunk {
            id: RequestId(id.into()),
            seq,
            codes,
            last,
            reference,
        });
    }

    fn idle(&mut self) -> IdleOutcome {
        self.stage.idle_step()
    }

    /// The stage tells `talker` after each batch.
    fn waking(self, talker: std::sync::mpsc::SyncSender<TalkerMsg>) -> Self {
        let Rig { stage, registry, metrics } = self;
        Rig { stage: stage.with_talker_wake(TalkerWake::new(talker)), registry, metrics }
    }
}

fn key(r: &RefInput) -> String {
    Reference::materialize(&r.samples, r.sample_rate).unwrap().key
}

fn chunk0_codes() -> Vec<u32> {
    let mut c = Chunker::new(25, 25, 3, SILENCE_CODE);
    (0..25u32).find_map(|i| c.push((i * 211 + 5) % 6561)).unwrap().codes
}

fn audio(log: &Log) -> Vec<Vec<f32>> {
    log.lock()
        .unwrap()
        .iter()
        .filter_map(|e| match e {
            EngineEvent::Audio { samples, .. } => Some(samples.clone()),
            _ => None,
        })
        .collect()
}

fn id(s: &str) -> RequestId {
    RequestId(s.into())
}

#[test]
fn prefetch_runs_only_on_an_idle_step_after_an_idle_step() {
    let mut r = Rig::new(EngineConfig::default());
    let v = voice(180.0);
    r.admit("a", Some(v.clone()));
    assert_eq!(r.idle(), IdleOutcome::Skipped(PrefetchSkip::SingleIdle));
    assert_eq!(r.idle(), IdleOutcome::PhaseA(vec![id("a")]));
    let e = r.stage.ref_cache().get(&key(&v)).unwrap();
    assert!(e.features.is_some() && e.pins.contains(&id("a")) && e.owners.is_empty());
    // a busy step resets the rule
    r.chunk("a", 0, chunk0_codes(), false, Some(v));
    assert!(r.stage.step());
    r.admit("b", Some(voice(220.0)));
    assert_eq!(r.idle(), IdleOutcome::Skipped(PrefetchSkip::SingleIdle));
    assert_eq!(r.metrics.skip_count(PrefetchSkip::SingleIdle), 2);
}

#[test]
fn prefetch_phase_b_is_off_by_default_and_on_when_asked() {
    let mut r = Rig::new(EngineConfig::default());
    r.admit("a", Some(voice(180.0)));
    r.idle();
    assert_eq!(r.idle(), IdleOutcome::PhaseA(vec![id("a")]));
    assert_eq!(r.idle(), IdleOutcome::Nothing, "phase B is off by default");
    assert!(r.stage.setup_cache().is_empty());

    let mut r = Rig::new(EngineConfig::default().with(|c| c.prefetch.setup = true));
    let v = voice(180.0);
    r.admit("a", Some(v.clone()));
    r.idle();
    assert_eq!(r.idle(), IdleOutcome::PhaseA(vec![id("a")]));
    assert_eq!(r.idle(), IdleOutcome::PhaseB(vec![id("a")]), "one phase per idle step");
    assert!(r.stage.setup_cache().contains(&key(&v)));
    assert_eq!(r.idle(), IdleOutcome::Nothing);
    // chunk 0 reuses both
    r.chunk("a", 0, chunk0_codes(), false, Some(v));
    assert!(r.stage.step());
    assert_eq!(r.metrics.prefetch_count(PrefetchEvent::Claimed), 1);
    assert_eq!(r.metrics.prefetch_count(PrefetchEvent::SetupHit), 1);
    assert_eq!(r.metrics.prefetch_count(PrefetchEvent::Inline), 0);
}

/// A burst of waiting references goes through each phase together: phase A prepares them in one
/// batch (up to the pin cap), phase B sets them up in one (up to the setup cache's room), and their
/// chunk 0s claim both, with the first audio a burst prepared at its chunk 0s gets.
#[test]
fn a_burst_of_placeholders_is_prefetched_together() {
    let (va, vb, vc) = (voice(180.0), voice(200.0), voice(240.0));
    let cfg = EngineConfig::default().with(|c| {
        c.prefetch.ref_cache_capacity = 2;
        c.prefetch.setup_cache_capacity = 1;
        c.prefetch.setup = true;
    });
    let mut r = Rig::new(cfg);
    let (la, lb) = (r.admit("a", Some(va.clone())), r.admit("b", Some(vb.clone())));
    r.admit("c", Some(vc.clone()));
    r.idle();
    assert_eq!(
        r.idle(),
        IdleOutcome::PhaseA(vec![id("a"), id("b")]),
        "both in one phase, c beyond the pin cap"
    );
    assert_eq!(r.metrics.voice_preparations.get(), 2);
    assert_eq!(r.stage.ref_cache().pin_count(), 2);
    assert_eq!(r.idle(), IdleOutcome::PhaseB(vec![id("a")]), "the setup cache holds one");
    assert_eq!(
        r.idle(),
        IdleOutcome::Skipped(PrefetchSkip::SetupCap),
        "a's state is not pushed out while a waits"
    );
    assert!(r.stage.setup_cache().contains(&key(&va)));
    r.chunk("a", 0, chunk0_codes(), false, Some(va.clone()));
    r.chunk("b", 0, chunk0_codes(), false, Some(vb.clone()));
    assert!(r.stage.step());
    assert_eq!(r.metrics.prefetch_count(PrefetchEvent::Claimed), 2);
    assert_eq!(r.metrics.prefetch_count(PrefetchEvent::SetupHit), 1);
    assert_eq!(r.metrics.prefetch_count(PrefetchEvent::Inline), 0);
    assert_eq!(r.metrics.skip_count(PrefetchSkip::SetupCap), 1);

    // the same burst prepared at its chunk 0s (no prefetch) gives the same first audio
    let mut q = Rig::new(EngineConfig::default().with(|c| c.prefetch.enabled = false));
    let (qa, qb) = (q.admit("a", Some(va.clone())), q.admit("b", Some(vb.clone())));
    q.chunk("a", 0, chunk0_codes(), false, Some(va));
    q.chunk("b", 0, chunk0_codes(), false, Some(vb));
    assert!(q.stage.step());
    assert_eq!(q.metrics.prefetch_count(PrefetchEvent::Inline), 2);
    // (a setup batch of one or of two: equal to rounding)
    for (got, want) in [(audio(&la), audio(&qa)), (audio(&lb), audio(&qb))] {
        assert_eq!((got.len(), want.len()), (1, 1));
        assert_eq!(got[0].len(), want[0].len());
        let d = got[0]
            .iter()
            .zip(&want[0])
            .map(
                |(x, y)| if x.is_finite() && y.is_finite() { (x - y).abs() } else { f32::INFINITY },
            )
            .fold(0f32, f32::max);
        assert!(d < 1e-4, "first audio differs by {d} from the burst prepared at its chunk 0s");
    }
}

/// A burst's chunk 0s in one step: both references prepared inline, together, and each stream's
/// first audio what it gets with its request alone.
#[test]
fn a_burst_of_chunk0s_prepares_its_references_together() {
    let (va, vb) = (voice(180.0), voice(200.0));
    let mut r = Rig::new(EngineConfig::default());
    let (la, lb) = (r.admit("a", Some(va.clone())), r.admit("b", Some(vb.clone())));
    r.chunk("a", 0, chunk0_codes(), false, Some(va.clone()));
    r.chunk("b", 0, chunk0_codes(), false, Some(vb.clone()));
    assert!(r.stage.step());
    assert_eq!(r.stage.live_streams(), 2);
    assert_eq!(r.metrics.prefetch_count(PrefetchEvent::Inline), 2);
    assert_eq!(r.metrics.voice_preparations.get(), 2);
    let alone = |v: &RefInput| {
        let mut r = Rig::new(EngineConfig::default());
        let log = r.admit("x", Some(v.clone()));
        r.chunk("x", 0, chunk0_codes(), false, Some(v.clone()));
        assert!(r.stage.step());
        audio(&log).remove(0)
    };
    let (a, b) = (audio(&la).remove(0), audio(&lb).remove(0));
    assert_ne!(a, b, "two voices, two sounds");
    // (CAM++ over the batch sums in other orders than over one voice: equal to rounding)
    for (got, want) in [(a, alone(&va)), (b, alone(&vb))] {
        assert_eq!(got.len(), want.len());
        let d = got
            .iter()
            .zip(&want)
            .map(
                |(x, y)| if x.is_finite() && y.is_finite() { (x - y).abs() } else { f32::INFINITY },
            )
            .fold(0f32, f32::max);
        assert!(d < 1e-4, "first audio differs from the voice's alone by {d}");
    }
}

#[test]
fn prefetch_never_runs_while_a_stream_is_live() {
    let mut r = Rig::new(EngineConfig::default());
    let va = voice(180.0);
    r.admit("a", Some(va.clone()));
    r.chunk("a", 0, chunk0_codes(), false, Some(va));
    assert!(r.stage.step());
    assert_eq!(r.stage.live_streams(), 1);
    r.admit("b", Some(voice(200.0)));
    r.idle();
    assert_eq!(r.idle(), IdleOutcome::Skipped(PrefetchSkip::Busy));
    assert_eq!(r.idle(), IdleOutcome::Skipped(PrefetchSkip::Busy));
    assert!(r.stage.ref_cache().pinned_by(&id("b")).is_none());
}

#[test]
fn an_open_duplex_session_is_a_live_stream_for_the_busy_gate() {
    let mut r = Rig::new(EngineConfig::default());
    r.stage.on_message(Code2WavMsg::DuplexOpen("s1".into()));
    r.stage.on_message(Code2WavMsg::DuplexOpen("s2".into()));
    r.admit("a", Some(voice(180.0)));
    r.idle();
    assert_eq!(r.idle(), IdleOutcome::Skipped(PrefetchSkip::Busy));
    r.stage.on_message(Code2WavMsg::DuplexClose("s1".into()));
    assert_eq!(r.idle(), IdleOutcome::Skipped(PrefetchSkip::Busy));
    r.stage.on_message(Code2WavMsg::DuplexClose("s2".into()));
    assert_eq!(r.idle(), IdleOutcome::PhaseA(vec![id("a")]));
}

#[test]
fn prefetch_pins_never_exceed_the_cache_capacity() {
    let mut r = Rig::new(EngineConfig::default().with(|c| c.prefetch.ref_cache_capacity = 1));
    r.admit("a", Some(voice(180.0)));
    r.idle();
    assert_eq!(r.idle(), IdleOutcome::PhaseA(vec![id("a")]));
    r.admit("b", Some(voice(200.0)));
    assert_eq!(r.idle(), IdleOutcome::Skipped(PrefetchSkip::PinCap));
    assert_eq!(r.stage.ref_cache().pin_count(), 1);
}

#[test]
fn prefetch_chunk0_claims_the_prefetched_entry() {
    let mut r = Rig::new(EngineConfig::default());
    let v = voice(180.0);
    let log = r.admit("a", Some(v.clone()));
    r.idle();
    r.idle();
    r.chunk("a", 0, chunk0_codes(), false, Some(v.clone()));
    assert!(r.stage.step());
    assert_eq!(r.metrics.prefetch_count(PrefetchEvent::Claimed), 1);
    assert_eq!(r.metrics.prefetch_count(PrefetchEvent::Inline), 0);
    let e = r.stage.ref_cache().get(&key(&v)).unwrap();
    assert!(e.pins.is_empty() && e.owners.contains(&id("a")), "the pin became ownership");
    assert_eq!(audio(&log).len(), 1);
}

#[test]
fn prefetch_chunk0_retires_a_pending_placeholder_and_runs_inline() {
    let mut r = Rig::new(EngineConfig::default());
    let v = voice(180.0);
    r.admit("a", Some(v.clone()));
    r.chunk("a", 0, chunk0_codes(), false, Some(v));
    assert!(r.stage.step());
    assert_eq!(r.metrics.prefetch_count(PrefetchEvent::Retired), 1);
    assert_eq!(r.metrics.prefetch_count(PrefetchEvent::Inline), 1);
    assert_eq!(r.metrics.prefetch_count(PrefetchEvent::PhaseA), 0);
    assert_eq!(r.idle(), IdleOutcome::Nothing, "nothing is left to prefetch");
}

#[test]
fn prefetch_a_different_reference_at_chunk0_runs_inline_and_evicts_the_prefetched_one() {
    let mut r = Rig::new(EngineConfig::default());
    let (x, y) = (voice(180.0), voice(260.0));
    r.admit("a", Some(x.clone()));
    r.idle();
    r.idle();
    assert!(r.stage.ref_cache().get(&key(&x)).is_some());
    r.chunk("a", 0, chunk0_codes(), false, Some(y.clone()));
    assert!(r.stage.step());
    assert_eq!(r.metrics.prefetch_count(PrefetchEvent::Evicted), 1);
    assert_eq!(r.metrics.prefetch_count(PrefetchEvent::Inline), 1);
    assert!(r.stage.ref_cache().get(&key(&x)).is_none(), "the prefetched reference is gone");
    assert!(r.stage.ref_cache().get(&key(&y)).unwrap().owners.contains(&id("a")));
}

#[test]
fn prefetch_a_failed_phase_is_dropped_and_unpinned() {
    let mut r = Rig::new(EngineConfig::default());
    let bad = RefInput::new(vec![f32::NAN; 1000], 16_000);
    let log = r.admit("a", Some(bad));
    r.idle();
    assert_eq!(r.idle(), IdleOutcome::Failed(vec![id("a")]));
    assert_eq!(r.stage.ref_cache().pin_count(), 0);
    assert_eq!(r.metrics.prefetch_count(PrefetchEvent::Failed), 1);
    assert_eq!(r.idle(), IdleOutcome::Nothing, "a failed phase is not retried");
    // chunk 0 with a usable reference prepares inline
    r.chunk("a", 0, chunk0_codes(), false, Some(voice(180.0)));
    assert!(r.stage.step());
    assert_eq!(r.metrics.prefetch_count(PrefetchEvent::Inline), 1);
    assert_eq!(audio(&log).len(), 1);
}

#[test]
fn prefetch_abort_releases_pins() {
    let mut r = Rig::new(EngineConfig::default());
    let v = voice(180.0);
    r.admit("a", Some(v.clone()));
    r.idle();
    r.idle();
    assert_eq!(r.stage.ref_cache().pin_count(), 1);
    r.registry.finish(&id("a"), antiphon_engine::Status::Cancelled);
    r.stage.on_message(Code2WavMsg::Cancel(id("a")));
    assert_eq!(r.stage.ref_cache().pin_count(), 0);
    assert!(r.stage.ref_cache().get(&key(&v)).unwrap().evictable());
}

#[test]
fn prefetch_owner_and_pin_cannot_alias() {
    // Two requests share a reference; the second's id is spelled like a pin key of the first.
    let mut r = Rig::new(EngineConfig::default());
    let v = voice(180.0);
    r.admit("req-1", Some(v.clone()));
    r.idle();
    assert_eq!(r.idle(), IdleOutcome::PhaseA(vec![id("req-1")]));
    r.admit("pin:req-1", None);
    r.chunk("pin:req-1", 0, chunk0_codes(), false, Some(v.clone()));
    assert!(r.stage.step());
    assert_eq!(
        r.metrics.prefetch_count(PrefetchEvent::CacheHit),
        1,
        "the second request found the prepared entry"
    );
    let e = r.stage.ref_cache().get(&key(&v)).unwrap();
    assert!(e.pins.contains(&id("req-1")) && e.owners.contains(&id("pin:req-1")));
    // ending the pinning request leaves the owner; ending the owner leaves nothing
    r.registry.finish(&id("req-1"), antiphon_engine::Status::Cancelled);
    r.stage.on_message(Code2WavMsg::Cancel(id("req-1")));
    let e = r.stage.ref_cache().get(&key(&v)).unwrap();
    assert!(e.pins.is_empty() && e.owners.contains(&id("pin:req-1")));
    assert!(!e.evictable());
}

#[test]
fn prefetch_duplex_requests_carry_no_reference_and_block_others() {
    let mut r = Rig::new(EngineConfig::default());
    // a duplex request: its placeholder carries no reference (Engine::submit attaches none)
    r.admit("duplex", None);
    r.idle();
    assert_eq!(r.idle(), IdleOutcome::Nothing, "nothing to prefetch for duplex");
    r.chunk("duplex", 0, chunk0_codes(), false, Some(voice(150.0)));
    assert!(r.stage.step());
    assert_eq!(r.metrics.prefetch_count(PrefetchEvent::Inline), 1);
    // its live stream blocks a turn-mode request's prefetch
    r.admit("turn", Some(voice(200.0)));
    r.idle();
    assert_eq!(r.idle(), IdleOutcome::Skipped(PrefetchSkip::Busy));
}

#[test]
fn prefetch_chunk0_output_is_bit_identical_on_and_off() {
    let v = voice(180.0);
    let run = |cfg: EngineConfig, idle_steps: usize| {
        let mut r = Rig::new(cfg);
        let log = r.admit("a", Some(v.clone()));
        for _ in 0..idle_steps {
            r.idle();
        }
        r.chunk("a", 0, chunk0_codes(), false, Some(v.clone()));
        assert!(r.stage.step());
        audio(&log).remove(0)
    };
    let off = run(EngineConfig::default().with(|c| c.prefetch.enabled = false), 3);
    let on_a = run(EngineConfig::default(), 3);
    let on_ab = run(EngineConfig::default().with(|c| c.prefetch.setup = true), 3);
    assert!(!off.is_empty());
    assert_eq!(on_a, off);
    assert_eq!(on_ab, off);
}

/// A registration is prepared once, in a step with no chunk due, and its features survive a round
/// trip through the tensors the server saves: a fresh Code2Wav handed them serves the voice with no
/// new preparation (`registered`, no `inline`) and the same audio as a stage that prepared it
/// itself; once forgotten, the voice is prepared again.
#[test]
fn a_registered_voice_is_served_from_its_kept_features() {
    use antiphon_engine::voices::PreparedVoice;
    let v = voice(220.0);
    let mut a = Rig::new(EngineConfig::default());
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    a.stage.on_message(Code2WavMsg::Prepare { voice: v.clone(), reply: tx });
    assert!(a.stage.step(), "the preparation ran in a step with nothing due");
    let prepared = rx.try_recv().expect("a reply").expect("prepared");
    assert_eq!(prepared.key, key(&v));
    assert_eq!(a.metrics.voice_preparations.get(), 1);
    let loaded = PreparedVoice::from_tensors(&prepared.key, &prepared.tensors().unwrap()).unwrap();
    assert_eq!(loaded, prepared);
    // a bad saved file is refused
    let mut bad = prepared.tensors().unwrap();
    bad.remove("mel");
    assert!(PreparedVoice::from_tensors(&prepared.key, &bad).is_err());

    let run = |r: &mut Rig, name: &str| {
        let log = r.admit(name, None);
        r.chunk(name, 0, chunk0_codes(), false, Some(v.clone()));
        assert!(r.stage.step());
        audio(&log).remove(0)
    };
    let mut b = Rig::new(EngineConfig::default());
    b.stage.on_message(Code2WavMsg::Install(loaded));
    let served = run(&mut b, "b");
    assert_eq!(b.metrics.voice_preparations.get(), 0, "no new preparation");
    assert_eq!(b.metrics.prefetch_count(PrefetchEvent::Registered), 1);
    assert_eq!(b.metrics.prefetch_count(PrefetchEvent::Inline), 0);
    let mut c = Rig::new(EngineConfig::default());
    let prepared_here = run(&mut c, "c");
    assert_eq!(c.metrics.prefetch_count(PrefetchEvent::Inline), 1);
    assert!(!served.is_empty() && served.iter().all(|s| s.is_finite()));
    assert_eq!(served, prepared_here, "the kept features give the same audio");

    let mut d = Rig::new(EngineConfig::default());
    d.stage.on_message(Code2WavMsg::Install(prepared.clone()));
    d.stage.on_message(Code2WavMsg::Forget(prepared.key.clone()));
    run(&mut d, "d");
    assert_eq!(d.metrics.voice_preparations.get(), 1, "forgotten: prepared again");
}

/// The Talker holds a stream back until its audio is delivered (`talker.lead_chunks`) and waits
/// for Code2Wav to say so, not for a timer: every batch that delivers audio tells it, an idle step
/// does not, and a full inbox never blocks the step.
#[test]
fn a_batch_that_delivers_audio_tells_the_talker_and_a_full_inbox_does_not_block_it() {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let mut r = Rig::new(EngineConfig::default()).waking(tx.clone());
    let v = voice(180.0);
    let log = r.admit("a", Some(v.clone()));
    r.idle();
    r.idle();
    assert!(rx.try_recv().is_err(), "no audio yet: the Talker is not told");
    r.chunk("a", 0, chunk0_codes(), false, Some(v));
    assert!(r.stage.step());
    assert_eq!(audio(&log).len(), 1);
    assert!(matches!(rx.try_recv(), Ok(TalkerMsg::Delivered)));
    assert!(rx.try_recv().is_err(), "one word a batch");
    // the Talker's inbox full: the next batch still runs and delivers
    tx.try_send(TalkerMsg::Delivered).unwrap();
    r.chunk("a", 1, chunk0_codes(), true, None);
    assert!(r.stage.step());
    assert_eq!(audio(&log).len(), 2);
    assert!(matches!(rx.try_recv(), Ok(TalkerMsg::Delivered)));
    assert!(rx.try_recv().is_err());
}
