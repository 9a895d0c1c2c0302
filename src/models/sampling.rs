//! Token sampling on the host: repetition penalty, temperature, top-k, top-p, seeded per request.
//!
//! The Talker's penalty is frequency-style over a window of recent codes (`logit / a` for a
//! non-negative logit, `logit * a` otherwise, `a = penalty ^ count`); the Thinker's is the usual
//! presence-style penalty over everything seen. Top-k and top-p keep at least `min_keep` tokens.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::top_k::LogitsRow;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PenaltyKind {
    /// Each distinct earlier token once (HF / vLLM `repetition_penalty`).
    Presence,
    /// Each earlier token as often as it occurs (the Talker's codec penalty).
    Frequency,
}

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    /// 1 = off.
    pub top_p: f32,
    /// 1 = off.
    pub repetition_penalty: f32,
    pub penalty_kind: PenaltyKind,
    /// How many of the most recent tokens the penalty looks at (0 = all).
    pub penalty_window: usize,
    pub min_keep: usize,
}

impl SamplingParams {
    /// The Talker's defaults (MiniCPM-o 4.5 `TTSSamplingParams`).
    pub fn talker() -> Self {
        Self {
            temperature: 0.8,
            top_k: 25,
            top_p: 0.85,
            repetition_penalty: 1.05,
            penalty_kind: PenaltyKind::Frequency,
            penalty_window: 16,
            min_keep: 3,
        }
    }

    /// Greedy text decoding with the served Thinker's repetition penalty.
    pub fn thinker_greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            repetition_penalty: 1.1,
            penalty_kind: PenaltyKind::Presence,
            penalty_window: 0,
            min_keep: 1,
        }
    }
}

/// A seeded sampler with the token history its penalty needs.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    history: Vec<u32>,
}

impl Sampler {
    pub fn new(params: SamplingParams, seed: u64) -> Self {
        Self { params, rng: ChaCha8Rng::seed_from_u64(seed), history: Vec::new() }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Adds tokens the penalty should see without sampling them (e.g. the prompt).
    pub fn observe(&mut self, ids: &[u32]) {
        self.history.extend_from_slice(ids);
    }

    pub fn history(&self) -> &[u32] {
        &self.history
    }

    /// The recent tokens the repetition penalty applies to.
    fn penalty_window(&self) -> &[u32] {
        match self.params.penalty_window {
            0 => &self.history[..],
            w => &self.history[self.history.len().saturating_sub(w)..],
        }
    }

    fn penalize(&self, logits: &mut [f32]) {
        let p = self.params.repetition_penalty;
        if p == 1.0 || self.history.is_empty() {
            return;
        }
        let window = self.penalty_window();
        let mut counts: std::collections::HashMap<u32, i32> = std::collections::HashMap::new();
        for &t in window {
            *counts.entry(t).or_default() += 1;
        }
        for (&t, &c) in &counts {
            let Some(l) = logits.get_mut(t as usize) else {
                continue;
            };
            *l = self.penalized(*l, c);
        }
    }

    /// A logit of a token seen `count` (> 0) times in the penalty's window, penalised.
    fn penalized(&self, l: f32, count: i32) -> f32 {
        let p = self.params.repetition_penalty;
        let a = match self.params.penalty_kind {
            PenaltyKind::Presence => p,
            PenaltyKind::Frequency => p.powi(count),
        };
        if l >= 0.0 {
            l / a
        } else {
            l * a
        }
    }

    /// Picks the next token from a row whose best entries are on the host, never one in `forbid`,
    /// and records it. Greedy with a penalty ≥ 1 picks from the candidates when they decide it
    /// (see [`Sampler::greedy_from_top`]); otherwise the whole row comes from the device.
    pub fn sample_row(&mut self, row: &LogitsRow, forbid: &[u32]) -> candle_core::Result<u32> {
        if let Some(id) = self.greedy_from_top(row.top(), row.vocab(), forbid) {
            self.history.push(id);
            return Ok(id);
        }
        Ok(self.sample(&row.full()?, forbid))
    }

    /// The greedy pick among `top` (a row's best entries, best first, of `vocab`), as
    /// [`Sampler::sample`] would pick it from the whole row, when the candidates decide it: a
    /// penalty ≥ 1 and `forbid` only lower logits, so a token outside them scores at most its raw
    /// logit, which is at most the last candidate's, with a smaller id when equal (ties go to the
    /// larger id, in the row's order as in the argmax). A candidate that scores at least the last
    /// candidate's raw logit with at least its id wins over all of them. `None` when they do not
    /// decide it (logits in bf16 tie often), or when sampling is not greedy.
    fn greedy_from_top(&self, top: &[(u32, f32)], vocab: usize, forbid: &[u32]) -> Option<u32> {
        if !(self.params.temperature <= 0.0 && self.params.repetition_penalty >= 1.0) {
            return None;
        }
        let (last_id, last) = *top.last()?;
        let window = self.penalty_window();
        let mut best: Option<(u32, f32)> = None;
        for &(id, raw) in top {
            let v = if forbid.contains(&id) {
                f32::NEG_INFINITY
            } else if self.params.repetition_penalty == 1.0 {
                raw
            } else {
                match window.iter().filter(|&&t| t == id).count() {
                    0 => raw,
                    c => self.penalized(raw, c as i32),
                }
            };
            // the whole row's argmax: the larger value, on ties the larger id
            if best.is_none_or(|(bi, bv)| {
                v.total_cmp(&bv).then(id.cmp(&bi)) == std::cmp::Ordering::Greater
            }) {
                best = Some((id, v));
            }
        }
        let (id, v) = best?;
        (top.len() >= vocab
            || v.total_cmp(&last).then(id.cmp(&last_id)) != std::cmp::Ordering::Less)
            .then_some(id)
    }

    /// Picks the next token from `logits`, never one in `forbid`, and records it.
    pub fn sample(&mut self, logits: &[f32], forbid: &[u32]) -> u32 {
        // greedy: `forbid` and a penalty >= 1 only lower logits, so the raw argmax stands unless
        // it is one of the tokens they touch (one pass over the vocabulary, no copy)
        if self.params.temperature <= 0.0 && self.params.repetition_penalty >= 1.0 {
            if let Some((i, _)) = logits.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)) {
                let id = i as u32;
                if !forbid.contains(&id) && !self.penalty_window().contains(&id) {
                    self.history.push(id);
                    return id;
                }
            }
        }
        self.sample_full(logits, forbid)
    }

    /// [`Sampler::sample`] without the greedy shortcut.
    fn sample_full(&mut self, logits: &[f32], forbid: &[u32]) -> u32 {
        let mut l = logits.to_vec();
        for &f in forbid {
            if let Some(x) = l.get_mut(f as usize) {
                *x = f32::NEG_INFINITY;
            }
        }
        self.penalize(&mut l);
        let id = self.pick(&l);
        self.history.push(id);
        id
    }

    fn pick(&mut self, l: &[f32]) -> u32 {
        let argmax = || {
            l.iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .map(|(i, _)| i as u32)
                .unwrap_or(0)
        };
        let prm = &self.params;
        if prm.temperature <= 0.0 {
            return argmax();
        }
        let mut idx: Vec<usize> = (0..l.len()).filter(|&i| l[i].is_finite()).collect();
        if idx.is_empty() {
            return argmax();
        }
        // best first (ties: lower id first); with top-k only the best k are sorted: the same
        // list as sorting all, at O(n) instead of O(n log n) (the Talker's 6562 codes, every step)
        let order = |&a: &usize, &b: &usize| l[b].total_cmp(&l[a]).then(a.cmp(&b));
        let k = if prm.top_k > 0 { prm.top_k.max(prm.min_keep) } else { idx.len() };
        if k < idx.len() {
            idx.select_nth_unstable_by(k - 1, order);
            idx.truncate(k);
        }
        idx.sort_by(order);
        let t = prm.temperature;
        let m = l[idx[0]] / t;
        let mut probs: Vec<f32> = idx.iter().map(|&i| (l[i] / t - m).exp()).collect();
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= sum);
        if prm.top_p < 1.0 {
            let mut cum = 0.0;
            let mut keep = probs.len();
            for (k, p) in probs.iter().enumerate() {
                cum += p;
                if cum >= prm.top_p {
                    keep = k + 1;
                    break;
                }
            }
            let keep = keep.max(prm.min_keep).min(probs.len());
            idx.truncate(keep);
            probs.truncate(keep);
            let s: f32 = probs.iter().sum();
            probs.iter_mut().for_each(|p| *p /= s);
        }
        let u: f32 = self.rng.random();
        let mut cum = 0.0;
        for (k, p) in probs.iter().enumerate() {
            cum += p;
            if u < cum {
                return idx[k] as u32;
            }
        }
        idx[probs.len() - 1] as u32
    }
}

/// Length control around a sampler: the end token is forbidden before `min` tokens and forced at
/// `max` (min = max forces an exact length).
#[derive(Debug, Clone)]
pub struct LengthPolicy {
    pub end: Vec<u32>,
    pub min: usize,
    pub max: usize,
    generated: usize,
}

impl LengthPolicy {
    pub fn new(end: Vec<u32>, min: usize, max: usize) -> Self {
        Self { end, min: min.min(max), max, generated: 0 }
    }

    pub fn generated(&self) -> usize {
        self.generated
    }

    /// Whether the reply has its most tokens.
    pub fn full(&self) -> bool {
        self.generated >= self.max
    }

    /// A token the caller chose (a reply's given beginning): counted as a sampled one, and seen by
    /// the sampler's penalties.
    pub fn force(&mut self, sampler: &mut Sampler, id: u32) {
        sampler.observe(&[id]);
        if !self.end.contains(&id) {
            self.generated += 1;
        }
    }

    /// Next token: forced end at `max`, otherwise sampled with ends forbidden before `min`.
    /// `extra_forbid` is always forbidden. Ending tokens are not counted.
    pub fn next(&mut self, sampler: &mut Sampler, logits: &[f32], extra_forbid: &[u32]) -> u32 {
        if self.generated >= self.max {
            let e = self.end[0];
            sampler.observe(&[e]);
            return e;
        }
        let mut forbid = extra_forbid.to_vec();
        if self.generated < self.min {
            forbid.extend_from_slice(&self.end);
        }
        let id = sampler.sample(logits, &forbid);
        if !self.end.contains(&id) {
            self.generated += 1;
        }
        id
    }

    /// [`LengthPolicy::next`] from a row on the device ([`Sampler::sample_row`]).
    pub fn next_row(
        &mut self,
        sampler: &mut Sampler,
        row: &LogitsRow,
        extra_forbid: &[u32],
    ) -> candle_core::Result<u32> {
        if self.generated >= self.max {
            let e = self.end[0];
            sampler.observe(&[e]);
            return Ok(e);
        }
        let mut forbid = extra_forbid.to_vec();
        if self.generated < self.min {
            forbid.extend_from_slice(&self.end);
        }
        let id = sampler.sample_row(row, &forbid)?;
        if !self.end.contains(&id) {
            self.generated += 1;
        }
        Ok(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        (0..100).map(|i| ((i * 37 % 100) as f32) / 20.0).collect()
    }

    #[test]
    fn greedy_shortcut_picks_what_the_full_path_picks() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        for round in 0..300 {
            // few distinct values: ties, and winners that are forbidden or penalised
            let l: Vec<f32> =
                (0..64).map(|_| (rng.random_range(0..12) as f32 - 6.0) / 2.0).collect();
            let forbid: Vec<u32> =
                (0..rng.random_range(0..4)).map(|_| rng.random_range(0..64)).collect();
            let mut s = Sampler::new(SamplingParams::thinker_greedy(), 0);
            s.observe(
                &(0..rng.random_range(0..20))
                    .map(|_| rng.random_range(0..64))
                    .collect::<Vec<u32>>(),
            );
            let mut full = s.clone();
            assert_eq!(s.sample(&l, &forbid), full.sample_full(&l, &forbid), "round {round}");
            assert_eq!(s.history(), full.history());
        }
    }

    /// Sampling from a row's best candidates picks what sampling from the whole row picks, for
    /// greedy and sampled parameters, penalties of both kinds, forbidden tokens and ties; and the
    /// candidates alone decide most greedy picks.
    #[test]
    fn sampling_from_the_best_candidates_picks_what_the_whole_row_picks() -> candle_core::Result<()>
    {
        use crate::top_k::Logits;
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let (mut decided, mut greedy) = (0, 0);
        for round in 0..400 {
            let vocab = 4 + round % 90;
            let rows: Vec<f32> =
                (0..3 * vocab).map(|_| (rng.random_range(0..24) as f32 - 12.0) / 3.0).collect();
            let t =
                candle_core::Tensor::from_vec(rows.clone(), (3, vocab), &candle_core::Device::Cpu)?;
            let logits = Logits::new(t, 1 + round % 9)?;
            let mut params = match round % 3 {
                0 => SamplingParams::thinker_greedy(),
                1 => SamplingParams { temperature: 0.0, ..SamplingParams::talker() },
                _ => SamplingParams::talker(),
            };
            if round % 7 == 0 {
                params.repetition_penalty = 1.0;
            }
            let mut a = Sampler::new(params.clone(), round as u64);
            a.observe(
                &(0..rng.random_range(0..30))
                    .map(|_| rng.random_range(0..vocab as u32))
                    .collect::<Vec<u32>>(),
            );
            let mut b = a.clone();
            for i in 0..3 {
                let forbid: Vec<u32> = (0..rng.random_range(0..3))
                    .map(|_| rng.random_range(0..vocab as u32))
                    .collect();
                let row = logits.row(i);
                if params.temperature <= 0.0 {
                    greedy += 1;
                    decided +=
                        usize::from(a.greedy_from_top(row.top(), row.vocab(), &forbid).is_some());
                }
                let got = a.sample_row(&row, &forbid)?;
                let want = b.sample(&rows[i * vocab..(i + 1) * vocab], &forbid);
                assert_eq!(got, want, "round {round}, row {i}");
                assert_eq!(a.history(), b.history());
            }
        }
        // (743 of 801 when written: the rest are rows where every candidate was penalised)
        assert!(
            decided * 10 > greedy * 8,
            "the candidates decided {decided} of {greedy} greedy picks"
        );
        Ok(())
    }

    #[test]
    fn same_seed_same_tokens_other_seed_differs() {
        let run = |seed| {
            let mut s = Sampler::new(SamplingParams::talker(), seed);
            (0..50).map(|_| s.sample(&logits(), &[])).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    /// Top-k by partial selection picks exactly what a full sort would, ties included.
    #[test]
    fn top_k_selection_equals_a_full_sort() {
        use rand::Rng;
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        for trial in 0..200 {
            let n = 1 + trial * 37 % 500;
            // coarse values: many ties
            let l: Vec<f32> = (0..n).map(|_| (rng.random::<f32>() * 8.0).floor()).collect();
            for top_k in [1, 3, 25, n, n + 5] {
                let prm = SamplingParams {
                    temperature: 0.8,
                    top_k,
                    top_p: 1.0,
                    repetition_penalty: 1.0,
                    penalty_kind: PenaltyKind::Presence,
                    penalty_window: 0,
                    min_keep: 1,
                };
                let mut full: Vec<usize> = (0..n).collect();
                full.sort_by(|&a, &b| l[b].total_cmp(&l[a]).then(a.cmp(&b)));
                full.truncate(top_k.min(n));
                for seed in 0..3 {
                    // the same draw over the same ordered candidates
                    let (mut a, mut b) =
                        (Sampler::new(prm.clone(), seed), Sampler::new(prm.clone(), seed));
                    let got = a.pick(&l);
                    let want = {
                        let t = prm.temperature;
                        let m = l[full[0]] / t;
                        let probs: Vec<f32> = full.iter().map(|&i| (l[i] / t - m).exp()).collect();
                        let sum: f32 = probs.iter().sum();
                        let u: f32 = b.rng.random();
                        let mut cum = 0.0;
                        let mut pick = full[full.len() - 1] as u32;
                        for (k, p) in probs.iter().enumerate() {
                            cum += p / sum;
                            if u < cum {
                                pick = full[k] as u32;
                                break;
                            }
                        }
                        pick
                    };
                    assert_eq!(got, want, "n {n}, top_k {top_k}, seed {seed}");
                }
            }
        }
    }

    #[test]
    fn top_k_limits_choices() {
        let mut p = SamplingParams::talker();
        p.top_p = 1.0;
        p.repetition_penalty = 1.0;
        p.top_k = 3;
        let l = logits();
        let mut order: Vec<usize> = (0..100).collect();
        order.sort_by(|&a, &b| l[b].total_cmp(&l[a]));
        let top: Vec<u32> = order[..3].iter().map(|&i| i as u32).collect();
        let mut s = Sampler::new(p, 1);
        for _ in 0..200 {
            assert!(top.contains(&s.sample(&l, &[])));
        }
    }

    #[test]
    fn top_p_keeps_the_nucleus_but_at_least_min_keep() {
        // token 4 alone holds ~98.7 % of the mass, 1 and 2 ~0.7 % each, the rest nothing
        let mut l = vec![-30.0f32; 10];
        l[4] = 10.0;
        l[1] = 5.0;
        l[2] = 5.0;
        let mut p = SamplingParams::talker();
        p.temperature = 1.0;
        p.repetition_penalty = 1.0;
        p.min_keep = 1;
        let mut s = Sampler::new(p.clone(), 3);
        assert!((0..3000).all(|_| s.sample(&l, &[]) == 4), "the nucleus is token 4 alone");
        p.min_keep = 3;
        let mut s = Sampler::new(p, 3);
        let picks: std::collections::HashSet<u32> = (0..3000).map(|_| s.sample(&l, &[])).collect();
        assert!(picks.contains(&4) && (picks.contains(&1) || picks.contains(&2)), "{picks:?}");
        assert!(picks.iter().all(|t| [1, 2, 4].contains(t)), "{picks:?}");
    }

    #[test]
    fn frequency_penalty_counts_repeats_in_window() {
        let mut p = SamplingParams::talker();
        p.repetition_penalty = 2.0;
        let mut s = Sampler::new(p, 0);
        s.observe(&[1, 1, 2]);
        let mut l = vec![4.0, 4.0, -4.0];
        s.penalize(&mut l);
        assert_eq!(l, vec![4.0, 1.0, -8.0]);
        // outside the window of 16 the tokens no longer count
        s.observe(&[0; 16]);
        let mut l = vec![4.0, 4.0, -4.0];
        s.penalize(&mut l);
        assert_eq!(l[1], 4.0);
        assert!(l[0] < 1e-3);
    }

    #[test]
    fn greedy_with_presence_penalty() {
        let mut s = Sampler::new(SamplingParams::thinker_greedy(), 0);
        assert_eq!(s.sample(&[1.0, 1.05, 0.0], &[]), 1);
        // 1.05 / 1.1 < 1.0 now
        assert_eq!(s.sample(&[1.0, 1.05, 0.0], &[]), 0);
        assert_eq!(s.sample(&[1.0, 1.05, 0.0], &[0, 1]), 2);
    }

    #[test]
    fn length_policy_forces_exact_lengths() {
        let mut l = vec![0.0f32; 10];
        l[9] = 50.0; // the end token would always win
        let mut s = Sampler::new(SamplingParams::talker(), 5);
        let mut lp = LengthPolicy::new(vec![9], 4, 4);
        let out: Vec<u32> = (0..5).map(|_| lp.next(&mut s, &l, &[])).collect();
        assert!(out[..4].iter().all(|&t| t != 9));
        assert_eq!(out[4], 9);
        // without a minimum the end token comes at once
        let mut lp = LengthPolicy::new(vec![9], 0, 100);
        assert_eq!(lp.next(&mut s, &l, &[]), 9);
    }
}
