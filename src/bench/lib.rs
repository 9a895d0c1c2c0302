//! `antiphon bench`: a scripted client of the wire protocol that measures what a listener gets —
//! time to first text and first audio, real-time factors, playback stalls under a jitter-buffer
//! model, throughput — and writes `summary.json` (the contract of docs: spec/bench.md),
//! `requests.jsonl`, `summary.csv`, an SVG plot and a text table.
//!
//! Closed-loop workloads, one level per concurrency C (C sessions, each sending its next request
//! as soon as the last one is done): `tts` (text in, forced lengths), `voice` (a WAV streamed in
//! real time as Opus packets, then `input.commit`), `clone` (like `tts`, a different reference
//! voice every request, each request a new caller: a session of its own), `clone-turns` (the same
//! voices as the turns of one conversation per worker: the Thinker hears a new voice at the head
//! of the system turn, so every turn prefills the whole conversation again), `duplex` (C sessions
//! streaming audio in real time, one record per spoken turn).
//!
//! Open loop, one level per arrival rate: `conversations` (`arrivals.rs`). Callers arrive as a
//! Poisson process (seeded exponential gaps); each connects, creates a turn-mode session — a
//! `capacity` answer refuses the call, recorded at once and never retried — and sends `--turns`
//! text turns, each `--think-ms` after the previous reply has played (its last packet's audio
//! ended under the no-pre-buffer playback model), then closes. `--warmup` does not apply (warm the
//! server before). A level's `concurrency` is the peak number of conversations in progress at once.
//!
//! Every summary carries its goodput (`goodput.rs`): the highest level at which TTFA p95 stays
//! within 800 ms, 99 % of the completed responses play without a stall, nothing is refused and
//! nothing fails.

pub mod ab;
mod arrivals;
mod client;
mod duplex;
pub mod goodput;
mod playback;
mod prompts;
pub mod report;
pub mod scrape;

pub use arrivals::poisson_arrivals;
use client::{Client, Msg};
use duplex::{duplex_drain, duplex_turns, run_duplex_level};
pub use playback::{played_ms, stalls};

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use antiphon_protocol::DoneStatus;
use anyhow::{bail, Context, Result};
use base64::Engine as _;
use futures_util::SinkExt;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::Message;

pub use prompts::PROMPTS;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Workload {
    Tts,
    Voice,
    Clone,
    CloneTurns,
    Duplex,
    Conversations,
}

impl Workload {
    pub fn name(self) -> &'static str {
        match self {
            Workload::Tts => "tts",
            Workload::Voice => "voice",
            Workload::Clone => "clone",
            Workload::CloneTurns => "clone-turns",
            Workload::Duplex => "duplex",
            Workload::Conversations => "conversations",
        }
    }
}

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    pub url: String,
    pub api_key: Option<String>,
    pub workload: Workload,
    pub levels: Vec<usize>,
    /// Measured requests per level (spread over the workers).
    pub requests: usize,
    /// Warm-up requests per level (excluded).
    pub warmup: usize,
    pub text_tokens: usize,
    pub audio_tokens: usize,
    pub prebuffers_ms: Vec<u64>,
    /// The spoken input of the `voice` workload (any WAV).
    pub input_wav: Option<PathBuf>,
    /// Sessions ask for transcripts of their spoken turns (`input_transcription`): what that
    /// costs the replies is the measurement.
    pub transcribe: bool,
    pub out: PathBuf,
    pub server_label: String,
    pub config_label: String,
    pub synthetic: Option<bool>,
    pub progress: bool,
    pub timeout: Duration,
    /// Duplex: speak in every k-th unit (k >= 2, so every turn ends at the next unit).
    pub speak_every: u64,
    /// Duplex: seconds (units) of audio each session streams per level.
    pub duplex_units: usize,
    /// Conversations: arrival rates (conversations per second), one level each.
    pub rates: Vec<f64>,
    /// Conversations: conversations started per rate.
    pub conversations: usize,
    /// Conversations: text turns per conversation.
    pub turns: usize,
    /// Conversations: from a reply having played to the next turn.
    pub think: Duration,
    /// Conversations: seeds the arrival schedule (the same at every rate, scaled).
    pub seed: u64,
}

/// One request's raw figures.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RequestRecord {
    /// The level's concurrency; in the `conversations` workload, the conversations in progress
    /// when the turn started.
    pub concurrency: usize,
    pub worker: usize,
    pub index: usize,
    pub warmup: bool,
    pub prompt: usize,
    pub ok: bool,
    pub error: Option<String>,
    /// How the response ended (`response.done`'s `status`).
    pub status: Option<DoneStatus>,
    /// Input end -> first text delta.
    pub ttft_ms: Option<f64>,
    /// Input end -> first audio packet.
    pub ttfa_ms: Option<f64>,
    /// Input end -> last audio packet.
    pub last_audio_ms: Option<f64>,
    pub audio_ms: f64,
    pub packets: usize,
    pub chunks: Option<u64>,
    /// (last audio − request start) / audio duration.
    pub rtf: Option<f64>,
    /// (last audio − first audio) / audio duration.
    pub rtf_compute: Option<f64>,
    /// Per pre-buffer: (pre-buffer ms, stall events, stall ms).
    pub stalls: Vec<(u64, usize, f64)>,
    /// When the request started, seconds after the level started.
    pub start_s: f64,
    /// Arrival times of audio packets, ms after input end (for stall recomputation).
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub arrivals_ms: Vec<f64>,
    /// Conversations: the level's arrival rate (per second).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_per_s: Option<f64>,
    /// Conversations: the conversation (its place in the arrival order) and its turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conversation: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn: Option<usize>,
}

impl RequestRecord {
    /// A request not yet answered.
    pub fn new(
        concurrency: usize,
        worker: usize,
        index: usize,
        warmup: bool,
        prompt: usize,
        start_s: f64,
    ) -> Self {
        Self {
            concurrency,
            worker,
            index,
            warmup,
            prompt,
            ok: false,
            error: None,
            status: None,
            ttft_ms: None,
            ttfa_ms: None,
            last_audio_ms: None,
            audio_ms: 0.0,
            packets: 0,
            chunks: None,
            rtf: None,
            rtf_compute: None,
            stalls: vec![],
            start_s,
            arrivals_ms: vec![],
            rate_per_s: None,
            conversation: None,
            turn: None,
        }
    }
}
/// A 16-bit PCM WAV of a reference voice, made different per request (a cold reference cache).
fn clone_voice(base: &[f32], rate: u32, n: usize) -> String {
    // a per-request resampling ratio and gain: different content, different hash
    let factor = 1.0 + 0.003 * (n % 97) as f32;
    let out_len = (base.len() as f32 / factor) as usize;
    let x: Vec<f32> = (0..out_len)
        .map(|i| {
            base[((i as f32 * factor) as usize).min(base.len() - 1)]
                * (0.8 + 0.002 * (n % 50) as f32)
        })
        .collect();
    let wav = antiphon_audio::encode_wav_pcm16(&x, rate).expect("wav encoding");
    base64::engine::general_purpose::STANDARD.encode(wav)
}

/// The spoken input for the `voice` workload: 48 kHz Opus packets of 20 ms.
pub fn voice_packets(wav: &Path) -> Result<Vec<Vec<u8>>> {
    let bytes = std::fs::read(wav).with_context(|| format!("reading {}", wav.display()))?;
    let (x, rate) = antiphon_audio::decode_wav(&bytes)?;
    let x = antiphon_audio::resample(&x, rate, 48_000)?;
    let mut enc = opus::Encoder::new(48_000, opus::Channels::Mono, opus::Application::Voip)?;
    let mut out = Vec::new();
    for f in x.chunks(960) {
        let mut f = f.to_vec();
        f.resize(960, 0.0);
        out.push(enc.encode_vec_float(&f, 4000)?);
    }
    Ok(out)
}

struct Shared {
    cfg: BenchConfig,
    voice: Option<Vec<Vec<u8>>>,
    clone_base: (Vec<f32>, u32),
    progress: Option<indicatif::ProgressBar>,
}

async fn one_request(
    sh: &Shared,
    c: &mut Client,
    level: usize,
    worker: usize,
    index: usize,
    warmup: bool,
    level_start: Instant,
) -> RequestRecord {
    request(sh, c, level, worker, index, warmup, level_start).await.0
}

/// One request on an open session, and when its reply has played (no pre-buffer), if it came.
/// A reply the server refuses (a non-fatal `capacity` error) is a failure with error `capacity`.
async fn request(
    sh: &Shared,
    c: &mut Client,
    level: usize,
    worker: usize,
    index: usize,
    warmup: bool,
    level_start: Instant,
) -> (RequestRecord, Option<Instant>) {
    let cfg = &sh.cfg;
    let prompt = (worker * 7 + index) % PROMPTS.len();
    let mut rec = RequestRecord::new(
        level,
        worker,
        index,
        warmup,
        prompt,
        level_start.elapsed().as_secs_f64(),
    );
    let gen = json!({"min_text_tokens": cfg.text_tokens, "max_text_tokens": cfg.text_tokens,
        "min_audio_tokens": cfg.audio_tokens, "max_audio_tokens": cfg.audio_tokens,
            "seed": (worker * 1000 + index) as u64});
    let mut refused = false;
    let result: Result<Option<Instant>> = async {
        let request_start = Instant::now();
        if matches!(cfg.workload, Workload::Clone | Workload::CloneTurns) {
            let b64 = clone_voice(
                &sh.clone_base.0,
                sh.clone_base.1,
                level * 100_000 + worker * 1000 + index,
            );
            c.send(json!({"type": "session.update", "voice": {"ref_audio_b64": b64,
                "sample_rate": sh.clone_base.1}}))
                .await?;
        }
        let input_end = match cfg.workload {
            Workload::Tts | Workload::Clone | Workload::CloneTurns | Workload::Conversations => {
                c.send(json!({"type": "input.text", "text": PROMPTS[prompt],
                    "generation": gen}))
                    .await?;
                Instant::now()
            }
            Workload::Voice => {
                let packets = sh.voice.as_ref().expect("voice packets");
                let t0 = Instant::now();
                for (k, p) in packets.iter().enumerate() {
                    // real time: packet k leaves at k × 20 ms
                    let due = t0 + Duration::from_millis(20 * k as u64);
                    tokio::time::sleep_until(due.into()).await;
                    c.input_seq += 1;
                    let mut f = vec![1u8, 0, 0, 0];
                    f.extend_from_slice(&(c.input_seq as u32).to_le_bytes());
                    f.extend_from_slice(&0u32.to_le_bytes());
                    f.extend_from_slice(p);
                    c.ws.send(Message::Binary(f.into())).await?;
                }
                c.send(json!({"type": "input.commit", "generation": gen})).await?;
                Instant::now()
            }
            Workload::Duplex => bail!("duplex sessions are measured by duplex_session"),
        };
        let ms = |t: Instant| t.duration_since(input_end).as_secs_f64() * 1000.0;
        let mut durations = Vec::new();
        let mut last_ack = Instant::now();
        let mut created = false;
        loop {
            match c.recv(cfg.timeout).await? {
                Msg::Event(v) => match v["type"].as_str().unwrap_or("") {
                    "response.created" => created = true,
                    "response.text.delta" => {
                        rec.ttft_ms.get_or_insert(ms(Instant::now()));
                    }
                    "response.done" => {
                        rec.status = done_status(&v);
                        rec.chunks = v["chunks"].as_u64();
                        if rec.status != Some(DoneStatus::Completed) {
                            bail!("response {}", v["status"]);
                        }
                        break;
                    }
                    "error" => {
                        if v["fatal"] == true {
                            bail!("error {}: {}", v["code"], v["message"]);
                        }
                        rec.error = Some(v["code"].as_str().unwrap_or("?").to_string());
                        if v["code"] == "capacity" {
                            // the server refused the reply: no response comes unless one had begun
                            refused = true;
                            if !created {
                                break;
                            }
                        }
                    }
                    _ => {}
                },
                Msg::Audio => {
                    let now = Instant::now();
                    rec.ttfa_ms.get_or_insert(ms(now));
                    rec.arrivals_ms.push(ms(now));
                    durations.push(c.frame_ms);
                    rec.packets += 1;
                }
            }
            if last_ack.elapsed() >= Duration::from_millis(250) {
                c.ack().await?;
                last_ack = Instant::now();
            }
        }
        c.ack().await?;
        rec.audio_ms = durations.iter().sum();
        if let (Some(&first), Some(&last)) = (rec.arrivals_ms.first(), rec.arrivals_ms.last()) {
            rec.last_audio_ms = Some(last);
            let start_to_end = ms(input_end) - ms(request_start) + last;
            rec.rtf = Some(start_to_end / rec.audio_ms.max(1e-9));
            rec.rtf_compute = Some((last - first) / rec.audio_ms.max(1e-9));
        }
        rec.stalls = cfg
            .prebuffers_ms
            .iter()
            .map(|&p| {
                let (e, t) = stalls(&rec.arrivals_ms, &durations, p as f64);
                (p, e, t)
            })
            .collect();
        Ok(played_ms(&rec.arrivals_ms, &durations)
            .map(|p| input_end + Duration::from_secs_f64(p / 1000.0)))
    }
    .await;
    let played = match result {
        Ok(p) => {
            rec.ok = rec.ttfa_ms.is_some() && !refused;
            p
        }
        Err(e) => {
            rec.error = Some(e.to_string());
            None
        }
    };
    if refused {
        rec.ok = false;
        rec.error = Some("capacity".into());
    }
    if let Some(p) = &sh.progress {
        if !warmup {
            p.inc(1);
        }
    }
    (rec, played)
}

/// Runs one concurrency level: `level` workers, each with its own session, closed loop.
async fn run_level(sh: Arc<Shared>, level: usize) -> Result<(Vec<RequestRecord>, f64)> {
    let cfg = &sh.cfg;
    let per_worker = cfg.requests.div_ceil(level);
    let warm_per_worker = cfg.warmup.div_ceil(level);
    let start = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..level {
        let sh = sh.clone();
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            let mut client = Client::open(&sh.cfg).await?;
            for i in 0..warm_per_worker + per_worker {
                let warm = i < warm_per_worker;
                if i > 0 && sh.cfg.workload == Workload::Clone {
                    // a new caller: the last one hangs up, the next one opens its own session
                    client.close().await;
                    client = Client::open(&sh.cfg).await?;
                }
                let mut r = one_request(&sh, &mut client, level, w, i, warm, start).await;
                if sh.cfg.workload != Workload::Clone {
                    // (one session's turns in order: how first audio grows with a conversation)
                    r.turn = Some(i);
                }
                let broken = !r.ok
                    && r.error
                        .as_deref()
                        .is_some_and(|e| e.contains("closed") || e.contains("ended"));
                out.push(r);
                if broken {
                    // a new session for the next request
                    client = Client::open(&sh.cfg).await?;
                }
            }
            client.close().await;
            Ok::<_, anyhow::Error>(out)
        }));
    }
    // measured wall time: from the first measured request's start to the last one's end
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.context("bench worker")??);
    }
    let measured: Vec<&RequestRecord> = all.iter().filter(|r| !r.warmup).collect();
    let begin = measured.iter().map(|r| r.start_s).fold(f64::INFINITY, f64::min);
    let wall = start.elapsed().as_secs_f64() - if begin.is_finite() { begin } else { 0.0 };
    Ok((all, wall))
}

/// Runs every level and writes the outputs; returns the summary.
pub async fn run(cfg: BenchConfig) -> Result<report::Summary> {
    std::fs::create_dir_all(&cfg.out).with_context(|| format!("creating {}", cfg.out.display()))?;
    if cfg.workload == Workload::Duplex && cfg.speak_every < 2 {
        bail!(
            "the duplex workload needs --speak-every >= 2 (a turn ends at the next listening unit)"
        );
    }
    if cfg.workload == Workload::Conversations {
        arrivals::check(&cfg)?;
    }
    let voice = match cfg.workload {
        Workload::Voice | Workload::Duplex => {
            let wav =
                cfg.input_wav.clone().unwrap_or_else(|| PathBuf::from("assets/voices/default.wav"));
            Some(voice_packets(&wav)?)
        }
        _ => None,
    };
    let base = std::fs::read("assets/voices/default.wav")
        .ok()
        .and_then(|b| antiphon_audio::decode_wav(&b).ok());
    let clone_base = match (cfg.workload, base) {
        (Workload::Clone | Workload::CloneTurns, Some(b)) => b,
        (Workload::Clone | Workload::CloneTurns, None) => {
            bail!(
                "the clone workloads derive its voices from assets/voices/default.wav (run from \
                the repository root)"
            )
        }
        (_, b) => b.unwrap_or((vec![0.0; 16_000], 16_000)),
    };
    let total: usize = match cfg.workload {
        Workload::Duplex => cfg.levels.iter().map(|&c| c * duplex_turns(&cfg)).sum(),
        Workload::Conversations => cfg.rates.len() * cfg.conversations * cfg.turns,
        _ => cfg.levels.len() * cfg.requests,
    };
    let progress = cfg.progress.then(|| {
        let p = indicatif::ProgressBar::new(total as u64);
        p.set_style(
            indicatif::ProgressStyle::with_template(
                "{elapsed_precise} [{bar:40}] {pos}/{len} requests {msg}",
            )
            .expect("template"),
        );
        p
    });
    let sh = Arc::new(Shared { cfg: cfg.clone(), voice, clone_base, progress });
    let mut records = Vec::new();
    let mut levels = Vec::new();
    // one level per concurrency, or per arrival rate
    let count =
        if cfg.workload == Workload::Conversations { cfg.rates.len() } else { cfg.levels.len() };
    for i in 0..count {
        let tag = match cfg.workload {
            Workload::Conversations => format!("r{}", cfg.rates[i]),
            _ => format!("c{}", cfg.levels[i]),
        };
        if let Some(p) = &sh.progress {
            p.set_message(format!("({})", tag.to_uppercase()));
        }
        let before = scrape::http_get(&cfg.url, "/metrics").await;
        let (recs, mut summary) = match cfg.workload {
            Workload::Conversations => arrivals::run_rate_level(sh.clone(), cfg.rates[i]).await?,
            _ => {
                let level = cfg.levels[i];
                let (recs, wall) = match cfg.workload {
                    Workload::Duplex => run_duplex_level(sh.clone(), level).await?,
                    _ => run_level(sh.clone(), level).await?,
                };
                let summary = report::level_summary(level, &recs, wall);
                (recs, summary)
            }
        };
        // the server's own breakdown of this level, where its /metrics can be read
        if let (Some(b), Some(a)) = (before, scrape::http_get(&cfg.url, "/metrics").await) {
            let _ = std::fs::write(cfg.out.join(format!("metrics-{tag}.txt")), &a);
            summary.server = Some(scrape::breakdown(&scrape::parse(&b), &scrape::parse(&a)));
        }
        levels.push(summary);
        records.extend(recs);
        // the outputs so far, after every level: a run cut short keeps what it measured
        report::write_all(&cfg.out, &summary_of(&cfg, levels.clone()), &records)?;
    }
    if let Some(p) = &sh.progress {
        p.finish_and_clear();
    }
    let summary = summary_of(&cfg, levels);
    report::write_all(&cfg.out, &summary, &records)?;
    Ok(summary)
}

fn summary_of(cfg: &BenchConfig, levels: Vec<report::LevelSummary>) -> report::Summary {
    report::Summary {
        workload: cfg.workload.name().into(),
        server: cfg.server_label.clone(),
        config: cfg.config_label.clone(),
        synthetic_weights: cfg.synthetic.unwrap_or(false),
        date: report::now_iso(),
        // duplex: per spoken unit, and per turn (a unit of codes plus the drain)
        text_tokens: if cfg.workload == Workload::Duplex {
            cfg.text_tokens.min(antiphon_protocol::DUPLEX_UNIT_MAX_TEXT_TOKENS)
        } else {
            cfg.text_tokens
        },
        audio_tokens: if cfg.workload == Workload::Duplex {
            25 + duplex_drain(cfg)
        } else {
            cfg.audio_tokens
        },
        goodput: Some(goodput::of(cfg.workload, &levels)),
        levels,
    }
}

/// Asks the server whether its weights are synthetic (`/api/build_info`), from the WebSocket URL.
pub async fn probe_build_info(url: &str) -> Option<Value> {
    serde_json::from_str(&scrape::http_get(url, "/api/build_info").await?).ok()
}

/// A `response.done`'s status (`None`: none, or a word this client does not know).
fn done_status(v: &serde_json::Value) -> Option<DoneStatus> {
    serde_json::from_value(v["status"].clone()).ok()
}

#[cfg(test)]
mod tests;
