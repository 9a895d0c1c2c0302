//! Code2Wav: speech codes -> 24 kHz audio. The flow (Conformer encoder + DiT flow
//! matching) makes mel, the HiFT vocoder makes audio; reference-voice preparation (S3 speech
//! tokens, CAM++ speaker embedding, prompt mel) feeds the flow's prompt.
//!
//! Streaming API per stream: [`Code2Wav::prepare`] (reference -> features),
//! [`Code2Wav::setup`] (features -> flow caches over the prompt), [`Code2Wav::start`] (a stream
//! state from features and setup caches), [`Code2Wav::chunk_batch`] / [`Code2Wav::chunk`]
//! (codes -> audio; the last chunk flushes).

pub mod campplus;
pub mod cfm;
pub mod conformer;
pub mod conv_cols;
pub mod dit;
pub mod dit_attention;
#[cfg(feature = "cuda")]
mod dit_attention_in_place;
pub mod dit_ops;
pub mod flow;
pub mod hift;
pub mod prompt;
pub mod s3tokenizer;
pub mod slots;

use anyhow::{anyhow, bail, Result};
use candle_core::{DType, Device, Tensor};
use rand::SeedableRng;
use rand_distr::{Distribution, StandardNormal};

use campplus::CamPlusPlus;
use flow::{Flow, FlowConfig, FlowState};
use hift::{HiftGenerator, HiftState, OriginalStreamState};
use prompt::{PromptFeatures, Reference};
use s3tokenizer::S3Tokenizer;

use crate::mel::FlowMel;

/// The code that stands for silence (the first chunk's left context and the prompt's look-ahead).
pub const SILENCE_CODE: u32 = 4218;

/// Files of `assets/token2wav/`.
pub const FLOW_YAML: &str = "flow.yaml";
pub const FLOW_PT: &str = "flow.pt";
pub const HIFT_PT: &str = "hift.pt";
pub const HIFT_CONFIG: &str = "config.yaml";
pub const HIFT_ORIGINAL_PT: &str = "hift_original.pt";
pub const CAMPPLUS_ONNX: &str = "campplus.onnx";
pub const TOKENIZER_ONNX: &str = "speech_tokenizer_v2_25hz.onnx";

/// Seeds and sizes of the fixed random buffers the reference creates at start-up (they are not
/// stored in any checkpoint file).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BufferSeeds {
    pub seed: u64,
    /// CFM noise frames (the reference: 600 s at 50 frames/s).
    pub noise_frames: usize,
    /// Causal vocoder noise table length in samples (the reference: 300 s; it wraps around).
    pub table_samples: usize,
}

impl Default for BufferSeeds {
    fn default() -> Self {
        Self { seed: 20_241_120, noise_frames: 30_000, table_samples: 30 * 24_000 }
    }
}

/// The vocoder in use.
#[derive(Debug, Clone)]
pub enum Vocoder {
    /// minicpmo-utils 1.0.7 layout: the causal generator streams.
    Causal(HiftGenerator),
    /// Older layout: the original generator, streamed by overlap and cross-fade.
    Original(HiftGenerator),
}

#[derive(Debug, Clone)]
enum VocoderState {
    Causal(HiftState),
    Original(OriginalStreamState),
}

/// One stream's state.
#[derive(Debug, Clone)]
pub struct StreamState {
    pub flow: FlowState,
    vocoder: VocoderState,
    speaker: Tensor,
    /// Mel frames produced so far.
    pub frames: usize,
    pub finished: bool,
}

/// Code2Wav's models.
#[derive(Debug, Clone)]
pub struct Code2Wav {
    pub flow: Flow,
    pub vocoder: Vocoder,
    pub s3: S3Tokenizer,
    pub campplus: CamPlusPlus,
    flow_mel: std::sync::Arc<FlowMel>,
    /// The flow's attention caches in fixed slots ([`slots`]); a stream that finds none free keeps
    /// caches of its own.
    pool: Option<std::sync::Arc<slots::FlowPool>>,
    device: Device,
}

impl std::fmt::Debug for FlowMel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FlowMel")
    }
}

/// Gaussian noise `[rows, cols]` from a seed.
pub fn gaussian(rows: usize, cols: usize, seed: u64, dev: &Device) -> candle_core::Result<Tensor> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let v: Vec<f32> = (0..rows * cols).map(|_| StandardNormal.sample(&mut rng)).collect();
    Tensor::from_vec(v, (rows, cols), dev)
}

impl Code2Wav {
    /// Assembles Code2Wav from loaded parts.
    pub fn new(
        flow: Flow,
        vocoder: Vocoder,
        s3: S3Tokenizer,
        campplus: CamPlusPlus,
        device: &Device,
    ) -> Self {
        Self {
            flow,
            vocoder,
            s3,
            campplus,
            flow_mel: std::sync::Arc::new(FlowMel::standard()),
            pool: None,
            device: device.clone(),
        }
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// CUDA graphs for the streaming chunk: the flow's CFM solve (`flow`) and the causal vocoder's
    /// F0 and decode steps (at most `vocoder` shapes held); `None` = op by op. With the flow's
    /// graphs on, a voice's preparation (the S3 tokenizer, CAM++) and setup are graphs too.
    pub fn set_graphs(&mut self, flow: Option<dit::GraphPolicy>, vocoder: Option<usize>) {
        self.flow.decoder.set_graphs(flow);
        self.campplus.set_graphs(flow.is_some());
        self.s3.set_graphs(flow.is_some());
        self.flow.set_setup_graphs(flow.is_some());
        if let Vocoder::Causal(h) = &mut self.vocoder {
            h.set_graphs(vocoder);
        }
    }

    /// How pooled solves attend ([`dit_attention::PoolAttention`]; each path where the device has
    /// it, else the gathered one). Set before [`Code2Wav::set_graphs`]' warm-up captures.
    pub fn set_pool_attention(&mut self, mode: dit_attention::PoolAttention) {
        self.flow.decoder.set_pool_attention(mode);
    }

    /// The vocoder's convolutions in f16 columns and products with f32 sums where it runs in f32 on
    /// CUDA ([`HiftGenerator::set_half_columns`]). Set before [`Code2Wav::set_graphs`]' warm-up.
    pub fn set_vocoder_half_columns(&mut self, on: bool) -> Result<()> {
        match &mut self.vocoder {
            Vocoder::Causal(h) | Vocoder::Original(h) => Ok(h.set_half_columns(on)?),
        }
    }

    /// Puts the flow's attention caches of up to `slots` streams into a pool of slots of `frames`
    /// positions each, allocated now (`slots` = 0: every stream keeps its own). A stream takes a
    /// slot at [`Code2Wav::start`] if its prompt, the history and a chunk of `max_chunk_codes`
    /// codes fit.
    pub fn set_slots(&mut self, slots: usize, frames: usize, max_chunk_codes: usize) -> Result<()> {
        self.pool = match slots {
            0 => None,
            n => {
                let max_chunk = (max_chunk_codes + self.flow.lookahead()) * self.flow.up_rate();
                let dtype = self.flow.decoder.noise.dtype();
                Some(slots::FlowPool::new(
                    self.flow.config(),
                    n,
                    frames,
                    max_chunk,
                    dtype,
                    &self.device,
                )?)
            }
        };
        Ok(())
    }

    /// What one slot of [`Code2Wav::set_slots`] with `frames` positions takes of the device's
    /// memory.
    pub fn slot_bytes(&self, frames: usize) -> usize {
        slots::FlowPool::slot_bytes(self.flow.config(), frames, self.flow.decoder.noise.dtype())
    }

    /// Pooled solves padded up to the lengths of these payloads (codes, last), as the warm-up runs
    /// them: a step's chunks then ride the graphs it captured whatever their lengths.
    pub fn set_solve_payloads(&mut self, payloads: &[(usize, bool)]) {
        let frames = payloads
            .iter()
            .map(|&(n, last)| self.flow.payload_frames(n, last))
            .filter(|&f| f > 0)
            .collect();
        self.flow.set_solve_frames(frames);
    }

    /// The slot pool, if there is one.
    pub fn pool(&self) -> Option<&std::sync::Arc<slots::FlowPool>> {
        self.pool.as_ref()
    }

    /// Graphs held now: (flow, vocoder).
    pub fn graphs_held(&self) -> (usize, usize) {
        let v = match &self.vocoder {
            Vocoder::Causal(h) => h.graphs_held(),
            Vocoder::Original(_) => 0,
        };
        (self.flow.decoder.graphs_held(), v)
    }

    /// The audio's sample rate (the vocoder's).
    pub fn sample_rate(&self) -> usize {
        match &self.vocoder {
            Vocoder::Causal(h) | Vocoder::Original(h) => h.config().sampling_rate,
        }
    }

    pub fn flow_config(&self) -> &FlowConfig {
        self.flow.config()
    }

    /// Step 2 of reference preparation (step 1 is [`Reference::materialize`]).
    /// The prompt mel's analysis (24 kHz).
    pub fn flow_mel(&self) -> &FlowMel {
        &self.flow_mel
    }

    pub fn prepare(&self, reference: &Reference) -> Result<PromptFeatures> {
        let a16 = antiphon_audio::resample(
            &reference.samples,
            prompt::PROMPT_RATE,
            prompt::TOKENIZER_RATE,
        )?;
        prompt::prepare_features(
            &a16,
            &reference.samples,
            &self.s3,
            &self.campplus,
            &self.flow_mel,
            self.flow.up_rate(),
            &self.device,
        )
    }

    /// [`Code2Wav::prepare`] for several references at once (a burst of new voices): their host
    /// front ends side by side, their device work queued together. One result per reference.
    pub fn prepare_batch(&self, references: &[&Reference]) -> Vec<Result<PromptFeatures>> {
        if references.len() == 1 {
            return vec![self.prepare(references[0])];
        }
        let voices: Vec<&[f32]> = references.iter().map(|r| r.samples.as_slice()).collect();
        prompt::prepare_features_batch(
            &voices,
            &self.s3,
            &self.campplus,
            &self.flow_mel,
            self.flow.up_rate(),
            &self.device,
        )
    }

    /// With graphs on, a voice's preparation run until its graphs are captured (from its third
    /// run: the first folds CAM++'s shapes), so that the first voices a server meets do not pay
    /// for the capture.
    pub fn warm_prepare(&self, reference: &Reference) -> Result<()> {
        if self.flow.decoder.policy().is_some() {
            for _ in 0..2 {
                drop(self.prepare(reference)?);
            }
            // and a burst's batches (CAM++ folds and captures each batch size)
            for b in (1..).map(|i| 1usize << i).take_while(|&b| b <= campplus::MAX_BATCH) {
                for _ in 0..3 {
                    for f in self.prepare_batch(&vec![reference; b]) {
                        drop(f?);
                    }
                }
            }
        }
        Ok(())
    }

    /// Step 3: the flow over the prompt (prompt codes + look-ahead silence), filling the caches.
    pub fn setup(&self, f: &PromptFeatures) -> Result<FlowState> {
        Ok(self.setup_batch(&[f])?.remove(0))
    }

    /// [`Code2Wav::setup`] for several voices, batched: voices of one prompt length together, in
    /// batches of at most the graph policy's `setup_batch` padded to a power of two (so that a
    /// few captured shapes serve every count). One state per voice, in order.
    pub fn setup_batch(&self, fs: &[&PromptFeatures]) -> Result<Vec<FlowState>> {
        let la = self.flow.lookahead();
        let prompts: Vec<Vec<u32>> = fs
            .iter()
            .map(|f| f.codes.iter().copied().chain(std::iter::repeat_n(SILENCE_CODE, la)).collect())
            .collect();
        let cap = self.flow.decoder.policy().map(|p| p.setup_batch.max(1));
        let mut out: Vec<Option<FlowState>> = vec![None; fs.len()];
        let mut lengths: Vec<usize> = prompts.iter().map(|p| p.len()).collect();
        lengths.sort_unstable();
        lengths.dedup();
        for len in lengths {
            let idx: Vec<usize> = (0..fs.len()).filter(|&i| prompts[i].len() == len).collect();
            for part in idx.chunks(cap.unwrap_or(idx.len().max(1))) {
                let padded =
                    if cap.is_some() { part.len().next_power_of_two() } else { part.len() };
                let args: Vec<(&[u32], &candle_core::Tensor, &candle_core::Tensor)> = (0..padded)
                    .map(|j| part[j.min(part.len() - 1)])
                    .map(|i| (prompts[i].as_slice(), &fs[i].mel, &fs[i].speaker))
                    .collect();
                for (&i, st) in part.iter().zip(self.flow.setup_batch(&args)?) {
                    out[i] = Some(st);
                }
            }
        }
        Ok(out.into_iter().map(|s| s.expect("every voice set up")).collect())
    }

    /// A new stream from prepared features and setup caches (the caches are copied on write, or
    /// into a slot of the pool when one is free).
    pub fn start(&self, f: &PromptFeatures, setup: &FlowState) -> Result<StreamState> {
        let vocoder = match &self.vocoder {
            Vocoder::Causal(h) => VocoderState::Causal(h.new_state()?),
            Vocoder::Original(_) => VocoderState::Original(OriginalStreamState::new(0x0a11ce)),
        };
        let mut flow = setup.clone();
        if let Some(pool) = &self.pool {
            flow.slot = pool.lease(&setup.estimator, setup.prompt_frames)?;
        }
        Ok(StreamState { flow, vocoder, speaker: f.speaker.clone(), frames: 0, finished: false })
    }

    /// With graphs on: for every batch size in `batches`, streams taken through each of
    /// `sequences` (a request's payloads in order, each its length in codes, left context
    /// included, and whether it is the last), twice over, so that each shape's graphs (the pooled
    /// flow solve, the vocoder's windows) are captured now rather than when a request first
    /// brings it (and the setup over a prompt likewise). A batch larger than the free slots is
    /// skipped. Returns the chunks run.
    pub fn warm_graphs(
        &self,
        f: &PromptFeatures,
        setup: &FlowState,
        batches: &[usize],
        sequences: &[Vec<(usize, bool)>],
    ) -> Result<usize> {
        if self.flow.decoder.policy().is_none() {
            return Ok(0);
        }
        let payload = |n: usize, salt: u32| -> Vec<u32> {
            (0..n as u32).map(|i| (i * 131 + salt * 17 + 7) % 6561).collect()
        };
        // the setup over prompts (every voice's has the same shape): a graph per batch size from
        // its second run
        let top = self.flow.decoder.policy().map(|p| p.setup_batch.max(1)).unwrap_or(1);
        for b in (0..).map(|i| 1usize << i).take_while(|&b| b <= top) {
            for _ in 0..2 {
                drop(self.setup_batch(&vec![f; b])?);
            }
        }
        let mut runs = 0;
        for &b in batches {
            if self.pool.as_ref().is_none_or(|p| p.free_slots() < b) {
                continue;
            }
            for seq in sequences {
                for _ in 0..2 {
                    let mut streams =
                        (0..b).map(|_| self.start(f, setup)).collect::<Result<Vec<_>>>()?;
                    for (i, &(n, last)) in seq.iter().enumerate() {
                        let codes = payload(n, i as u32);
                        let refs: Vec<&[u32]> = (0..b).map(|_| codes.as_slice()).collect();
                        self.chunk_batch(&mut streams.iter_mut().collect::<Vec<_>>(), &refs, last)?;
                        runs += 1;
                    }
                }
            }
        }
        Ok(runs)
    }

    /// Whether a chunk's payload is one the flow takes (every code in its vocabulary; enough codes
    /// for the look-ahead layer), so that a batch fails for none of its chunks' contents.
    pub fn check_chunk(&self, codes: &[u32], last: bool) -> Result<()> {
        let (la, vocab) = (self.flow.lookahead(), self.flow.config().vocab_size);
        if let Some(&bad) = codes.iter().find(|&&c| c as usize >= vocab) {
            bail!("speech code {bad} is outside the flow's {vocab} codes");
        }
        let tokens = codes.len() + if last { la } else { 0 };
        if tokens < la + 2 {
            bail!(
                "a chunk of {} codes{} is too short (the flow needs {} with its look-ahead)",
                codes.len(),
                if last { " (last)" } else { "" },
                la + 2
            );
        }
        Ok(())
    }

    /// One chunk for several streams with equal chunk lengths (any voices, any points in their
    /// histories): the flow and the (causal) vocoder run batched. `codes[i]` = left context + new
    /// codes + look-ahead (the last chunk may end without look-ahead). Returns each stream's new 24
    /// kHz samples.
    pub fn chunk_batch(
        &self,
        streams: &mut [&mut StreamState],
        codes: &[&[u32]],
        last: bool,
    ) -> Result<Vec<Tensor>> {
        self.chunk_mixed(streams, codes, &vec![last; codes.len()])
    }

    /// One chunk for several streams whatever their chunks' lengths and `last` flags: one flow
    /// solve for every stream in a pool slot ([`Flow::chunk_mixed`]), the (causal) vocoder batched
    /// per group of equal mel length and flag. Returns each stream's new 24 kHz samples.
    pub fn chunk_mixed(
        &self,
        streams: &mut [&mut StreamState],
        codes: &[&[u32]],
        lasts: &[bool],
    ) -> Result<Vec<Tensor>> {
        let mels = self.flow_mixed(streams, codes, lasts)?;
        let shapes: Vec<(usize, bool)> =
            mels.iter().zip(lasts).map(|(m, &l)| Ok((m.dim(1)?, l))).collect::<Result<_>>()?;
        let mut groups: Vec<(usize, bool)> = shapes.clone();
        groups.sort_unstable();
        groups.dedup();
        let mut out: Vec<Option<Tensor>> = vec![None; streams.len()];
        for (frames, last) in groups {
            let idx: Vec<usize> =
                (0..shapes.len()).filter(|&i| shapes[i] == (frames, last)).collect();
            let mut sub: Vec<&mut StreamState> = streams
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| idx.contains(i))
                .map(|(_, s)| &mut **s)
                .collect();
            let sub_mels: Vec<Tensor> = idx.iter().map(|&i| mels[i].clone()).collect();
            for (&i, a) in idx.iter().zip(self.vocode_batch(&mut sub, &sub_mels, last)?) {
                out[i] = Some(a);
            }
        }
        for (st, &last) in streams.iter_mut().zip(lasts) {
            st.finished = last;
        }
        Ok(out.into_iter().map(|a| a.expect("every stream vocoded")).collect())
    }

    /// The flow's share of [`Code2Wav::chunk_batch`]: each stream's mel `[80, frames]`.
    pub fn flow_batch(
        &self,
        streams: &mut [&mut StreamState],
        codes: &[&[u32]],
        last: bool,
    ) -> Result<Vec<Tensor>> {
        self.flow_mixed(streams, codes, &vec![last; codes.len()])
    }

    /// The flow's share of [`Code2Wav::chunk_mixed`]: each stream's mel `[80, frames]`.
    pub fn flow_mixed(
        &self,
        streams: &mut [&mut StreamState],
        codes: &[&[u32]],
        lasts: &[bool],
    ) -> Result<Vec<Tensor>> {
        if streams.iter().any(|s| s.finished) {
            bail!("a finished stream got another chunk");
        }
        let spks: Vec<Tensor> = streams.iter().map(|s| s.speaker.clone()).collect();
        let spk_refs: Vec<&Tensor> = spks.iter().collect();
        let mels = {
            let mut flows: Vec<&mut FlowState> = streams.iter_mut().map(|s| &mut s.flow).collect();
            self.flow.chunk_mixed(codes, &spk_refs, &mut flows, lasts)?
        };
        for (st, mel) in streams.iter_mut().zip(&mels) {
            st.frames += mel.dim(1)?;
        }
        Ok(mels)
    }

    /// The vocoder's share of [`Code2Wav::chunk_batch`] (`mels[i]`: `[80, frames]`): the causal
    /// vocoder runs batched, the original one stream by stream.
    pub fn vocode_batch(
        &self,
        streams: &mut [&mut StreamState],
        mels: &[Tensor],
        last: bool,
    ) -> Result<Vec<Tensor>> {
        let Vocoder::Causal(h) = &self.vocoder else {
            return streams
                .iter_mut()
                .zip(mels)
                .map(|(st, mel)| self.vocode_chunk(st, mel, last))
                .collect();
        };
        let mels = mels
            .iter()
            .map(|m| m.unsqueeze(0)?.to_dtype(DType::F32))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let mut states = Vec::with_capacity(streams.len());
        for st in streams.iter_mut() {
            match &mut st.vocoder {
                VocoderState::Causal(vs) => states.push(vs),
                VocoderState::Original(_) => bail!("vocoder state does not match the vocoder"),
            }
        }
        Ok(h.stream_batch(&mut states, &mels.iter().collect::<Vec<_>>(), last)?)
    }

    /// Profiling: the flow's share of one chunk alone (returns its mel, `[80, frames]`).
    pub fn flow_chunk(&self, st: &mut StreamState, codes: &[u32], last: bool) -> Result<Tensor> {
        Ok(self.flow.chunk(codes, &st.speaker.clone(), &mut st.flow, last)?)
    }

    /// The vocoder's share of one chunk (`mel`: `[80, frames]`); alone, for profiling.
    pub fn vocode_chunk(&self, st: &mut StreamState, mel: &Tensor, last: bool) -> Result<Tensor> {
        let mel = mel.unsqueeze(0)?.to_dtype(DType::F32)?;
        match (&self.vocoder, &mut st.vocoder) {
            (Vocoder::Causal(h), VocoderState::Causal(vs)) => Ok(h.stream(vs, &mel, last)?),
            (Vocoder::Original(h), VocoderState::Original(vs)) => {
                Ok(h.stream_original(vs, &mel, last)?)
            }
            _ => Err(anyhow!("vocoder state does not match the vocoder")),
        }
    }

    /// One chunk of one stream.
    pub fn chunk(&self, st: &mut StreamState, codes: &[u32], last: bool) -> Result<Tensor> {
        Ok(self.chunk_batch(&mut [st], &[codes], last)?.pop().expect("one in, one out"))
    }
}
