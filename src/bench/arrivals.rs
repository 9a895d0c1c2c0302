//! The `conversations` workload: open loop, one level per arrival rate. Callers arrive as a
//! Poisson process (exponential gaps with mean 1 / rate, from a seeded splitmix64; the first call
//! at the level's start). Each connects and creates a turn-mode session; a `capacity` answer (or
//! a 503 at the upgrade) refuses the call: it is counted, its `retry_after_ms` kept, and never
//! retried. A call that gets a session sends `turns` text turns with the forced lengths, each
//! `think` after the previous reply has played (the moment its buffer runs dry under the
//! no-pre-buffer playback model), then closes the session. A reply the server refuses
//! (`capacity`) is a failed turn; the conversation goes on with its next turn.
//!
//! The level's wall time runs from the first arrival to the end of the last conversation. There
//! is no warm-up here (`--warmup` does not apply): warm the server before.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::client::{Capacity, Client};
use super::report::{self, LevelSummary};
use super::{request, BenchConfig, RequestRecord, Shared};

/// splitmix64 (Steele, Lea, Flood 2014): a small, well-mixed, seedable generator.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in the open interval (0, 1).
    fn open01(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
}

/// `n` Poisson arrival times in seconds after the first (which is at 0): exponential gaps with
/// mean `1 / rate`, always positive, the same for the same seed. Every rate draws the same
/// uniforms, so the schedule at rate 2r is the one at r, twice as fast.
pub fn poisson_arrivals(rate: f64, n: usize, seed: u64) -> Vec<f64> {
    let mut rng = SplitMix64(seed);
    let mut t = 0.0;
    (0..n)
        .map(|i| {
            if i > 0 {
                t += -rng.open01().ln() / rate;
            }
            t
        })
        .collect()
}

/// The workload's options, checked before anything runs.
pub(super) fn check(cfg: &BenchConfig) -> Result<()> {
    if cfg.rates.is_empty() || cfg.rates.iter().any(|r| !r.is_finite() || *r <= 0.0) {
        bail!(
            "--rates: the conversations workload needs arrival rates above 0 (conversations per \
            second), e.g. 2,4,8"
        );
    }
    if cfg.conversations == 0 || cfg.turns == 0 {
        bail!("--conversations and --turns must be at least 1");
    }
    Ok(())
}

/// How many are in progress now, and the most at once.
#[derive(Default)]
struct Gauge {
    now: AtomicUsize,
    peak: AtomicUsize,
}

impl Gauge {
    fn enter(&self) {
        let n = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.peak.fetch_max(n, Ordering::SeqCst);
    }

    fn leave(&self) {
        self.now.fetch_sub(1, Ordering::SeqCst);
    }

    fn now(&self) -> usize {
        self.now.load(Ordering::SeqCst)
    }

    fn peak(&self) -> usize {
        self.peak.load(Ordering::SeqCst)
    }
}

/// Conversations in progress (arrived, not ended) and sessions held (created, not closed).
#[derive(Default)]
struct Live {
    conversations: Gauge,
    sessions: Gauge,
}

/// What became of one call.
enum Call {
    /// The server refused it (`capacity`), with the `retry_after_ms` it sent.
    Refused(Option<u64>),
    /// It got no session for another reason (its first turn is recorded as failed).
    Failed(String),
    Held,
}

struct Outcome {
    call: Call,
    records: Vec<RequestRecord>,
    end: Instant,
}

/// One conversation, arriving at `due`.
async fn conversation(
    sh: Arc<Shared>,
    rate: f64,
    n: usize,
    due: Instant,
    level_start: Instant,
    live: Arc<Live>,
) -> Outcome {
    tokio::time::sleep_until(due.into()).await;
    let cfg = &sh.cfg;
    let skip = |turns: usize| {
        if let Some(p) = &sh.progress {
            p.inc(turns as u64);
        }
    };
    let mark = |mut r: RequestRecord, turn: usize| {
        r.rate_per_s = Some(rate);
        r.conversation = Some(n);
        r.turn = Some(turn);
        r
    };
    live.conversations.enter();
    let opened = async {
        let mut c = Client::connect(cfg).await?;
        c.create(cfg).await?;
        Ok::<_, anyhow::Error>(c)
    }
    .await;
    let mut c = match opened {
        Ok(c) => c,
        Err(e) => {
            let in_progress = live.conversations.now();
            live.conversations.leave();
            skip(cfg.turns);
            return match e.downcast_ref::<Capacity>() {
                Some(Capacity(ms)) => {
                    Outcome { call: Call::Refused(*ms), records: vec![], end: Instant::now() }
                }
                None => {
                    let mut r = RequestRecord::new(
                        in_progress,
                        n,
                        0,
                        false,
                        0,
                        due.duration_since(level_start).as_secs_f64(),
                    );
                    r.error = Some(format!("{e:#}"));
                    Outcome {
                        call: Call::Failed(format!("{e:#}")),
                        records: vec![mark(r, 0)],
                        end: Instant::now(),
                    }
                }
            };
        }
    };
    live.sessions.enter();
    let mut records = Vec::new();
    for turn in 0..cfg.turns {
        let (rec, played) =
            request(&sh, &mut c, live.conversations.now(), n, turn, false, level_start).await;
        // a refused reply or a failed response leaves the session usable; anything else ends it
        let broken = !rec.ok
            && rec.error.as_deref().is_some_and(|e| e != "capacity" && !e.starts_with("response "));
        records.push(mark(rec, turn));
        if broken {
            skip(cfg.turns - turn - 1);
            break;
        }
        if turn + 1 < cfg.turns {
            tokio::time::sleep_until((played.unwrap_or_else(Instant::now) + cfg.think).into())
                .await;
        }
    }
    c.close().await;
    live.sessions.leave();
    live.conversations.leave();
    Outcome { call: Call::Held, records, end: Instant::now() }
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    v.sort_by(|a, b| a.total_cmp(b));
    match v.len() {
        0 => None,
        n if n % 2 == 1 => Some(v[n / 2]),
        n => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

/// One arrival rate: `conversations` calls on the Poisson schedule; every turn's record and the
/// level's summary.
pub(super) async fn run_rate_level(
    sh: Arc<Shared>,
    rate: f64,
) -> Result<(Vec<RequestRecord>, LevelSummary)> {
    let cfg = &sh.cfg;
    let schedule = poisson_arrivals(rate, cfg.conversations, cfg.seed);
    let live = Arc::new(Live::default());
    let start = Instant::now();
    let tasks: Vec<_> = schedule
        .iter()
        .enumerate()
        .map(|(n, &at)| {
            tokio::spawn(conversation(
                sh.clone(),
                rate,
                n,
                start + Duration::from_secs_f64(at),
                start,
                live.clone(),
            ))
        })
        .collect();
    let (mut records, mut refused, mut failed) = (Vec::new(), Vec::new(), Vec::new());
    let mut end = start;
    for t in tasks {
        let o = t.await.context("bench conversation")?;
        end = end.max(o.end);
        match o.call {
            Call::Refused(ms) => refused.push(ms),
            Call::Failed(e) => failed.push(e),
            Call::Held => {}
        }
        records.extend(o.records);
    }
    if !failed.is_empty() && failed.len() == schedule.len() {
        bail!("no conversation got a session at {rate}/s: {}", failed[0]);
    }
    // the first call arrives at the start
    let wall = end.duration_since(start).as_secs_f64();
    let mut l = report::level_summary(live.conversations.peak(), &records, wall);
    l.rate_per_s = Some(rate);
    l.calls_offered = Some(schedule.len());
    l.calls_refused = Some(refused.len());
    l.replies_refused =
        Some(records.iter().filter(|r| r.error.as_deref() == Some("capacity")).count());
    l.live_sessions_peak = Some(live.sessions.peak());
    l.retry_after_ms = median(refused.iter().flatten().map(|&ms| ms as f64).collect());
    Ok((records, l))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_schedule() {
        let a = poisson_arrivals(4.0, 200, 7);
        assert_eq!(a, poisson_arrivals(4.0, 200, 7));
        assert_ne!(a, poisson_arrivals(4.0, 200, 8));
        assert_eq!(a.len(), 200);
        assert_eq!(a[0], 0.0);
        // the same draws at every rate: twice the rate, half the times
        let b = poisson_arrivals(8.0, 200, 7);
        assert!(a.iter().zip(&b).all(|(x, y)| (x / 2.0 - y).abs() < 1e-9));
        assert!(poisson_arrivals(1.0, 0, 0).is_empty());
    }

    #[test]
    fn gaps_are_positive_with_mean_one_over_the_rate() {
        for (rate, seed) in [(0.5, 0), (4.0, 1), (32.0, 12345)] {
            let t = poisson_arrivals(rate, 20_001, seed);
            let gaps: Vec<f64> = t.windows(2).map(|w| w[1] - w[0]).collect();
            assert!(gaps.iter().all(|&g| g > 0.0 && g.is_finite()), "rate {rate}");
            let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
            // the standard error of the mean is 1 / (rate √20000) ≈ 0.7 %
            assert!((mean * rate - 1.0).abs() < 0.05, "rate {rate}: mean gap {mean}");
            // exponential: about e^-1 of the gaps are longer than the mean
            let longer =
                gaps.iter().filter(|&&g| g > 1.0 / rate).count() as f64 / gaps.len() as f64;
            assert!((longer - (-1f64).exp()).abs() < 0.03, "rate {rate}: {longer}");
        }
    }

    #[test]
    fn medians() {
        assert_eq!(median(vec![]), None);
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), Some(2.5));
    }
}
