//! The `antiphon` command line: a thin layer over the library.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

use antiphon_assets::synth::{Preset, SynthOptions};
use antiphon_server::config::Config;

#[derive(Parser)]
#[command(
    name = "antiphon",
    version,
    about = "Realtime voice server for the MiniCPM-o 4.5 speech path"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Serve a configuration (the default command; without --config, the embedded default).
    Serve {
        /// A TOML configuration file (configs/*.toml).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Overrides server.listen.
        #[arg(long)]
        listen: Option<String>,
        /// Overrides server.replica_id (the prefix of every session id; e.g. the pod name).
        #[arg(long, env = "ANTIPHON_REPLICA_ID")]
        replica_id: Option<String>,
    },
    /// Validate a configuration file without starting anything: the file, and what `serve` would
    /// meet on this machine (the device on this build, web_dir, voice files, a checkpoint's files
    /// and tensor headers), without loading a weight.
    CheckConfig {
        file: PathBuf,
        /// The file alone, not what it names on this machine (a configuration rendered for
        /// another machine, such as a Kubernetes pod's).
        #[arg(long)]
        file_only: bool,
    },
    /// Write a synthetic checkpoint directory (seeded random weights in the real layout).
    SynthCheckpoint {
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
        /// Dimensions: tiny or full.
        #[arg(long, default_value = "tiny")]
        preset: Preset,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Stored dtype: f32 or bf16.
        #[arg(long, default_value = "f32")]
        dtype: antiphon_models::gpu::Precision,
        /// Largest shard, in MiB.
        #[arg(long, default_value_t = 2048)]
        shard_mib: usize,
    },
    /// Measure a running server: TTFT, TTFA, RTF, stalls and throughput at each concurrency level.
    Bench {
        /// The server's WebSocket endpoint.
        #[arg(long, default_value = "ws://127.0.0.1:8080/v1/realtime")]
        url: String,
        #[command(flatten)]
        args: BenchArgs,
    },
    /// Time each stage's step on its own (Thinker prefill/decode, Talker decode, Code2Wav prepare /
    /// setup / chunks) on the configuration's device and dimensions.
    Profile {
        #[arg(long)]
        config: Option<PathBuf>,
        #[arg(long, default_value_t = 10)]
        iters: usize,
        /// Decode batch sizes.
        #[arg(long, value_delimiter = ',', default_values_t = vec![1, 8, 32])]
        batch: Vec<usize>,
        /// Also write the timings as JSON here.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Run only the rows whose names contain one of these strings (e.g. "graph" or
        /// "chunk 0"); their timed runs are ranges for `ncu --profile-from-start off`.
        #[arg(long, value_delimiter = ',')]
        only: Vec<String>,
    },
    /// A/B: two configurations or server commands, interleaved blocks (A B B A …), a fresh server
    /// each.
    BenchAb {
        /// Side A: a configuration file served by this binary.
        #[arg(long, conflicts_with = "a_cmd", required_unless_present = "a_cmd")]
        a_config: Option<PathBuf>,
        /// Side A: a shell command starting a server; `{port}` is its port.
        #[arg(long)]
        a_cmd: Option<String>,
        #[arg(long, conflicts_with = "b_cmd", required_unless_present = "b_cmd")]
        b_config: Option<PathBuf>,
        #[arg(long)]
        b_cmd: Option<String>,
        /// Blocks per side.
        #[arg(long, default_value_t = 2)]
        blocks: usize,
        /// Seconds a server may take to become ready.
        #[arg(long, default_value_t = 600)]
        ready_timeout_s: u64,
        #[command(flatten)]
        args: BenchArgs,
    },
}

#[derive(clap::Args)]
struct BenchArgs {
    #[arg(long, value_enum, default_value = "tts")]
    workload: antiphon_bench::Workload,
    /// Concurrency levels, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1, 2, 4, 8, 16, 32])]
    concurrency: Vec<usize>,
    /// Measured requests per level.
    #[arg(long, default_value_t = 32)]
    requests: usize,
    /// Warm-up requests per level (excluded from the figures).
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Forced text tokens per response (synthetic weights).
    #[arg(long, default_value_t = 32)]
    text_tokens: usize,
    /// Forced audio codes per response (25 per second).
    #[arg(long, default_value_t = 100)]
    audio_tokens: usize,
    /// Playback pre-buffers to model, in ms, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = vec![0, 100])]
    prebuffer_ms: Vec<u64>,
    /// The spoken input of the voice workload (default assets/voices/default.wav).
    #[arg(long)]
    input_wav: Option<PathBuf>,
    /// Sessions ask for transcripts of their spoken turns (what they cost the replies).
    #[arg(long)]
    transcribe: bool,
    /// Output folder.
    #[arg(long, default_value = "bench-out")]
    out: PathBuf,
    /// A label for the configuration, written into summary.json.
    #[arg(long, default_value = "")]
    label: String,
    /// Bearer token, if the server wants one.
    #[arg(long)]
    api_key: Option<String>,
    /// Seconds without any server message before a request fails.
    #[arg(long, default_value_t = 120)]
    timeout_s: u64,
    #[arg(long)]
    no_progress: bool,
    /// Duplex workload: speak in every k-th unit (k >= 2).
    #[arg(long, default_value_t = 2)]
    speak_every: u64,
    /// Duplex workload: seconds of audio each session streams per level.
    #[arg(long, default_value_t = 12)]
    duplex_units: usize,
    /// Conversations workload (open loop): arrival rates in conversations per second,
    /// comma-separated; one level each (replaces --concurrency; --warmup does not apply).
    #[arg(long, value_delimiter = ',', default_values_t = vec![2.0, 4.0, 8.0])]
    rates: Vec<f64>,
    /// Conversations workload: conversations started per rate.
    #[arg(long, default_value_t = 120)]
    conversations: usize,
    /// Conversations workload: text turns per conversation.
    #[arg(long, default_value_t = 3)]
    turns: usize,
    /// Conversations workload: ms from a reply having played (no pre-buffer) to the next turn.
    #[arg(long, default_value_t = 1000)]
    think_ms: u64,
    /// Conversations workload: seeds the Poisson arrival schedule.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

impl BenchArgs {
    fn into_config(self, url: String) -> Result<antiphon_bench::BenchConfig> {
        if self.concurrency.is_empty() || self.concurrency.contains(&0) {
            anyhow::bail!("--concurrency: levels must be at least 1");
        }
        if self.requests == 0 {
            anyhow::bail!("--requests must be at least 1");
        }
        Ok(antiphon_bench::BenchConfig {
            url,
            api_key: self.api_key,
            workload: self.workload,
            levels: self.concurrency,
            requests: self.requests,
            warmup: self.warmup,
            text_tokens: self.text_tokens,
            audio_tokens: self.audio_tokens,
            prebuffers_ms: self.prebuffer_ms,
            input_wav: self.input_wav,
            transcribe: self.transcribe,
            out: self.out,
            server_label: String::new(),
            config_label: self.label,
            synthetic: None,
            progress: !self.no_progress,
            timeout: std::time::Duration::from_secs(self.timeout_s),
            speak_every: self.speak_every,
            duplex_units: self.duplex_units,
            rates: self.rates,
            conversations: self.conversations,
            turns: self.turns,
            think: std::time::Duration::from_millis(self.think_ms),
            seed: self.seed,
        })
    }
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,tower_http=warn".into()),
        )
        .init();
    let cli = Cli::parse();
    match cli.command.unwrap_or(Command::Serve {
        config: None,
        listen: None,
        replica_id: std::env::var("ANTIPHON_REPLICA_ID").ok(),
    }) {
        Command::Serve { config, listen, replica_id } => {
            let mut cfg = match &config {
                Some(p) => Config::load(p)?,
                None => Config::embedded_default()
                    .context("the embedded default (run from the repository root)")?,
            };
            if let Some(l) = listen {
                cfg.server.listen = l;
            }
            if let Some(r) = replica_id {
                cfg.server.replica_id = r;
            }
            cfg.validate()?;
            serve(cfg)
        }
        Command::CheckConfig { file, file_only } => {
            let cfg = Config::load(&file)?;
            let problems = if file_only { Vec::new() } else { cfg.preflight() };
            if !problems.is_empty() {
                for p in &problems {
                    eprintln!("error: {p}");
                }
                anyhow::bail!(
                    "{}: {} problem(s) that `serve` would meet",
                    file.display(),
                    problems.len()
                );
            }
            println!(
                "{}: OK ({:?} model, {} on {}, listen {}, {} voice(s))",
                file.display(),
                cfg.model.source,
                cfg.model.dtype,
                cfg.model.device,
                cfg.server.listen,
                cfg.voices.len()
            );
            Ok(())
        }
        Command::SynthCheckpoint { out, preset, seed, dtype, shard_mib } => {
            let opts =
                SynthOptions { preset, seed, dtype: dtype.dtype(), shard_bytes: shard_mib << 20 };
            antiphon_assets::synth::write_checkpoint(&out, &opts)?;
            println!("wrote a {preset:?} synthetic checkpoint (seed {seed}) to {}", out.display());
            Ok(())
        }
        Command::Bench { url, args } => {
            let mut cfg = args.into_config(url)?;
            let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            rt.block_on(async move {
                let info = antiphon_bench::probe_build_info(&cfg.url).await;
                if let Some(i) = &info {
                    cfg.synthetic = i["synthetic_weights"].as_bool();
                    cfg.server_label = format!(
                        "antiphon {} ({})",
                        i["version"].as_str().unwrap_or("?"),
                        i["git"].as_str().unwrap_or("?")
                    );
                    if cfg.config_label.is_empty() {
                        let m = &i["model"];
                        cfg.config_label = format!(
                            "{} {} weights, {} on {}",
                            m["source"].as_str().unwrap_or("?"),
                            m["preset"].as_str().unwrap_or("?"),
                            m["dtype"].as_str().unwrap_or("?"),
                            m["device"].as_str().unwrap_or("?")
                        );
                    }
                } else {
                    cfg.server_label = cfg.url.clone();
                }
                let out = cfg.out.clone();
                let summary = antiphon_bench::run(cfg).await?;
                print!("{}", antiphon_bench::report::table(&summary));
                println!(
                    "wrote {}/summary.json, requests.jsonl, summary.csv, ttfa.svg",
                    out.display()
                );
                Ok(())
            })
        }
        Command::Profile { config, iters, batch, out, only } => {
            let cfg = match &config {
                Some(p) => Config::load(p)?,
                None => Config::embedded_default()
                    .context("the embedded default (run from the repository root)")?,
            };
            let t0 = std::time::Instant::now();
            let models = antiphon_server::load_models(&cfg)?;
            eprintln!("models ready in {:.1} s", t0.elapsed().as_secs_f64());
            let voice = &cfg.voices[0];
            let (samples, rate) = antiphon_audio::decode_wav(&std::fs::read(&voice.wav)?)?;
            // as the server runs (Engine::start sets the same)
            if cfg.engine.gpu_tf32 && models.code2wav.device().is_cuda() {
                candle_core::cuda::set_gemm_reduced_precision_f32(true);
            }
            antiphon_models::attention::set_causal_softmax_kernel(cfg.engine.causal_softmax_kernel);
            antiphon_models::batch_decode::set_decode_attention_teams(
                cfg.engine.decode_attention_teams,
            );
            let timings = antiphon_engine::profile::run(
                &models,
                &cfg.engine,
                iters.max(1),
                &batch,
                (&samples, rate),
                &only,
            )?;
            if let Some(o) = out {
                std::fs::write(&o, serde_json::to_string_pretty(&timings)?)?;
            }
            Ok(())
        }
        Command::BenchAb { a_config, a_cmd, b_config, b_cmd, blocks, ready_timeout_s, args } => {
            use antiphon_bench::ab::{AbConfig, ServerSpec};
            let side = |c: Option<PathBuf>, s: Option<String>| match (c, s) {
                (Some(c), _) => ServerSpec::Config(c),
                (None, Some(s)) => ServerSpec::Shell(s),
                (None, None) => unreachable!("clap requires one"),
            };
            let out = args.out.clone();
            let cfg = AbConfig {
                a: side(a_config, a_cmd),
                b: side(b_config, b_cmd),
                blocks,
                bench: args.into_config(String::new())?,
                out: out.clone(),
                ready_timeout: std::time::Duration::from_secs(ready_timeout_s),
            };
            let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            let report = rt.block_on(antiphon_bench::ab::run(cfg))?;
            print!("{}", antiphon_bench::ab::table(&report));
            println!("wrote {}/ab.json and ab.md", out.display());
            Ok(())
        }
    }
}

fn serve(cfg: Config) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        tracing::info!(source = ?cfg.model.source, preset = ?cfg.model.preset,
            device = %cfg.model.device, "loading models");
        let models = tokio::task::spawn_blocking({
            let cfg = cfg.clone();
            move || antiphon_server::load_models(&cfg)
        })
        .await??;
        let server = antiphon_server::start(cfg, models).await?;
        println!("antiphon listening on http://{} (WebSocket /v1/realtime)", server.addr);
        shutdown_signal().await;
        tracing::info!("shutting down: no new connections, telling sessions, draining");
        server.shutdown().await
    })
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
