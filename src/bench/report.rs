//! The bench's outputs: `summary.json` (the contract scripts read), `requests.jsonl` (every raw
//! figure), `summary.csv`, `ttfa.svg` (TTFA percentiles and stalls against concurrency) and a text
//! table.

use std::io::Write;
use std::path::Path;

use anyhow::Result;
use serde::{Deserialize, Serialize};

use super::RequestRecord;

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Percentiles {
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p95: f64,
    pub p99: f64,
}

impl Percentiles {
    pub fn of(values: &[f64]) -> Self {
        if values.is_empty() {
            return Self::default();
        }
        let mut v = values.to_vec();
        v.sort_by(|a, b| a.total_cmp(b));
        let at = |p: f64| {
            // nearest rank
            let k = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len());
            v[k - 1]
        };
        Self { mean: v.iter().sum::<f64>() / v.len() as f64, p50: at(0.5), p90: at(0.9), p95: at(0.95), p99: at(0.99) }
    }
}

/// One concurrency level (the contract's fields first, then more).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LevelSummary {
    pub concurrency: usize,
    pub requests: usize,
    pub failures: usize,
    pub ttfa_ms: Percentiles,
    pub ttft_ms: Percentiles,
    /// Mean of (last audio − request start) / audio duration.
    pub rtf_mean: f64,
    pub stall_events: usize,
    pub stall_ms: f64,
    /// Delivered audio seconds per wall second.
    pub audio_throughput: f64,
    pub requests_per_s: f64,
    /// Mean of (last audio − first audio) / audio duration.
    pub rtf_compute_mean: f64,
    /// audio_throughput × 25.
    pub codes_per_s: f64,
    /// Stalls with a 100 ms pre-buffer.
    pub stall_events_prebuffer_100ms: usize,
    pub stall_ms_prebuffer_100ms: f64,
    pub failures_by_code: std::collections::BTreeMap<String, usize>,
    pub warmup_requests: usize,
    pub audio_ms_mean: f64,
    pub chunks_mean: f64,
    pub wall_s: f64,
    /// The server's per-stage step times and first-audio milestones over this level (from its
    /// `/metrics`), where it could be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server: Option<super::scrape::ServerBreakdown>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Summary {
    pub workload: String,
    pub server: String,
    pub config: String,
    pub synthetic_weights: bool,
    pub date: String,
    pub text_tokens: usize,
    pub audio_tokens: usize,
    pub levels: Vec<LevelSummary>,
}

pub fn level_summary(level: usize, recs: &[RequestRecord], wall_s: f64) -> LevelSummary {
    let measured: Vec<&RequestRecord> = recs.iter().filter(|r| !r.warmup).collect();
    let ok: Vec<&&RequestRecord> = measured.iter().filter(|r| r.ok).collect();
    let mut failures_by_code = std::collections::BTreeMap::new();
    for r in measured.iter().filter(|r| !r.ok) {
        let code = r.error.clone().unwrap_or_else(|| "unknown".into());
        let code = code.split(':').next().unwrap_or("?").trim().to_string();
        *failures_by_code.entry(code).or_insert(0) += 1;
    }
    let f = |get: &dyn Fn(&RequestRecord) -> Option<f64>| -> Vec<f64> { ok.iter().filter_map(|r| get(r)).collect() };
    let mean = |v: Vec<f64>| {
        if v.is_empty() {
            0.0
        } else {
            v.iter().sum::<f64>() / v.len() as f64
        }
    };
    let stall =
        |p: u64| -> (usize, f64) { ok.iter().flat_map(|r| r.stalls.iter().filter(move |s| s.0 == p)).fold((0, 0.0), |(e, t), s| (e + s.1, t + s.2)) };
    let (se, sm) = stall(0);
    let (se100, sm100) = stall(100);
    let audio_s: f64 = ok.iter().map(|r| r.audio_ms / 1000.0).sum();
    let wall = wall_s.max(1e-9);
    LevelSummary {
        concurrency: level,
        requests: measured.len(),
        failures: measured.len() - ok.len(),
        ttfa_ms: Percentiles::of(&f(&|r| r.ttfa_ms)),
        ttft_ms: Percentiles::of(&f(&|r| r.ttft_ms)),
        rtf_mean: mean(f(&|r| r.rtf)),
        stall_events: se,
        stall_ms: sm,
        audio_throughput: audio_s / wall,
        requests_per_s: ok.len() as f64 / wall,
        rtf_compute_mean: mean(f(&|r| r.rtf_compute)),
        codes_per_s: 25.0 * audio_s / wall,
        stall_events_prebuffer_100ms: se100,
        stall_ms_prebuffer_100ms: sm100,
        failures_by_code,
        warmup_requests: recs.len() - measured.len(),
        audio_ms_mean: mean(f(&|r| Some(r.audio_ms))),
        chunks_mean: mean(f(&|r| r.chunks.map(|c| c as f64))),
        wall_s,
        server: None,
    }
}

/// UTC date and time, ISO 8601.
pub fn now_iso() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // civil-from-days (Howard Hinnant)
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

pub fn table(s: &Summary) -> String {
    let mut out = format!(
        "workload {} · {} · synthetic weights: {} · forced lengths {} text / {} codes\n",
        s.workload, s.config, s.synthetic_weights, s.text_tokens, s.audio_tokens
    );
    out.push_str("   C   req  fail  TTFA p50   p95   mean   TTFT p50   RTF  RTFc  stalls(ms)  audio s/s  req/s\n");
    for l in &s.levels {
        out.push_str(&format!(
            "{:>4} {:>5} {:>5} {:>9.0} {:>5.0} {:>6.0} {:>10.0} {:>5.2} {:>5.2} {:>4} ({:>5.0}) {:>10.2} {:>6.2}\n",
            l.concurrency,
            l.requests,
            l.failures,
            l.ttfa_ms.p50,
            l.ttfa_ms.p95,
            l.ttfa_ms.mean,
            l.ttft_ms.p50,
            l.rtf_mean,
            l.rtf_compute_mean,
            l.stall_events,
            l.stall_ms,
            l.audio_throughput,
            l.requests_per_s
        ));
    }
    for l in &s.levels {
        let Some(b) = &l.server else { continue };
        let steps: Vec<String> = b
            .step_ms
            .iter()
            .map(|(stage, ms)| {
                format!("{stage} {ms:.1} ms × {:.0} (batch {:.1})", b.steps.get(stage).unwrap_or(&0.0), b.batch_mean.get(stage).unwrap_or(&0.0))
            })
            .collect();
        let order = ["first_text", "handoff", "first_code", "first_chunk", "first_audio"];
        let phases: Vec<String> = order.iter().filter_map(|p| Some(format!("{p} {:.0}", b.phase_ms.get(*p)?))).collect();
        out.push_str(&format!("C{} server: {}\n      milestones (ms after admission): {}\n", l.concurrency, steps.join(", "), phases.join(", ")));
    }
    out
}

fn csv(s: &Summary) -> String {
    let mut out = String::from(
        "workload,concurrency,requests,failures,ttfa_mean,ttfa_p50,ttfa_p90,ttfa_p95,ttfa_p99,ttft_mean,ttft_p50,ttft_p90,ttft_p95,ttft_p99,rtf_mean,rtf_compute_mean,stall_events,stall_ms,stall_events_prebuffer_100ms,stall_ms_prebuffer_100ms,audio_throughput,codes_per_s,requests_per_s\n",
    );
    for l in &s.levels {
        let (a, t) = (&l.ttfa_ms, &l.ttft_ms);
        out.push_str(&format!(
            "{},{},{},{},{:.1},{:.1},{:.1},{:.1},{:.1},{:.1},{:.1},{:.1},{:.1},{:.1},{:.4},{:.4},{},{:.1},{},{:.1},{:.4},{:.2},{:.4}\n",
            s.workload,
            l.concurrency,
            l.requests,
            l.failures,
            a.mean,
            a.p50,
            a.p90,
            a.p95,
            a.p99,
            t.mean,
            t.p50,
            t.p90,
            t.p95,
            t.p99,
            l.rtf_mean,
            l.rtf_compute_mean,
            l.stall_events,
            l.stall_ms,
            l.stall_events_prebuffer_100ms,
            l.stall_ms_prebuffer_100ms,
            l.audio_throughput,
            l.codes_per_s,
            l.requests_per_s
        ));
    }
    out
}

/// TTFA p50 / p95 and stall count against concurrency (log2 axis), as SVG.
pub fn plot(s: &Summary, path: &Path) -> Result<()> {
    use plotters::prelude::*;
    let root = SVGBackend::new(path, (900, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let xs: Vec<f64> = s.levels.iter().map(|l| (l.concurrency as f64).log2()).collect();
    let ymax = s.levels.iter().map(|l| l.ttfa_ms.p95).fold(1.0, f64::max) * 1.15;
    let smax = s.levels.iter().map(|l| l.stall_events as f64).fold(1.0, f64::max) * 1.15;
    let xmax = xs.iter().cloned().fold(0.0, f64::max).max(1.0) + 0.25;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("antiphon bench — {} workload ({})", s.workload, s.config), ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .right_y_label_area_size(60)
        .build_cartesian_2d(-0.25..xmax, 0.0..ymax)?
        .set_secondary_coord(-0.25..xmax, 0.0..smax);
    chart.configure_mesh().x_desc("concurrency C").y_desc("TTFA (ms)").x_label_formatter(&|x| format!("{}", 2f64.powf(*x).round())).draw()?;
    chart.configure_secondary_axes().y_desc("stall events").draw()?;
    let series = |f: &dyn Fn(&LevelSummary) -> f64| -> Vec<(f64, f64)> { xs.iter().cloned().zip(s.levels.iter().map(f)).collect() };
    chart
        .draw_series(LineSeries::new(series(&|l| l.ttfa_ms.p50), &BLUE).point_size(4))?
        .label("TTFA p50")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLUE));
    chart
        .draw_series(LineSeries::new(series(&|l| l.ttfa_ms.p95), &RED).point_size(4))?
        .label("TTFA p95")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], RED));
    chart
        .draw_secondary_series(LineSeries::new(series(&|l| l.stall_events as f64), &GREEN).point_size(3))?
        .label("stall events (no pre-buffer)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], GREEN));
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
    root.present()?;
    Ok(())
}

pub fn write_all(dir: &Path, s: &Summary, records: &[RequestRecord]) -> Result<()> {
    std::fs::write(dir.join("summary.json"), serde_json::to_string_pretty(s)?)?;
    let mut f = std::io::BufWriter::new(std::fs::File::create(dir.join("requests.jsonl"))?);
    for r in records {
        writeln!(f, "{}", serde_json::to_string(r)?)?;
    }
    f.flush()?;
    std::fs::write(dir.join("summary.csv"), csv(s))?;
    plot(s, &dir.join("ttfa.svg"))?;
    std::fs::write(dir.join("table.txt"), table(s))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_by_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(|x| x as f64).collect();
        let p = Percentiles::of(&v);
        assert_eq!((p.p50, p.p90, p.p95, p.p99), (50.0, 90.0, 95.0, 99.0));
        assert!((p.mean - 50.5).abs() < 1e-9);
        assert_eq!(Percentiles::of(&[]), Percentiles::default());
    }

    #[test]
    fn iso_dates() {
        let d = now_iso();
        assert_eq!(d.len(), 20);
        assert!(d.starts_with("20") && d.ends_with('Z'));
    }
}
