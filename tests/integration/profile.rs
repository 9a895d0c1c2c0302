//! `antiphon profile` on the embedded default (tiny synthetic models on the CPU): the rows a GPU
//! call asks for run and come out in its JSON, so that a broken profile is found here and not in a
//! lent GPU's budget.

use std::process::Command;

fn root() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Runs the profile with `--only only` at batch 1, one iteration: each row's name and median ms.
fn profile(only: &str) -> Vec<(String, f64)> {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("profile.json");
    let run = Command::new(env!("CARGO_BIN_EXE_antiphon"))
        .args(["profile", "--iters", "1", "--batch", "1", "--only", only, "--out"])
        .arg(&out)
        .current_dir(root())
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let rows: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    rows.as_array()
        .expect("a list of rows")
        .iter()
        .map(|r| (r["what"].as_str().unwrap().to_string(), r["median_ms"].as_f64().unwrap()))
        .collect()
}

#[test]
fn the_profile_times_the_decode_steps_and_the_long_call_rows() {
    let rows = profile("(slots,position");
    let has = |start: &str| rows.iter().any(|(what, _)| what.starts_with(start));
    for start in [
        "thinker decode step (slots, graph) + ids to host",
        "talker decode step (slots, graph) + ids to host",
        // the long call's rows, at the last whole 1024 positions the tiny model's context holds
        "thinker decode step (slots, graph) at position 7168",
        "thinker prefill step in slots: b prompts x 96 positions at position 7168",
    ] {
        assert!(has(start), "no row {start:?} in {rows:?}");
    }
    for (what, ms) in &rows {
        assert!(ms.is_finite() && *ms > 0.0, "{what}: {ms} ms");
    }
}
