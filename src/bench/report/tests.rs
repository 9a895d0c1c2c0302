use super::*;

#[test]
fn percentiles_by_nearest_rank() {
    let v: Vec<f64> = (1..=100).map(|x| x as f64).collect();
    let p = Percentiles::of(&v);
    assert_eq!((p.p50, p.p90, p.p95, p.p99), (50.0, 90.0, 95.0, 99.0));
    assert!((p.mean - 50.5).abs() < 1e-9);
    assert_eq!(Percentiles::of(&[]), Percentiles::default());
}

fn summary(workload: &str, levels: Vec<LevelSummary>) -> Summary {
    use super::super::{goodput, Workload};
    let w = if workload == "conversations" { Workload::Conversations } else { Workload::Tts };
    Summary {
        workload: workload.into(),
        server: "s".into(),
        config: "c".into(),
        synthetic_weights: true,
        date: "d".into(),
        text_tokens: 8,
        audio_tokens: 30,
        goodput: Some(goodput::of(w, &levels)),
        levels,
    }
}

fn level(concurrency: usize, p95: f64) -> LevelSummary {
    LevelSummary {
        concurrency,
        requests: 10,
        ttfa_ms: Percentiles { mean: p95 / 2.0, p50: p95 / 2.0, p90: p95, p95, p99: p95 },
        stall_events: 3,
        ..Default::default()
    }
}

/// The SVG's text elements: (the element's attributes, its text).
fn svg_texts(s: &Summary, name: &str) -> Vec<(String, String)> {
    let path =
        std::env::temp_dir().join(format!("antiphon-bench-{}-{name}.svg", std::process::id()));
    plot(s, &path).unwrap();
    let svg = std::fs::read_to_string(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    svg.split("<text")
        .skip(1)
        .filter_map(|t| {
            t.split_once('>').map(|(attrs, rest)| {
                (attrs.to_string(), rest.split("</text>").next().unwrap_or("").trim().to_string())
            })
        })
        .collect()
}

/// The x axis's tick labels: the centred texts that are not a caption or an axis's
/// description (those have spaces).
fn x_ticks(texts: &[(String, String)]) -> Vec<String> {
    texts
        .iter()
        .filter(|(a, t)| a.contains("text-anchor=\"middle\"") && !t.contains(' ') && !t.is_empty())
        .map(|(_, t)| t.clone())
        .collect()
}

/// A long conversation's first audio per ten turns, from its records (warm-up and failed
/// replies left out); none for short conversations.
#[test]
fn ttfa_by_ten_turns_of_a_session() {
    let recs: Vec<RequestRecord> = (0..2)
        .flat_map(|w| {
            (0..25).map(move |i| {
                let mut r = RequestRecord::new(2, w, i, false, 0, 0.0);
                (r.ok, r.turn, r.ttfa_ms) = (true, Some(i), Some(100.0 + 10.0 * i as f64));
                r
            })
        })
        .collect();
    let l = level_summary(2, &recs, 10.0);
    assert_eq!(l.ttfa_p50_by_ten_turns, Some(vec![140.0, 240.0, 320.0]));
    assert_eq!(level_summary(2, &recs[..9], 10.0).ttfa_p50_by_ten_turns, None);
}

#[test]
fn one_tick_per_level_labelled_with_it() {
    let s = summary("tts", vec![level(1, 300.0), level(2, 450.0)]);
    let texts = svg_texts(&s, "levels");
    assert_eq!(x_ticks(&texts), ["1", "2"], "{texts:?}");
    let all: Vec<&str> = texts.iter().map(|(_, t)| t.as_str()).collect();
    assert_eq!(all.iter().filter(|t| **t == "1").count(), 1, "{all:?}");
    assert_eq!(all.iter().filter(|t| **t == "2").count(), 1, "{all:?}");
    assert!(all.contains(&"concurrency C") && all.contains(&"TTFA p95"), "{all:?}");
    // wide levels too: evenly spaced, never a repeated label
    let s =
        summary("tts", [1, 2, 4, 8, 16, 32].iter().map(|&c| level(c, 100.0 * c as f64)).collect());
    assert_eq!(x_ticks(&svg_texts(&s, "six")), ["1", "2", "4", "8", "16", "32"]);
}

#[test]
fn rates_are_ticks_too() {
    let at = |r: f64, p95: f64| LevelSummary {
        rate_per_s: Some(r),
        calls_offered: Some(10),
        calls_refused: Some(1),
        ..level(3, p95)
    };
    let s = summary("conversations", vec![at(0.5, 200.0), at(2.0, 300.0), at(8.0, 900.0)]);
    let texts = svg_texts(&s, "rates");
    assert_eq!(x_ticks(&texts), ["0.5/s", "2/s", "8/s"], "{texts:?}");
    let all: Vec<&str> = texts.iter().map(|(_, t)| t.as_str()).collect();
    assert!(
        all.contains(&"refused calls") && all.contains(&"arrival rate (conversations per second)"),
        "{all:?}"
    );
    let t = table(&s);
    assert!(t.contains("0.5/s") && t.contains("goodput"), "{t}");
}

#[test]
fn iso_dates() {
    let d = now_iso();
    assert_eq!(d.len(), 20);
    assert!(d.starts_with("20") && d.ends_with('Z'));
}
