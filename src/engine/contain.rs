//! One stream's failure fails that stream only. A batched forward that fails is run again stream
//! by stream: a failed forward advances no cache (a cache counts its new positions only once
//! every layer has appended them, and the next step writes over what a failed one left), so
//! each stream alone starts from where the batch did.

use antiphon_models::decoder::StreamStep;
use candle_core::{Result, Tensor};

/// A stream's hidden rows from its forward, or why it failed.
pub type Outcome = std::result::Result<Tensor, String>;

/// `forward` over the whole batch; if that fails for more than one stream, over each stream alone.
pub fn forward_contained(
    steps: &mut [StreamStep],
    mut forward: impl FnMut(&mut [StreamStep]) -> Result<Vec<Tensor>>,
) -> Vec<Outcome> {
    let n = steps.len();
    let one_each = |h: Vec<Tensor>, n: usize| -> Vec<Outcome> {
        if h.len() == n {
            h.into_iter().map(Ok).collect()
        } else {
            vec![Err(format!("the forward gave {} outputs for {n} streams", h.len())); n]
        }
    };
    match forward(steps) {
        Ok(h) => one_each(h, n),
        Err(e) if n <= 1 => vec![Err(format!("{e:#}")); n],
        Err(e) => {
            tracing::warn!(
                "a batched forward of {n} streams failed ({e:#}); running each stream alone"
            );
            steps
                .iter_mut()
                .map(|s| {
                    let mut one = [StreamStep { cache: &mut *s.cache, embeds: s.embeds.clone() }];
                    match forward(&mut one) {
                        Ok(h) => one_each(h, 1).pop().expect("one outcome"),
                        Err(e) => Err(format!("{e:#}")),
                    }
                })
                .collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use antiphon_models::decoder::KvCache;
    use candle_core::Device;

    /// A stand-in forward of a model 4 wide: the rows of all streams through one concatenation (as
    /// the real batched step does), which fails when one stream's rows have another width, as
    /// does that stream alone.
    fn concat_forward(calls: &mut usize, steps: &mut [StreamStep]) -> Result<Vec<Tensor>> {
        *calls += 1;
        let all = Tensor::cat(&steps.iter().map(|s| s.embeds.clone()).collect::<Vec<_>>(), 0)?;
        if all.dim(1)? != 4 {
            candle_core::bail!("rows of width {}, the model is 4 wide", all.dim(1)?);
        }
        let mut out = Vec::new();
        let mut at = 0;
        for s in steps.iter() {
            let n = s.embeds.dim(0)?;
            out.push((all.narrow(0, at, n)? * 2.0)?);
            at += n;
        }
        Ok(out)
    }

    #[test]
    fn a_stream_that_breaks_the_batch_fails_alone() {
        let dev = Device::Cpu;
        let rows = |w: usize, v: f32| Tensor::full(v, (1, w), &dev).unwrap();
        let mut caches: Vec<KvCache> = (0..3).map(|_| KvCache::new(0)).collect();
        let embeds = [rows(4, 1.0), rows(3, 5.0), rows(4, 2.0)];
        let mut steps: Vec<StreamStep> = caches
            .iter_mut()
            .zip(embeds)
            .map(|(cache, embeds)| StreamStep { cache, embeds })
            .collect();
        let mut calls = 0;
        let out = forward_contained(&mut steps, |s| concat_forward(&mut calls, s));
        assert_eq!(calls, 4, "the batch, then each stream alone");
        assert_eq!(out[0].as_ref().unwrap().to_vec2::<f32>().unwrap(), vec![vec![2.0f32; 4]]);
        assert!(out[1].is_err(), "the stream with the wrong width fails");
        assert_eq!(out[2].as_ref().unwrap().to_vec2::<f32>().unwrap(), vec![vec![4.0f32; 4]]);
    }

    #[test]
    fn a_batch_that_works_runs_once_and_a_lone_failure_is_not_retried() {
        let dev = Device::Cpu;
        let mut caches: Vec<KvCache> = (0..2).map(|_| KvCache::new(0)).collect();
        let mut steps: Vec<StreamStep> = caches
            .iter_mut()
            .map(|cache| StreamStep {
                cache,
                embeds: Tensor::ones((2, 4), candle_core::DType::F32, &dev).unwrap(),
            })
            .collect();
        let mut calls = 0;
        let out = forward_contained(&mut steps, |s| concat_forward(&mut calls, s));
        assert_eq!((calls, out.iter().filter(|o| o.is_ok()).count()), (1, 2));
        let mut lone = KvCache::new(0);
        let mut one = [StreamStep {
            cache: &mut lone,
            embeds: Tensor::ones((1, 4), candle_core::DType::F32, &dev).unwrap(),
        }];
        let mut calls = 0;
        let out = forward_contained(&mut one, |_| {
            calls += 1;
            candle_core::bail!("broken")
        });
        assert_eq!(calls, 1);
        assert!(out[0].as_ref().is_err_and(|e| e.contains("broken")));
    }
}
