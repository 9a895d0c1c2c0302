//! `antiphon profile`'s timing: a row is the median and min of its runs, each ended by a device
//! synchronize.

use std::time::Instant;

use anyhow::Result;
use candle_core::Device;
use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub struct Timing {
    pub what: String,
    pub batch: usize,
    pub median_ms: f64,
    pub min_ms: f64,
}

/// The rows asked for (all when `only` is empty) and their timings.
pub(super) struct Rows<'a> {
    pub(super) only: &'a [String],
    pub(super) devs: &'a [Device],
    pub(super) out: Vec<Timing>,
}

impl Rows<'_> {
    /// Whether a row named `what` is to run: its name contains one of `only`'s strings.
    pub(super) fn wants(&self, what: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|s| what.contains(s.as_str()))
    }

    /// Whether any of these rows is wanted.
    pub(super) fn wants_any(&self, rows: &[String]) -> bool {
        rows.iter().any(|r| self.wants(r))
    }

    /// Times `f` as the row `what` (if it is wanted) and prints the row.
    pub(super) fn time(
        &mut self,
        what: &str,
        batch: usize,
        iters: usize,
        f: impl FnMut() -> Result<()>,
    ) -> Result<()> {
        if !self.wants(what) {
            return Ok(());
        }
        let (median_ms, min_ms) = time(self.devs, iters, f)?;
        eprintln!("{what:<48} B={batch:<3} median {median_ms:>9.2} ms  min {min_ms:>9.2} ms");
        self.out.push(Timing { what: what.into(), batch, median_ms, min_ms });
        Ok(())
    }
}

/// Median and min of `iters` runs of `f`, each ended by synchronising every stage's device (each
/// stage may have its own stream). The timed runs (not the warm-up) are a range for an attached
/// CUDA profiler (`ncu --profile-from-start off`).
fn time(devs: &[Device], iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<(f64, f64)> {
    let sync = || -> Result<()> {
        for d in devs {
            d.synchronize()?;
        }
        Ok(())
    };
    for _ in 0..2 {
        f()?;
    }
    sync()?;
    let mut v = Vec::with_capacity(iters);
    antiphon_models::gpu::profiler_range(&devs[0], true);
    for _ in 0..iters {
        let t0 = Instant::now();
        f()?;
        sync()?;
        v.push(t0.elapsed().as_secs_f64() * 1000.0);
    }
    antiphon_models::gpu::profiler_range(&devs[0], false);
    v.sort_by(f64::total_cmp);
    Ok((v[v.len() / 2], v[0]))
}
