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
    assert_eq!(s.model.dtype, "bf16");
    // the real-checkpoint file names a directory this machine does not have
    let e = format!("{:#}", Config::load(&root().join("configs/minicpmo45.toml")).unwrap_err());
    assert!(e.contains("model.path") && e.contains("config.json"), "{e}");
}

#[test]
fn mistakes_are_named() {
    let base = std::fs::read_to_string(root().join("configs/default.toml")).unwrap();
    let cfgdir = root().join("configs");
    let err = |text: &str| format!("{:#}", Config::parse(text, &cfgdir).unwrap_err());
    assert!(err(&base.replace("listen = \"127.0.0.1:8080\"", "listen = \"nowhere\"")).contains("server.listen"));
    assert!(err(&base.replace("source = \"synthetic\"", "source = \"magic\"")).contains("source"));
    assert!(err(&base.replace("dtype = \"f32\"", "dtype = \"f8\"")).contains("model.dtype"));
    assert!(err(&base.replace("default.wav", "missing.wav")).contains("does not exist"));
    assert!(err(&format!("{base}\n[server2]\nx = 1\n")).contains("server2"), "unknown tables are refused");
    assert!(err(&base.replace("max_sessions = 8", "max_sessions = 0")).contains("max_sessions"));
}

#[test]
fn check_config_command() {
    let bin = env!("CARGO_BIN_EXE_antiphon");
    let ok = Command::new(bin).args(["check-config", "configs/default.toml"]).current_dir(root()).output().unwrap();
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    assert!(String::from_utf8_lossy(&ok.stdout).contains("OK"));
    let bad = Command::new(bin).args(["check-config", "configs/minicpmo45.toml"]).current_dir(root()).output().unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("model.path"));
}
