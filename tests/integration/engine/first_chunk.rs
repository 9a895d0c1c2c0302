//! The first chunk's size: small for a lone stream, sized by the paces on a busy engine, and
//! every code heard either way.

use super::*;

#[test]
fn a_smaller_first_chunk_comes_first() {
    let e = engine(EngineConfig::default().with(|c| c.code2wav.first_chunk_codes = 5));
    let o = collect(submit(&e, spec("small", "hi", 6, 40, 2)));
    assert_eq!(o.status, Status::Completed);
    // chunks of 5, 25 and the remaining 10 new codes
    assert_eq!(o.audio.len(), 3);
    assert!(o.audio[0].len() < o.audio[1].len());
    let total: usize = o.audio.iter().map(|a| a.len()).sum();
    assert_eq!(total, (3 + 40) * 2 * 480 + 3840);
}

/// The small first chunk is for a stream that finds the engine (nearly) idle: requests that come
/// together get full first chunks, even the first of them to reach the Talker (the others are
/// still in the Thinker then). Holding the Talker until the first chunk is delivered changes timing
/// only, never the audio.
#[test]
fn a_small_first_chunk_only_for_a_lone_stream_and_holding_changes_no_audio() {
    let cfg = EngineConfig::default().with(|c| {
        c.code2wav.first_chunk_codes = 5;
        c.code2wav.small_first_chunk_streams = Some(1);
        c.talker.hold_first_chunk = true;
    });
    let e = engine(cfg);
    let a = collect(submit(&e, spec("lone", "hi", 6, 40, 2)));
    assert_eq!(a.status, Status::Completed);
    assert_eq!(a.audio.len(), 3, "5 + 25 + 10 new codes");
    // two requests at once: both are in the engine when the first reaches the Talker
    let (ra, rb) =
        (submit(&e, spec("first", "hi", 6, 40, 2)), submit(&e, spec("second", "hello", 6, 40, 3)));
    let (b, c) = (collect(ra), collect(rb));
    assert_eq!((b.status.clone(), c.status.clone()), (Status::Completed, Status::Completed));
    assert_eq!((b.audio.len(), c.audio.len()), (2, 2), "25 + 15 new codes each");
    assert!(a.audio[0].len() < b.audio[0].len());
    // the same request alone, without the hold: the same audio
    let free = engine(EngineConfig::default().with(|c| c.code2wav.first_chunk_codes = 5));
    let a2 = collect(submit(&free, spec("lone", "hi", 6, 40, 2)));
    assert_eq!(a.audio.concat(), a2.audio.concat());
}

/// With `code2wav.small_first_chunk_slack`, a stream that finds the engine busy gets a first chunk
/// of one of the three sizes (which one depends on this machine's paces: the choice itself is
/// tested with set paces in `talker/tests.rs`) and all of its audio; without it, a full one.
#[test]
fn a_busy_engine_sizes_the_first_chunk_and_every_code_is_heard() {
    let first_of_second = |slack: bool| {
        // (chunks of 50 codes: on an unloaded 2-core machine the halfway chunk, 28 codes)
        let cfg = EngineConfig::default().with(|c| {
            c.code2wav.first_chunk_codes = 5;
            c.code2wav.chunk_codes = 50;
            c.code2wav.small_first_chunk_streams = Some(1);
            c.code2wav.small_first_chunk_slack = slack;
        });
        let e = engine(cfg);
        // a long reply speaking (generated faster than it plays, so its listener has seconds
        // buffered), then a second request once it has delivered four chunks
        let rx = submit(&e, spec("speaking", "hi", 6, 300, 2));
        let mut early = Vec::new();
        while early.iter().filter(|ev| matches!(ev, EngineEvent::Audio { .. })).count() < 4 {
            early.push(rx.recv_timeout(Duration::from_secs(120)).expect("the long reply speaks"));
        }
        let second = collect(submit(&e, spec("second", "hello", 6, 60, 3)));
        let long = loop {
            if let EngineEvent::Done { status, .. } =
                rx.recv_timeout(Duration::from_secs(120)).expect("the long reply ends")
            {
                break status;
            }
        };
        assert_eq!((long, second.status.clone()), (Status::Completed, Status::Completed));
        // (a chunk's audio is 40 ms, 960 samples, a new code)
        (second.audio[0].len() / 960, second.audio.concat())
    };
    let (full, full_audio) = first_of_second(false);
    assert_eq!(full, 50, "busy, no slack: a full first chunk");
    let (slack, slack_audio) = first_of_second(true);
    eprintln!("a busy engine's first chunk with slack: {slack} codes");
    assert!(
        [5, 28, 50].contains(&slack),
        "with slack: the small, the halfway or a full first chunk, got {slack}"
    );
    assert_eq!(full_audio.len(), slack_audio.len(), "every code is heard either way");
    assert!(slack_audio.iter().all(|v| v.is_finite()));
}
