//! Numerical parity of the Talker's turn-mode streaming (text chunks, `engine.talker.text_chunk`)
//! with the model authors' own streaming generator (`TTSStreamingGenerator` in
//! minicpm-o-4_5-pytorch-simple-demo, `sliding_recompute`): every chunk's condition and window,
//! the positions, and the logits of every step with the codes the reference sampled fed back.
//! Fixtures: `tests/parity/make_stream_fixtures.py`, over the `parity_lm` checkpoint.

use crate::common;

use antiphon_assets::checkpoint::Checkpoint;
use antiphon_engine::talker::{chunk_condition, segment_window};
use antiphon_models::decoder::{DecodeMode, StreamStep};
use antiphon_models::talker::Talker;
use candle_core::{DType, Tensor};
use common::{assert_close, ids, load_io, load_meta};

const TOL: f32 = 1e-4;
const FIX: &str = "parity_stream";

fn talker() -> Talker {
    let ck =
        Checkpoint::open(&common::fixture_dir("parity_lm")).expect("open the fixture checkpoint");
    ck.load_models(DType::F32, &common::device()).expect("load through the real loader").1
}

fn positions(v: &serde_json::Value) -> Vec<Vec<u64>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect())
        .collect()
}

fn streaming_matches_the_reference(mode: DecodeMode) {
    let (io, meta) = (load_io(FIX), load_meta(FIX));
    let mut talker = talker();
    talker.set_decode_mode(mode);
    let chunks = meta["chunks"].as_array().unwrap();
    assert_eq!(chunks.len(), 3, "a reply of three text chunks");
    let mut previous: Option<(Tensor, Vec<u32>)> = None;
    for (k, c) in chunks.iter().enumerate() {
        let (tids, codes) = (ids(&c["ids"]), ids(&c["codes"]));
        let last = c["last"].as_bool().unwrap();
        let steps = c["steps"].as_u64().unwrap() as usize;
        assert!(
            !codes.is_empty() && steps >= codes.len() && steps <= codes.len() + 1,
            "chunk {k}: {steps} steps, {} codes",
            codes.len()
        );
        let condition =
            chunk_condition(&talker, &tids, &io[&format!("chunk{k}_hidden")], last).unwrap();
        assert_eq!(
            condition.dim(0).unwrap(),
            tids.len() + 1 + usize::from(last),
            "rows, the text end on the last chunk, the audio start"
        );
        let window = segment_window(
            &talker,
            previous.as_ref().map(|(c, codes)| (c, codes.as_slice())),
            &condition,
        )
        .unwrap();
        assert_close(
            &format!("chunk {k}'s window"),
            &window,
            &io[&format!("chunk{k}_window")],
            TOL,
        );
        // the reference starts every chunk's cache over: the window from position 0, then one
        // position a step
        let len = window.dim(0).unwrap() as u64;
        let pos = positions(&c["positions"]);
        assert!(c["fresh"].as_bool().unwrap());
        assert_eq!(pos[0], (0..len).collect::<Vec<_>>());
        assert!(pos[1..].iter().enumerate().all(|(t, p)| p == &[len + t as u64]));
        let mut cache = talker.new_cache();
        let h = talker
            .forward(&mut [StreamStep { cache: &mut cache, embeds: window }])
            .unwrap()
            .pop()
            .unwrap();
        let mut rows = vec![h.narrow(0, h.dim(0).unwrap() - 1, 1).unwrap()];
        // each step feeds the code the step before sampled
        for &code in &codes[..steps - 1] {
            let embeds = talker.embed_codes(&[code]).unwrap();
            rows.push(
                talker
                    .forward(&mut [StreamStep { cache: &mut cache, embeds }])
                    .unwrap()
                    .pop()
                    .unwrap(),
            );
        }
        let logits = talker.logits(&Tensor::cat(&rows, 0).unwrap()).unwrap();
        assert_close(
            &format!("chunk {k}'s logits"),
            &logits,
            &io[&format!("chunk{k}_logits")],
            TOL,
        );
        previous = Some((condition, codes));
    }
}

#[test]
fn parity_stream_chunks_windows_and_steps() {
    streaming_matches_the_reference(DecodeMode::Eager);
}

#[test]
fn parity_stream_static_and_graph_steps() {
    streaming_matches_the_reference(DecodeMode::Static);
    streaming_matches_the_reference(DecodeMode::Graph);
}
