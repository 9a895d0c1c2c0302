//! Voices prepared ahead of their requests: a registered voice's features (S3 codes, speaker
//! embedding, prompt mel) are made once when it is registered, or handed in as an earlier run
//! saved them, and Code2Wav keeps them for as long as the voice is registered, so a request with
//! that voice never prepares it (the `registered` prefetch event counts each use).

use std::collections::HashMap;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};

use antiphon_models::code2wav::prompt::PromptFeatures;

/// Why Code2Wav did not prepare a voice: busy is not bad audio.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PrepareRefused {
    /// This many registrations wait to be prepared already (try again later).
    Busy { waiting: usize },
    /// The audio cannot make a voice (the model's reason).
    Unusable(String),
}

impl std::fmt::Display for PrepareRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PrepareRefused::Busy { waiting } => {
                write!(f, "{waiting} voices are waiting to be prepared already")
            }
            PrepareRefused::Unusable(why) => f.write_str(why),
        }
    }
}

/// A voice's prepared features on the host, with the key of the reference they were made from
/// (the hash of its normalized samples, `Reference::materialize`).
#[derive(Debug, Clone, PartialEq)]
pub struct PreparedVoice {
    pub key: String,
    pub codes: Vec<u32>,
    pub speaker: Vec<f32>,
    /// `[frames, bins]`, row-major.
    pub mel: Vec<f32>,
    pub mel_bins: usize,
}

impl PreparedVoice {
    /// The host copy of features Code2Wav made.
    pub fn from_features(key: &str, f: &PromptFeatures) -> Result<Self> {
        let (_, bins) = f.mel.dims2()?;
        let v = Self {
            key: key.to_string(),
            codes: f.codes.clone(),
            speaker: f.speaker.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?,
            mel: f.mel.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?,
            mel_bins: bins,
        };
        v.check()?;
        Ok(v)
    }

    /// The features as Code2Wav takes them, on `dev` (f32, as its preparation makes them).
    pub fn to_features(&self, dev: &Device) -> Result<PromptFeatures> {
        self.check()?;
        Ok(PromptFeatures {
            codes: self.codes.clone(),
            speaker: Tensor::from_vec(self.speaker.clone(), self.speaker.len(), dev)?,
            mel: Tensor::from_vec(
                self.mel.clone(),
                (self.mel.len() / self.mel_bins, self.mel_bins),
                dev,
            )?,
        })
    }

    /// As named CPU tensors (`codes` u32, `speaker` f32, `mel` f32 `[frames, bins]`), e.g. for a
    /// safetensors file.
    pub fn tensors(&self) -> Result<HashMap<String, Tensor>> {
        let f = self.to_features(&Device::Cpu)?;
        let codes = Tensor::from_vec(self.codes.clone(), self.codes.len(), &Device::Cpu)?;
        Ok(HashMap::from([
            ("codes".to_string(), codes),
            ("speaker".to_string(), f.speaker),
            ("mel".to_string(), f.mel),
        ]))
    }

    /// Back from [`PreparedVoice::tensors`]; anything missing, misshapen or not finite is refused.
    pub fn from_tensors(key: &str, t: &HashMap<String, Tensor>) -> Result<Self> {
        let get = |name: &str| t.get(name).with_context(|| format!("no `{name}` tensor"));
        let mel = get("mel")?;
        let (_, bins) = mel.dims2().context("`mel` must be [frames, bins]")?;
        let v = Self {
            key: key.to_string(),
            codes: get("codes")?.to_dtype(DType::U32)?.to_vec1()?,
            speaker: get("speaker")?.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?,
            mel: mel.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?,
            mel_bins: bins,
        };
        v.check()?;
        Ok(v)
    }

    fn check(&self) -> Result<()> {
        if self.codes.is_empty()
            || self.speaker.is_empty()
            || self.mel_bins == 0
            || self.mel.is_empty()
            || !self.mel.len().is_multiple_of(self.mel_bins)
        {
            bail!(
                "prepared voice: {} codes, {} speaker values, {} mel values in rows of {}",
                self.codes.len(),
                self.speaker.len(),
                self.mel.len(),
                self.mel_bins
            );
        }
        if self.speaker.iter().chain(&self.mel).any(|x| !x.is_finite()) {
            bail!("prepared voice: values that are not finite");
        }
        Ok(())
    }
}

/// Code2Wav's registered voices' features, by reference key, at most `max` (beyond, the least
/// recently installed goes: it is prepared again when a request needs it).
pub struct PreparedStore {
    map: HashMap<String, (u64, PromptFeatures)>,
    max: usize,
    tick: u64,
}

impl PreparedStore {
    pub fn new(max: usize) -> Self {
        Self { map: HashMap::new(), max, tick: 0 }
    }

    pub fn get(&self, key: &str) -> Option<&PromptFeatures> {
        self.map.get(key).map(|(_, f)| f)
    }

    pub fn insert(&mut self, key: String, f: PromptFeatures) {
        if self.max == 0 {
            return;
        }
        self.tick += 1;
        if !self.map.contains_key(&key) && self.map.len() >= self.max {
            if let Some(old) = self.map.iter().min_by_key(|(_, (t, _))| *t).map(|(k, _)| k.clone())
            {
                self.map.remove(&old);
            }
        }
        self.map.insert(key, (self.tick, f));
    }

    pub fn remove(&mut self, key: &str) -> bool {
        self.map.remove(key).is_some()
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn voice(key: &str) -> PreparedVoice {
        PreparedVoice {
            key: key.into(),
            codes: vec![1, 2, 3],
            speaker: vec![0.5; 4],
            mel: (0..12).map(|i| i as f32).collect(),
            mel_bins: 2,
        }
    }

    #[test]
    fn a_prepared_voice_survives_its_tensors_and_refuses_damage() {
        let v = voice("k");
        let t = v.tensors().unwrap();
        assert_eq!(PreparedVoice::from_tensors("k", &t).unwrap(), v);
        assert_eq!(
            PreparedVoice::from_features("k", &v.to_features(&Device::Cpu).unwrap()).unwrap(),
            v
        );
        let mut bad = t.clone();
        bad.insert("speaker".into(), Tensor::new(&[f32::NAN, 1.0], &Device::Cpu).unwrap());
        assert!(PreparedVoice::from_tensors("k", &bad).is_err(), "a NaN is refused");
        let mut missing = t;
        missing.remove("codes");
        assert!(PreparedVoice::from_tensors("k", &missing).is_err());
    }

    #[test]
    fn the_store_keeps_at_most_its_bound_least_recent_out() {
        let mut s = PreparedStore::new(2);
        for k in ["a", "b", "c"] {
            s.insert(k.into(), voice(k).to_features(&Device::Cpu).unwrap());
        }
        assert_eq!(s.len(), 2);
        assert!(s.get("a").is_none() && s.get("b").is_some() && s.get("c").is_some());
        assert!(s.remove("b") && !s.remove("b"));
    }
}
