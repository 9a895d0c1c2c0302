//! `antiphon bench`: a scripted client of the wire protocol that measures what a listener gets —
//! time to first text and first audio, real-time factors, playback stalls under a jitter-buffer
//! model, throughput — at closed-loop concurrency levels, and writes `summary.json` (the contract
//! of docs: spec/bench.md), `requests.jsonl`, `summary.csv`, an SVG plot and a text table.
//!
//! Workloads: `tts` (text in, forced lengths), `voice` (a WAV streamed in real time as Opus
//! packets, then `input.commit`), `clone` (like `tts`, a different reference voice every request,
//! each request a new caller: a session of its own), `clone-turns` (the same voices as the turns
//! of one conversation per worker: the Thinker hears a new voice at the head of the system turn,
//! so every turn prefills the whole conversation again).

pub mod ab;
mod duplex;
mod prompts;
pub mod report;
pub mod scrape;

use duplex::{duplex_drain, duplex_turns, run_duplex_level};

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use base64::Engine as _;
use futures_util::{SinkExt, StreamExt};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
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
}

impl Workload {
    pub fn name(self) -> &'static str {
        match self {
            Workload::Tts => "tts",
            Workload::Voice => "voice",
            Workload::Clone => "clone",
            Workload::CloneTurns => "clone-turns",
            Workload::Duplex => "duplex",
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
}

/// One request's raw figures.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RequestRecord {
    pub concurrency: usize,
    pub worker: usize,
    pub index: usize,
    pub warmup: bool,
    pub prompt: usize,
    pub ok: bool,
    pub error: Option<String>,
    pub status: Option<String>,
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
}

/// The playback model: playback starts when the first packet arrives plus `prebuffer`, consumes
/// in real time, and pauses whenever the buffer is empty before the response's last packet (one
/// stall per pause). Returns (events, total ms).
pub fn stalls(arrivals_ms: &[f64], durations_ms: &[f64], prebuffer_ms: f64) -> (usize, f64) {
    let Some(&first) = arrivals_ms.first() else {
        return (0, 0.0);
    };
    // the moment the buffer runs dry if nothing more arrives
    let mut dry = first + prebuffer_ms;
    let mut events = 0;
    let mut total = 0.0;
    for (i, (&a, &d)) in arrivals_ms.iter().zip(durations_ms).enumerate() {
        if i > 0 && a > dry + 1e-9 {
            events += 1;
            total += a - dry;
            dry = a;
        }
        dry += d;
    }
    (events, total)
}

/// A 16-bit PCM WAV of a reference voice, made different per request (a cold reference cache).
fn clone_voice(base: &[f32], rate: u32, n: usize) -> String {
    // a per-request resampling ratio and gain: different content, different hash
    let factor = 1.0 + 0.003 * (n % 97) as f32;
    let out_len = (base.len() as f32 / factor) as usize;
    let x: Vec<f32> = (0..out_len).map(|i| base[((i as f32 * factor) as usize).min(base.len() - 1)] * (0.8 + 0.002 * (n % 50) as f32)).collect();
    let wav = antiphon_audio::encode_wav_pcm16(&x, rate).expect("wav encoding");
    base64::engine::general_purpose::STANDARD.encode(wav)
}

type Ws = tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

struct Client {
    ws: Ws,
    last_seq: u64,
    input_seq: u64,
    frame_ms: f64,
}

enum Msg {
    Event(Value),
    Audio,
}

impl Client {
    async fn connect(cfg: &BenchConfig) -> Result<Self> {
        let mut req = cfg.url.as_str().into_client_request()?;
        if let Some(k) = &cfg.api_key {
            req.headers_mut().insert("authorization", format!("Bearer {k}").parse()?);
        }
        let (ws, _) = tokio_tungstenite::connect_async(req).await.with_context(|| format!("connecting to {}", cfg.url))?;
        Ok(Self { ws, last_seq: 0, input_seq: 0, frame_ms: 20.0 })
    }

    async fn send(&mut self, mut v: Value) -> Result<()> {
        if v["type"] != "ack" {
            self.input_seq += 1;
            v["seq"] = json!(self.input_seq);
        }
        self.ws.send(Message::Text(v.to_string().into())).await?;
        Ok(())
    }

    async fn recv(&mut self, timeout: Duration) -> Result<Msg> {
        loop {
            let m = tokio::time::timeout(timeout, self.ws.next()).await.map_err(|_| anyhow!("timed out waiting for the server"))?;
            match m {
                Some(Ok(Message::Text(t))) => {
                    let v: Value = serde_json::from_str(&t)?;
                    if let Some(s) = v.get("seq").and_then(Value::as_u64) {
                        self.last_seq = self.last_seq.max(s);
                    }
                    return Ok(Msg::Event(v));
                }
                Some(Ok(Message::Binary(b))) => {
                    if b.len() < 12 {
                        bail!("a binary frame shorter than its header");
                    }
                    let seq = u32::from_le_bytes([b[4], b[5], b[6], b[7]]) as u64;
                    self.last_seq = self.last_seq.max(seq);
                    if b[0] != 1 {
                        continue;
                    }
                    return Ok(Msg::Audio);
                }
                Some(Ok(Message::Close(c))) => bail!("closed by the server: {c:?}"),
                Some(Ok(_)) => continue,
                Some(Err(e)) => return Err(e.into()),
                None => bail!("the connection ended"),
            }
        }
    }

    async fn ack(&mut self) -> Result<()> {
        let s = self.last_seq;
        self.ws.send(Message::Text(json!({"type": "ack", "seq": s}).to_string().into())).await?;
        Ok(())
    }

    async fn create(&mut self, cfg: &BenchConfig) -> Result<Value> {
        self.send(json!({"type": "session.create", "mode": "turn",
            "input_audio": {"codec": "opus", "sample_rate": 48000},
            "output_audio": {"codec": "opus", "frame_ms": 20}}))
            .await?;
        loop {
            match self.recv(cfg.timeout).await? {
                Msg::Event(v) if v["type"] == "session.created" => {
                    self.frame_ms = v["output_audio"]["frame_ms"].as_f64().unwrap_or(20.0);
                    return Ok(v);
                }
                Msg::Event(v) if v["type"] == "error" => {
                    if v["code"] == "capacity" {
                        return Err(anyhow::Error::new(Capacity(v["retry_after_ms"].as_u64().unwrap_or(1000))));
                    }
                    bail!("session.create: {} ({})", v["code"], v["message"])
                }
                _ => {}
            }
        }
    }

    /// Ends the session (`session.close`) and waits (up to 5 s) for the server to close the
    /// connection, so that its place is free before the caller opens another.
    async fn close(&mut self) {
        let _ = self.send(json!({"type": "session.close"})).await;
        let _ = tokio::time::timeout(Duration::from_secs(5), async { while let Some(Ok(_)) = self.ws.next().await {} }).await;
    }

    /// A new connection with a turn-mode session. A server with no free session (`capacity`) is
    /// asked again after its `retry_after_ms`, for up to the bench's timeout: sessions that
    /// earlier clients left parked free their places as they expire.
    async fn open(cfg: &BenchConfig) -> Result<Self> {
        let t0 = Instant::now();
        loop {
            let mut c = Self::connect(cfg).await?;
            match c.create(cfg).await {
                Ok(_) => return Ok(c),
                Err(e) => match e.downcast_ref::<Capacity>() {
                    Some(Capacity(ms)) if t0.elapsed() < cfg.timeout => {
                        tokio::time::sleep(Duration::from_millis((*ms).clamp(50, 5000))).await;
                    }
                    _ => return Err(e),
                },
            }
        }
    }
}

/// The server had no free session; it asked to retry after this many ms.
#[derive(Debug)]
struct Capacity(u64);

impl std::fmt::Display for Capacity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "session.create: \"capacity\" (the server has no free session; retry after {} ms)", self.0)
    }
}

impl std::error::Error for Capacity {}

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

async fn one_request(sh: &Shared, c: &mut Client, level: usize, worker: usize, index: usize, warmup: bool, level_start: Instant) -> RequestRecord {
    let cfg = &sh.cfg;
    let prompt = (worker * 7 + index) % PROMPTS.len();
    let mut rec = RequestRecord {
        concurrency: level,
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
        start_s: level_start.elapsed().as_secs_f64(),
        arrivals_ms: vec![],
    };
    let gen = json!({"min_text_tokens": cfg.text_tokens, "max_text_tokens": cfg.text_tokens,
        "min_audio_tokens": cfg.audio_tokens, "max_audio_tokens": cfg.audio_tokens, "seed": (worker * 1000 + index) as u64});
    let result: Result<()> = async {
        let request_start = Instant::now();
        if matches!(cfg.workload, Workload::Clone | Workload::CloneTurns) {
            let b64 = clone_voice(&sh.clone_base.0, sh.clone_base.1, level * 100_000 + worker * 1000 + index);
            c.send(json!({"type": "session.update", "voice": {"ref_audio_b64": b64, "sample_rate": sh.clone_base.1}})).await?;
        }
        let input_end = match cfg.workload {
            Workload::Tts | Workload::Clone | Workload::CloneTurns => {
                c.send(json!({"type": "input.text", "text": PROMPTS[prompt], "generation": gen})).await?;
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
        loop {
            match c.recv(cfg.timeout).await? {
                Msg::Event(v) => match v["type"].as_str().unwrap_or("") {
                    "response.text.delta" => {
                        rec.ttft_ms.get_or_insert(ms(Instant::now()));
                    }
                    "response.done" => {
                        rec.status = v["status"].as_str().map(str::to_string);
                        rec.chunks = v["chunks"].as_u64();
                        if v["status"] != "completed" {
                            bail!("response {}", v["status"]);
                        }
                        break;
                    }
                    "error" => {
                        if v["fatal"] == true {
                            bail!("error {}: {}", v["code"], v["message"]);
                        }
                        rec.error = Some(v["code"].as_str().unwrap_or("?").to_string());
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
        Ok(())
    }
    .await;
    match result {
        Ok(()) => rec.ok = rec.ttfa_ms.is_some(),
        Err(e) => rec.error = Some(e.to_string()),
    }
    if let Some(p) = &sh.progress {
        if !warmup {
            p.inc(1);
        }
    }
    rec
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
                let r = one_request(&sh, &mut client, level, w, i, warm, start).await;
                let broken = !r.ok && r.error.as_deref().is_some_and(|e| e.contains("closed") || e.contains("ended"));
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
        bail!("the duplex workload needs --speak-every >= 2 (a turn ends at the next listening unit)");
    }
    let voice = match cfg.workload {
        Workload::Voice | Workload::Duplex => {
            let wav = cfg.input_wav.clone().unwrap_or_else(|| PathBuf::from("assets/voices/default.wav"));
            Some(voice_packets(&wav)?)
        }
        _ => None,
    };
    let base = std::fs::read("assets/voices/default.wav").ok().and_then(|b| antiphon_audio::decode_wav(&b).ok());
    let clone_base = match (cfg.workload, base) {
        (Workload::Clone | Workload::CloneTurns, Some(b)) => b,
        (Workload::Clone | Workload::CloneTurns, None) => {
            bail!("the clone workloads derive its voices from assets/voices/default.wav (run from the repository root)")
        }
        (_, b) => b.unwrap_or((vec![0.0; 16_000], 16_000)),
    };
    let total: usize = match cfg.workload {
        Workload::Duplex => cfg.levels.iter().map(|&c| c * duplex_turns(&cfg)).sum(),
        _ => cfg.levels.len() * cfg.requests,
    };
    let progress = cfg.progress.then(|| {
        let p = indicatif::ProgressBar::new(total as u64);
        p.set_style(indicatif::ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} requests {msg}").expect("template"));
        p
    });
    let sh = Arc::new(Shared { cfg: cfg.clone(), voice, clone_base, progress });
    let mut records = Vec::new();
    let mut levels = Vec::new();
    for &level in &cfg.levels {
        if let Some(p) = &sh.progress {
            p.set_message(format!("(C{level})"));
        }
        let before = scrape::http_get(&cfg.url, "/metrics").await;
        let (recs, wall) = match cfg.workload {
            Workload::Duplex => run_duplex_level(sh.clone(), level).await?,
            _ => run_level(sh.clone(), level).await?,
        };
        let mut summary = report::level_summary(level, &recs, wall);
        // the server's own breakdown of this level, where its /metrics can be read
        if let (Some(b), Some(a)) = (before, scrape::http_get(&cfg.url, "/metrics").await) {
            let _ = std::fs::write(cfg.out.join(format!("metrics-c{level}.txt")), &a);
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
        audio_tokens: if cfg.workload == Workload::Duplex { 25 + duplex_drain(cfg) } else { cfg.audio_tokens },
        levels,
    }
}

/// Asks the server whether its weights are synthetic (`/api/build_info`), from the WebSocket URL.
pub async fn probe_build_info(url: &str) -> Option<Value> {
    serde_json::from_str(&scrape::http_get(url, "/api/build_info").await?).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stall_model() {
        let d = vec![20.0; 5];
        // packets every 20 ms: no stall
        assert_eq!(stalls(&[0.0, 20.0, 40.0, 60.0, 80.0], &d, 0.0), (0, 0.0));
        // a 70 ms gap after the third packet: the buffer is dry at 60 ms, one stall of 50 ms
        let a = [0.0, 20.0, 40.0, 110.0, 130.0];
        let (e, t) = stalls(&a, &d, 0.0);
        assert_eq!(e, 1);
        assert!((t - 50.0).abs() < 1e-6, "{t}");
        // a 100 ms pre-buffer absorbs it
        assert_eq!(stalls(&a, &d, 100.0), (0, 0.0));
        // a burst arriving all at once never stalls
        assert_eq!(stalls(&[5.0; 5], &d, 0.0), (0, 0.0));
    }
}
