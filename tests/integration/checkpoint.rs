//! The checkpoint loader and the synthetic checkpoint generator.

use crate::common;

use std::collections::{HashMap, HashSet};

use antiphon_assets::checkpoint::{load_models, Checked, Checkpoint};
use antiphon_assets::synth::{self, Preset, SynthOptions, SyntheticBackend};
use antiphon_models::config::MiniCpmoConfig;
use antiphon_models::decoder::StreamStep;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;

fn tiny_dir(seed: u64, shard_bytes: usize) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let opts = SynthOptions { preset: Preset::Tiny, seed, dtype: DType::F32, shard_bytes };
    synth::write_checkpoint(dir.path(), &opts).unwrap();
    dir
}

fn all_tensors(ck: &Checkpoint) -> HashMap<String, Tensor> {
    let mut all = HashMap::new();
    for s in &ck.shards {
        all.extend(candle_core::safetensors::load(s, &Device::Cpu).unwrap());
    }
    all
}

#[test]
fn synthetic_checkpoint_is_sharded_and_every_tensor_is_read() {
    let dir = tiny_dir(3, 4 << 20);
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert!(
        ck.shards.len() >= 3,
        "small shard limit gives several shards, got {}",
        ck.shards.len()
    );
    let names: HashSet<String> = all_tensors(&ck).keys().cloned().collect();
    ck.load_models(DType::F32, &Device::Cpu).unwrap();
    // every stored tensor is one the loader reads, and vice versa
    let specs: HashSet<String> =
        synth::tensor_specs(&ck.config).into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, specs);
}

#[test]
fn loader_reads_exactly_the_spec_list() {
    let cfg = Preset::Tiny.config();
    let specs: HashMap<String, Tensor> = synth::tensor_specs(&cfg)
        .into_iter()
        .map(|(n, s)| {
            let t = synth::init_tensor(1, &n, &s, DType::F32, &Device::Cpu).unwrap();
            (n, t)
        })
        .collect();
    let names: HashSet<String> = specs.keys().cloned().collect();
    let checked = std::sync::Arc::new(Checked::recording(Box::new(specs), "specs"));
    let vb = VarBuilder::from_backend(
        Box::new(antiphon_assets::checkpoint::SharedBackend(checked.clone())),
        DType::F32,
        Device::Cpu,
    );
    load_models(&vb, &cfg).unwrap();
    assert_eq!(checked.seen(), names, "the loader reads every listed tensor and nothing else");
}

#[test]
fn file_and_in_memory_synthetic_weights_agree() {
    let dir = tiny_dir(11, 2 << 30);
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ck.shards.len(), 1);
    let (t_file, _) = ck.load_models(DType::F32, &Device::Cpu).unwrap();
    let vb = SyntheticBackend::var_builder(&ck.config, 11, DType::F32, &Device::Cpu);
    let (t_mem, _) = load_models(&vb, &ck.config).unwrap();
    let ids = [1u32, 2, 3, 200, 17];
    let run = |t: &antiphon_models::thinker::Thinker| {
        let mut c = t.llm.new_cache();
        let h = t
            .llm
            .forward(&mut [StreamStep { cache: &mut c, embeds: t.llm.embed(&ids).unwrap() }])
            .unwrap();
        t.llm.logits(&h[0]).unwrap()
    };
    assert_eq!(common::rel_err(&run(&t_file), &run(&t_mem)), 0.0);
    // another seed gives other weights
    let vb = SyntheticBackend::var_builder(&ck.config, 12, DType::F32, &Device::Cpu);
    let (t_other, _) = load_models(&vb, &ck.config).unwrap();
    assert!(common::rel_err(&run(&t_other), &run(&t_file)) > 1e-3);
}

fn vb_without(ck: &Checkpoint, drop: &str, replace: Option<Tensor>) -> VarBuilder<'static> {
    let mut all = all_tensors(ck);
    all.remove(drop);
    if let Some(t) = replace {
        all.insert(drop.to_string(), t);
    }
    VarBuilder::from_backend(
        Box::new(Checked { inner: Box::new(all), origin: "ckpt".into(), seen: None }),
        DType::F32,
        Device::Cpu,
    )
}

#[test]
fn missing_tensor_is_named_with_its_expected_shape() {
    let dir = tiny_dir(0, 2 << 30);
    let ck = Checkpoint::open(dir.path()).unwrap();
    let err = load_models(
        &vb_without(&ck, "llm.model.layers.2.self_attn.k_norm.weight", None),
        &ck.config,
    )
    .unwrap_err();
    let msg = format!("{err:#}");
    assert!(msg.contains("missing tensor llm.model.layers.2.self_attn.k_norm.weight"), "{msg}");
    assert!(msg.contains("[32]"), "expected shape named: {msg}");
}

#[test]
fn misshaped_tensor_is_named_with_both_shapes() {
    let dir = tiny_dir(0, 2 << 30);
    let ck = Checkpoint::open(dir.path()).unwrap();
    let bad = Tensor::zeros((7, 64), DType::F32, &Device::Cpu).unwrap();
    let err = load_models(&vb_without(&ck, "apm.layers.1.fc2.weight", Some(bad)), &ck.config)
        .unwrap_err();
    let msg = format!("{err:#}");
    assert!(msg.contains("apm.layers.1.fc2.weight has shape [7, 64], expected [64, 256]"), "{msg}");
}

#[test]
fn bf16_checkpoint_loads_as_f32_and_as_bf16() {
    let dir = tempfile::tempdir().unwrap();
    let opts =
        SynthOptions { preset: Preset::Tiny, seed: 5, dtype: DType::BF16, shard_bytes: 2 << 30 };
    synth::write_checkpoint(dir.path(), &opts).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    let (t32, _) = ck.load_models(DType::F32, &Device::Cpu).unwrap();
    let (t16, _) = ck.load_models(DType::BF16, &Device::Cpu).unwrap();
    let ids = [3u32, 4, 5];
    let mut c = t32.llm.new_cache();
    let a = t32
        .llm
        .forward(&mut [StreamStep { cache: &mut c, embeds: t32.llm.embed(&ids).unwrap() }])
        .unwrap();
    let mut c = t16.llm.new_cache();
    let b = t16
        .llm
        .forward(&mut [StreamStep { cache: &mut c, embeds: t16.llm.embed(&ids).unwrap() }])
        .unwrap();
    assert_eq!(b[0].dtype(), DType::BF16);
    let e = common::rel_err(&b[0].to_dtype(DType::F32).unwrap(), &a[0]);
    assert!(e < 5e-2, "bf16 vs f32 relative error {e}");
}

#[test]
fn a_shard_named_by_the_index_must_exist() {
    let dir = tiny_dir(0, 4 << 20);
    let ck = Checkpoint::open(dir.path()).unwrap();
    std::fs::remove_file(&ck.shards[1]).unwrap();
    let err = Checkpoint::open(dir.path()).unwrap_err().to_string();
    assert!(err.contains("model-00002-of-") && err.contains("missing"), "{err}");
}

#[test]
fn config_refuses_what_is_not_implemented() {
    let base = serde_json::to_value(Preset::Tiny.config()).unwrap();
    let with = |k: &str, v: serde_json::Value| {
        let mut c = base.clone();
        c[k] = v;
        MiniCpmoConfig::from_json(&c.to_string()).unwrap_err().to_string()
    };
    assert!(with("rope_scaling", serde_json::json!({"type": "yarn"})).contains("rope_scaling"));
    assert!(with("attention_bias", true.into()).contains("attention_bias"));
    assert!(with("hidden_act", "gelu".into()).contains("hidden_act"));
    let mut c = base.clone();
    c["tts_config"]["llm_dim"] = 99.into();
    assert!(MiniCpmoConfig::from_json(&c.to_string()).unwrap_err().to_string().contains("llm_dim"));
    let mut c = base.clone();
    c.as_object_mut().unwrap().remove("hidden_size");
    assert!(MiniCpmoConfig::from_json(&c.to_string())
        .unwrap_err()
        .to_string()
        .contains("hidden_size"));
}

#[test]
fn full_preset_has_the_real_layout() {
    let cfg = Preset::Full.config();
    cfg.validate().unwrap();
    let specs = synth::tensor_specs(&cfg);
    let count = |p: &str| specs.iter().filter(|(n, _)| n.starts_with(p)).count();
    // checkpoint.md: thinker 399, apm 367, projector 4
    assert_eq!(count("llm."), 399);
    assert_eq!(count("apm."), 367);
    assert_eq!(count("audio_projection_layer."), 4);
    let params = |p: &str| -> usize {
        specs
            .iter()
            .filter(|(n, _)| n.starts_with(p))
            .map(|(_, s)| s.iter().product::<usize>())
            .sum()
    };
    let llm = params("llm.");
    assert!(
        (8_100_000_000..8_300_000_000).contains(&llm),
        "Qwen3-8B has ~8.2 B parameters, got {llm}"
    );
    let get = |n: &str| specs.iter().find(|(k, _)| k == n).unwrap().1.clone();
    assert_eq!(get("llm.model.layers.35.self_attn.k_proj.weight"), vec![1024, 4096]);
    assert_eq!(get("tts.head_code.0.parametrizations.weight.original1"), vec![6562, 768]);
    assert_eq!(get("apm.embed_positions.weight"), vec![1500, 1024]);
}
