//! `antiphon profile`'s rows for a new voice: the parts of a preparation alone, and preparation
//! and setup beside a decoding Thinker.

use anyhow::Result;
use candle_core::{Device, Tensor};

use super::Rows;
use crate::{EngineConfig, Models};
use antiphon_models::code2wav::prompt::Reference;
use antiphon_models::decoder::{DecodeMode, StreamStep};

/// A voice's preparation and setup while the Thinker decodes on another thread, as in the
/// server while a request's text is still being thought (the Thinker's graphs at the raised
/// priority where the server config raises them; it runs this section last, since graphs
/// captured after the raise keep it).
pub(super) fn contended_preparation(
    rows: &mut Rows<'_>,
    m: &Models,
    g2w: &antiphon_models::code2wav::Code2Wav,
    r: &Reference,
    f: &antiphon_models::code2wav::prompt::PromptFeatures,
    ecfg: &EngineConfig,
    iters: usize,
) -> Result<()> {
    const NAMES: [&str; 4] = [
        "code2wav prepare, graphs (server config)",
        "code2wav prepare, thinker decoding beside",
        "code2wav prepare, graphs, thinker decoding beside",
        "code2wav setup, graph, thinker decoding beside",
    ];
    if !rows.wants_any(&NAMES.map(String::from)) {
        return Ok(());
    }
    g2w.warm_prepare(r)?;
    rows.time("code2wav prepare, graphs (server config)", 1, iters, || {
        drop(g2w.prepare(r)?);
        Ok(())
    })?;
    let d0 = m.thinker.llm.decoder().device().clone();
    if ecfg.stage_priorities && !d0.same_device(m.code2wav.device()) {
        antiphon_models::cuda_graph::raise_priority(&d0, i32::from(ecfg.talker_first));
    }
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
    let worker = {
        let (mut g, stop) = (m.thinker.llm.clone(), stop.clone());
        std::thread::spawn(move || -> Result<usize> {
            g.set_decode_mode(DecodeMode::Graph);
            let prompt: Vec<u32> = (0..200u32).map(|i| i % 250).collect();
            let mut c = g.new_cache();
            g.forward(&mut [StreamStep { cache: &mut c, embeds: g.embed(&prompt)? }])?;
            let tok = g.embed(&[42])?;
            let mut n = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let h = g.forward(&mut [StreamStep { cache: &mut c, embeds: tok.clone() }])?;
                std::hint::black_box(
                    g.logits(&h[0])?.argmax_keepdim(1)?.flatten_all()?.to_vec1::<u32>()?,
                );
                c.truncate(200);
                n += 1;
                if n == 3 {
                    let _ = ready_tx.send(());
                }
            }
            Ok(n)
        })
    };
    let started = ready_rx.recv().is_ok();
    let timed = (|| -> Result<()> {
        if !started {
            anyhow::bail!("the Thinker's decode thread did not start");
        }
        rows.time(NAMES[1], 1, iters, || {
            drop(m.code2wav.prepare(r)?);
            Ok(())
        })?;
        rows.time(NAMES[2], 1, iters, || {
            drop(g2w.prepare(r)?);
            Ok(())
        })?;
        rows.time(NAMES[3], 1, iters, || {
            drop(g2w.setup(f)?);
            Ok(())
        })?;
        Ok(())
    })();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let n = worker.join().map_err(|_| anyhow::anyhow!("the thinker thread panicked"))??;
    eprintln!("(the thinker ran {n} decode steps meanwhile)");
    timed
}

/// The parts of `code2wav prepare`, each alone (the row is their sum).
pub(super) fn prepare_parts(
    rows: &mut Rows<'_>,
    c2w: &antiphon_models::code2wav::Code2Wav,
    r: &Reference,
    iters: usize,
) -> Result<()> {
    use antiphon_models::code2wav::prompt::{PROMPT_RATE, TOKENIZER_RATE};
    use antiphon_models::mel::{kaldi_fbank, mean_normalize, WhisperLogMel};
    let a16 = antiphon_audio::resample(&r.samples, PROMPT_RATE, TOKENIZER_RATE)?;
    rows.time("code2wav prepare: resample to 16 kHz (host)", 1, iters, || {
        drop(antiphon_audio::resample(&r.samples, PROMPT_RATE, TOKENIZER_RATE)?);
        Ok(())
    })?;
    let wm = WhisperLogMel::new(c2w.s3.n_mels());
    rows.time("code2wav prepare: S3 log-mel (host)", 1, iters, || {
        drop(wm.compute(&a16));
        Ok(())
    })?;
    let (m, frames) = wm.compute(&a16);
    let mel128 = Tensor::from_vec(m, (c2w.s3.n_mels(), frames), c2w.device())?;
    rows.time("code2wav prepare: S3 tokenizer", 1, iters, || {
        drop(c2w.s3.quantize(&mel128)?);
        Ok(())
    })?;
    rows.time("code2wav prepare: kaldi fbank (host)", 1, iters, || {
        let (mut fb, _) = kaldi_fbank(&a16, TOKENIZER_RATE as usize, 80);
        mean_normalize(&mut fb, 80);
        Ok(())
    })?;
    let (mut fb, nf) = kaldi_fbank(&a16, TOKENIZER_RATE as usize, 80);
    mean_normalize(&mut fb, 80);
    let fb = Tensor::from_vec(fb, (nf, 80), &Device::Cpu)?;
    rows.time("code2wav prepare: CAM++", 1, iters, || {
        drop(c2w.campplus.embed(&fb)?);
        Ok(())
    })?;
    rows.time("code2wav prepare: prompt mel (host)", 1, iters, || {
        drop(c2w.flow_mel().compute(&r.samples));
        Ok(())
    })?;
    Ok(())
}
