//! The flow (`flow.pt`, `CausalMaskedDiffWithXvec`): speech codes -> 80-bin mel at 50 frames/s.
//!
//! `input_embedding` (codes -> 512), `encoder` (the Conformer, ×2 upsampling), `encoder_proj`
//! (-> 80 = `mu`), `spk_embed_affine_layer` (L2-normalized 192-d speaker embedding -> 80),
//! `decoder` (CFM over the DiT).
//!
//! Streaming per stream: [`Flow::setup`] runs the prompt (prompt codes + 3 look-ahead codes, with
//! the prompt mel as condition) to fill the caches; [`Flow::chunk_batch`] turns each next chunk of
//! codes (its first codes being the previous chunk's look-ahead) into mel, for several streams at
//! once (caches in a slot pool, `super::slots`, or their own padded to the longest); after every
//! chunk the caches are trimmed to the prompt plus the last 100 mel frames.

use candle_core::{DType, Module, Result, Tensor, D};
use candle_nn::{Embedding, Linear, VarBuilder};

use super::conformer::{linear, ConformerCache, ConformerConfig, ConformerEncoder};
use super::dit::{Cfm, Dit, DitConfig, EstimatorCache};
use super::slots::FlowSlot;

/// Hyper-parameters (`flow.yaml`).
#[derive(Debug, Clone, PartialEq)]
pub struct FlowConfig {
    pub input_size: usize,
    pub output_size: usize,
    pub spk_embed_dim: usize,
    pub vocab_size: usize,
    pub encoder: ConformerConfig,
    pub estimator: DitConfig,
    pub inference_cfg_rate: f64,
    /// Euler steps (10 in the reference servers).
    pub n_timesteps: usize,
    /// Mel frames of history kept after the prompt (`CONFORMER_HISTORY_FRAMES` and the estimator's
    /// trim: 100).
    pub history_frames: usize,
}

impl Default for FlowConfig {
    fn default() -> Self {
        Self {
            input_size: 512,
            output_size: 80,
            spk_embed_dim: 192,
            vocab_size: 6561,
            encoder: ConformerConfig::default(),
            estimator: DitConfig::default(),
            inference_cfg_rate: 0.7,
            n_timesteps: 10,
            history_frames: 100,
        }
    }
}

/// Per-stream flow state.
#[derive(Debug, Clone)]
pub struct FlowState {
    pub conformer: ConformerCache,
    /// Rows `[cond, uncond]` of this stream: `att [steps, depth, 2, h, L, 2 hd]`.
    pub estimator: EstimatorCache,
    /// Mel frames of the prompt (the caches' fixed origin).
    pub prompt_frames: usize,
    /// The stream's slot in the flow's pool, when it has one: then the attention cache lives there
    /// and `estimator.att` is stale (only `estimator.cnn` is used).
    pub slot: Option<FlowSlot>,
}

#[derive(Debug, Clone)]
pub struct Flow {
    input_embedding: Embedding,
    spk_embed_affine_layer: Linear,
    encoder: ConformerEncoder,
    encoder_proj: Linear,
    pub decoder: Cfm,
    cfg: FlowConfig,
    /// The setup's encoder pass replayed as a CUDA graph per batch size, when on.
    setup_graphs: crate::cuda_graph::GraphSlot,
    /// Chunk lengths (mel frames) a pooled solve is padded up to, ascending (empty: its longest
    /// chunk's): the lengths whose graphs the warm-up captured, so that a chunk of another length
    /// (a reply's last, of any length) rides a held graph instead of bringing a new shape.
    solve_frames: Vec<usize>,
}

impl Flow {
    /// `vb` over the `flow.pt` state dict; `noise`: the CFM's fixed noise `[80, frames]`.
    pub fn load(vb: VarBuilder, cfg: &FlowConfig, noise: Tensor) -> Result<Self> {
        let c = cfg.encoder.output_size;
        Ok(Self {
            input_embedding: Embedding::new(
                vb.pp("input_embedding").get((cfg.vocab_size, cfg.input_size), "weight")?,
                cfg.input_size,
            ),
            spk_embed_affine_layer: linear(
                vb.pp("spk_embed_affine_layer"),
                cfg.spk_embed_dim,
                cfg.output_size,
                true,
            )?,
            encoder: ConformerEncoder::load(vb.pp("encoder"), &cfg.encoder)?,
            encoder_proj: linear(vb.pp("encoder_proj"), c, cfg.output_size, true)?,
            decoder: Cfm::new(
                Dit::load(vb.pp("decoder").pp("estimator"), &cfg.estimator)?,
                cfg.inference_cfg_rate,
                noise.to_dtype(vb.dtype())?.to_device(vb.device())?,
            ),
            cfg: cfg.clone(),
            setup_graphs: crate::cuda_graph::GraphSlot::off(),
            solve_frames: Vec::new(),
        })
    }

    /// The setup's encoder pass as a CUDA graph per batch size (the solve's graphs follow the
    /// decoder's policy).
    pub fn set_setup_graphs(&mut self, on: bool) {
        self.setup_graphs = if on {
            crate::cuda_graph::GraphSlot::on(4)
        } else {
            crate::cuda_graph::GraphSlot::off()
        };
    }

    pub fn config(&self) -> &FlowConfig {
        &self.cfg
    }

    /// The lengths (mel frames) a pooled solve is padded up to ([`Flow::chunk_mixed`]).
    pub fn set_solve_frames(&mut self, mut frames: Vec<usize>) {
        frames.sort_unstable();
        frames.dedup();
        self.solve_frames = frames;
    }

    /// A pooled solve's length for a step whose longest chunk has `longest` frames.
    pub fn solve_length(&self, longest: usize) -> usize {
        self.solve_frames.iter().copied().find(|&f| f >= longest).unwrap_or(longest)
    }

    /// The mel frames a payload of `codes` codes makes (the look-ahead's held back unless `last`).
    pub fn payload_frames(&self, codes: usize, last: bool) -> usize {
        if last {
            codes * self.up_rate()
        } else {
            codes.saturating_sub(self.lookahead()) * self.up_rate()
        }
    }

    pub fn up_rate(&self) -> usize {
        self.cfg.encoder.up_stride
    }

    pub fn lookahead(&self) -> usize {
        self.cfg.encoder.pre_lookahead_len
    }

    fn device(&self) -> &candle_core::Device {
        self.input_embedding.embeddings().device()
    }

    fn dtype(&self) -> DType {
        self.input_embedding.embeddings().dtype()
    }

    fn embed(&self, codes: &[&[u32]]) -> Result<Tensor> {
        let rows = codes
            .iter()
            .map(|c| {
                if let Some(&bad) = c.iter().find(|&&x| x as usize >= self.cfg.vocab_size) {
                    candle_core::bail!(
                        "speech code {bad} is outside the flow's {} codes",
                        self.cfg.vocab_size
                    );
                }
                self.input_embedding.forward(&Tensor::new(*c, self.device())?)
            })
            .collect::<Result<Vec<_>>>()?;
        Tensor::stack(&rows, 0)
    }

    /// `L2normalize(spk) -> affine`: `[B, 192]` -> `[B, 80]`.
    fn speaker(&self, spk: &Tensor) -> Result<Tensor> {
        let s = spk.to_dtype(DType::F32)?;
        let norm = s.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?.maximum(1e-12)?;
        let s = s.broadcast_div(&norm)?.to_dtype(self.dtype())?;
        self.spk_embed_affine_layer.forward(&s)
    }

    /// Fills a stream's caches from its prompt: `prompt_codes` already ends with the look-ahead
    /// codes; `prompt_mel: [frames, 80]` with frames = up_rate × (codes - look-ahead);
    /// `spk: [192]`.
    pub fn setup(
        &self,
        prompt_codes: &[u32],
        prompt_mel: &Tensor,
        spk: &Tensor,
    ) -> Result<FlowState> {
        Ok(self.setup_batch(&[(prompt_codes, prompt_mel, spk)])?.remove(0))
    }

    /// [`Flow::setup`] for several prompts of one length at once (the encoder and the CFM solve
    /// batched over them): one state per prompt, in order.
    pub fn setup_batch(&self, prompts: &[(&[u32], &Tensor, &Tensor)]) -> Result<Vec<FlowState>> {
        let la = self.lookahead();
        let Some(&(first, first_mel, _)) = prompts.first() else { return Ok(vec![]) };
        let frames = first_mel.dim(0)?;
        for &(codes, mel, _) in prompts {
            if codes.len() <= la || (codes.len() - la) * self.up_rate() != mel.dim(0)? {
                candle_core::bail!(
                    "prompt of {} codes (with {la} look-ahead) does not match {} prompt mel frames",
                    codes.len(),
                    mel.dim(0)?
                );
            }
            if codes.len() != first.len() {
                candle_core::bail!(
                    "a batched setup needs prompts of one length ({} and {} codes)",
                    first.len(),
                    codes.len()
                );
            }
        }
        let b = prompts.len();
        if let Some(&bad) =
            prompts.iter().flat_map(|p| p.0).find(|&&x| x as usize >= self.cfg.vocab_size)
        {
            candle_core::bail!(
                "speech code {bad} is outside the flow's {} codes",
                self.cfg.vocab_size
            );
        }
        let ids = Tensor::new(
            prompts.iter().flat_map(|p| p.0.iter().copied()).collect::<Vec<u32>>(),
            self.device(),
        )?
        .reshape((b, first.len()))?;
        // the encoder over the prompts: mu, then the conformer's caches (conv, token-rate layers,
        // mel-rate layers), as one list of tensors for the graph
        let encode = |x: &[Tensor]| -> Result<Vec<Tensor>> {
            let (h, c) =
                self.encoder.forward_chunk(&self.input_embedding.forward(&x[0])?, false, None)?;
            let mut out =
                vec![self.encoder_proj.forward(&h)?.transpose(1, 2)?.contiguous()?, c.cnn];
            out.extend(c.att_token);
            out.extend(c.att_mel);
            Ok(out)
        };
        let mut outs = self.setup_graphs.run(0, &[&ids], &encode)?.into_iter();
        let (Some(mu), Some(cnn)) = (outs.next(), outs.next()) else {
            candle_core::bail!("the setup's encoder gave no outputs")
        };
        let mut att_token: Vec<Tensor> = outs.collect();
        let att_mel = att_token.split_off(self.cfg.encoder.num_blocks.min(att_token.len()));
        let conformer = ConformerCache { cnn, att_token, att_mel };
        let spk =
            self.speaker(&Tensor::stack(&prompts.iter().map(|p| p.2).collect::<Vec<_>>(), 0)?)?;
        let mels =
            prompts.iter().map(|p| p.1.to_dtype(self.dtype())?.t()).collect::<Result<Vec<_>>>()?;
        let cond = Tensor::stack(&mels, 0)?.contiguous()?;
        let (_, estimator) =
            self.decoder.solve_chunk(&mu, &spk, &cond, self.cfg.n_timesteps, None)?;
        if b == 1 {
            return Ok(vec![FlowState { conformer, estimator, prompt_frames: frames, slot: None }]);
        }
        (0..b)
            .map(|i| {
                Ok(FlowState {
                    conformer: conformer.row(i)?,
                    estimator: EstimatorCache {
                        att: pick_stream(&estimator.att, i, b)?,
                        cnn: pick_stream(&estimator.cnn, i, b)?,
                    },
                    prompt_frames: frames,
                    slot: None,
                })
            })
            .collect()
    }

    /// One chunk for a batch of streams whose chunks have equal lengths and the same `last` flag
    /// ([`Flow::chunk_mixed`] with one flag for all).
    pub fn chunk_batch(
        &self,
        codes: &[&[u32]],
        spks: &[&Tensor],
        states: &mut [&mut FlowState],
        last: bool,
    ) -> Result<Vec<Tensor>> {
        self.chunk_mixed(codes, spks, states, &vec![last; codes.len()])
    }

    /// One chunk for a batch of streams, whatever their chunks' lengths, `last` flags and cache
    /// lengths: the encoder runs once per group of equal (encoder cache length, chunk length,
    /// `last`); the CFM solve once for the streams in pool slots, their chunks padded to the
    /// longest and each row masked to its own, and once per chunk length for the others, over
    /// their caches padded to the longest. `codes[i]` includes the leading context and (unless
    /// `lasts[i]`) the trailing look-ahead; `spks[i]: [192]`. Returns each stream's mel `[80,
    /// frames]` and advances (and trims) its state.
    pub fn chunk_mixed(
        &self,
        codes: &[&[u32]],
        spks: &[&Tensor],
        states: &mut [&mut FlowState],
        lasts: &[bool],
    ) -> Result<Vec<Tensor>> {
        let b = codes.len();
        if b == 0 {
            return Ok(vec![]);
        }
        if spks.len() != b || states.len() != b || lasts.len() != b {
            candle_core::bail!(
                "chunk_mixed: {} codes, {} speakers, {} states, {} flags",
                b,
                spks.len(),
                states.len(),
                lasts.len()
            );
        }
        if let Some(i) = (0..b).find(|&i| !lasts[i] && codes[i].len() <= self.lookahead()) {
            candle_core::bail!(
                "a chunk that is not the last needs new codes plus {} look-ahead \
                codes (stream {i})",
                self.lookahead()
            );
        }
        // 1. the encoder, once per group of equal encoder cache length, chunk length and flag
        let mut mus: Vec<Option<Tensor>> = vec![None; b];
        let mut confs: Vec<Option<ConformerCache>> = vec![None; b];
        let mut groups: Vec<((usize, usize, bool), Vec<usize>)> = Vec::new();
        for (i, st) in states.iter().enumerate() {
            let k = (st.conformer.token_len(), codes[i].len(), lasts[i]);
            match groups.iter_mut().find(|g| g.0 == k) {
                Some(g) => g.1.push(i),
                None => groups.push((k, vec![i])),
            }
        }
        for ((_, _, last), idx) in &groups {
            let conf = if idx.len() == 1 {
                states[idx[0]].conformer.clone()
            } else {
                ConformerCache::stack(
                    &idx.iter().map(|&i| &states[i].conformer).collect::<Vec<_>>(),
                )?
            };
            let xs = self.embed(&idx.iter().map(|&i| codes[i]).collect::<Vec<_>>())?;
            let (h, conf) = self.encoder.forward_chunk(&xs, *last, Some(&conf))?;
            let mu = self.encoder_proj.forward(&h)?.transpose(1, 2)?;
            for (r, &i) in idx.iter().enumerate() {
                mus[i] = Some(mu.narrow(0, r, 1)?);
                confs[i] = Some(if idx.len() == 1 { conf.clone() } else { conf.row(r)? });
            }
        }
        let mus: Vec<Tensor> = mus.into_iter().map(|m| m.expect("every stream encoded")).collect();
        for (st, conf) in states.iter_mut().zip(confs) {
            st.conformer = conf.expect("every stream encoded");
            st.conformer.trim(st.prompt_frames, self.cfg.history_frames)?;
        }
        let frames: Vec<usize> = mus.iter().map(|m| m.dim(2)).collect::<Result<_>>()?;
        // (the pooled solve's length: the step's longest chunk, up to the next held length)
        let t = self.solve_length(frames.iter().copied().max().unwrap_or(0));
        // 2. the estimator: streams in pool slots in one solve over the pool, the others in one
        // per chunk length over their own caches (a slot that cannot take the pooled solve's
        // length gives its cache back first)
        for st in states.iter_mut() {
            if st.slot.as_ref().is_some_and(|s| !s.fits(t)) {
                let slot = st.slot.take().expect("checked");
                st.estimator.att = slot.materialize()?;
            }
        }
        let spk = self.speaker(&Tensor::stack(spks, 0)?)?;
        let mut solves: Vec<(Vec<usize>, bool)> = Vec::new();
        let pooled: Vec<usize> = (0..b).filter(|&i| states[i].slot.is_some()).collect();
        if !pooled.is_empty() {
            solves.push((pooled, true));
        }
        let mut own_lengths: Vec<usize> =
            (0..b).filter(|&i| states[i].slot.is_none()).map(|i| frames[i]).collect();
        own_lengths.sort_unstable();
        own_lengths.dedup();
        for f in own_lengths {
            solves.push((
                (0..b).filter(|&i| states[i].slot.is_none() && frames[i] == f).collect(),
                false,
            ));
        }
        let mut mels: Vec<Option<Tensor>> = vec![None; b];
        for (idx, in_pool) in solves {
            let tt = if in_pool { t } else { idx.iter().map(|&i| frames[i]).max().unwrap_or(0) };
            let rows = idx.iter().map(|&i| {
                if frames[i] < tt {
                    mus[i].pad_with_zeros(2, 0, tt - frames[i])
                } else {
                    Ok(mus[i].clone())
                }
            });
            let mu_s = Tensor::cat(&rows.collect::<Result<Vec<_>>>()?, 0)?.contiguous()?;
            let spk_s = if idx.len() == b {
                spk.clone()
            } else {
                spk.index_select(
                    &Tensor::new(
                        idx.iter().map(|&i| i as u32).collect::<Vec<_>>().as_slice(),
                        spk.device(),
                    )?,
                    0,
                )?
            };
            let own_frames: Vec<usize> = idx.iter().map(|&i| frames[i]).collect();
            let mut sub: Vec<&mut FlowState> = states
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| idx.contains(i))
                .map(|(_, s)| &mut **s)
                .collect();
            let mel = if in_pool {
                self.estimate_pooled(&mu_s, &spk_s, &mut sub, &own_frames)?
            } else {
                self.estimate_own(&mu_s, &spk_s, &mut sub)?
            };
            for (r, &i) in idx.iter().enumerate() {
                let m = mel.get(r)?;
                mels[i] = Some(if frames[i] < tt { m.narrow(1, 0, frames[i])? } else { m });
            }
        }
        Ok(mels.into_iter().map(|m| m.expect("every stream solved")).collect())
    }

    /// The CFM solve for streams with caches of their own (padded to the longest); advances and
    /// trims them. Returns the mel `[B, 80, T]`.
    fn estimate_own(
        &self,
        mu: &Tensor,
        spk: &Tensor,
        states: &mut [&mut FlowState],
    ) -> Result<Tensor> {
        let b = states.len();
        // estimator caches in the CFG layout [cond rows; uncond rows], padded to the longest
        let lens: Vec<usize> = states.iter().map(|s| s.estimator.len()).collect();
        let lmax = lens.iter().copied().max().unwrap_or(0);
        let ragged = lens.iter().any(|&l| l != lmax);
        let est = if b == 1 {
            states[0].estimator.clone()
        } else {
            let att = |s: &FlowState| -> Result<Tensor> {
                let a = &s.estimator.att;
                if a.dim(4)? < lmax {
                    a.pad_with_zeros(4, 0, lmax - a.dim(4)?)
                } else {
                    Ok(a.clone())
                }
            };
            let atts = states.iter().map(|s| att(s)).collect::<Result<Vec<_>>>()?;
            let (ar, cr): (Vec<&Tensor>, Vec<&Tensor>) =
                (atts.iter().collect(), states.iter().map(|s| &s.estimator.cnn).collect());
            EstimatorCache { att: cfg_rows(&ar, 0)?, cnn: cfg_rows(&cr, 0)? }
        };
        let cond = mu.zeros_like()?;
        let (mel, est) = if ragged {
            self.decoder.solve_chunk_ragged(mu, spk, &cond, self.cfg.n_timesteps, &est, &lens)?
        } else {
            self.decoder.solve_chunk(mu, spk, &cond, self.cfg.n_timesteps, Some(&est))?
        };
        // split back (dropping the padding), trim
        let t = mel.dim(2)?;
        for (i, st) in states.iter_mut().enumerate() {
            st.estimator = if b == 1 {
                est.clone()
            } else {
                let att = pick_stream(&est.att, i, b)?;
                let att = if ragged { att.narrow(4, 0, t + lens[i])? } else { att };
                EstimatorCache { att, cnn: pick_stream(&est.cnn, i, b)? }
            };
            st.estimator.trim(st.prompt_frames, self.cfg.history_frames)?;
        }
        Ok(mel)
    }

    /// The CFM solve for streams in pool slots (one pool), padded to the solver's batch; stream
    /// `i`'s chunk is the first `frames[i]` of `mu`'s `T` frames (the rest padding, masked out of
    /// attention). The slots advance (and trim) in place. Returns the mel `[B, 80, T]`.
    fn estimate_pooled(
        &self,
        mu: &Tensor,
        spk: &Tensor,
        states: &mut [&mut FlowState],
        frames: &[usize],
    ) -> Result<Tensor> {
        let (b, _, t) = mu.dims3()?;
        let pad = self.decoder.pool_pad(b);
        let slots: Vec<&FlowSlot> =
            states.iter().map(|s| s.slot.as_ref().expect("a pooled stream has a slot")).collect();
        let pool = slots[0].pool().clone();
        if slots.iter().any(|s| !std::sync::Arc::ptr_eq(s.pool(), &pool)) {
            candle_core::bail!("streams of one flow batch hold slots of different pools");
        }
        let mut batch = pool.batch(&slots, frames, t, pad, self.dtype(), self.device())?;
        // rows of one length, and no held lengths to pad to: the solve (and its graph) as uniform
        // chunks always ran it, without the rows' ends
        if self.solve_frames.is_empty() && frames.iter().all(|&f| f == t) {
            batch.ends = None;
        }
        let lens: Vec<usize> = slots.iter().map(|s| s.len()).collect();
        let x0 = self.decoder.noise_rows(&lens, t, pad, self.dtype())?;
        let padded = |x: &Tensor| -> Result<Tensor> {
            if pad > b {
                x.pad_with_zeros(0, 0, pad - b)
            } else {
                Ok(x.clone())
            }
        };
        let (mu_p, spk_p) = (padded(mu)?, padded(spk)?);
        let cnns: Vec<&Tensor> = states.iter().map(|s| &s.estimator.cnn).collect();
        let cnn = cfg_rows(&cnns, pad - b)?;
        let (mel, cnn) = self.decoder.solve_chunk_pool(
            &x0,
            &mu_p,
            &spk_p,
            &mu_p.zeros_like()?,
            self.cfg.n_timesteps,
            &pool,
            &cnn,
            &batch,
        )?;
        for (i, st) in states.iter_mut().enumerate() {
            st.estimator.cnn = pick_stream(&cnn, i, pad)?;
            st.slot.as_mut().expect("pooled").advance(frames[i], st.prompt_frames);
        }
        mel.narrow(0, 0, b)
    }

    /// One chunk of one stream.
    pub fn chunk(
        &self,
        codes: &[u32],
        spk: &Tensor,
        state: &mut FlowState,
        last: bool,
    ) -> Result<Tensor> {
        Ok(self.chunk_batch(&[codes], &[spk], &mut [state], last)?.pop().expect("one in, one out"))
    }
}

/// Streams' per-stream caches (`[steps, depth, 2, …]`, rows cond, uncond) in the CFG layout of a
/// batch: `[steps, depth, 2 (B + pad), …]` = all cond rows, `pad` zero rows, all uncond rows,
/// `pad` zero rows.
fn cfg_rows(ts: &[&Tensor], pad: usize) -> Result<Tensor> {
    let mut parts = Vec::with_capacity(2 * (ts.len() + 1));
    for c in 0..2 {
        parts.extend(ts.iter().map(|t| t.narrow(2, c, 1)).collect::<Result<Vec<_>>>()?);
        if pad > 0 {
            let mut dims = ts[0].dims().to_vec();
            dims[2] = pad;
            parts.push(Tensor::zeros(dims, ts[0].dtype(), ts[0].device())?);
        }
    }
    Tensor::cat(&parts, 2)
}

/// Stream `i`'s rows (cond, uncond) of a batch's CFG-layout cache with `b` streams per half.
fn pick_stream(x: &Tensor, i: usize, b: usize) -> Result<Tensor> {
    Tensor::cat(&[&x.narrow(2, i, 1)?, &x.narrow(2, b + i, 1)?], 2)
}
