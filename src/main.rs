//! The `antiphon` command line.

use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};

use antiphon::synth::{Preset, SynthOptions};

#[derive(Parser)]
#[command(name = "antiphon", version, about = "Realtime voice server for the MiniCPM-o 4.5 speech path")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
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
    let cli = Cli::parse();
    match cli.command {
        Command::SynthCheckpoint { out, preset, seed, dtype, shard_mib } => {
            let dtype = match dtype.as_str() {
                "f32" => candle_core::DType::F32,
                "bf16" => candle_core::DType::BF16,
                other => anyhow::bail!("--dtype {other}: expected f32 or bf16"),
            };
            let opts = SynthOptions { preset, seed, dtype, shard_bytes: shard_mib << 20 };
            antiphon::synth::write_checkpoint(&out, &opts)?;
            println!("wrote a {preset:?} synthetic checkpoint (seed {seed}) to {}", out.display());
        }
    }
    Ok(())
}
