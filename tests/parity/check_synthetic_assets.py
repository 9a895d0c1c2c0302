#!/usr/bin/env python3
"""Checks that a synthetic checkpoint written by `antiphon synth-checkpoint` loads in the reference
implementations exactly like a real one: flow.pt / hift.pt / hift_original.pt with strict=True into
the minicpmo-utils classes built from the written YAML, the speech tokenizer through s3tokenizer's
onnx2torch, campplus.onnx in onnxruntime, the LM weights into transformers' classes.

    cargo run --release -- synth-checkpoint --out /tmp/ck --preset tiny
    .venv-parity/bin/python tests/parity/check_synthetic_assets.py /tmp/ck
"""
import json
import os
import sys

import numpy as np
import onnxruntime
import torch
from s3tokenizer.model_v2 import ModelConfig, S3TokenizerV2
from s3tokenizer.utils import onnx2torch
from safetensors.torch import load_file
from stepaudio2.flashcosyvoice.modules.hifigan import ConvRNNF0Predictor, HiFTGenerator
from stepaudio2.token2wav import _load_config
from transformers import Qwen3Config, Qwen3ForCausalLM

ck = sys.argv[1]
a = os.path.join(ck, "assets", "token2wav")
flow = _load_config(os.path.join(a, "flow.yaml"))["flow"]
flow.load_state_dict(torch.load(os.path.join(a, "flow.pt"), weights_only=True), strict=True)
print("flow.pt: strict load OK,", sum(p.numel() for p in flow.parameters()), "parameters")
hift = _load_config(os.path.join(a, "config.yaml"), {"hifigan": None})["hift"]
hift.load_state_dict(torch.load(os.path.join(a, "hift.pt"), weights_only=True), strict=True)
print("hift.pt (causal): strict load OK")
sd = {k.removeprefix("generator."): v for k, v in torch.load(os.path.join(a, "hift_original.pt"), weights_only=True).items()}
f0c = sd["f0_predictor.condnet.0.parametrizations.weight.original1"].shape[0]
base = sd["conv_pre.parametrizations.weight.original1"].shape[0]
orig = HiFTGenerator(base_channels=base)
orig.f0_predictor = ConvRNNF0Predictor(cond_channels=f0c)
orig.load_state_dict(sd, strict=True)
print("hift_original.pt: strict load OK")
w = onnx2torch(os.path.join(a, "speech_tokenizer_v2_25hz.onnx"))
n_state = w["encoder.conv1.weight"].shape[0]
n_layer = len({k.split(".")[2] for k in w if k.startswith("encoder.blocks.")})
tok = S3TokenizerV2("speech_tokenizer_v2_25hz", ModelConfig(n_mels=128, n_audio_state=n_state, n_audio_head=n_state // 64, n_audio_layer=n_layer))
tok.load_state_dict(w, strict=True)
print("speech_tokenizer_v2_25hz.onnx: onnx2torch + strict load OK")
sess = onnxruntime.InferenceSession(os.path.join(a, "campplus.onnx"), providers=["CPUExecutionProvider"])
emb = sess.run(None, {sess.get_inputs()[0].name: np.random.default_rng(0).standard_normal((1, 598, 80)).astype(np.float32)})[0]
print("campplus.onnx: onnxruntime runs it ->", emb.shape)
cfg = json.load(open(os.path.join(ck, "config.json")))
q = Qwen3ForCausalLM(Qwen3Config(**{k: cfg[k] for k in ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                                          "num_attention_heads", "num_key_value_heads", "head_dim"]}))
st = {}
for f in sorted(os.listdir(ck)):
    if f.endswith(".safetensors"):
        st.update(load_file(os.path.join(ck, f)))
llm = {k[len("llm."):]: v for k, v in st.items() if k.startswith("llm.")}
q.load_state_dict(llm, strict=True)
print("llm.*: strict load into Qwen3ForCausalLM OK")
