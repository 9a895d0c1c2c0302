//! Prompts and Talker conditions as the rows of a captured step (`prefill_graph_rows`): on the
//! CPU the same bucket buffers run uncaptured, so the engine's chunking and the rows' numerics are
//! checked here; CUDA adds the capture.

use super::*;
use antiphon_models::decoder::DecodeMode;

/// Three replies at once with the Thinker's prompts chunked to a bucket of 32 rows (what the
/// decoding streams leave of it) and the Talker's conditions in a bucket: each gets the text,
/// codes and audio the op-by-op engine gives it.
#[test]
fn prompts_and_conditions_as_rows_of_captured_steps_give_what_op_by_op_gives() {
    let request = |i: usize, tag: &str| {
        spec(&format!("{tag}{i}"), &format!("prompt {i}"), 8 + i, 30 + 5 * i, i as u64)
    };
    let plain = engine(EngineConfig::default());
    let want: Vec<Outcome> = (0..3).map(|i| collect(submit(&plain, request(i, "a")))).collect();
    let plain_prefills = plain.metrics().step_count(StepKind::ThinkerPrefill);
    let mut models = models_in_memory(Preset::Tiny, 5, DType::F32, &Device::Cpu).unwrap();
    models.thinker.llm.set_decode_mode(DecodeMode::Graph);
    models.thinker.llm.set_prefill_graph_rows(32);
    models.talker.set_decode_mode(DecodeMode::Graph);
    models.talker.set_prefill_graph_rows(32);
    let e = Engine::start(models, EngineConfig::default()).unwrap();
    let rxs: Vec<_> = (0..3).map(|i| submit(&e, request(i, "b"))).collect();
    let got: Vec<Outcome> = rxs.into_iter().map(collect).collect();
    // (a prompt of the system turn, the voice's rows and the text, in steps of at most 32 rows)
    let prefills = e.metrics().step_count(StepKind::ThinkerPrefill);
    assert!(prefills > plain_prefills + 3, "{prefills} prefill steps, {plain_prefills} op by op");
    for (i, (w, g)) in want.iter().zip(&got).enumerate() {
        assert_eq!(g.status, Status::Completed, "reply {i}");
        assert_eq!(w.text, g.text, "reply {i}");
        assert_eq!(w.codes, g.codes, "reply {i}");
        assert_eq!(w.audio.len(), g.audio.len(), "reply {i}");
        for (x, y) in w.audio.iter().zip(&g.audio) {
            assert_eq!(x.len(), y.len());
            let err = common::max_abs_diff(x, y);
            assert!(err < 1e-4, "reply {i}: audio differs by {err}");
        }
    }
}
