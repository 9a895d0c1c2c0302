//! Hyper-parameters from the token2wav YAML files (`flow.yaml`, `config.yaml`), which are
//! hyperpyyaml: object tags (`!new:…`) are ignored, `!ref <key>` is resolved against top-level
//! keys, and a missing field takes the reference class's default.

use anyhow::{anyhow, bail, Context, Result};
use yaml_rust2::{Yaml, YamlLoader};

use antiphon_models::code2wav::conformer::ConformerConfig;
use antiphon_models::code2wav::dit::DitConfig;
use antiphon_models::code2wav::flow::FlowConfig;
use antiphon_models::code2wav::hift::HiftConfig;

/// A mapping node with `!ref` resolution against the document root.
pub struct Node<'a> {
    root: &'a Yaml,
    node: &'a Yaml,
    path: String,
}

impl<'a> Node<'a> {
    fn resolve(&self, v: &'a Yaml) -> &'a Yaml {
        if let Yaml::String(s) = v {
            if let Some(key) = s.strip_prefix('<').and_then(|s| s.strip_suffix('>')) {
                return &self.root[key];
            }
        }
        v
    }

    fn get(&self, key: &str) -> Option<&'a Yaml> {
        match &self.node[key] {
            Yaml::BadValue => None,
            v => Some(self.resolve(v)),
        }
    }

    pub fn child(&self, key: &str) -> Result<Node<'a>> {
        match self.get(key) {
            Some(n @ Yaml::Hash(_)) => {
                Ok(Node { root: self.root, node: n, path: format!("{}.{key}", self.path) })
            }
            _ => bail!("{}: no mapping `{key}`", self.path),
        }
    }

    pub fn usize_or(&self, key: &str, default: usize) -> Result<usize> {
        match self.get(key) {
            None => Ok(default),
            Some(Yaml::Integer(i)) if *i >= 0 => Ok(*i as usize),
            Some(v) => bail!("{}.{key}: expected a non-negative integer, found {v:?}", self.path),
        }
    }

    pub fn f64_or(&self, key: &str, default: f64) -> Result<f64> {
        match self.get(key) {
            None => Ok(default),
            Some(Yaml::Integer(i)) => Ok(*i as f64),
            Some(Yaml::Real(r)) => {
                r.parse().map_err(|_| anyhow!("{}.{key}: bad number {r}", self.path))
            }
            Some(v) => bail!("{}.{key}: expected a number, found {v:?}", self.path),
        }
    }

    pub fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(Yaml::Boolean(b)) => Ok(*b),
            Some(v) => bail!("{}.{key}: expected true/false, found {v:?}", self.path),
        }
    }

    pub fn str_or(&self, key: &str, default: &str) -> Result<String> {
        match self.get(key) {
            None => Ok(default.to_string()),
            Some(Yaml::String(s)) => Ok(s.clone()),
            Some(v) => bail!("{}.{key}: expected a string, found {v:?}", self.path),
        }
    }

    pub fn usizes_or(&self, key: &str, default: &[usize]) -> Result<Vec<usize>> {
        match self.get(key) {
            None => Ok(default.to_vec()),
            Some(Yaml::Array(a)) => a
                .iter()
                .map(|v| match self.resolve(v) {
                    Yaml::Integer(i) if *i >= 0 => Ok(*i as usize),
                    v => bail!("{}.{key}: expected integers, found {v:?}", self.path),
                })
                .collect(),
            Some(v) => bail!("{}.{key}: expected a list, found {v:?}", self.path),
        }
    }

    pub fn usize_lists_or(&self, key: &str, default: &[Vec<usize>]) -> Result<Vec<Vec<usize>>> {
        match self.get(key) {
            None => Ok(default.to_vec()),
            Some(Yaml::Array(a)) => a
                .iter()
                .map(|v| match v {
                    Yaml::Array(inner) => inner
                        .iter()
                        .map(|x| match x {
                            Yaml::Integer(i) if *i >= 0 => Ok(*i as usize),
                            x => bail!("{}.{key}: expected integers, found {x:?}", self.path),
                        })
                        .collect(),
                    v => bail!("{}.{key}: expected lists, found {v:?}", self.path),
                })
                .collect(),
            Some(v) => bail!("{}.{key}: expected a list of lists, found {v:?}", self.path),
        }
    }
}

/// Parses a YAML document and hands its root to `f`.
pub fn with_root<T>(text: &str, what: &str, f: impl FnOnce(Node<'_>) -> Result<T>) -> Result<T> {
    let docs = YamlLoader::load_from_str(text).with_context(|| format!("{what}: not YAML"))?;
    let root = docs.first().ok_or_else(|| anyhow!("{what}: empty"))?;
    f(Node { root, node: root, path: what.to_string() })
}

/// `flow.yaml` -> [`FlowConfig`].
pub fn flow_config(text: &str) -> Result<FlowConfig> {
    with_root(text, "flow.yaml", |root| {
        let f = root.child("flow")?;
        let e = f.child("encoder")?;
        let d = f.child("decoder")?;
        let s = d.child("estimator")?;
        let de = ConformerConfig::default();
        let encoder = ConformerConfig {
            input_size: e.usize_or("input_size", de.input_size)?,
            output_size: e.usize_or("output_size", 256)?,
            pre_lookahead_len: e.usize_or("pre_lookahead_len", de.pre_lookahead_len)?,
            num_blocks: e.usize_or("num_blocks", de.num_blocks)?,
            num_up_blocks: e.usize_or("num_up_blocks", de.num_up_blocks)?,
            up_stride: e.usize_or("up_stride", de.up_stride)?,
            attention_heads: e.usize_or("attention_heads", 4)?,
            linear_units: e.usize_or("linear_units", de.linear_units)?,
            key_bias: e.bool_or("key_bias", true)?,
        };
        for (k, want) in [
            ("input_layer", "linear"),
            ("pos_enc_layer_type", "rel_pos_espnet"),
            ("selfattention_layer_type", "rel_selfattn"),
        ] {
            let got = e.str_or(k, want)?;
            if got != want {
                bail!("flow.yaml: encoder.{k} = {got:?}; only {want:?} is implemented");
            }
        }
        if !e.bool_or("normalize_before", true)? {
            bail!("flow.yaml: encoder.normalize_before = false is not implemented");
        }
        if e.f64_or("up_scale_factor", encoder.up_stride as f64)? != encoder.up_stride as f64 {
            bail!("flow.yaml: encoder.up_scale_factor must equal up_stride");
        }
        let dd = DitConfig::default();
        let estimator = DitConfig {
            in_channels: s.usize_or("in_channels", dd.in_channels)?,
            out_channels: s.usize_or("out_channels", dd.out_channels)?,
            hidden_size: s.usize_or("hidden_size", 256)?,
            depth: s.usize_or("depth", 28)?,
            num_heads: s.usize_or("num_heads", dd.num_heads)?,
            head_dim: s.usize_or("head_dim", dd.head_dim)?,
            mlp_ratio: s.f64_or("mlp_ratio", dd.mlp_ratio)?,
        };
        let output_size = f.usize_or("output_size", 80)?;
        if estimator.in_channels != 4 * output_size || estimator.out_channels != output_size {
            bail!(
                "flow.yaml: the estimator's channels ({} in, {} out) do not fit {} mel bins",
                estimator.in_channels,
                estimator.out_channels,
                output_size
            );
        }
        Ok(FlowConfig {
            input_size: f.usize_or("input_size", 512)?,
            output_size,
            spk_embed_dim: f.usize_or("spk_embed_dim", 192)?,
            vocab_size: f.usize_or("vocab_size", 5121)?,
            encoder,
            estimator,
            inference_cfg_rate: d.f64_or("inference_cfg_rate", 0.7)?,
            ..FlowConfig::default()
        })
    })
}

/// `config.yaml` (the causal vocoder's) -> [`HiftConfig`]; the feature extractor must be the
/// 24 kHz / 480-hop / 80-bin mel the flow produces.
pub fn causal_hift_config(text: &str) -> Result<HiftConfig> {
    with_root(text, "config.yaml", |root| {
        let fe = root.child("feat_extractor")?;
        for (k, want) in [
            ("n_fft", 1920),
            ("num_mels", 80),
            ("sampling_rate", 24000),
            ("hop_size", 480),
            ("win_size", 1920),
            ("fmin", 0),
            ("fmax", 8000),
        ] {
            let got = fe.usize_or(k, usize::MAX)?;
            if got != want {
                bail!("config.yaml: feat_extractor.{k} = {got}, the vocoder needs {want}");
            }
        }
        let h = root.child("hift")?;
        let cfg = hift_config(&h, true)?;
        if cfg.sampling_rate != 24000 || cfg.hop() != 480 {
            bail!("config.yaml: the vocoder must make 24 kHz audio with 480 samples per mel frame");
        }
        Ok(cfg)
    })
}

/// The fields of a HiFT generator node (the original HiFT's defaults where absent).
pub fn hift_config(h: &Node<'_>, causal: bool) -> Result<HiftConfig> {
    let d = HiftConfig::original();
    let f0 = h.child("f0_predictor").ok();
    Ok(HiftConfig {
        in_channels: h.usize_or("in_channels", d.in_channels)?,
        base_channels: h.usize_or("base_channels", d.base_channels)?,
        nb_harmonics: h.usize_or("nb_harmonics", d.nb_harmonics)?,
        sampling_rate: h.usize_or("sampling_rate", d.sampling_rate)?,
        nsf_alpha: h.f64_or("nsf_alpha", d.nsf_alpha)?,
        nsf_sigma: h.f64_or("nsf_sigma", d.nsf_sigma)?,
        nsf_voiced_threshold: h.f64_or("nsf_voiced_threshold", d.nsf_voiced_threshold)?,
        upsample_rates: h.usizes_or("upsample_rates", &d.upsample_rates)?,
        upsample_kernel_sizes: h.usizes_or("upsample_kernel_sizes", &d.upsample_kernel_sizes)?,
        istft_n_fft: h.child("istft_params").map(|p| p.usize_or("n_fft", 16)).unwrap_or(Ok(16))?,
        istft_hop: h.child("istft_params").map(|p| p.usize_or("hop_len", 4)).unwrap_or(Ok(4))?,
        resblock_kernel_sizes: h.usizes_or("resblock_kernel_sizes", &d.resblock_kernel_sizes)?,
        resblock_dilation_sizes: h
            .usize_lists_or("resblock_dilation_sizes", &d.resblock_dilation_sizes)?,
        source_resblock_kernel_sizes: h
            .usizes_or("source_resblock_kernel_sizes", &d.source_resblock_kernel_sizes)?,
        source_resblock_dilation_sizes: h
            .usize_lists_or("source_resblock_dilation_sizes", &d.source_resblock_dilation_sizes)?,
        lrelu_slope: h.f64_or("lrelu_slope", d.lrelu_slope)?,
        audio_limit: h.f64_or("audio_limit", d.audio_limit)?,
        conv_pre_look_right: if causal { h.usize_or("conv_pre_look_right", 4)? } else { 0 },
        f0_channels: match f0 {
            Some(f) => f.usize_or("cond_channels", 512)?,
            None => 512,
        },
        causal,
    })
}
