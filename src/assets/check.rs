//! What `antiphon check-config` checks of a checkpoint directory without loading a weight: the
//! files the loader opens, each safetensors shard's header against the file's length (a truncated
//! or corrupt shard), the index against the shards, the Thinker LLM's tensors (the bulk of the
//! checkpoint) against the shapes its `config.json` implies, `tokenizer.json`, and the token2wav
//! assets. Each problem names the file and what was expected.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

use crate::checkpoint::Checkpoint;

/// One tensor as a safetensors header describes it.
#[derive(Debug, Clone, serde::Deserialize)]
struct TensorHeader {
    dtype: String,
    shape: Vec<usize>,
    data_offsets: (u64, u64),
}

/// Bytes per element of a safetensors dtype (`None`: one the loader does not read).
fn dtype_bytes(dtype: &str) -> Option<u64> {
    match dtype {
        "F64" | "I64" | "U64" => Some(8),
        "F32" | "I32" | "U32" => Some(4),
        "F16" | "BF16" | "I16" | "U16" => Some(2),
        "U8" | "I8" | "BOOL" | "F8_E4M3" | "F8_E5M2" => Some(1),
        _ => None,
    }
}

/// The largest header a shard may have (the format's own bound).
const MAX_HEADER: u64 = 100 << 20;

/// A shard's tensors as its header says, after checking the header against the file: every
/// tensor's bytes match its shape and dtype, and the file holds exactly the data the header
/// describes.
fn shard_header(path: &Path) -> Result<BTreeMap<String, TensorHeader>, String> {
    let name = path.display();
    let mut f = std::fs::File::open(path).map_err(|e| format!("{name}: {e}"))?;
    let len = f.metadata().map_err(|e| format!("{name}: {e}"))?.len();
    let mut n = [0u8; 8];
    f.read_exact(&mut n)
        .map_err(|_| format!("{name}: {len} bytes, shorter than a safetensors header"))?;
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER || 8 + n > len {
        return Err(format!(
            "{name}: the header claims {n} bytes, the file holds {len}: not a \
            safetensors file, or truncated"
        ));
    }
    let mut head = vec![0u8; n as usize];
    f.read_exact(&mut head).map_err(|e| format!("{name}: {e}"))?;
    let mut all: BTreeMap<String, serde_json::Value> = serde_json::from_slice(&head)
        .map_err(|e| format!("{name}: the safetensors header is not JSON ({e})"))?;
    all.remove("__metadata__");
    let mut tensors = BTreeMap::new();
    let mut end = 0;
    for (k, v) in all {
        let t: TensorHeader =
            serde_json::from_value(v).map_err(|e| format!("{name}: tensor {k}: {e}"))?;
        let Some(size) = dtype_bytes(&t.dtype) else {
            return Err(format!("{name}: tensor {k} has dtype {}, which is not read", t.dtype));
        };
        let want = t.shape.iter().map(|&d| d as u64).product::<u64>() * size;
        let (b, e) = t.data_offsets;
        if e < b || e - b != want {
            return Err(format!(
                "{name}: tensor {k} takes bytes {b}..{e}, its shape {:?} of {} needs {want}",
                t.shape, t.dtype
            ));
        }
        end = end.max(e);
        tensors.insert(k, t);
    }
    if len != 8 + n + end {
        return Err(format!(
            "{name}: {len} bytes, its header describes {} (truncated, or not the \
            file the index names)",
            8 + n + end
        ));
    }
    Ok(tensors)
}

/// The Thinker LLM's tensors and their shapes as `config.json` implies them (Qwen3: `llm.` then
/// the Hugging Face names), as the loader reads them.
fn llm_shapes(ck: &Checkpoint) -> Vec<(String, Vec<usize>)> {
    let c = &ck.config;
    let (v, h, i, d) = (c.vocab_size, c.hidden_size, c.intermediate_size, c.head_dim());
    let (hq, hkv) = (c.num_attention_heads, c.num_key_value_heads);
    let mut out = vec![
        ("llm.model.embed_tokens.weight".to_string(), vec![v, h]),
        ("llm.model.norm.weight".into(), vec![h]),
    ];
    if !c.tie_word_embeddings {
        out.push(("llm.lm_head.weight".into(), vec![v, h]));
    }
    for l in 0..c.num_hidden_layers {
        let p = format!("llm.model.layers.{l}");
        for (name, shape) in [
            ("self_attn.q_proj.weight", vec![hq * d, h]),
            ("self_attn.k_proj.weight", vec![hkv * d, h]),
            ("self_attn.v_proj.weight", vec![hkv * d, h]),
            ("self_attn.o_proj.weight", vec![h, hq * d]),
            ("mlp.gate_proj.weight", vec![i, h]),
            ("mlp.up_proj.weight", vec![i, h]),
            ("mlp.down_proj.weight", vec![h, i]),
            ("input_layernorm.weight", vec![h]),
            ("post_attention_layernorm.weight", vec![h]),
        ] {
            out.push((format!("{p}.{name}"), shape));
        }
    }
    out
}

/// Problems with the checkpoint directory `dir` that loading it would meet (empty: none found).
pub fn check_checkpoint(dir: &Path) -> Vec<String> {
    let ck = match Checkpoint::open(dir) {
        Ok(ck) => ck,
        Err(e) => return vec![format!("{e:#}")],
    };
    let mut problems = Vec::new();
    if let Err(e) = ck.tokenizer() {
        problems.push(format!("{e:#}"));
    }
    // every shard's header, and where each tensor is
    let before = problems.len();
    let mut held: BTreeMap<String, (String, TensorHeader)> = BTreeMap::new();
    for shard in &ck.shards {
        match shard_header(shard) {
            Ok(tensors) => {
                let file =
                    shard.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
                held.extend(tensors.into_iter().map(|(k, t)| (k, (file.clone(), t))));
            }
            Err(e) => problems.push(e),
        }
    }
    // (what a shard that could not be read holds is unknown: the rest waits for it to be fixed)
    if problems.len() == before {
        let index = dir.join("model.safetensors.index.json");
        if let Ok(ix) = std::fs::read_to_string(&index)
            .map(|t| serde_json::from_str::<crate::checkpoint::SafetensorsIndex>(&t))
        {
            for (name, file) in ix.iter().flat_map(|ix| &ix.weight_map) {
                if held.get(name).is_none_or(|(f, _)| f != file) {
                    problems.push(format!(
                        "{} places {name} in {file}, which does not hold it",
                        index.display()
                    ));
                }
            }
        }
        for (name, want) in llm_shapes(&ck) {
            match held.get(&name) {
                None => problems.push(format!(
                    "{}: missing tensor {name} (expected shape {want:?} from config.json)",
                    dir.display()
                )),
                Some((file, t)) if t.shape != want => problems.push(format!(
                    "{file}: tensor {name} has shape {:?}, config.json implies {want:?}",
                    t.shape
                )),
                Some(_) => {}
            }
        }
    }
    let assets = dir.join("assets").join("token2wav");
    let missing = crate::token2wav::missing_assets(&assets);
    if !missing.is_empty() {
        problems.push(format!(
            "{}: missing token2wav asset(s) {}",
            assets.display(),
            missing.join(", ")
        ));
    }
    problems
}
