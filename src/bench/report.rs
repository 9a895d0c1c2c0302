//! The bench's outputs: `summary.json` (the contract scripts read), `requests.jsonl` (every raw
//! figure), `summary.csv`, `ttfa.svg` (TTFA percentiles and stalls against concurrency, or against
//! the arrival rate) and a text table.

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
        Self {
            mean: v.iter().sum::<f64>() / v.len() as f64,
            p50: at(0.5),
            p90: at(0.9),
            p95: at(0.95),
            p99: at(0.99),
        }
    }
}

/// One level (the contract's fields first, then more): a concurrency, or an arrival rate.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct LevelSummary {
    /// The level's concurrency; in the `conversations` workload, the peak number of conversations
    /// in progress at once (arrived, not yet ended).
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
    /// Conversations: the level's arrival rate (conversations per second).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_per_s: Option<f64>,
    /// Conversations: calls that arrived.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calls_offered: Option<usize>,
    /// Conversations: calls the server refused (`capacity` at `session.create`, or a 503 at the
    /// upgrade); never retried, they send no request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calls_refused: Option<usize>,
    /// Conversations: replies the server refused (a non-fatal `capacity` error); each is also a
    /// failed request (code `capacity`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replies_refused: Option<usize>,
    /// Conversations: the peak number of sessions held at once (created, not yet closed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub live_sessions_peak: Option<usize>,
    /// The fraction of completed responses with no stall event (no pre-buffer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub responses_without_stall_frac: Option<f64>,
    /// Conversations: the median `retry_after_ms` of the refused calls, where the server said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<f64>,
    /// TTFA p50 of each ten turns of a session (turns 0-9, 10-19, …), where sessions went past
    /// ten turns: how first audio grows with a conversation's length.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttfa_p50_by_ten_turns: Option<Vec<f64>>,
}

/// TTFA p50 per ten turns of a session (`None` unless some reply is turn 10 or later).
fn ttfa_by_ten_turns(ok: &[&&RequestRecord]) -> Option<Vec<f64>> {
    let last = ok.iter().filter_map(|r| r.turn).max()?;
    if last < 10 {
        return None;
    }
    let tens = (0..=last / 10).map(|t| {
        let v: Vec<f64> = ok
            .iter()
            .filter(|r| r.turn.is_some_and(|n| n / 10 == t))
            .filter_map(|r| r.ttfa_ms)
            .collect();
        Percentiles::of(&v).p50
    });
    Some(tens.collect())
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
    /// The highest level that meets the goodput criterion (`goodput.rs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub goodput: Option<super::goodput::Goodput>,
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
    let f = |get: &dyn Fn(&RequestRecord) -> Option<f64>| -> Vec<f64> {
        ok.iter().filter_map(|r| get(r)).collect()
    };
    let mean = |v: Vec<f64>| {
        if v.is_empty() {
            0.0
        } else {
            v.iter().sum::<f64>() / v.len() as f64
        }
    };
    let stall = |p: u64| -> (usize, f64) {
        ok.iter()
            .flat_map(|r| r.stalls.iter().filter(move |s| s.0 == p))
            .fold((0, 0.0), |(e, t), s| (e + s.1, t + s.2))
    };
    let (se, sm) = stall(0);
    let without_stall = ok.iter().filter(|r| r.stalls.iter().any(|s| s.0 == 0 && s.1 == 0)).count();
    let with_model = ok.iter().filter(|r| r.stalls.iter().any(|s| s.0 == 0)).count();
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
        responses_without_stall_frac: (with_model > 0)
            .then(|| without_stall as f64 / with_model as f64),
        ttfa_p50_by_ten_turns: ttfa_by_ten_turns(&ok),
        ..Default::default()
    }
}

/// A level as the axis and the table name it: "4" (concurrency) or "2/s" (arrival rate).
pub fn level_label(l: &LevelSummary) -> String {
    match l.rate_per_s {
        Some(r) => format!("{r}/s"),
        None => l.concurrency.to_string(),
    }
}

/// UTC date and time, ISO 8601.
pub fn now_iso() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0) as i64;
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
    if s.workload == "conversations" {
        out.push_str(
            "  rate  calls  refused  live  req  fail  rrep  TTFA p50   p95   TTFT p50  \
            stalls(ms)  no-stall  audio s/s\n",
        );
        for l in &s.levels {
            out.push_str(&format!(
                "{:>6} {:>6} {:>8} {:>5} {:>4} {:>5} {:>5} {:>9.0} {:>5.0} {:>10.0} {:>4} \
                ({:>5.0}) {:>8.1}% {:>10.2}\n",
                level_label(l),
                l.calls_offered.unwrap_or(0),
                l.calls_refused.unwrap_or(0),
                l.live_sessions_peak.unwrap_or(l.concurrency),
                l.requests,
                l.failures,
                l.replies_refused.unwrap_or(0),
                l.ttfa_ms.p50,
                l.ttfa_ms.p95,
                l.ttft_ms.p50,
                l.stall_events,
                l.stall_ms,
                100.0 * l.responses_without_stall_frac.unwrap_or(0.0),
                l.audio_throughput
            ));
        }
    } else {
        out.push_str(
            "   C   req  fail  TTFA p50   p95   mean   TTFT p50   RTF  RTFc  stalls(ms)  \
            audio s/s  req/s\n",
        );
        for l in &s.levels {
            out.push_str(&format!(
                "{:>4} {:>5} {:>5} {:>9.0} {:>5.0} {:>6.0} {:>10.0} {:>5.2} {:>5.2} {:>4} \
                ({:>5.0}) {:>10.2} {:>6.2}\n",
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
    }
    for l in &s.levels {
        if let Some(tens) = &l.ttfa_p50_by_ten_turns {
            let v: Vec<String> = tens.iter().map(|t| format!("{t:.0}")).collect();
            out.push_str(&format!(
                "{}: TTFA p50 by ten turns of a session: {} ms\n",
                level_label(l),
                v.join(" · ")
            ));
        }
    }
    if let Some(g) = &s.goodput {
        match g.level {
            Some(v) => out.push_str(&format!("goodput: {v} {} ({})\n", g.unit, g.criterion)),
            None => out.push_str(&format!("goodput: no level ({})\n", g.criterion)),
        }
        if let Some(n) = g.sessions_held {
            out.push_str(&format!(
                "duplex sessions held: {n} (the most live at once with no \
                stall, none refused or failed)\n"
            ));
        }
    }
    for l in &s.levels {
        let Some(b) = &l.server else { continue };
        let steps: Vec<String> = b
            .step_ms
            .iter()
            .map(|(stage, ms)| {
                format!(
                    "{stage} {ms:.1} ms × {:.0} (batch {:.1})",
                    b.steps.get(stage).unwrap_or(&0.0),
                    b.batch_mean.get(stage).unwrap_or(&0.0)
                )
            })
            .collect();
        let order = [
            "first_token",
            "first_text",
            "handoff",
            "first_code",
            "chunk0_codes",
            "first_chunk",
            "first_audio",
        ];
        let phases: Vec<String> =
            order.iter().filter_map(|p| Some(format!("{p} {:.0}", b.phase_ms.get(*p)?))).collect();
        let name =
            if l.rate_per_s.is_some() { level_label(l) } else { format!("C{}", l.concurrency) };
        out.push_str(&format!(
            "{name} server: {}\n      milestones (ms after admission): {}\n",
            steps.join(", "),
            phases.join(", ")
        ));
    }
    out
}

/// The summary as CSV; the `conversations` workload adds its columns at the end.
fn csv(s: &Summary) -> String {
    let rates = s.workload == "conversations";
    let mut out = String::from(concat!(
        "workload,concurrency,requests,failures,",
        "ttfa_mean,ttfa_p50,ttfa_p90,ttfa_p95,ttfa_p99,",
        "ttft_mean,ttft_p50,ttft_p90,ttft_p95,ttft_p99,",
        "rtf_mean,rtf_compute_mean,stall_events,stall_ms,",
        "stall_events_prebuffer_100ms,stall_ms_prebuffer_100ms,",
        "audio_throughput,codes_per_s,requests_per_s",
    ));
    if rates {
        out.push_str(concat!(
            ",rate_per_s,calls_offered,calls_refused,replies_refused,live_sessions_peak,",
            "responses_without_stall_frac,retry_after_ms"
        ));
    }
    out.push('\n');
    for l in &s.levels {
        let (a, t) = (&l.ttfa_ms, &l.ttft_ms);
        out.push_str(&format!(
            concat!(
                "{},{},{},{},",
                "{:.1},{:.1},{:.1},{:.1},{:.1},",
                "{:.1},{:.1},{:.1},{:.1},{:.1},",
                "{:.4},{:.4},{},{:.1},",
                "{},{:.1},",
                "{:.4},{:.2},{:.4}",
            ),
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
        if rates {
            let opt = |v: Option<f64>| v.map(|v| format!("{v}")).unwrap_or_default();
            out.push_str(&format!(
                ",{},{},{},{},{},{},{}",
                opt(l.rate_per_s),
                opt(l.calls_offered.map(|v| v as f64)),
                opt(l.calls_refused.map(|v| v as f64)),
                opt(l.replies_refused.map(|v| v as f64)),
                opt(l.live_sessions_peak.map(|v| v as f64)),
                opt(l.responses_without_stall_frac),
                opt(l.retry_after_ms)
            ));
        }
        out.push('\n');
    }
    out
}

/// TTFA p50 / p95 and stall events (and, for arrival rates, refused calls) against the levels, as
/// SVG: one evenly spaced tick per level, labelled with it ("4", or "2/s" for a rate); the legend
/// to the right of the plot area.
pub fn plot(s: &Summary, path: &Path) -> Result<()> {
    use plotters::prelude::*;
    let rates = s.workload == "conversations";
    let root = SVGBackend::new(path, (1000, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let (area, legend) = root.split_horizontally(780);
    let labels: Vec<String> = s.levels.iter().map(level_label).collect();
    let xs: Vec<f64> = (0..s.levels.len()).map(|i| i as f64).collect();
    let x_axis = || Categories(s.levels.len());
    let refused = |l: &LevelSummary| l.calls_refused.unwrap_or(0) as f64;
    let ymax = s.levels.iter().map(|l| l.ttfa_ms.p95).fold(1.0, f64::max) * 1.15;
    let smax =
        s.levels.iter().map(|l| (l.stall_events as f64).max(refused(l))).fold(1.0, f64::max) * 1.15;
    let mut chart = ChartBuilder::on(&area)
        .caption(
            format!("antiphon bench — {} workload ({})", s.workload, s.config),
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .right_y_label_area_size(60)
        .build_cartesian_2d(x_axis(), 0.0..ymax)?
        .set_secondary_coord(x_axis(), 0.0..smax);
    let tick = |x: &f64| {
        let i = x.round();
        if (x - i).abs() < 1e-6 && i >= 0.0 {
            labels.get(i as usize).cloned().unwrap_or_default()
        } else {
            String::new()
        }
    };
    let x_desc = if rates { "arrival rate (conversations per second)" } else { "concurrency C" };
    chart.configure_mesh().x_desc(x_desc).y_desc("TTFA (ms)").x_label_formatter(&tick).draw()?;
    chart
        .configure_secondary_axes()
        .y_desc(if rates { "stall events, refused calls" } else { "stall events" })
        .draw()?;
    let series = |f: &dyn Fn(&LevelSummary) -> f64| -> Vec<(f64, f64)> {
        xs.iter().cloned().zip(s.levels.iter().map(f)).collect()
    };
    let mut keys: Vec<(RGBColor, &str)> =
        vec![(BLUE, "TTFA p50"), (RED, "TTFA p95"), (GREEN, "stall events (no pre-buffer)")];
    chart.draw_series(LineSeries::new(series(&|l| l.ttfa_ms.p50), &BLUE).point_size(4))?;
    chart.draw_series(LineSeries::new(series(&|l| l.ttfa_ms.p95), &RED).point_size(4))?;
    chart.draw_secondary_series(
        LineSeries::new(series(&|l| l.stall_events as f64), &GREEN).point_size(3),
    )?;
    if rates {
        chart.draw_secondary_series(LineSeries::new(series(&refused), &MAGENTA).point_size(3))?;
        keys.push((MAGENTA, "refused calls"));
    }
    // the legend, beside the plot area rather than over the data
    for (k, (color, name)) in keys.iter().enumerate() {
        let y = 60 + 26 * k as i32;
        legend.draw(&PathElement::new(vec![(8, y), (32, y)], color.stroke_width(2)))?;
        legend.draw(&Circle::new((20, y), 3, color.filled()))?;
        legend.draw(&Text::new(name.to_string(), (40, y - 7), ("sans-serif", 14).into_font()))?;
    }
    root.present()?;
    Ok(())
}

/// A categorical axis of `n` levels: level i sits at x = i, evenly spaced from -0.5 to n - 0.5,
/// with a tick at each level and nowhere else.
struct Categories(usize);

impl plotters::coord::ranged1d::Ranged for Categories {
    type FormatOption = plotters::coord::ranged1d::DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        let frac = (value + 0.5) / self.0.max(1) as f64;
        limit.0 + (frac * (limit.1 - limit.0) as f64).round() as i32
    }

    fn key_points<H: plotters::coord::ranged1d::KeyPointHint>(&self, hint: H) -> Vec<f64> {
        // bold points only: no light mesh lines between the levels
        if hint.weight().allow_light_points() {
            vec![]
        } else {
            (0..self.0).map(|i| i as f64).collect()
        }
    }

    fn range(&self) -> std::ops::Range<f64> {
        -0.5..self.0.max(1) as f64 - 0.5
    }
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
mod tests;
