//! The flow's conditional flow matching solver over the DiT estimator: Euler steps on the cosine
//! time grid with classifier-free guidance, per chunk of a batch of streams, op by op or replayed
//! as a CUDA graph per shape; streams whose caches differ in length share a chunk with their
//! caches padded and the padding masked out of attention ([`Cfm::solve_chunk_ragged`]).

use std::sync::{Arc, Mutex};

use candle_core::{Result, Tensor};

use super::dit::{Att, Dit, EstimatorCache, Sink, StepCondition};
use super::dit_attention::PoolAttention;
use super::slots::{FlowPool, PoolBatch};
use crate::cuda_graph::GraphSlot;

/// The Euler schedule on the cosine time grid: `t_k = 1 - cos(k / n · π / 2)`, computed in f32 as
/// the reference does.
pub fn cosine_t_span(n: usize) -> Vec<f32> {
    let steps = n + 1;
    let step = 1.0f32 / n as f32;
    (0..steps)
        .map(|i| {
            // torch.linspace: from the start in the first half, from the end in the second
            let l =
                if i < steps / 2 { i as f32 * step } else { 1.0 - (steps - 1 - i) as f32 * step };
            1.0 - (l * 0.5 * std::f32::consts::PI).cos()
        })
        .collect()
}

/// When the chunk solver runs as a CUDA graph (GPU only, on a stream no other stage uses).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GraphPolicy {
    /// Largest batch (streams) that is captured; larger batches run op by op.
    pub max_batch: usize,
    /// Captured graphs kept at once (each holds its own input and output caches); the least
    /// recently used goes first.
    pub max_graphs: usize,
    /// Largest batch of streams in pool slots solved as a graph (batches are padded to powers of
    /// two up to it, so a few graphs serve every batch size).
    pub pool_batch: usize,
    /// Graphs of pooled solves kept at once (one per batch size and chunk length).
    pub pool_graphs: usize,
    /// Largest batch of voices whose setup (the solve over their prompts) is captured; callers
    /// pad their batches to powers of two up to it ([`super::Code2Wav::setup_batch`]).
    pub setup_batch: usize,
}

impl Default for GraphPolicy {
    fn default() -> Self {
        Self { max_batch: 2, max_graphs: 12, pool_batch: 32, pool_graphs: 16, setup_batch: 8 }
    }
}

/// What the Euler loop's estimator attends over besides the chunk itself.
#[derive(Clone, Copy)]
enum Cache<'a> {
    /// Nothing (the prompt's chunk).
    None,
    /// Per-step caches in the reference's layout (`att: [steps, depth, N, h, L, 2 hd]`, `cnn:
    /// [steps, depth, N, 2, 2 H]`), with an optional key mask over `[new; cache]`.
    Joined { att: &'a Tensor, cnn: &'a Tensor, mask: Option<&'a Tensor> },
    /// A slot pool's keys and values ([`FlowPool`]) with the conv caches `cnn` as above.
    Pool { pool: &'a FlowPool, cnn: &'a Tensor, batch: &'a PoolBatch },
}

/// The solver's memo: the time conditionings of the schedule in use.
#[derive(Default)]
struct SolverMemo {
    conds: Option<(usize, Arc<Vec<StepCondition>>)>,
}

/// Conditional flow matching with classifier-free guidance over the DiT.
pub struct Cfm {
    pub estimator: Dit,
    pub cfg_rate: f64,
    /// The fixed noise buffer `[out_channels, frames]`.
    pub noise: Tensor,
    policy: Option<GraphPolicy>,
    /// The chunk solves captured per shape (inputs: mu, speakers, condition, both caches).
    graphs: GraphSlot,
    /// The pooled chunk solves captured per shape.
    pool_graphs: GraphSlot,
    /// How pooled solves attend ([`super::dit_attention::attend_pool`]).
    pool_attention: PoolAttention,
    memo: Arc<Mutex<SolverMemo>>,
}

/// A clone starts with no graphs of its own (a graph is bound to its owner's buffers).
impl Clone for Cfm {
    fn clone(&self) -> Self {
        let mut c = Self::new(self.estimator.clone(), self.cfg_rate, self.noise.clone());
        c.set_graphs(self.policy);
        c.pool_attention = self.pool_attention;
        c
    }
}

impl std::fmt::Debug for Cfm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cfm")
            .field("cfg_rate", &self.cfg_rate)
            .field("graphs", &self.policy)
            .finish_non_exhaustive()
    }
}

impl Cfm {
    pub fn new(estimator: Dit, cfg_rate: f64, noise: Tensor) -> Self {
        Self {
            estimator,
            cfg_rate,
            noise,
            policy: None,
            graphs: GraphSlot::off(),
            pool_graphs: GraphSlot::off(),
            pool_attention: PoolAttention::default(),
            memo: Arc::new(Mutex::new(SolverMemo::default())),
        }
    }

    /// Chunk solves over fixed buffers replayed as CUDA graphs (`Some`), or op by op (`None`, the
    /// default). Where the device cannot capture ([`crate::cuda_graph::can_capture`]) the
    /// fixed-buffer solve runs op by op (same results; used to test it on the CPU).
    pub fn set_graphs(&mut self, policy: Option<GraphPolicy>) {
        self.policy = policy;
        (self.graphs, self.pool_graphs) = match policy {
            Some(p) => (GraphSlot::on(p.max_graphs), GraphSlot::on(p.pool_graphs)),
            None => (GraphSlot::off(), GraphSlot::off()),
        };
    }

    /// How pooled solves attend where the device has the path (set before graphs are captured: a
    /// graph keeps the path it was captured with).
    pub fn set_pool_attention(&mut self, mode: PoolAttention) {
        self.pool_attention = mode;
    }

    /// The graph policy in force (`None`: op by op).
    pub fn policy(&self) -> Option<GraphPolicy> {
        self.policy
    }

    /// Captured graphs held now (both kinds).
    pub fn graphs_held(&self) -> usize {
        self.graphs.held() + self.pool_graphs.held()
    }

    /// The batch a pooled solve of `b` streams runs at: the next power of two when it is replayed
    /// as a graph, else `b`.
    pub fn pool_pad(&self, b: usize) -> usize {
        match self.policy {
            Some(p) if b.next_power_of_two() <= p.pool_batch => b.next_power_of_two(),
            _ => b,
        }
    }

    /// The noise each stream's chunk of `t` frames starts from (stream `i`'s cache holding
    /// `lens[i]` frames), `[pad, 80, t]` (rows past `lens` zero), in `dtype`.
    pub fn noise_rows(
        &self,
        lens: &[usize],
        t: usize,
        pad: usize,
        dtype: candle_core::DType,
    ) -> Result<Tensor> {
        let mut rows = lens.iter().map(|&l| self.noise_at(l, t)).collect::<Result<Vec<_>>>()?;
        if pad > lens.len() {
            let z =
                Tensor::zeros((self.noise.dim(0)?, t), self.noise.dtype(), self.noise.device())?;
            rows.extend(std::iter::repeat_n(z, pad - lens.len()));
        }
        Tensor::stack(&rows, 0)?.to_dtype(dtype)?.contiguous()
    }

    /// The time conditioning of every Euler step of an `n`-step schedule (memoised).
    fn conditions(&self, n: usize, dev: &candle_core::Device) -> Result<Arc<Vec<StepCondition>>> {
        let mut memo = self.memo.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((m, c)) = &memo.conds {
            if *m == n {
                return Ok(c.clone());
            }
        }
        let span = cosine_t_span(n);
        let mut t = span[0];
        let mut conds = Vec::with_capacity(n);
        for &next in &span[1..=n] {
            conds.push(self.estimator.step_condition(t, dev)?);
            // (as the Euler loop advances its time, step by step in f32)
            let dt = next - t;
            t += dt;
        }
        let conds = Arc::new(conds);
        memo.conds = Some((n, conds.clone()));
        Ok(conds)
    }

    /// The noise a chunk of `t` frames starts from for a stream whose cache holds `offset`
    /// frames: `[80, t]`.
    fn noise_at(&self, offset: usize, t: usize) -> Result<Tensor> {
        if offset + t > self.noise.dim(1)? {
            candle_core::bail!(
                "noise buffer of {} frames is too short for offset {offset} + {t}",
                self.noise.dim(1)?
            );
        }
        self.noise.narrow(1, offset, t)
    }

    /// The Euler loop from `x0: [B, 80, T]` over the estimator caches `cache`. Returns the solution
    /// `[B, 80, T]` and every step's new caches: conv `[steps, depth, 2 B, 2, 2 H]` and (unless the
    /// cache is a pool's, written in place) attention `[steps, depth, 2 B, h, T + L, 2 hd]`.
    #[allow(clippy::too_many_arguments)]
    fn euler(
        &self,
        x0: Tensor,
        mu: &Tensor,
        spks: &Tensor,
        cond: &Tensor,
        conds: &[StepCondition],
        cache: Cache<'_>,
    ) -> Result<(Tensor, Tensor, Option<Tensor>)> {
        let n_timesteps = conds.len();
        let (b, _, t) = mu.dims3()?;
        let mut x = x0;
        // keys and values apart, once per chunk: each block then appends its new ones with one
        // plain copy and attends without another
        let hd = self.estimator.config().head_dim;
        let kv = match cache {
            Cache::Joined { att, .. } => {
                Some((att.narrow(5, 0, hd)?.contiguous()?, att.narrow(5, hd, hd)?.contiguous()?))
            }
            _ => None,
        };
        let l = kv.as_ref().map(|(k, _)| k.dim(4)).transpose()?.unwrap_or(0);
        let (cnn_out, att_out) = Sink::buffers(
            self.estimator.config(),
            n_timesteps,
            2 * b,
            t,
            l,
            matches!(cache, Cache::Pool { .. }),
            mu,
        )?;
        let span = cosine_t_span(n_timesteps);
        let mu_in = Tensor::cat(&[mu, &mu.zeros_like()?], 0)?;
        let spks_in = Tensor::cat(&[spks, &spks.zeros_like()?], 0)?;
        let cond_in = Tensor::cat(&[cond, &cond.zeros_like()?], 0)?;
        let mut tt = span[0];
        let mut dt = span[1] - span[0];
        for step in 1..=n_timesteps {
            let x_in = Tensor::cat(&[&x, &x], 0)?;
            let cc = match cache {
                Cache::None => None,
                Cache::Joined { cnn, .. } | Cache::Pool { cnn, .. } => Some(cnn.get(step - 1)?),
            };
            let step_kv = match (&kv, cache) {
                (Some((k, v)), _) => Some((k.get(step - 1)?, v.get(step - 1)?)),
                (None, Cache::Pool { pool, .. }) => Some(pool.step_planes(step - 1)?),
                _ => None,
            };
            let att = match (cache, &step_kv) {
                (Cache::Joined { mask, .. }, Some((k, v))) => Att::Joined { k, v, mask },
                (Cache::Pool { batch, .. }, Some((k, v))) => Att::Pool {
                    k,
                    v,
                    rows: &batch.rows,
                    pos: &batch.pos,
                    mask: &batch.mask,
                    mode: self.pool_attention,
                },
                _ => Att::Empty,
            };
            let (sink_cnn, sink_att) =
                (cnn_out.get(step - 1)?, att_out.as_ref().map(|a| a.get(step - 1)).transpose()?);
            let ends = match cache {
                Cache::Pool { batch, .. } => batch.ends.as_ref(),
                _ => None,
            };
            let sink = Sink { cnn: &sink_cnn, att: sink_att.as_ref(), ends };
            let v = self.estimator.forward_into(
                &x_in,
                &mu_in,
                &conds[step - 1],
                &spks_in,
                &cond_in,
                cc.as_ref(),
                att,
                &sink,
            )?;
            let vc = v.narrow(0, 0, b)?;
            let vu = v.narrow(0, b, b)?;
            let v = ((vc * (1.0 + self.cfg_rate))? - (vu * self.cfg_rate)?)?;
            x = (x + (v * dt as f64)?)?;
            tt += dt;
            if step < n_timesteps {
                dt = span[step + 1] - tt;
            }
        }
        Ok((x, cnn_out, att_out))
    }

    /// Solves one chunk for a batch of `B` streams. `mu`, `cond`: `[B, 80, T]`, `spks: [B, 80]`;
    /// `cache` rows are `[cond rows of all B; uncond rows of all B]`. Noise starts at the cache
    /// length. Returns `[B, 80, T]` and the new caches.
    pub fn solve_chunk(
        &self,
        mu: &Tensor,
        spks: &Tensor,
        cond: &Tensor,
        n_timesteps: usize,
        cache: Option<&EstimatorCache>,
    ) -> Result<(Tensor, EstimatorCache)> {
        let (b, ch, t) = mu.dims3()?;
        let offset = cache.map(|c| c.len()).unwrap_or(0);
        let noise = self.noise_at(offset, t)?;
        let conds = self.conditions(n_timesteps, mu.device())?;
        // inputs: mu, speakers, condition, then (with a cache) its attention and conv parts;
        // outputs: the solution, the new attention and conv caches
        let solve = |x: &[Tensor]| -> Result<Vec<Tensor>> {
            let x0 = noise
                .unsqueeze(0)?
                .broadcast_as((b, ch, t))?
                .to_dtype(x[0].dtype())?
                .contiguous()?;
            let cache = if x.len() == 5 {
                Cache::Joined { att: &x[3], cnn: &x[4], mask: None }
            } else {
                Cache::None
            };
            let (out, cnn, att) = self.euler(x0, &x[0], &x[1], &x[2], &conds, cache)?;
            Ok(vec![out, att.expect("caches held apart"), cnn])
        };
        let out = match (self.policy, cache) {
            // (the shape key holds the cache length, hence the noise offset)
            (Some(p), Some(c)) if b <= p.max_batch => {
                self.graphs.run(n_timesteps, &[mu, spks, cond, &c.att, &c.cnn], &solve)?
            }
            (_, Some(c)) => {
                solve(&[mu.clone(), spks.clone(), cond.clone(), c.att.clone(), c.cnn.clone()])?
            }
            // a voice's setup (no cache yet): the reference is cut to a fixed length, so one
            // graph serves every voice
            (Some(p), None) if b <= p.setup_batch => {
                self.graphs.run(n_timesteps, &[mu, spks, cond], &solve)?
            }
            (_, None) => solve(&[mu.clone(), spks.clone(), cond.clone()])?,
        };
        let [x, att, cnn]: [Tensor; 3] = out
            .try_into()
            .map_err(|_| candle_core::Error::Msg("the chunk solve gives three outputs".into()))?;
        Ok((x, EstimatorCache { att, cnn }))
    }

    /// One chunk for streams whose caches are in a slot pool: `x0` (from [`Cfm::noise_rows`]),
    /// `mu`, `cond`: `[B, 80, T]`, `spks: [B, 80]`, `cnn`: the conv caches `[steps, depth, 2 B,
    /// 2, 2 H]`, `batch` from [`FlowPool::batch`] for the same `B` (padding included). The new keys
    /// and values go into the pool; returns the solution and the new conv caches. With graphs on
    /// and `B` at most the policy's `pool_batch`, replayed as a CUDA graph per shape (every input,
    /// rows and mask included, is copied into the graph's buffers; the pool stays where it is).
    #[allow(clippy::too_many_arguments)]
    pub fn solve_chunk_pool(
        &self,
        x0: &Tensor,
        mu: &Tensor,
        spks: &Tensor,
        cond: &Tensor,
        n_timesteps: usize,
        pool: &FlowPool,
        cnn: &Tensor,
        batch: &PoolBatch,
    ) -> Result<(Tensor, Tensor)> {
        let conds = self.conditions(n_timesteps, mu.device())?;
        let solve = |x: &[Tensor]| -> Result<Vec<Tensor>> {
            let batch = PoolBatch {
                rows: x[5].clone(),
                pos: x[6].clone(),
                mask: x[7].clone(),
                ends: x.get(8).cloned(),
            };
            let (out, cnn, _) = self.euler(
                x[0].clone(),
                &x[1],
                &x[2],
                &x[3],
                &conds,
                Cache::Pool { pool, cnn: &x[4], batch: &batch },
            )?;
            Ok(vec![out, cnn])
        };
        // (the ends only when the rows' chunks may differ in length: a graph without them is the
        // one uniform chunks always ran)
        let mut inputs = vec![x0, mu, spks, cond, cnn, &batch.rows, &batch.pos, &batch.mask];
        inputs.extend(batch.ends.as_ref());
        let out = match self.policy {
            Some(p) if mu.dim(0)? <= p.pool_batch => {
                self.pool_graphs.run(n_timesteps, &inputs, &solve)?
            }
            _ => solve(&inputs.iter().map(|t| (*t).clone()).collect::<Vec<_>>())?,
        };
        let [x, cnn]: [Tensor; 2] = out.try_into().map_err(|_| {
            candle_core::Error::Msg("the pooled chunk solve gives two outputs".into())
        })?;
        Ok((x, cnn))
    }

    /// [`Cfm::solve_chunk`] for streams whose caches hold different lengths: `cache` is padded to
    /// the longest (`lens[i]` = stream `i`'s own length, padding after it), the padding is masked
    /// out of attention and each stream's noise starts at its own length, so every stream gets
    /// what it gets alone. Op by op. Returns the solution and the new (still padded) caches:
    /// stream `i`'s new attention cache is its first `T + lens[i]` positions.
    pub fn solve_chunk_ragged(
        &self,
        mu: &Tensor,
        spks: &Tensor,
        cond: &Tensor,
        n_timesteps: usize,
        cache: &EstimatorCache,
        lens: &[usize],
    ) -> Result<(Tensor, EstimatorCache)> {
        let (b, _, t) = mu.dims3()?;
        let lmax = cache.len();
        if lens.len() != b || lens.iter().any(|&l| l > lmax) {
            candle_core::bail!(
                "solve_chunk_ragged: {} lengths for {b} streams, cache of {lmax}",
                lens.len()
            );
        }
        let x0 = Tensor::stack(
            &lens.iter().map(|&l| self.noise_at(l, t)).collect::<Result<Vec<_>>>()?,
            0,
        )?
        .to_dtype(mu.dtype())?
        .contiguous()?;
        // keys are [new t; cache lmax]: a row sees its t new keys and its own cache length
        let mut m = Vec::with_capacity(2 * b * (t + lmax));
        for _ in 0..2 {
            for &l in lens {
                m.extend((0..t + lmax).map(|j| if j < t + l { 0f32 } else { f32::NEG_INFINITY }));
            }
        }
        let mask =
            Tensor::from_vec(m, (2 * b, 1, 1, t + lmax), mu.device())?.to_dtype(mu.dtype())?;
        let conds = self.conditions(n_timesteps, mu.device())?;
        let (x, cnn, att) = self.euler(
            x0,
            mu,
            spks,
            cond,
            &conds,
            Cache::Joined { att: &cache.att, cnn: &cache.cnn, mask: Some(&mask) },
        )?;
        Ok((x, EstimatorCache { att: att.expect("caches held apart"), cnn }))
    }
}
