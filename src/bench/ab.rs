//! A/B mode: two server configurations (or two server commands) measured in interleaved blocks
//! (A B B A A B B A …), a fresh server per block, the same prompts and seeds in every block.
//!
//! Each metric is reported per side as the mean over blocks and the min–max across blocks; the
//! ratio is B / A of the means. When the two ranges overlap, the difference is inside the
//! block-to-block spread and the report calls it noise.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use super::report::{LevelSummary, Summary};
use super::BenchConfig;

/// How to start one side's server.
#[derive(Debug, Clone)]
pub enum ServerSpec {
    /// `antiphon serve --config FILE --listen 127.0.0.1:PORT` with this very binary.
    Config(PathBuf),
    /// A shell command; `{port}` is replaced by the port it must listen on.
    Shell(String),
}

impl ServerSpec {
    fn label(&self) -> String {
        match self {
            ServerSpec::Config(p) => p.display().to_string(),
            ServerSpec::Shell(s) => s.clone(),
        }
    }

    fn spawn(&self, port: u16, log: &Path) -> Result<Child> {
        let log_out =
            std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let log_err = log_out.try_clone()?;
        let mut cmd = match self {
            ServerSpec::Config(p) => {
                let mut c = Command::new(std::env::current_exe().context("locating this binary")?);
                c.arg("serve")
                    .arg("--config")
                    .arg(p)
                    .arg("--listen")
                    .arg(format!("127.0.0.1:{port}"));
                c
            }
            ServerSpec::Shell(s) => {
                let mut c = Command::new("sh");
                c.arg("-c").arg(format!("exec {}", s.replace("{port}", &port.to_string())));
                c
            }
        };
        cmd.stdin(Stdio::null()).stdout(log_out).stderr(log_err);
        cmd.spawn().with_context(|| format!("starting the server: {}", self.label()))
    }
}

#[derive(Debug, Clone)]
pub struct AbConfig {
    pub a: ServerSpec,
    pub b: ServerSpec,
    /// Blocks per side (the run has twice as many servers).
    pub blocks: usize,
    /// The bench each block runs (its `url` and `out` are set per block).
    pub bench: BenchConfig,
    pub out: PathBuf,
    /// How long a server may take to become ready.
    pub ready_timeout: Duration,
}

/// The block order: A B, then B A, then A B …, so drift over time falls on both sides alike.
pub fn block_order(blocks: usize) -> Vec<char> {
    (0..blocks).flat_map(|k| if k % 2 == 0 { ['A', 'B'] } else { ['B', 'A'] }).collect()
}

/// One metric at one level: both sides' spread and the verdict.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Comparison {
    pub concurrency: usize,
    /// The level's arrival rate (the `conversations` workload, whose levels are rates: there
    /// `concurrency` is the first A block's peak of conversations in progress).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_per_s: Option<f64>,
    pub metric: String,
    pub a_mean: f64,
    pub a_min: f64,
    pub a_max: f64,
    pub b_mean: f64,
    pub b_min: f64,
    pub b_max: f64,
    /// B mean / A mean.
    pub ratio: f64,
    /// "noise" when the block ranges overlap, otherwise "B better" / "B worse".
    pub verdict: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AbReport {
    pub a: String,
    pub b: String,
    pub workload: String,
    pub blocks_per_side: usize,
    pub order: String,
    pub date: String,
    pub comparisons: Vec<Comparison>,
}

/// The compared metrics: name, getter, and whether lower is better.
type Getter = fn(&LevelSummary) -> f64;
const METRICS: [(&str, Getter, bool); 10] = [
    ("ttfa_p50_ms", |l| l.ttfa_ms.p50, true),
    ("ttfa_p95_ms", |l| l.ttfa_ms.p95, true),
    ("ttfa_mean_ms", |l| l.ttfa_ms.mean, true),
    ("ttft_p50_ms", |l| l.ttft_ms.p50, true),
    ("rtf_mean", |l| l.rtf_mean, true),
    ("rtf_compute_mean", |l| l.rtf_compute_mean, true),
    ("stall_events", |l| l.stall_events as f64, true),
    ("audio_throughput", |l| l.audio_throughput, false),
    ("requests_per_s", |l| l.requests_per_s, false),
    ("failures", |l| l.failures as f64, true),
];

fn spread(v: &[f64]) -> (f64, f64, f64) {
    let mean = v.iter().sum::<f64>() / v.len().max(1) as f64;
    let min = v.iter().cloned().fold(f64::INFINITY, f64::min);
    let max = v.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    (mean, min, max)
}

/// Compares the blocks of both sides, level by level.
pub fn compare(a: &[Summary], b: &[Summary]) -> Vec<Comparison> {
    let mut out = Vec::new();
    // a level is its concurrency, or its arrival rate
    let levels: Vec<LevelSummary> = a.first().map(|s| s.levels.clone()).unwrap_or_default();
    for first in &levels {
        let same = |l: &&LevelSummary| {
            l.rate_per_s == first.rate_per_s
                && (first.rate_per_s.is_some() || l.concurrency == first.concurrency)
        };
        let pick = |runs: &[Summary], g: Getter| -> Vec<f64> {
            runs.iter().filter_map(|s| s.levels.iter().find(same)).map(g).collect()
        };
        for (name, g, lower_better) in METRICS {
            let (va, vb) = (pick(a, g), pick(b, g));
            if va.is_empty() || vb.is_empty() {
                continue;
            }
            let (am, an, ax) = spread(&va);
            let (bm, bn, bx) = spread(&vb);
            let overlap = an <= bx && bn <= ax;
            let verdict = if overlap {
                "noise"
            } else if (bm < am) == lower_better {
                "B better"
            } else {
                "B worse"
            };
            let ratio = if am.abs() > 1e-12 {
                bm / am
            } else if bm.abs() > 1e-12 {
                f64::INFINITY
            } else {
                1.0
            };
            out.push(Comparison {
                concurrency: first.concurrency,
                rate_per_s: first.rate_per_s,
                metric: name.into(),
                a_mean: am,
                a_min: an,
                a_max: ax,
                b_mean: bm,
                b_min: bn,
                b_max: bx,
                ratio,
                verdict: verdict.into(),
            });
        }
    }
    out
}

/// The report as a Markdown table.
pub fn table(r: &AbReport) -> String {
    let mut s = format!(
        "A/B · workload {} · {} blocks per side ({}) · {}\n\nA: `{}`\nB: `{}`\n\n| C | metric \
        | A mean [min–max] | B mean [min–max] | B/A | verdict \
        |\n|---|---|---|---|---|---|\n",
        r.workload, r.blocks_per_side, r.order, r.date, r.a, r.b
    );
    for c in &r.comparisons {
        s.push_str(&format!(
            "| {} | {} | {:.2} [{:.2}–{:.2}] | {:.2} [{:.2}–{:.2}] | {:.3} | {} |\n",
            c.rate_per_s.map_or(c.concurrency.to_string(), |r| format!("{r}/s")),
            c.metric,
            c.a_mean,
            c.a_min,
            c.a_max,
            c.b_mean,
            c.b_min,
            c.b_max,
            c.ratio,
            c.verdict
        ));
    }
    s
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

async fn wait_ready(port: u16, child: &mut Child, timeout: Duration) -> Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let t0 = Instant::now();
    loop {
        if let Some(st) = child.try_wait()? {
            bail!("the server exited before it was ready ({st})");
        }
        if let Ok(mut s) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
            let req = format!(
                "GET /readyz HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n"
            );
            if s.write_all(req.as_bytes()).await.is_ok() {
                let mut buf = String::new();
                let _ = s.read_to_string(&mut buf).await;
                if buf.starts_with("HTTP/1.1 200") {
                    return Ok(());
                }
            }
        }
        if t0.elapsed() > timeout {
            bail!("the server was not ready within {:?}", timeout);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Graceful stop (SIGTERM), then a kill if it does not exit in time.
fn stop(child: &mut Child) {
    let _ = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status();
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(30) {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Runs the whole A/B comparison and writes `ab.json`, `ab.md` and each block's bench outputs.
pub async fn run(cfg: AbConfig) -> Result<AbReport> {
    if cfg.blocks == 0 {
        bail!("--blocks must be at least 1");
    }
    std::fs::create_dir_all(&cfg.out)?;
    let order = block_order(cfg.blocks);
    let (mut sa, mut sb) = (Vec::new(), Vec::new());
    for (i, side) in order.iter().enumerate() {
        let spec = if *side == 'A' { &cfg.a } else { &cfg.b };
        let dir = cfg.out.join(format!("block{:02}-{side}", i + 1));
        std::fs::create_dir_all(&dir)?;
        let port = free_port()?;
        eprintln!(
            "block {}/{} ({side}): starting {} on port {port}",
            i + 1,
            order.len(),
            spec.label()
        );
        let mut child = spec.spawn(port, &dir.join("server.log"))?;
        let result = async {
            wait_ready(port, &mut child, cfg.ready_timeout).await?;
            let mut b = cfg.bench.clone();
            b.url = format!("ws://127.0.0.1:{port}/v1/realtime");
            b.out = dir.clone();
            b.server_label = format!("{side}: {}", spec.label());
            b.config_label = spec.label();
            if b.synthetic.is_none() {
                b.synthetic = super::probe_build_info(&b.url)
                    .await
                    .and_then(|v| v["synthetic_weights"].as_bool());
            }
            super::run(b).await
        }
        .await;
        stop(&mut child);
        let summary = result.with_context(|| {
            format!(
                "block {} ({side}); the server log is {}",
                i + 1,
                dir.join("server.log").display()
            )
        })?;
        eprint!("{}", super::report::table(&summary));
        if *side == 'A' {
            sa.push(summary);
        } else {
            sb.push(summary);
        }
    }
    let report = AbReport {
        a: cfg.a.label(),
        b: cfg.b.label(),
        workload: cfg.bench.workload.name().into(),
        blocks_per_side: cfg.blocks,
        order: order.iter().map(|c| c.to_string()).collect::<Vec<_>>().join(" "),
        date: super::report::now_iso(),
        comparisons: compare(&sa, &sb),
    };
    std::fs::write(cfg.out.join("ab.json"), serde_json::to_string_pretty(&report)?)?;
    std::fs::write(cfg.out.join("ab.md"), table(&report))?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::super::report::Percentiles;
    use super::*;

    fn summary(ttfa: f64, thr: f64) -> Summary {
        let l = LevelSummary {
            concurrency: 1,
            requests: 4,
            failures: 0,
            ttfa_ms: Percentiles { mean: ttfa, p50: ttfa, p90: ttfa, p95: ttfa, p99: ttfa },
            ttft_ms: Percentiles::default(),
            rtf_mean: 0.5,
            stall_events: 0,
            stall_ms: 0.0,
            audio_throughput: thr,
            requests_per_s: 1.0,
            rtf_compute_mean: 0.3,
            codes_per_s: 25.0 * thr,
            stall_events_prebuffer_100ms: 0,
            stall_ms_prebuffer_100ms: 0.0,
            failures_by_code: Default::default(),
            warmup_requests: 1,
            audio_ms_mean: 4000.0,
            chunks_mean: 4.0,
            wall_s: 10.0,
            ..Default::default()
        };
        Summary {
            workload: "tts".into(),
            server: "s".into(),
            config: "c".into(),
            synthetic_weights: true,
            date: "d".into(),
            text_tokens: 32,
            audio_tokens: 100,
            levels: vec![l],
            goodput: None,
        }
    }

    #[test]
    fn interleaved_order() {
        assert_eq!(block_order(2).iter().collect::<String>(), "ABBA");
        assert_eq!(block_order(3).iter().collect::<String>(), "ABBAAB");
    }

    #[test]
    fn overlapping_ranges_are_noise_and_separated_ones_are_not() {
        let a = [summary(100.0, 2.0), summary(120.0, 2.1)];
        let b = [summary(110.0, 3.0), summary(130.0, 3.2)];
        let c = compare(&a, &b);
        let get = |m: &str| c.iter().find(|x| x.metric == m).unwrap().clone();
        let t = get("ttfa_p50_ms");
        assert_eq!(t.verdict, "noise");
        assert!((t.ratio - 120.0 / 110.0).abs() < 1e-9);
        assert_eq!((t.a_min, t.a_max, t.b_min, t.b_max), (100.0, 120.0, 110.0, 130.0));
        // throughput: B's whole range is above A's, higher is better
        assert_eq!(get("audio_throughput").verdict, "B better");
        let slow = [summary(300.0, 1.0), summary(310.0, 1.0)];
        assert_eq!(
            compare(&a, &slow).iter().find(|x| x.metric == "ttfa_p50_ms").unwrap().verdict,
            "B worse"
        );
        assert!(table(&AbReport {
            a: "a".into(),
            b: "b".into(),
            workload: "tts".into(),
            blocks_per_side: 2,
            order: "A B B A".into(),
            date: "d".into(),
            comparisons: c
        })
        .contains(
            "| 1 | ttfa_p50_ms | 110.00 [100.00–120.00] | 120.00 [110.00–130.00] | 1.091 | \
            noise |"
        ));
    }
}
