//! The bench client against a real server with the tiny engine: the output contract of
//! `summary.json`, every workload, and A/B mode with servers it starts and stops itself.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use antiphon_bench::{ab, report::Summary, BenchConfig, Workload};
use antiphon_server::config::Config;
use serde_json::Value;

async fn server() -> antiphon_server::Server {
    let mut cfg = Config::parse(
        antiphon_server::config::DEFAULT_TOML,
        std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/configs")),
    )
    .unwrap();
    cfg.server.listen = "127.0.0.1:0".into();
    let models = antiphon_assets::synth::models_in_memory(
        antiphon_assets::synth::Preset::Tiny,
        0,
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let s = antiphon_server::start(cfg, models).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !s.shared.ready.load(std::sync::atomic::Ordering::SeqCst) {
        assert!(Instant::now() < deadline, "server never got ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    s
}

fn config(
    url: String,
    workload: Workload,
    levels: Vec<usize>,
    requests: usize,
    out: PathBuf,
) -> BenchConfig {
    BenchConfig {
        url,
        api_key: None,
        workload,
        levels,
        requests,
        warmup: 1,
        text_tokens: 8,
        audio_tokens: 30,
        prebuffers_ms: vec![0, 100],
        input_wav: None,
        transcribe: false,
        out,
        server_label: "test".into(),
        config_label: "tiny".into(),
        synthetic: Some(true),
        progress: false,
        timeout: Duration::from_secs(120),
        speak_every: 2,
        duplex_units: 6,
        rates: vec![2.0],
        conversations: 2,
        turns: 2,
        think: Duration::from_millis(100),
        seed: 0,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tts_summary_follows_the_contract() {
    let s = server().await;
    let dir = tempfile::tempdir().unwrap();
    let url = format!("ws://{}/v1/realtime", s.addr);
    let info = antiphon_bench::probe_build_info(&url).await.expect("build info");
    assert_eq!(info["synthetic_weights"], true);
    let summary = antiphon_bench::run(config(url, Workload::Tts, vec![1, 2], 2, dir.path().into()))
        .await
        .unwrap();

    // the contract, as a script reads it
    let v: Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("summary.json")).unwrap()).unwrap();
    for k in ["workload", "server", "config", "synthetic_weights", "date", "levels"] {
        assert!(v.get(k).is_some(), "summary.json lacks {k}");
    }
    assert_eq!(v["workload"], "tts");
    assert_eq!(v["levels"].as_array().unwrap().len(), 2);
    for (l, c) in v["levels"].as_array().unwrap().iter().zip([1, 2]) {
        assert_eq!(l["concurrency"], c);
        assert_eq!(l["requests"], 2);
        assert_eq!(l["failures"], 0, "{l}");
        for m in ["ttfa_ms", "ttft_ms"] {
            for p in ["mean", "p50", "p90", "p95", "p99"] {
                assert!(l[m][p].as_f64().unwrap() > 0.0, "{m}.{p} in {l}");
            }
            assert!(l[m]["p50"].as_f64() <= l[m]["p99"].as_f64());
        }
        for k in ["rtf_mean", "audio_throughput", "requests_per_s"] {
            assert!(l[k].as_f64().unwrap() > 0.0, "{k} in {l}");
        }
        for k in ["stall_events", "stall_ms"] {
            assert!(l[k].as_f64().is_some(), "{k} in {l}");
        }
        // first text before first audio; audio ≈ forced codes × 40 ms
        assert!(l["ttft_ms"]["p50"].as_f64() <= l["ttfa_ms"]["p50"].as_f64());
        let audio = l["audio_ms_mean"].as_f64().unwrap();
        assert!((1200.0..=1600.0).contains(&audio), "audio {audio} ms for 30 codes");
    }
    let parsed: Summary = serde_json::from_value(v).unwrap();
    assert_eq!(parsed.levels.len(), summary.levels.len());
    assert!((parsed.levels[0].ttfa_ms.p50 - summary.levels[0].ttfa_ms.p50).abs() < 1e-6);

    // every request, warm-up included and marked
    let lines = std::fs::read_to_string(dir.path().join("requests.jsonl")).unwrap();
    let recs: Vec<Value> = lines.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    // C1: 1 warm-up + 2; C2: 2 workers × (1 warm-up + 1)
    assert_eq!(recs.len(), 7);
    assert_eq!(recs.iter().filter(|r| r["warmup"] == true).count(), 3);
    for r in &recs {
        assert_eq!(r["ok"], true, "{r}");
        assert!(r["packets"].as_u64().unwrap() > 0);
        assert!(r["chunks"].as_u64().unwrap() >= 1);
        assert!(r["rtf"].as_f64().unwrap() > r["rtf_compute"].as_f64().unwrap());
    }
    let csv = std::fs::read_to_string(dir.path().join("summary.csv")).unwrap();
    assert_eq!(csv.lines().count(), 3);
    assert!(csv.starts_with("workload,concurrency,requests,failures,ttfa_mean"));
    let svg = std::fs::read_to_string(dir.path().join("ttfa.svg")).unwrap();
    assert!(svg.contains("<svg") && svg.contains("TTFA p50"));
    assert!(std::fs::read_to_string(dir.path().join("table.txt")).unwrap().contains("TTFA p50"));
    s.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn voice_and_clone_workloads() {
    let s = server().await;
    let url = format!("ws://{}/v1/realtime", s.addr);
    for w in [Workload::Voice, Workload::Clone, Workload::CloneTurns] {
        let dir = tempfile::tempdir().unwrap();
        let t0 = Instant::now();
        let created = s.shared.metrics.sessions_created.get();
        let mut cfg = config(url.clone(), w, vec![1], 1, dir.path().into());
        // (the voice workload with its turns transcribed: the transcript events come between the
        // bench's own and change nothing it measures)
        cfg.transcribe = w == Workload::Voice;
        let summary = antiphon_bench::run(cfg).await.unwrap();
        let l = &summary.levels[0];
        assert_eq!(l.failures, 0, "{w:?}: {:?}", l.failures_by_code);
        assert!(l.ttfa_ms.p50 > 0.0);
        // a warm-up request and a measured one: two callers for `clone`, one conversation else
        let sessions = s.shared.metrics.sessions_created.get() - created;
        assert_eq!(sessions, if w == Workload::Clone { 2 } else { 1 }, "{w:?}");
        if w == Workload::Voice {
            // the 6 s input is streamed in real time, twice (warm-up + measured)
            assert!(t0.elapsed() > Duration::from_secs(11), "{:?}", t0.elapsed());
        }
    }
    let m = s.shared.engine.metrics().render();
    assert!(m.contains("antiphon_prefetch_total"), "the clone workload exercised prefetch");
    s.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplex_workload() {
    let s = server().await;
    let url = format!("ws://{}/v1/realtime", s.addr);
    let dir = tempfile::tempdir().unwrap();
    let t0 = Instant::now();
    // 6 s per session: units 1 and 3 speak (5 has no unit after it); the first turn is warm-up
    let mut cfg = config(url, Workload::Duplex, vec![1, 2], 1, dir.path().into());
    cfg.text_tokens = 4;
    cfg.audio_tokens = 35;
    let summary = antiphon_bench::run(cfg).await.unwrap();
    assert!(t0.elapsed() >= Duration::from_secs(12), "streamed in real time: {:?}", t0.elapsed());
    for (l, c) in summary.levels.iter().zip([1, 2]) {
        assert_eq!(l.concurrency, c);
        assert_eq!(l.requests, c, "one measured turn per session");
        assert_eq!(l.warmup_requests, c);
        assert_eq!(l.failures, 0, "{:?}", l.failures_by_code);
        // measured from the end of the speaking unit: positive, and well under the unit cycle
        assert!(l.ttfa_ms.p50 > 0.0 && l.ttfa_ms.p50 < 2000.0, "{:?}", l.ttfa_ms);
        // 25 codes of the unit + 10 drained = 1.4 s, plus the first chunk's lead-in
        assert!((1400.0..=1800.0).contains(&l.audio_ms_mean), "{}", l.audio_ms_mean);
    }
    let recs = std::fs::read_to_string(dir.path().join("requests.jsonl")).unwrap();
    let units: Vec<u64> = recs
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["prompt"].as_u64().unwrap())
        .collect();
    assert!(units.iter().all(|u| [1, 3].contains(u)), "{units:?}");
    s.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conversations_arrive_at_a_rate() {
    let s = server().await;
    let url = format!("ws://{}/v1/realtime", s.addr);
    let dir = tempfile::tempdir().unwrap();
    let created = s.shared.metrics.sessions_created.get();
    let mut cfg = config(url, Workload::Conversations, vec![1], 1, dir.path().into());
    cfg.rates = vec![4.0];
    cfg.conversations = 3;
    cfg.turns = 2;
    cfg.think = Duration::from_millis(50);
    cfg.seed = 3;
    let summary = antiphon_bench::run(cfg).await.unwrap();

    let v: Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("summary.json")).unwrap()).unwrap();
    assert_eq!(v["workload"], "conversations");
    let levels = v["levels"].as_array().unwrap();
    assert_eq!(levels.len(), 1);
    let l = &levels[0];
    assert_eq!(l["rate_per_s"], 4.0, "{l}");
    assert_eq!(l["calls_offered"], 3, "{l}");
    assert_eq!(l["calls_refused"], 0, "{l}");
    assert_eq!(l["replies_refused"], 0, "{l}");
    // every turn of every conversation, none failed; no warm-up in this workload
    assert_eq!(l["requests"], 6, "{l}");
    assert_eq!(l["failures"], 0, "{l}");
    assert_eq!(l["warmup_requests"], 0, "{l}");
    assert!(l["ttfa_ms"]["p50"].as_f64().unwrap() > 0.0, "{l}");
    assert!(l["audio_throughput"].as_f64().unwrap() > 0.0, "{l}");
    let peak = l["concurrency"].as_u64().unwrap();
    assert!((1..=3).contains(&peak), "{l}");
    assert!((1..=peak).contains(&l["live_sessions_peak"].as_u64().unwrap()), "{l}");
    let frac = l["responses_without_stall_frac"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&frac), "{l}");
    assert!(l.get("retry_after_ms").is_none(), "no refusal, no retry_after_ms: {l}");
    assert_eq!(s.shared.metrics.sessions_created.get() - created, 3, "a session per conversation");
    // the goodput, in conversations per second (whether 4/s meets it depends on the machine)
    let g = &v["goodput"];
    assert_eq!(g["unit"], "conversations/s", "{g}");
    assert!(g["criterion"].as_str().unwrap().contains("800 ms"), "{g}");
    assert!(g["level"].is_null() || g["level"] == 4.0, "{g}");
    assert!(summary.goodput.is_some());

    // each turn's record names its rate, conversation and turn; turn 1 comes after turn 0 played
    let lines = std::fs::read_to_string(dir.path().join("requests.jsonl")).unwrap();
    let recs: Vec<Value> = lines.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(recs.len(), 6);
    for c in 0..3u64 {
        let turns: Vec<&Value> = recs.iter().filter(|r| r["conversation"] == c).collect();
        assert_eq!(turns.len(), 2, "conversation {c}");
        let (t0, t1) = (
            turns.iter().find(|r| r["turn"] == 0).unwrap(),
            turns.iter().find(|r| r["turn"] == 1).unwrap(),
        );
        assert!(turns.iter().all(|r| r["rate_per_s"] == 4.0 && r["ok"] == true), "{turns:?}");
        // the reply is at least its audio long, then the think time
        let played = t0["start_s"].as_f64().unwrap()
            + (t0["ttfa_ms"].as_f64().unwrap() + t0["audio_ms"].as_f64().unwrap() + 50.0) / 1000.0;
        assert!(t1["start_s"].as_f64().unwrap() >= played - 0.05, "{t0} {t1}");
    }
    let table = std::fs::read_to_string(dir.path().join("table.txt")).unwrap();
    assert!(table.contains("4/s") && table.contains("goodput"), "{table}");
    let csv = std::fs::read_to_string(dir.path().join("summary.csv")).unwrap();
    assert!(csv.lines().next().unwrap().ends_with(concat!(
        ",rate_per_s,calls_offered,calls_refused,replies_refused,live_sessions_peak,",
        "responses_without_stall_frac,retry_after_ms"
    )));
    assert!(
        std::fs::read_to_string(dir.path().join("ttfa.svg")).unwrap().contains("\n4/s\n"),
        "the rate's tick"
    );
    s.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_are_counted_by_code() {
    // nothing listens on this port: every worker fails to connect, and the run says so
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let dir = tempfile::tempdir().unwrap();
    let r = antiphon_bench::run(config(
        format!("ws://127.0.0.1:{port}/v1/realtime"),
        Workload::Tts,
        vec![1],
        1,
        dir.path().into(),
    ))
    .await;
    assert!(r.is_err());
    assert!(format!("{:#}", r.unwrap_err()).contains("connecting"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ab_mode_starts_and_stops_its_servers() {
    let dir = tempfile::tempdir().unwrap();
    let exe = env!("CARGO_BIN_EXE_antiphon");
    let root = env!("CARGO_MANIFEST_DIR");
    let conf = |prefetch: bool| {
        let p = dir.path().join(format!("prefetch-{prefetch}.toml"));
        let text = antiphon_server::config::DEFAULT_TOML
            .replace("prefetch = true", &format!("prefetch = {prefetch}"))
            .replace("\"../web\"", &format!("\"{root}/web\""))
            .replace("\"../assets/", &format!("\"{root}/assets/"));
        std::fs::write(&p, text).unwrap();
        p
    };
    let (a, b) = (conf(true), conf(false));
    let cfg = ab::AbConfig {
        a: ab::ServerSpec::Shell(format!(
            "{exe} serve --config {} --listen 127.0.0.1:{{port}}",
            a.display()
        )),
        b: ab::ServerSpec::Shell(format!(
            "{exe} serve --config {} --listen 127.0.0.1:{{port}}",
            b.display()
        )),
        blocks: 1,
        bench: config(String::new(), Workload::Clone, vec![1], 1, PathBuf::new()),
        out: dir.path().join("ab"),
        ready_timeout: Duration::from_secs(120),
    };
    let report = ab::run(cfg).await.unwrap();
    assert_eq!(report.order, "A B");
    assert!(!report.comparisons.is_empty());
    let t = report.comparisons.iter().find(|c| c.metric == "ttfa_p50_ms").unwrap();
    assert!(t.a_mean > 0.0 && t.b_mean > 0.0);
    // the verdict follows from the blocks' ranges (ttfa: lower is better)
    let overlap = t.a_min <= t.b_max && t.b_min <= t.a_max;
    let want = if overlap {
        "noise"
    } else if t.b_mean < t.a_mean {
        "B better"
    } else {
        "B worse"
    };
    assert_eq!(t.verdict, want, "{t:?}");
    assert!((t.ratio - t.b_mean / t.a_mean).abs() < 1e-9, "{t:?}");
    assert_eq!(report.comparisons.iter().find(|c| c.metric == "failures").unwrap().a_mean, 0.0);
    for block in ["block01-A", "block02-B"] {
        let d = dir.path().join("ab").join(block);
        assert!(d.join("summary.json").exists(), "{block}");
        let log = std::fs::read_to_string(d.join("server.log")).unwrap();
        assert!(log.contains("listening"), "{log}");
    }
    assert!(std::fs::read_to_string(dir.path().join("ab/ab.md"))
        .unwrap()
        .contains("| 1 | ttfa_p50_ms |"));
    let v: Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("ab/ab.json")).unwrap()).unwrap();
    assert_eq!(v["blocks_per_side"], 1);
}
