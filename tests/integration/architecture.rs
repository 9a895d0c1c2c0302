//! The architecture as tests: the crate graph keeps the layers (ARCHITECTURE.md's "Architecture
//! invariant:" lines point here), the models crate does no file IO, and no source file grows past
//! the size a reader can hold.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `cargo metadata` of the workspace: package name -> the names of every package it depends on
/// for normal (non-dev, non-build) use, transitively.
fn normal_closure() -> BTreeMap<String, BTreeSet<String>> {
    let out = std::process::Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1"])
        .current_dir(root())
        .output()
        .expect("running cargo metadata");
    assert!(
        out.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let m: Value = serde_json::from_slice(&out.stdout).expect("cargo metadata prints JSON");
    let names: BTreeMap<String, String> = m["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["id"].as_str().unwrap().to_string(), p["name"].as_str().unwrap().to_string()))
        .collect();
    let mut direct: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for n in m["resolve"]["nodes"].as_array().unwrap() {
        let deps = n["deps"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|d| d["dep_kinds"].as_array().unwrap().iter().any(|k| k["kind"].is_null()))
            .map(|d| d["pkg"].as_str().unwrap().to_string())
            .collect();
        direct.insert(n["id"].as_str().unwrap().to_string(), deps);
    }
    let mut closure = BTreeMap::new();
    for (id, name) in &names {
        if !name.starts_with("antiphon") {
            continue;
        }
        let mut seen = BTreeSet::new();
        let mut todo = vec![id.clone()];
        while let Some(x) = todo.pop() {
            for d in direct.get(&x).into_iter().flatten() {
                if seen.insert(names[d].clone()) {
                    todo.push(d.clone());
                }
            }
        }
        closure.insert(name.clone(), seen);
    }
    closure
}

#[test]
fn the_crate_graph_keeps_the_layers() {
    let c = normal_closure();
    let expect = [
        "antiphon",
        "antiphon-protocol",
        "antiphon-audio",
        "antiphon-models",
        "antiphon-assets",
        "antiphon-engine",
        "antiphon-server",
        "antiphon-bench",
    ];
    for name in expect {
        assert!(
            c.contains_key(name),
            "the workspace has no crate {name}: {:?}",
            c.keys().collect::<Vec<_>>()
        );
    }
    let forbid = |krate: &str, banned: &[&str]| {
        let deps = &c[krate];
        let bad: Vec<&&str> = banned.iter().filter(|b| deps.contains(**b)).collect();
        assert!(
            bad.is_empty(),
            "{krate} must not depend on {bad:?} (directly or through another crate)"
        );
    };
    let server_side =
        ["tokio", "axum", "tower-http", "tokio-tungstenite", "opus", "prometheus", "hyper"];
    // Architecture invariant: the models are pure computation (candle + serde), no runtime, no
    // sockets.
    forbid("antiphon-models", &server_side);
    forbid(
        "antiphon-models",
        &[
            "antiphon-assets",
            "antiphon-engine",
            "antiphon-server",
            "antiphon-bench",
            "antiphon-protocol",
        ],
    );
    // Architecture invariant: model files are read in one crate, which knows nothing of serving.
    forbid("antiphon-assets", &server_side);
    forbid("antiphon-assets", &["antiphon-engine", "antiphon-server", "antiphon-bench"]);
    // Architecture invariant: the engine runs stages on threads; sockets and HTTP are the server's.
    forbid(
        "antiphon-engine",
        &["axum", "tower-http", "tokio-tungstenite", "tokio", "hyper", "opus"],
    );
    forbid("antiphon-engine", &["antiphon-server", "antiphon-bench", "antiphon-assets"]);
    // Architecture invariant: the bench client knows the wire protocol only, like any client.
    forbid(
        "antiphon-bench",
        &[
            "antiphon-engine",
            "antiphon-models",
            "antiphon-assets",
            "antiphon-server",
            "candle-core",
        ],
    );
    // Architecture invariant: the protocol crate is plain data (serde only).
    forbid(
        "antiphon-protocol",
        &["antiphon-audio", "antiphon-models", "antiphon-engine", "candle-core", "tokio"],
    );
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn the_models_crate_reads_no_files() {
    let mut files = Vec::new();
    rust_files(&root().join("src/models"), &mut files);
    assert!(files.len() > 10, "found only {} files under src/models", files.len());
    for f in files.iter().filter(|f| !f.ends_with("build.rs")) {
        let text = std::fs::read_to_string(f).unwrap();
        for banned in ["std::fs", "File::open", "read_to_string(", "tokio"] {
            assert!(
                !text.contains(banned),
                "{} uses {banned}: file IO belongs in antiphon-assets",
                f.display()
            );
        }
    }
}

#[test]
fn no_source_file_is_over_600_lines() {
    let mut files = Vec::new();
    for d in ["src", "tests", "benches"] {
        rust_files(&root().join(d), &mut files);
    }
    let long: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let n = std::fs::read_to_string(f).unwrap().lines().count();
            (n > 600).then(|| format!("{} ({n} lines)", f.strip_prefix(root()).unwrap().display()))
        })
        .collect();
    assert!(long.is_empty(), "split these files: {long:?}");
}

/// Every line of every Rust file (the sources, tests, benches and build scripts of every crate) is
/// at most 100 columns, counted in characters: rustfmt's `max_width`, and what it cannot break
/// (strings, comments, macro bodies) broken by hand.
#[test]
fn no_line_is_over_100_columns() {
    let mut files = Vec::new();
    for d in ["src", "tests", "benches"] {
        rust_files(&root().join(d), &mut files);
    }
    assert!(files.len() > 100, "found only {} files", files.len());
    let mut wide = Vec::new();
    for f in &files {
        for (k, line) in std::fs::read_to_string(f).unwrap().lines().enumerate() {
            let n = line.chars().count();
            if n > 100 {
                let path = f.strip_prefix(root()).unwrap().display();
                wide.push(format!("{path}:{} ({n} columns)", k + 1));
            }
        }
    }
    assert!(wide.is_empty(), "break these lines: {wide:?}");
}

/// The crates of the workspace: the root and every `src/*` with a manifest.
fn crate_dirs() -> Vec<PathBuf> {
    let mut dirs = vec![root()];
    for e in std::fs::read_dir(root().join("src")).unwrap() {
        let p = e.unwrap().path();
        if p.join("Cargo.toml").is_file() {
            dirs.push(p);
        }
    }
    dirs
}

/// One link and one run per crate: a crate's integration tests are modules of one binary
/// (`tests/<name>.rs`, or `tests/<name>/main.rs` with its modules beside it), never one binary a
/// file, and no `[[test]]` target is declared by hand.
#[test]
fn each_crate_has_at_most_one_integration_test_binary() {
    let dirs = crate_dirs();
    assert!(dirs.len() >= 8, "found only {} crates", dirs.len());
    for dir in dirs {
        let manifest = std::fs::read_to_string(dir.join("Cargo.toml")).unwrap();
        assert!(
            !manifest.contains("[[test]]"),
            "{}: a [[test]] target; keep integration tests in one binary",
            dir.display()
        );
        let Ok(entries) = std::fs::read_dir(dir.join("tests")) else { continue };
        let binaries: Vec<String> = entries
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "rs") || p.join("main.rs").is_file())
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert!(
            binaries.len() <= 1,
            "{}: {} integration-test binaries {binaries:?}; make them modules of one",
            dir.display(),
            binaries.len()
        );
    }
}

/// The string types a field must not have where a closed set of words belongs.
const STRING_TYPES: [&str; 6] =
    ["String", "&'static str", "&str", "Option<String>", "Option<&'static str>", "Option<&str>"];

/// `name: Type` fields in `line` whose name is one of `names` and whose type is a string.
fn string_fields<'a>(line: &str, names: &[&'a str]) -> Vec<&'a str> {
    let mut found = Vec::new();
    for name in names {
        let mut from = 0;
        while let Some(at) = line[from..].find(name).map(|k| k + from) {
            from = at + name.len();
            let before = line[..at].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '.') {
                continue;
            }
            let Some(rest) = line[from..].strip_prefix(':') else { continue };
            let rest = rest.trim_start();
            let string = STRING_TYPES.iter().any(|t| {
                rest.strip_prefix(t).is_some_and(|after| {
                    after.is_empty() || after.starts_with([',', '}', ')', ' ', '>'])
                })
            });
            if string {
                found.push(*name);
            }
        }
    }
    found
}

/// Contracts between layers are types: in no crate's types does a field named `status`,
/// `reason`, `code` or `trigger` hold a string (each is an enum with its words).
#[test]
fn status_reason_code_and_trigger_are_never_strings() {
    assert_eq!(
        string_fields("    ToolCallInvalid { seq: u64, reason: String },", &["reason"]),
        ["reason"]
    );
    assert_eq!(string_fields("    pub code: &'static str,", &["code"]), ["code"]);
    assert!(string_fields("    pub status: ItemStatus, error_code: String", &["status", "code"])
        .is_empty());
    let mut files = Vec::new();
    rust_files(&root().join("src"), &mut files);
    assert!(files.len() > 100, "found only {} files", files.len());
    let mut bad = Vec::new();
    for f in &files {
        for (k, line) in std::fs::read_to_string(f).unwrap().lines().enumerate() {
            // (a function's parameters are not a type's fields)
            if line.contains("fn ") || line.trim_start().starts_with("//") {
                continue;
            }
            for name in string_fields(line, &["status", "reason", "code", "trigger"]) {
                bad.push(format!(
                    "{}:{}: `{name}`",
                    f.strip_prefix(root()).unwrap().display(),
                    k + 1
                ));
            }
        }
    }
    assert!(bad.is_empty(), "make these closed sets of words enums: {bad:?}");
}

/// ARCHITECTURE.md is a map a newcomer reads in one sitting: under 300 lines of at most 100
/// columns, every source file named in its code map, and no measurement history (run numbers
/// belong in docs/performance.md, rationale in docs/design/).
#[test]
fn the_architecture_document_maps_every_file() {
    let doc = std::fs::read_to_string(root().join("ARCHITECTURE.md")).unwrap();
    let lines = doc.lines().count();
    assert!(lines < 300, "ARCHITECTURE.md is {lines} lines: move rationale to docs/design/");
    let wide: Vec<usize> = doc
        .lines()
        .enumerate()
        .filter(|(_, l)| l.chars().count() > 100)
        .map(|(k, _)| k + 1)
        .collect();
    assert!(wide.is_empty(), "ARCHITECTURE.md lines over 100 columns: {wide:?}");
    let words: Vec<&str> = doc.split_whitespace().collect();
    let runs: Vec<String> = words
        .windows(2)
        .filter(|w| {
            matches!(w[0].trim_start_matches('('), "run" | "runs")
                && w[1].starts_with(|c: char| c.is_ascii_digit())
        })
        .map(|w| w.join(" "))
        .collect();
    assert!(runs.is_empty(), "ARCHITECTURE.md names measurements: {runs:?}");
    let mut files = Vec::new();
    rust_files(&root().join("src"), &mut files);
    let unnamed: Vec<String> = files
        .iter()
        .filter_map(|f| f.file_name()?.to_str())
        .filter(|n| {
            !matches!(*n, "mod.rs" | "lib.rs" | "main.rs" | "tests.rs" | "build.rs")
                && !n.ends_with("_tests.rs")
        })
        .filter(|n| !doc.contains(&format!("`{n}`")) && !doc.contains(&format!("/{n}`")))
        .map(str::to_string)
        .collect();
    assert!(unnamed.is_empty(), "ARCHITECTURE.md's code map does not name {unnamed:?}");
}

/// Lines of `src/engine` and `src/server` outside `allowed` that contain one of `all` (every one).
fn lines_with(all: &[&str], allowed: &str) -> Vec<String> {
    let mut files = Vec::new();
    for d in ["src/engine", "src/server"] {
        rust_files(&root().join(d), &mut files);
    }
    let mut hits = Vec::new();
    for f in files.iter().filter(|f| !f.ends_with(allowed)) {
        for (k, line) in std::fs::read_to_string(f).unwrap().lines().enumerate() {
            if all.iter().all(|w| line.contains(w)) {
                hits.push(format!("{}:{}", f.strip_prefix(root()).unwrap().display(), k + 1));
            }
        }
    }
    hits
}

/// The context-fit rule and the voice check are each defined once: a check of a request against a
/// context is a call into `src/engine/fit.rs`, whether audio makes a voice is
/// `antiphon_audio::voice_fault`, whether samples can reach a stage is `RefInput::fault`.
#[test]
fn the_context_fit_rule_and_the_voice_check_are_defined_once() {
    let mut twice = Vec::new();
    for sum in ["saturating_sub(", "checked_add(", "checked_sub("] {
        for size in ["context", "max_positions", "ctx0", "ctx1"] {
            twice.extend(
                lines_with(&[size, sum], "src/engine/fit.rs")
                    .into_iter()
                    .filter(|l| !l.contains("with_context")),
            );
        }
    }
    assert!(twice.is_empty(), "context arithmetic outside src/engine/fit.rs: {twice:?}");
    for check in
        [["samples.is_empty()", "is_finite"], ["MIN_VOICE_S", "<"], ["MIN_VOICE_DBFS", "<"]]
    {
        let again = lines_with(&check, "src/engine/clips.rs");
        assert!(again.is_empty(), "a second voice check ({check:?}): {again:?}");
    }
}

/// Metric label values are types: the engine's spelled once in `src/engine/metric_labels.rs`, the
/// server's in `src/server/metrics.rs` (and a label type's own impl); no other file picks a series
/// by a string.
#[test]
fn metric_labels_are_types() {
    let mut files = Vec::new();
    rust_files(&root().join("src/engine"), &mut files);
    rust_files(&root().join("src/server"), &mut files);
    let spelled = ["src/engine/metric_labels.rs", "src/server/metrics.rs"];
    for s in spelled {
        assert!(files.iter().any(|f| f.ends_with(s)), "{s}");
    }
    let mut hits = Vec::new();
    for f in files.iter().filter(|f| !spelled.iter().any(|s| f.ends_with(s))) {
        for (k, line) in std::fs::read_to_string(f).unwrap().lines().enumerate() {
            if line.contains("with_label_values(") {
                hits.push(format!("{}:{}", f.strip_prefix(root()).unwrap().display(), k + 1));
            }
        }
    }
    assert!(hits.is_empty(), "pick a series with `Labeled::at` and a label type: {hits:?}");
}

/// Async code never waits on a stage: the engine's API (`src/engine/lib.rs`, what the server's
/// tasks call) and admission (which the server's tasks also reach) only offer messages to the
/// stages' bounded inboxes (`src/engine/inbox.rs`), never a blocking `send`.
#[test]
fn the_engine_api_never_waits_on_a_stage_inbox() {
    let mut hits = Vec::new();
    for f in ["src/engine/lib.rs", "src/engine/admission.rs"] {
        for (k, line) in std::fs::read_to_string(root().join(f)).unwrap().lines().enumerate() {
            if line.contains(".send(") {
                hits.push(format!("{f}:{}", k + 1));
            }
        }
    }
    assert!(hits.is_empty(), "offer to a stage with `inbox::offer`: {hits:?}");
}
