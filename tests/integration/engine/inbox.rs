//! A stage a whole inbox behind: the engine's API never waits for it.

use super::*;
use antiphon_engine::SubmitError;

/// Stages with an inbox of one message, Code2Wav busy preparing a voice: a response that finds a
/// stage's inbox full is refused at once as at capacity, counted by stage, and holds nothing
/// afterwards; the responses the stages took complete, and so does the preparation.
#[test]
fn a_full_stage_inbox_refuses_a_response_at_once_and_holds_nothing() {
    let e = engine(EngineConfig::default().with(|c| c.channel_capacity = 1));
    let prepared = e.prepare_voice(voice()).unwrap();
    // (Code2Wav spends milliseconds on the preparation; the submits below take microseconds)
    let (mut taken, mut refused) = (Vec::new(), 0);
    for k in 0..8u64 {
        let (tx, rx) = mpsc::channel();
        let tx = std::sync::Mutex::new(tx);
        let sink = Arc::new(move |ev| {
            let _ = tx.lock().unwrap().send(ev);
        });
        match e.submit(spec(&format!("r{k}"), "hi", 4, 10, k), sink) {
            Ok(()) => taken.push(rx),
            Err(SubmitError::Busy(b)) => {
                assert!(b.retry_after_ms > 0);
                refused += 1;
            }
            Err(other) => panic!("neither taken nor busy: {other}"),
        }
    }
    use antiphon_engine::metric_labels::StageName;
    let full: u64 = [StageName::Thinker, StageName::Talker, StageName::Code2Wav]
        .into_iter()
        .map(|s| e.metrics().inbox_full.at(s).get())
        .sum();
    assert!(full >= 1 && refused as u64 >= full, "{full} full, {refused} refused");
    for rx in taken {
        assert_eq!(collect(rx).status, Status::Completed);
    }
    let voice = prepared.recv_timeout(Duration::from_secs(120)).expect("prepared in time");
    assert!(voice.is_ok(), "the preparation went on");
    assert_eq!(e.active(), 0);
    let (running, queued, _) = e.admission().counts();
    assert_eq!((running, queued), (0, 0), "a refused response holds no place");
}
