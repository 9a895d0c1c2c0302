//! Prompt reuse in the threaded engine on the tiny synthetic models: a conversation's next turn
//! starts from the KV its previous turn left, spoken turns are kept as audio, a new voice reuses
//! the head of another voice's system turn, and a cached prefix answers exactly as none.

use crate::common;

use antiphon_engine::{Engine, EngineConfig, RefInput, SpokenClip, Status, UserInput};
use common::engine::{collect, engine, spec, submit, Outcome};

/// The next turn of a conversation starts from the KV its previous turn left (prompt + reply),
/// not from the system turn alone, and answers exactly as without any prefix cache.
#[test]
fn a_conversations_next_turn_reuses_its_previous_turn() {
    let off = engine(EngineConfig::default().with(|c| c.thinker.prefix_cache = 0));
    let on = engine(EngineConfig::default());
    let reused = |e: &Engine| -> u64 {
        let m = e.metrics().render();
        m.lines()
            .find_map(|l| l.strip_prefix("antiphon_prompt_positions_total{source=\"reused\"} "))
            .map(|v| v.parse().unwrap())
            .unwrap_or(0)
    };
    let run = |e: &Engine| -> (Outcome, Outcome, u64, u64) {
        let first = collect(submit(e, spec("t1", "tell me about the sea", 10, 30, 3)));
        let before = reused(e);
        // an unrelated request: only the system turn is shared
        let _ = collect(submit(e, spec("x", "something else entirely", 6, 20, 5)));
        let system_only = reused(e) - before;
        let mut next = spec("t2", "and about the mountains", 12, 30, 4);
        next.history =
            vec![antiphon_engine::Turn::text("tell me about the sea", first.text.clone())];
        let before = reused(e);
        let second = collect(submit(e, next));
        (first, second, system_only, reused(e) - before)
    };
    let (a0, b0, _, _) = run(&off);
    let (a1, b1, system_only, conversation) = run(&on);
    assert!(system_only > 0, "the unrelated request shares the system turn");
    assert!(
        conversation > system_only + 5,
        "turn 2 reused {conversation} positions, the system turn alone is {system_only}"
    );
    for (x, y) in [(&a0, &a1), (&b0, &b1)] {
        assert_eq!(x.status, Status::Completed);
        assert_eq!(x.text, y.text);
        assert_eq!(x.codes, y.codes);
    }
}

/// A spoken conversation keeps each turn as its audio: every later prompt holds the earlier
/// clips, so its KV is reused whole (from the previous turn's prompt up to where the reply is
/// re-rendered, a few template positions), never rebuilt from a stand-in, and the replies are the
/// same with the prefix store off (where every prompt is encoded and prefilled whole).
#[test]
fn a_spoken_conversation_keeps_every_turns_audio() {
    let counter = |e: &Engine, source: &str| -> u64 {
        let m = e.metrics().render();
        let key = format!("antiphon_prompt_positions_total{{source=\"{source}\"}} ");
        m.lines()
            .find_map(|l| l.strip_prefix(key.as_str()))
            .map(|v| v.parse().unwrap())
            .unwrap_or(0)
    };
    let clip = |k: usize| {
        SpokenClip::new(
            (0..16_000 + 4_000 * k)
                .map(|i| 0.25 * (i as f32 * (0.02 + 0.013 * k as f32)).sin())
                .collect(),
        )
        .unwrap()
    };
    let run = |e: &Engine| -> Vec<(Outcome, u64, u64)> {
        let mut history = Vec::new();
        let mut turns = Vec::new();
        for k in 0..4 {
            let mut s = spec(&format!("spoken{k}"), "", 6, 20, 10 + k as u64);
            s.input = UserInput::Audio(clip(k));
            s.history = history.clone();
            let (reused, prefilled) = (counter(e, "reused"), counter(e, "prefilled"));
            let out = collect(submit(e, s));
            assert_eq!(out.status, Status::Completed, "turn {k}");
            history.push(antiphon_engine::Turn {
                user: UserInput::Audio(clip(k)),
                assistant: out.text.clone(),
                calls: vec![],
            });
            turns.push((out, counter(e, "reused") - reused, counter(e, "prefilled") - prefilled));
        }
        turns
    };
    let off = run(&engine(EngineConfig::default().with(|c| c.thinker.prefix_cache = 0)));
    let on = run(&engine(EngineConfig::default()));
    for k in 1..4 {
        let (_, reused, _) = on[k];
        let (_, before_reused, before_prefilled) = on[k - 1];
        let before = before_reused + before_prefilled;
        assert!(
            reused + 8 >= before,
            "turn {k} reused {reused} positions; turn {} had {before}",
            k - 1
        );
        assert!(reused > before_reused, "turn {k} reused {reused}, turn {} {before_reused}", k - 1);
    }
    for (k, ((a, ..), (b, ..))) in off.iter().zip(&on).enumerate() {
        assert_eq!(a.text, b.text, "turn {k}");
        assert_eq!(a.codes, b.codes, "turn {k}");
    }
}

/// A new voice's system turn takes its head (the template and the text before the voice's audio)
/// from another voice's, and gives what it gives with the store off.
#[test]
fn a_new_voice_reuses_the_head_of_another_voices_system_turn() {
    let off = engine(EngineConfig::default().with(|c| c.thinker.prefix_cache = 0));
    let on = engine(EngineConfig::default());
    let run = |e: &Engine| {
        let a = collect(submit(e, spec("a", "the first question", 10, 30, 3)));
        let mut b = spec("b", "the first question", 10, 30, 3);
        b.voice = RefInput::new(
            (0..16_000 * 2).map(|k| 0.3 * (k as f32 * 0.031).sin()).collect(),
            16_000,
        );
        (a, collect(submit(e, b)))
    };
    let (a0, b0) = run(&off);
    let (a1, b1) = run(&on);
    let m = on.metrics().render();
    assert!(
        m.contains("antiphon_prefix_cache_total{event=\"hit\"} 1"),
        "the second voice found the first's head: {m}"
    );
    assert_ne!(b0.audio, a0.audio, "two voices, two sounds");
    for (x, y) in [(&a0, &a1), (&b0, &b1)] {
        assert_eq!(x.status, Status::Completed);
        assert_same_response(x, y, "the shared head");
    }
}

/// The same text and codes, and audio within 1e-4 (`what` changed it otherwise).
fn assert_same_response(x: &Outcome, y: &Outcome, what: &str) {
    assert_eq!(x.text, y.text);
    assert_eq!(x.codes, y.codes);
    let (p, q): (Vec<f32>, Vec<f32>) = (x.audio.concat(), y.audio.concat());
    assert_eq!(p.len(), q.len());
    let err = common::max_abs_diff(&p, &q);
    assert!(err < 1e-4, "{what} changed the audio by {err}");
}

#[test]
fn a_cached_prompt_prefix_gives_the_same_response() {
    let off = engine(EngineConfig::default().with(|c| c.thinker.prefix_cache = 0));
    let on = engine(EngineConfig::default());
    let run = |e: &Engine| {
        let a = collect(submit(e, spec("a", "the first question", 10, 30, 3)));
        let b = collect(submit(e, spec("b", "a second, longer question", 12, 35, 4)));
        (a, b)
    };
    let (a0, b0) = run(&off);
    let (a1, b1) = run(&on);
    let m = on.metrics().render();
    // the first request prefilled the system turn with the voice, the second started from it
    assert!(m.contains("antiphon_prefix_cache_total{event=\"miss\"} 1"), "{m}");
    assert!(m.contains("antiphon_prefix_cache_total{event=\"hit\"} 1"), "{m}");
    assert!(
        off.metrics().render().contains("antiphon_prefix_cache_total{event=\"hit\"} 0"),
        "no hit with the cache off"
    );
    for (x, y) in [(&a0, &a1), (&b0, &b1)] {
        assert_same_response(x, y, "the prefix cache");
    }
}
