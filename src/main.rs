//! The `antiphon` command line: a thin layer over the library.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

use antiphon::server::config::Config;
use antiphon::synth::{Preset, SynthOptions};

#[derive(Parser)]
#[command(name = "antiphon", version, about = "Realtime voice server for the MiniCPM-o 4.5 speech path")]
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
    },
    /// Validate a configuration file without starting anything.
    CheckConfig { file: PathBuf },
    /// Write a synthetic checkpoint directory (seeded random weights in the real layout).
    SynthCheckpoint {
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
        #[arg(long, value_enum, default_value = "tiny")]
        preset: Preset,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Stored dtype: f32 or bf16.
        #[arg(long, default_value = "f32")]
        dtype: String,
        /// Largest shard, in MiB.
        #[arg(long, default_value_t = 2048)]
        shard_mib: usize,
    },
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info,tower_http=warn".into()))
        .init();
    let cli = Cli::parse();
    match cli.command.unwrap_or(Command::Serve { config: None, listen: None }) {
        Command::Serve { config, listen } => {
            let mut cfg = match &config {
                Some(p) => Config::load(p)?,
                None => Config::embedded_default().context("the embedded default (run from the repository root)")?,
            };
            if let Some(l) = listen {
                cfg.server.listen = l;
                cfg.validate()?;
            }
            serve(cfg)
        }
        Command::CheckConfig { file } => {
            let cfg = Config::load(&file)?;
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
            let dtype = match dtype.as_str() {
                "f32" => candle_core::DType::F32,
                "bf16" => candle_core::DType::BF16,
                other => anyhow::bail!("--dtype {other}: expected f32 or bf16"),
            };
            let opts = SynthOptions { preset, seed, dtype, shard_bytes: shard_mib << 20 };
            antiphon::synth::write_checkpoint(&out, &opts)?;
            println!("wrote a {preset:?} synthetic checkpoint (seed {seed}) to {}", out.display());
            Ok(())
        }
    }
}

fn serve(cfg: Config) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        tracing::info!(source = ?cfg.model.source, preset = ?cfg.model.preset, device = %cfg.model.device, "loading models");
        let models = tokio::task::spawn_blocking({
            let cfg = cfg.clone();
            move || antiphon::server::load_models(&cfg)
        })
        .await??;
        let server = antiphon::server::start(cfg, models).await?;
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
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
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
