//! The Talker against the reference: condition embeddings, prefill and decode logits in
//! every decode mode, weight-norm spellings, batched streams.

use super::*;

fn talker_inputs() -> (HashMap<String, Tensor>, Vec<u32>, Vec<u32>) {
    let meta = load_meta(FIX);
    (load_io(FIX), ids(&meta["talker_ids"]), ids(&meta["talker_codes"]))
}

/// The fixture's two streams' conditions: A, the fixture's hand-off; B, a shorter one (5 tokens).
fn two_conditions(talker: &Talker, io: &HashMap<String, Tensor>, tids: &[u32]) -> [Tensor; 2] {
    let h = &io["talker_hidden_in"];
    [
        talker.condition(tids, h, ConditionMode::Turn).unwrap(),
        talker.condition(&tids[..5], &h.narrow(0, 0, 5).unwrap(), ConditionMode::Duplex).unwrap(),
    ]
}

/// One stream alone in a cache of its own: its condition's last rows, then one row per code.
fn talker_alone(talker: &Talker, cond: &Tensor, codes: &[u32]) -> Tensor {
    let mut c = talker.new_cache();
    let mut rows =
        talker.forward(&mut [StreamStep { cache: &mut c, embeds: cond.clone() }]).unwrap();
    for &code in codes {
        let e = talker.embed_codes(&[code]).unwrap();
        rows.extend(talker.forward(&mut [StreamStep { cache: &mut c, embeds: e }]).unwrap());
    }
    Tensor::cat(&rows, 0).unwrap()
}

#[test]
fn parity_talker_condition_embeddings() {
    let (io, tids, _) = talker_inputs();
    let (_, talker) = models();
    let h = &io["talker_hidden_in"];
    let c = talker.condition(&tids, h, ConditionMode::Turn).unwrap();
    assert_eq!(c.dim(0).unwrap(), tids.len() + 2);
    assert_close("turn condition", &c, &io["talker_condition"], TOL);
    let c = talker.condition(&tids, h, ConditionMode::Duplex).unwrap();
    assert_eq!(c.dim(0).unwrap(), tids.len() + 1);
    assert_close("duplex condition", &c, &io["talker_condition_duplex"], TOL);
    // An empty hand-off still opens the audio.
    let empty = talker.condition(
        &[],
        &Tensor::zeros((0, 64), DType::F32, &common::device()).unwrap(),
        ConditionMode::Turn,
    );
    assert_eq!(empty.unwrap().dim(0).unwrap(), 2);
}

#[test]
fn parity_talker_prefill_and_decode_logits() {
    talker_prefill_and_decode(DecodeMode::Eager);
}

#[test]
fn parity_talker_decode_static_and_graph() {
    talker_prefill_and_decode(DecodeMode::Static);
    talker_prefill_and_decode(DecodeMode::Graph);
}

fn talker_prefill_and_decode(mode: DecodeMode) {
    let (io, tids, codes) = talker_inputs();
    let (_, mut talker) = models();
    talker.set_decode_mode(mode);
    let cond = talker.condition(&tids, &io["talker_hidden_in"], ConditionMode::Turn).unwrap();
    let mut cache = talker.new_cache();
    let mut rows = vec![talker
        .forward(&mut [StreamStep { cache: &mut cache, embeds: cond }])
        .unwrap()
        .pop()
        .unwrap()];
    for &c in &codes {
        let embeds = talker.embed_codes(&[c]).unwrap();
        rows.push(
            talker.forward(&mut [StreamStep { cache: &mut cache, embeds }]).unwrap().pop().unwrap(),
        );
    }
    let hidden = Tensor::cat(&rows, 0).unwrap();
    assert_close("talker hidden", &hidden, &io["talker_hidden"], TOL);
    assert_close("talker logits", &talker.logits(&hidden).unwrap(), &io["talker_logits"], TOL);
}

#[test]
fn parity_talker_weight_norm_spellings() {
    // The same head from the parametrization names (the fixture), the legacy weight_g / weight_v
    // names, and a plain materialized weight.
    let (io, _, _) = talker_inputs();
    let dir = common::fixture_dir(FIX);
    let ck = Checkpoint::open(&dir).unwrap();
    let mut all: HashMap<String, Tensor> = HashMap::new();
    for s in &ck.shards {
        all.extend(candle_core::safetensors::load(s, &common::device()).unwrap());
    }
    let g = all.remove("tts.head_code.0.parametrizations.weight.original0").unwrap();
    let v = all.remove("tts.head_code.0.parametrizations.weight.original1").unwrap();
    let want = &io["talker_head_weight"];
    let head_of = |extra: Vec<(&str, Tensor)>| {
        let mut m = all.clone();
        for (k, t) in extra {
            m.insert(k.to_string(), t);
        }
        let vb = candle_nn::VarBuilder::from_tensors(m, DType::F32, &common::device());
        let (_, talker) = load_models(&vb, &ck.config).unwrap();
        // head weight = logits of the identity
        let eye =
            Tensor::eye(ck.config.tts_config.hidden_size, DType::F32, &common::device()).unwrap();
        talker.logits(&eye).unwrap().t().unwrap()
    };
    let legacy = head_of(vec![
        ("tts.head_code.0.weight_g", g.clone()),
        ("tts.head_code.0.weight_v", v.clone()),
    ]);
    assert_close("legacy weight_g/weight_v", &legacy, want, TOL);
    let plain = head_of(vec![("tts.head_code.0.weight", want.clone())]);
    assert_close("materialized weight", &plain, want, TOL);
}

#[test]
fn parity_talker_batched_streams_match_single() {
    let (io, tids, codes) = talker_inputs();
    let (_, talker) = models();
    // stream A: the fixture's hand-off; stream B: a shorter one (5 tokens), decoding the same codes
    let conds = two_conditions(&talker, &io, &tids);
    let run_alone = |cond: &Tensor| talker_alone(&talker, cond, &codes);
    let mut ca = talker.new_cache();
    let mut cb = talker.new_cache();
    let mut ra = vec![];
    let mut rb = vec![];
    let out = talker
        .forward(&mut [
            StreamStep { cache: &mut ca, embeds: conds[0].clone() },
            StreamStep { cache: &mut cb, embeds: conds[1].clone() },
        ])
        .unwrap();
    ra.push(out[0].clone());
    rb.push(out[1].clone());
    for &code in &codes {
        let e = talker.embed_codes(&[code]).unwrap();
        let out = talker
            .forward(&mut [
                StreamStep { cache: &mut ca, embeds: e.clone() },
                StreamStep { cache: &mut cb, embeds: e },
            ])
            .unwrap();
        ra.push(out[0].clone());
        rb.push(out[1].clone());
    }
    assert_close(
        "talker stream A batched vs alone",
        &Tensor::cat(&ra, 0).unwrap(),
        &run_alone(&conds[0]),
        1e-5,
    );
    assert_close(
        "talker stream B batched vs alone",
        &Tensor::cat(&rb, 0).unwrap(),
        &run_alone(&conds[1]),
        1e-5,
    );
    assert_close(
        "talker stream A vs reference",
        &Tensor::cat(&ra, 0).unwrap(),
        &io["talker_hidden"],
        TOL,
    );
}

#[test]
fn talker_prefills_as_rows_of_a_captured_step_match_streams_alone() {
    let (io, tids, codes) = talker_inputs();
    let (_, mut talker) = models();
    let conds = two_conditions(&talker, &io, &tids);
    let want = conds.clone().map(|c| talker_alone(&talker, &c, &codes[..4]));
    talker.set_decode_mode(DecodeMode::Graph);
    talker.set_prefill_graph_rows(256);
    let pool = talker.decoder().slot_pool(3, 1024).unwrap();
    let mut ca = pool.take().unwrap().expect("a slot");
    let mut cb = pool.take().unwrap().expect("a slot");
    // both conditions in one step: its rows in a bucket beyond the decode steps' (1 to 3), its
    // attention over the first 256 positions of the slots' 1024 (on CUDA, the kernel's splits)
    let out = talker
        .forward(&mut [
            StreamStep { cache: &mut ca, embeds: conds[0].clone() },
            StreamStep { cache: &mut cb, embeds: conds[1].clone() },
        ])
        .unwrap();
    assert!(pool.buckets().iter().any(|&b| b > 3), "buckets {:?}", pool.buckets());
    let (mut ra, mut rb) = (vec![out[0].clone()], vec![out[1].clone()]);
    for &code in &codes[..4] {
        let e = talker.embed_codes(&[code]).unwrap();
        let out = talker
            .forward(&mut [
                StreamStep { cache: &mut ca, embeds: e.clone() },
                StreamStep { cache: &mut cb, embeds: e },
            ])
            .unwrap();
        ra.push(out[0].clone());
        rb.push(out[1].clone());
    }
    assert_close("stream A, prefill in a bucket", &Tensor::cat(&ra, 0).unwrap(), &want[0], 1e-5);
    assert_close("stream B, prefill in a bucket", &Tensor::cat(&rb, 0).unwrap(), &want[1], 1e-5);
}
