#!/usr/bin/env python3
"""Parity fixtures for the Thinker (Qwen3 LLM + Whisper encoder + audio projector) and the Talker.

Builds tiny random models with the reference implementations from PyPI (transformers'
Qwen3ForCausalLM, WhisperEncoder, LlamaModel; the Talker's embeddings, projector and weight-normed
head in plain torch, as MiniCPMTTS defines them), saves their weights in the MiniCPM-o 4.5
checkpoint layout (config.json, two safetensors shards + index), runs them on fixed inputs and
saves inputs and outputs:

    tests/fixtures/parity_lm/            the checkpoint directory
    tests/fixtures/parity_lm/io.safetensors   float inputs and reference outputs
    tests/fixtures/parity_lm/io.json          integer inputs (token ids, codes) and sizes

Run from the repository root:
    python3 tests/parity/make_lm_fixtures.py            # (re)write the fixtures
    python3 tests/parity/make_lm_fixtures.py --check    # regenerate in a temp dir, compare
"""
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.numpy import load_file, save_file
from transformers import (LlamaConfig, LlamaModel, Qwen3Config, Qwen3ForCausalLM, WhisperConfig,
                          WhisperFeatureExtractor)
from transformers.models.whisper.modeling_whisper import WhisperEncoder

import fixturecheck  # noqa: E402 (beside this script)

OUT = os.path.join(os.path.dirname(__file__), "..", "fixtures", "parity_lm")

# ---- tiny dimensions (every structural switch of the real model kept) ----
VOCAB = 300
LLM = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="silu",
           rms_norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=False,
           attention_bias=False)
ROPE_THETA = 1_000_000.0
AUDIO = dict(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128,
             num_mel_bins=80, max_source_positions=150, activation_function="gelu")
TTS = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2,
           num_key_value_heads=4, max_position_embeddings=4096, llm_dim=64, num_audio_tokens=300,
           num_text_tokens=VOCAB, audio_bos_token_id=298, text_eos_token_id=299,
           normalize_projected_hidden=True)
POOL = 5
# special ids of this tiny vocabulary (the Rust side is told them through io.json)
AUDIO_START, AUDIO_END, UNK = 290, 291, 292


def perturb(module, gen):
    """Replaces every parameter with seeded noise so that each tensor matters (norm scales away
    from 1, biases away from 0)."""
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen) if name.endswith("weight")
                        else 0.1 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = int(np.prod(p.shape[1:]))
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))


class Talker(torch.nn.Module):
    """MiniCPMTTS's modules around the Llama backbone, as model.md describes them."""

    def __init__(self):
        super().__init__()
        h = TTS["hidden_size"]
        self.emb_text = torch.nn.Embedding(TTS["num_text_tokens"], h)
        self.projector_semantic = torch.nn.Module()
        self.projector_semantic.linear1 = torch.nn.Linear(TTS["llm_dim"], h)
        self.projector_semantic.linear2 = torch.nn.Linear(h, h)
        self.emb_code = torch.nn.ModuleList([torch.nn.Embedding(TTS["num_audio_tokens"], h)])
        self.head_code = torch.nn.ModuleList([torch.nn.utils.parametrizations.weight_norm(
            torch.nn.Linear(h, TTS["num_audio_tokens"], bias=False), dim=0)])
        cfg = LlamaConfig(hidden_size=h, intermediate_size=TTS["intermediate_size"],
                          num_attention_heads=TTS["num_attention_heads"],
                          num_hidden_layers=TTS["num_hidden_layers"],
                          num_key_value_heads=TTS["num_key_value_heads"],
                          max_position_embeddings=TTS["max_position_embeddings"], vocab_size=32,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        cfg._attn_implementation = "eager"
        self.model = LlamaModel(cfg)

    def condition(self, ids, hidden, turn=True):
        p = self.projector_semantic.linear2(F.relu(self.projector_semantic.linear1(hidden)))
        p = F.normalize(p, p=2, dim=-1)
        cond = self.emb_text(ids) + p
        tail = [TTS["text_eos_token_id"], TTS["audio_bos_token_id"]] if turn else [TTS["audio_bos_token_id"]]
        return torch.cat([cond, self.emb_text(torch.tensor(tail))], 0)

    def run(self, embeds):
        h = self.model(inputs_embeds=embeds[None]).last_hidden_state[0]
        return h, self.head_code[0](h)


def whisper_layers_forward(enc, x, past=None):
    """The encoder layers over x [1, n, d], attending to `past` (per-layer K, V) plus x: the
    streaming path (MiniCPM-o keeps a per-session attention cache), written with the
    transformers layers' own submodules."""
    new_past = []
    for li, layer in enumerate(enc.layers):
        a = layer.self_attn
        res = x
        h = layer.self_attn_layer_norm(x)
        q = a.q_proj(h) * a.scaling
        k = a.k_proj(h)
        v = a.v_proj(h)
        if past is not None:
            k = torch.cat([past[li][0], k], 1)
            v = torch.cat([past[li][1], v], 1)
        new_past.append((k, v))
        b, n, d = q.shape
        hd = d // a.num_heads
        qh = q.view(b, n, a.num_heads, hd).transpose(1, 2)
        kh = k.view(b, k.shape[1], a.num_heads, hd).transpose(1, 2)
        vh = v.view(b, v.shape[1], a.num_heads, hd).transpose(1, 2)
        att = torch.softmax(qh @ kh.transpose(-1, -2), -1)
        o = (att @ vh).transpose(1, 2).reshape(b, n, d)
        x = res + a.out_proj(o)
        res = x
        h = layer.final_layer_norm(x)
        x = res + layer.fc2(layer.activation_fn(layer.fc1(h)))
    return enc.layer_norm(x), new_past


def whisper_front(enc, mel):
    x = F.gelu(enc.conv1(mel[None]))
    x = F.gelu(enc.conv2(x))
    return x.permute(0, 2, 1)


def build(out_dir):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1234)
    rng = np.random.default_rng(99)

    # ---------- models ----------
    qcfg = Qwen3Config(**LLM, rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA})
    qcfg._attn_implementation = "eager"
    llm = Qwen3ForCausalLM(qcfg).eval()
    perturb(llm, gen)
    wcfg = WhisperConfig(d_model=AUDIO["d_model"], encoder_layers=AUDIO["encoder_layers"],
                         encoder_attention_heads=AUDIO["encoder_attention_heads"],
                         encoder_ffn_dim=AUDIO["encoder_ffn_dim"], num_mel_bins=AUDIO["num_mel_bins"],
                         max_source_positions=AUDIO["max_source_positions"], activation_function="gelu")
    wcfg._attn_implementation = "eager"
    apm = WhisperEncoder(wcfg).eval()
    perturb(apm, gen)
    proj = torch.nn.Module()
    proj.linear1 = torch.nn.Linear(AUDIO["encoder_ffn_dim"] // 4, LLM["hidden_size"])
    proj.linear2 = torch.nn.Linear(LLM["hidden_size"], LLM["hidden_size"])
    perturb(proj, gen)
    talker = Talker().eval()
    perturb(talker, gen)

    # ---------- checkpoint in the MiniCPM-o layout ----------
    tensors = {}
    for prefix, m in [("llm.", llm), ("apm.", apm), ("audio_projection_layer.", proj), ("tts.", talker)]:
        for k, v in m.state_dict().items():
            tensors[prefix + k] = v.detach().float().contiguous().numpy()
    # a vision tensor that the loader must skip
    tensors["vpm.embeddings.patch_embedding.bias"] = np.zeros(4, np.float32)
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    os.makedirs(out_dir, exist_ok=True)
    weight_map = {}
    for f, ks in shards.items():
        save_file({k: tensors[k] for k in ks}, os.path.join(out_dir, f), metadata={"format": "pt"})
        weight_map.update({k: f for k in ks})
    total = int(sum(t.nbytes for t in tensors.values()))
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=1, sort_keys=True)
    config = dict(LLM, model_type="minicpmo", architectures=["MiniCPMO"], version="4.5", rope_theta=ROPE_THETA,
                  rope_scaling=None, audio_pool_step=POOL, torch_dtype="float32",
                  audio_config=dict(AUDIO, model_type="whisper"),
                  tts_config=dict(TTS, model_type="minicpmtts", backbone_model="llama", num_vq=1),
                  vision_config={"model_type": "siglip_vision_model"})
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(config, fh, indent=1, sort_keys=True)

    io = {}
    meta = {"audio_start": AUDIO_START, "audio_end": AUDIO_END, "unk": UNK, "pool": POOL}
    with torch.no_grad():
        # ---------- Whisper log-mel ----------
        fe = WhisperFeatureExtractor(feature_size=80, sampling_rate=16000, hop_length=160, n_fft=400)
        t = np.arange(int(2.5 * 16000)) / 16000.0
        clip = (0.3 * np.sin(2 * np.pi * 220 * t) * np.sin(2 * np.pi * 1.5 * t)
                + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)
        mel = fe._np_extract_fbank_features(clip[None].astype(np.float32), "cpu")[0].astype(np.float32)
        io["clip"] = clip
        io["clip_mel"] = mel

        # ---------- encoder, whole clip (MiniCPM-o slices the position table to the length) ----------
        x = whisper_front(apm, torch.from_numpy(mel))
        n = x.shape[1]
        x = x + apm.embed_positions.weight[:n]
        for layer in apm.layers:
            x = layer(x, None)
        enc = apm.layer_norm(x)[0]
        io["clip_encoder"] = enc.numpy()
        pe = proj.linear2(F.relu(proj.linear1(enc)))
        pooled = F.avg_pool1d(pe.T[None], POOL, POOL)[0].T
        io["clip_embeds"] = pooled.contiguous().numpy()

        # ---------- encoder, streaming 1 s units with an attention cache ----------
        # The cache starts afresh when length + new >= max_source_positions (150 here: units of 50
        # positions, so the third unit starts a fresh cache).
        units = [(0.2 * rng.standard_normal(16000) * np.sin(2 * np.pi * (k + 1) * np.arange(16000) / 16000.0)
                  ).astype(np.float32) for k in range(4)]
        past, length = None, 0
        for k, u in enumerate(units):
            umel = fe._np_extract_fbank_features(u[None], "cpu")[0].astype(np.float32)
            x = whisper_front(apm, torch.from_numpy(umel))
            n = x.shape[1]
            if length + n >= AUDIO["max_source_positions"]:
                past, length = None, 0
            x = x + apm.embed_positions.weight[length:length + n]
            y, past = whisper_layers_forward(apm, x, past)
            length += n
            io[f"unit{k}"] = u
            io[f"unit{k}_encoder"] = y[0].numpy()
            pe = proj.linear2(F.relu(proj.linear1(y[0])))
            io[f"unit{k}_embeds"] = F.avg_pool1d(pe.T[None], POOL, POOL)[0].T.contiguous().numpy()

        # ---------- LLM: prompt with an audio span, spliced embeddings ----------
        n_audio = io["clip_embeds"].shape[0]
        ids = ([1, 17, 42, 9, AUDIO_START] + [UNK] * n_audio + [AUDIO_END]
               + [int(v) for v in rng.integers(0, 280, 12)])
        emb = llm.model.embed_tokens(torch.tensor(ids))
        s = ids.index(AUDIO_START) + 1
        emb[s:s + n_audio] = torch.from_numpy(io["clip_embeds"])
        hid = llm.model(inputs_embeds=emb[None]).last_hidden_state[0]
        io["llm_audio_hidden"] = hid.numpy()
        io["llm_audio_logits"] = llm.lm_head(hid).numpy()
        meta["llm_audio_ids"] = ids

        # ---------- LLM: text-only sequence, whole (for prefill/decode/chunked tests) ----------
        tids = [int(v) for v in rng.integers(0, VOCAB, 24)]
        out = llm.model(input_ids=torch.tensor([tids])).last_hidden_state[0]
        io["llm_text_hidden"] = out.numpy()
        io["llm_text_logits"] = llm.lm_head(out).numpy()
        meta["llm_text_ids"] = tids

        # ---------- Talker ----------
        h_ids = [int(v) for v in rng.integers(0, 280, 9)]
        h_hidden = torch.from_numpy(rng.standard_normal((9, LLM["hidden_size"])).astype(np.float32) * 2.0)
        cond = talker.condition(torch.tensor(h_ids), h_hidden, turn=True)
        cond_duplex = talker.condition(torch.tensor(h_ids), h_hidden, turn=False)
        codes = [int(v) for v in rng.integers(0, TTS["num_audio_tokens"] - 1, 12)]
        seq = torch.cat([cond, talker.emb_code[0](torch.tensor(codes))], 0)
        th, tl = talker.run(seq)
        io["talker_hidden_in"] = h_hidden.numpy()
        io["talker_condition"] = cond.numpy()
        io["talker_condition_duplex"] = cond_duplex.numpy()
        io["talker_hidden"] = th.numpy()
        io["talker_logits"] = tl.numpy()
        io["talker_head_weight"] = talker.head_code[0].weight.detach().numpy()
        meta["talker_ids"] = h_ids
        meta["talker_codes"] = codes

    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in io.items()},
              os.path.join(out_dir, "io.safetensors"))
    with open(os.path.join(out_dir, "io.json"), "w") as fh:
        json.dump(meta, fh, indent=1, sort_keys=True)


if __name__ == "__main__":
    fixturecheck.main(build, OUT)
