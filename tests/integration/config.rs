//! Configuration files and `antiphon check-config`.

use std::process::Command;

use antiphon_server::config::{Config, ModelSource};

fn root() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn shipped_configs_parse() {
    let d = Config::load(&root().join("configs/default.toml")).unwrap();
    assert_eq!(d.model.source, ModelSource::Synthetic);
    assert_eq!(d.server.listen, "127.0.0.1:8080");
    assert!(d.voices[0].wav.is_file());
    let s = Config::load(&root().join("configs/minicpmo45-synthetic.toml")).unwrap();
    assert_eq!(s.model.preset, antiphon_assets::synth::Preset::Full);
    assert_eq!(s.model.dtype, antiphon_models::gpu::Precision::Bf16);
    // the GPU config sizes its streams from the card's memory, at most its 64 slots
    assert!(
        s.engine.streams_from_memory
            && s.engine.thinker.slots == 64
            && s.engine.memory_headroom_mib == 16384
    );
    // ...and ships run 54's Code2Wav scheduling and kernels (keys the reference defaults to off)
    assert!(
        s.engine.code2wav.first_chunks_apart
            && s.engine.code2wav.one_batch_per_step
            && s.engine.code2wav.vocoder_half_columns
    );
    // ...and the Talker's graphs ahead of the Thinker's, the gate for first-chunk prefills only
    // (runs 69-73)
    assert!(s.engine.stage_priorities && s.engine.talker_first && s.engine.gated_streams == 0);
    assert_eq!(
        s.engine.code2wav.pool_attention,
        antiphon_models::code2wav::dit_attention::PoolAttention::InPlace
    );
    // the real-checkpoint file names a directory this machine does not have
    let e = format!("{:#}", Config::load(&root().join("configs/minicpmo45.toml")).unwrap_err());
    assert!(e.contains("model.path") && e.contains("config.json"), "{e}");
}

#[test]
fn mistakes_are_named() {
    let base = std::fs::read_to_string(root().join("configs/default.toml")).unwrap();
    let cfgdir = root().join("configs");
    let err = |text: &str| format!("{:#}", Config::parse(text, &cfgdir).unwrap_err());
    assert!(err(&base.replace("listen = \"127.0.0.1:8080\"", "listen = \"nowhere\""))
        .contains("server.listen"));
    assert!(err(&base.replace("source = \"synthetic\"", "source = \"magic\"")).contains("source"));
    assert!(err(&base.replace("dtype = \"f32\"", "dtype = \"f8\"")).contains("model.dtype"));
    assert!(err(&base.replace("default.wav", "missing.wav")).contains("does not exist"));
    assert!(
        err(&format!("{base}\n[server2]\nx = 1\n")).contains("server2"),
        "unknown tables are refused"
    );
    assert!(err(&base.replace("max_sessions = 8", "max_sessions = 0")).contains("max_sessions"));
    // a replica id is a DNS label: it prefixes session ids and a proxy routes on it
    let with_replica = |id: &str| {
        base.replace("max_sessions = 8", &format!("max_sessions = 8\nreplica_id = {id:?}"))
    };
    assert!(Config::parse(&with_replica("antiphon-3"), &cfgdir).is_ok());
    for bad in ["a.b", "-a", "a b", &"x".repeat(64)] {
        assert!(err(&with_replica(bad)).contains("server.replica_id"), "{bad:?} is refused");
    }
}

/// Each stage's keys in its section; a count that may be absent is a number or `"none"`; a key of
/// the flat `[engine]` table from before the sections is refused with its new place.
#[test]
fn engine_sections_and_moved_keys() {
    let base = std::fs::read_to_string(root().join("configs/default.toml")).unwrap();
    let cfgdir = root().join("configs");
    let with = |extra: &str| format!("{base}\n{extra}\n");
    let c = Config::parse(
        &with(
            "[engine.talker]\ntext_chunk = 10\nlead_chunks = \"none\"\n\
            [engine.duplex]\nmax_context = 900",
        ),
        &cfgdir,
    )
    .unwrap();
    assert_eq!(
        (c.engine.talker.text_chunk, c.engine.talker.lead_chunks, c.engine.duplex.max_context),
        (10, None, Some(900))
    );
    let d = Config::parse(&base, &cfgdir).unwrap();
    assert_eq!(d.engine.talker.lead_chunks, Some(1), "absent: the default");
    assert_eq!(d.engine.code2wav.small_first_chunk_streams, None, "absent: every stream");
    let err = |text: &str| format!("{:#}", Config::parse(text, &cfgdir).unwrap_err());
    let e = err(&base.replace("[engine]\n", "[engine]\ntalker_text_chunk = 10\n"));
    assert!(e.contains("engine.talker.text_chunk") && e.contains("[engine.talker]"), "{e}");
    assert!(e.contains("text_chunk = "), "{e}");
    let flat = base
        .replace("[engine.prefetch]\nenabled = true\nsetup = false\n", "")
        .replace("[engine]\n", "[engine]\nprefetch = true\n");
    let e = err(&flat);
    assert!(e.contains("engine.prefetch.enabled"), "{e}");
    let e = err(&with("[engine.talker]\nlead_chunks = -1"));
    assert!(e.contains("engine.talker.lead_chunks") && e.contains("\"none\""), "{e}");
    let e = err(&with("[engine.talker]\nlead_chunks = \"never\""));
    assert!(e.contains("engine.talker.lead_chunks"), "{e}");
    let e = err(&with("[engine.duplex]\nmax_context = 0"));
    assert!(e.contains("engine.duplex.max_context 0") && e.contains("\"none\""), "{e}");
    let e = err(&base.replace("[engine]\n", "[engine]\nmax_streams = 0\n"));
    assert!(e.contains("engine.max_streams 0"), "0 once meant none: {e}");
    let e = err(&with("[engine.thinker]\nslotz = 3"));
    assert!(e.contains("slotz"), "unknown keys in a section are refused: {e}");
}

#[test]
fn check_config_command() {
    let bin = env!("CARGO_BIN_EXE_antiphon");
    let ok = Command::new(bin)
        .args(["check-config", "configs/default.toml"])
        .current_dir(root())
        .output()
        .unwrap();
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    assert!(String::from_utf8_lossy(&ok.stdout).contains("OK"));
    let bad = Command::new(bin)
        .args(["check-config", "configs/minicpmo45.toml"])
        .current_dir(root())
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("model.path"));
}

/// The configuration reference (docs/configuration.md) states every default: setting a key to the
/// value it gives must leave the parsed configuration exactly as leaving the key out does.
#[test]
fn the_configuration_reference_states_the_real_defaults() {
    let readme = std::fs::read_to_string(root().join("docs/configuration.md")).unwrap();
    let table = readme
        .split("# Configuration reference")
        .nth(1)
        .expect("a configuration section")
        .split("\n## ")
        .next()
        .unwrap();
    let base = "[model]\nsource = \"synthetic\"\n\n[[voices]]\nid = \"v\"\nwav \
    = \"../assets/voices/default.wav\"\n";
    let parse = |text: &str| {
        format!(
            "{:?}",
            Config::parse(text, &root().join("configs"))
                .unwrap_or_else(|e| panic!("{e:#}\n{text}"))
        )
    };
    let plain = parse(base);
    let strip = |s: &str| s.trim().trim_matches('`').to_string();
    let mut checked = 0;
    for row in table.lines().filter(|l| l.starts_with("| `")) {
        let cols: Vec<&str> = row.split('|').map(str::trim).collect();
        let (keys, defaults) = (cols[1], cols[2]);
        if defaults == "—" || defaults == "unlimited" {
            continue;
        }
        let sep = if keys.contains(" / ") { " / " } else { ", " };
        let keys: Vec<String> = keys.split(sep).map(strip).collect();
        let values: Vec<String> = defaults.split(sep).map(strip).collect();
        assert_eq!(keys.len(), values.len(), "README row {row:?}: as many defaults as keys");
        // (`engine.thinker.slots`, `slot_context`: the later keys in the first one's table)
        let section = keys[0].rsplit_once('.').unwrap().0.to_string();
        for (k, v) in keys.iter().zip(&values) {
            let (sec, key) = k.rsplit_once('.').unwrap_or((section.as_str(), k.as_str()));
            let literal =
                v.parse::<f64>().is_ok() || v == "true" || v == "false" || v.starts_with('[');
            let value = if literal { v.clone() } else { format!("{v:?}") };
            let text = if sec == "model" {
                base.replace("[model]\n", &format!("[model]\n{key} = {value}\n"))
            } else {
                format!("{base}\n[{sec}]\n{key} = {value}\n")
            };
            assert_eq!(
                parse(&text),
                plain,
                "docs/configuration.md says {sec}.{key} defaults to \
                {v}, but the code's default differs"
            );
            checked += 1;
        }
    }
    assert!(checked >= 40, "only {checked} defaults found in docs/configuration.md's table");
}

/// Every shipped configuration passes `check-config`, or fails only for the checkpoint directory
/// this machine does not have.
#[test]
fn every_shipped_config_passes_check_config() {
    let bin = env!("CARGO_BIN_EXE_antiphon");
    let mut n = 0;
    for e in std::fs::read_dir(root().join("configs")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_none_or(|x| x != "toml") {
            continue;
        }
        n += 1;
        let out =
            Command::new(bin).arg("check-config").arg(&p).current_dir(root()).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        let cuda = std::fs::read_to_string(&p).unwrap().contains("device = \"cuda");
        if p.ends_with("minicpmo45.toml") {
            assert!(!out.status.success() && err.contains("model.path"), "{}: {err}", p.display());
        } else if cuda && !cfg!(feature = "cuda") {
            // (a CUDA device on a build without CUDA is the one thing it finds)
            assert!(
                !out.status.success()
                    && err.contains("no CUDA")
                    && err.lines().filter(|l| l.starts_with("error: ")).count() == 1,
                "{}: {err}",
                p.display()
            );
        } else {
            assert!(out.status.success(), "{}: {err}", p.display());
        }
    }
    assert!(n >= 4, "found {n} configs");
}

/// `check-config` finds what `serve` would refuse or miss, without loading a weight, each named
/// with its file and what was expected (issue 42: it said OK to a missing tokenizer, a truncated
/// shard, a CUDA device on a CPU build and a missing web_dir).
#[test]
fn check_config_finds_what_serve_would_meet() {
    let bin = env!("CARGO_BIN_EXE_antiphon");
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path().join("ck");
    let opts = antiphon_assets::synth::SynthOptions { shard_bytes: 1 << 20, ..Default::default() };
    antiphon_assets::synth::write_checkpoint(&ck, &opts).unwrap();
    let config = |extra: &str| {
        let text = format!(
            "[server]\nweb_dir = {web:?}\n\n[model]\nsource = \"checkpoint\"\npath = \
            {ck:?}\n{extra}\n\n[[voices]]\nid = \"default\"\nwav = {wav:?}\n",
            web = root().join("web"),
            ck = ck,
            wav = root().join("assets/voices/default.wav"),
        );
        let p = tmp.path().join("c.toml");
        std::fs::write(&p, text).unwrap();
        let out = Command::new(bin).arg("check-config").arg(&p).output().unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (ok, err) = config("");
    assert!(ok, "a whole checkpoint passes: {err}");
    // a wrong shape: one layer's q_proj rewritten with a row too few
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(ck.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let name = "llm.model.layers.0.self_attn.q_proj.weight";
    let shard = ck.join(index["weight_map"][name].as_str().unwrap());
    let saved = std::fs::read(&shard).unwrap();
    let mut tensors = candle_core::safetensors::load(&shard, &candle_core::Device::Cpu).unwrap();
    let q = tensors[name].clone();
    tensors.insert(name.to_string(), q.narrow(0, 0, q.dim(0).unwrap() - 1).unwrap());
    candle_core::safetensors::save(&tensors, &shard).unwrap();
    let (ok, err) = config("");
    assert!(!ok && err.contains(name) && err.contains("config.json implies"), "{err}");
    // a truncated shard
    std::fs::write(&shard, &saved[..saved.len() - 100]).unwrap();
    let (ok, err) = config("");
    assert!(
        !ok && err.contains(&*shard.file_name().unwrap().to_string_lossy())
            && err.contains("truncated"),
        "{err}"
    );
    std::fs::write(&shard, &saved).unwrap();
    // no tokenizer
    std::fs::rename(ck.join("tokenizer.json"), ck.join("t.json")).unwrap();
    let (ok, err) = config("");
    assert!(!ok && err.contains("tokenizer.json"), "{err}");
    std::fs::rename(ck.join("t.json"), ck.join("tokenizer.json")).unwrap();
    // a CUDA device on a build without CUDA
    if !cfg!(feature = "cuda") {
        let (ok, err) = config("device = \"cuda:0\"");
        assert!(!ok && err.contains("no CUDA") && err.contains("--features cuda"), "{err}");
    }
    // a web_dir without the demo
    let text = std::fs::read_to_string(tmp.path().join("c.toml")).unwrap();
    std::fs::write(
        tmp.path().join("c.toml"),
        text.replace(&format!("{:?}", root().join("web")), &format!("{:?}", tmp.path())),
    )
    .unwrap();
    let out =
        Command::new(bin).arg("check-config").arg(tmp.path().join("c.toml")).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("server.web_dir") && err.contains("index.html"),
        "{err}"
    );
    // and all of it found, the checkpoint is whole again
    let (ok, err) = config("");
    assert!(ok, "{err}");
}

/// `check-config` opens `server.smart_turn_model` as `serve` does: a missing file and a file that
/// is not Smart Turn's are each named with the key.
#[test]
fn check_config_opens_the_turn_model() {
    let bin = env!("CARGO_BIN_EXE_antiphon");
    let tmp = tempfile::tempdir().unwrap();
    let base = std::fs::read_to_string(root().join("configs/default.toml"))
        .unwrap()
        .replace("../", &format!("{}/", root().display()));
    let check = |model: &std::path::Path| {
        let text =
            base.replacen("[server]\n", &format!("[server]\nsmart_turn_model = {model:?}\n"), 1);
        assert!(
            text.contains("smart_turn_model"),
            "the default configuration has a [server] table"
        );
        let p = tmp.path().join("c.toml");
        std::fs::write(&p, text).unwrap();
        let out = Command::new(bin).arg("check-config").arg(&p).output().unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (ok, err) = check(&tmp.path().join("missing.onnx"));
    assert!(
        !ok && err.contains("server.smart_turn_model") && err.contains("missing.onnx"),
        "{err}"
    );
    // an ONNX file, but CAM++'s speaker model from a synthetic checkpoint, not a turn model
    let ck = tmp.path().join("ck");
    antiphon_assets::synth::write_checkpoint(&ck, &antiphon_assets::synth::SynthOptions::default())
        .unwrap();
    let campplus = walk(&ck)
        .into_iter()
        .find(|p| p.file_name().is_some_and(|n| n == "campplus.onnx"))
        .expect("the checkpoint has campplus.onnx");
    let (ok, err) = check(&campplus);
    assert!(
        !ok && err.contains("server.smart_turn_model") && err.contains("input_features"),
        "{err}"
    );
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}
