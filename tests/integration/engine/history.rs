//! A conversation longer than the context: its oldest turns give way, in steps, within the
//! context the configuration allows.

use antiphon_engine::{EngineConfig, EngineEvent, Status, Turn};

use crate::common::engine::{collect, engine, spec, submit, Outcome};

/// The oldest turns a reply's prompt left out, as its `HistoryTrimmed` event says (none: `None`).
fn turns_left_out(o: &Outcome) -> Option<usize> {
    o.events.iter().find_map(|ev| match ev {
        EngineEvent::HistoryTrimmed { turns } => Some(*turns),
        _ => None,
    })
}

#[test]
fn a_history_longer_than_the_context_loses_its_oldest_turns() {
    let e = engine(EngineConfig::default());
    let mut s = spec("long-history", "and now?", 4, 10, 1);
    let history: Vec<_> = (0..60)
        .map(|i| Turn::text(format!("question {i} ").repeat(40), "answer ".repeat(60)))
        .collect();
    s.history = history.clone();
    let o = collect(submit(&e, s));
    assert_eq!(o.status, Status::Completed);
    // and says how many, before anything else of the reply
    let trimmed = o.events.iter().position(
        |ev| matches!(ev, EngineEvent::HistoryTrimmed { turns } if (1..60).contains(turns)),
    );
    assert_eq!(
        trimmed,
        Some(0),
        "the first event says how many turns were left out: {:?}",
        o.events.first()
    );
    // the next turn, from a session that dropped the turns left out, keeps every turn it sends:
    // the oldest give way in steps of half the room, not one turn at every turn (fit.rs), so its
    // prompt starts with this one's positions
    let mut s = spec("long-history-next", "and then?", 4, 10, 1);
    s.history = history[turns_left_out(&o).unwrap_or(0)..].to_vec();
    s.history.push(Turn::text("and now?", "answer ".repeat(60)));
    let next = collect(submit(&e, s));
    assert_eq!(next.status, Status::Completed);
    assert_eq!(turns_left_out(&next), None, "the turn after a cut left out more");
    // an input within `max_input_tokens` fits whatever the history: more of it gives way (here
    // ~3400 positions of history, within half of what the reply leaves, and an input of 5000)
    let max = e.max_input_tokens(0);
    let mut s = spec("big-input", &"b".repeat(max.min(5000)), 4, 10, 1);
    s.history =
        (0..12).map(|i| Turn::text(format!("q{i} ").repeat(80), "answer ".repeat(3))).collect();
    let o = collect(submit(&e, s));
    assert_eq!(o.status, Status::Completed, "an input of {} tokens, within {max}", max.min(5000));
    assert!(
        matches!(o.events.first(), Some(EngineEvent::HistoryTrimmed { turns }) if *turns > 0),
        "{:?}",
        o.events.first()
    );
    // a prompt that alone is longer than the context is refused clearly
    let o = collect(submit(&e, spec("huge", &"la ".repeat(4000), 4, 10, 1)));
    assert!(
        matches!(&o.status, Status::Refused(m) if m.contains("context") && m.contains("`text`")),
        "{:?}",
        o.status
    );
}

/// `thinker.context` bounds a conversation below the model's context: the limits a session is
/// told follow it, and the oldest turns give way within it.
#[test]
fn a_configured_context_bounds_the_conversation() {
    let history: Vec<_> =
        (0..12).map(|i| Turn::text(format!("q{i} ").repeat(80), "answer ".repeat(3))).collect();
    let whole = engine(EngineConfig::default());
    let model = whole.thinker_context();
    let mut s = spec("whole-context", "and now?", 4, 10, 1);
    s.history = history.clone();
    let o = collect(submit(&whole, s));
    assert_eq!(o.status, Status::Completed);
    assert_eq!(turns_left_out(&o), None, "the model's whole context holds the history");
    drop(whole);
    let mut cfg = EngineConfig::default();
    cfg.thinker.context = 2048;
    assert!(model > 2048, "the tiny model's context: {model}");
    let bounded = engine(cfg);
    assert_eq!(bounded.thinker_context(), 2048);
    assert!(bounded.max_input_tokens(0) < 2048);
    let mut s = spec("bounded-context", "and now?", 4, 10, 1);
    s.history = history;
    let o = collect(submit(&bounded, s));
    assert_eq!(o.status, Status::Completed);
    assert!(
        matches!(o.events.first(), Some(EngineEvent::HistoryTrimmed { turns }) if *turns > 0),
        "{:?}",
        o.events.first()
    );
}
