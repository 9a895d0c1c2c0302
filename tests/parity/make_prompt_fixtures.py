#!/usr/bin/env python3
"""Parity fixtures for reference-voice preparation: kaldi fbank (torchaudio), the flow's 24 kHz mel
(minicpmo-utils' mel_spectrogram), the S3 tokenizer's 128-bin log-mel and codes (s3tokenizer's
S3TokenizerV2, loaded through s3tokenizer's own onnx2torch from an ONNX file written with the
initializer and node names that loader expects), and the CAM++ speaker embedding (a tiny speakerlab
CAMPPlus exported to ONNX by torch, evaluated by onnxruntime as the reference servers do).

    tests/fixtures/parity_prompt/speech_tokenizer_v2_25hz.onnx, campplus.onnx
    tests/fixtures/parity_prompt/io.safetensors, io.json

    python3 tests/parity/make_prompt_fixtures.py [--check]
"""
import json
import math
import os
import sys

import numpy as np
import onnx
import onnxruntime
import torch
import torchaudio
import torchaudio.compliance.kaldi as kaldi
from onnx import helper, numpy_helper
from safetensors.numpy import load_file, save_file

import s3tokenizer
from s3tokenizer.model_v2 import ModelConfig, S3TokenizerV2
from s3tokenizer.utils import onnx2torch
from speakerlab.models.campplus.DTDNN import CAMPPlus
from stepaudio2.flashcosyvoice.utils.audio import mel_spectrogram

import fixturecheck  # noqa: E402 (beside this script)

OUT = os.path.join(os.path.dirname(__file__), "..", "fixtures", "parity_prompt")


def perturb(module, gen):
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            if p.dim() == 1:
                base = 1.0 if name.endswith("weight") else 0.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = int(np.prod(p.shape[1:]))
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))
        for name, b in sorted(module.named_buffers()):
            if name.endswith("running_mean"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
            elif name.endswith("running_var"):
                b.copy_(1.0 + 0.2 * torch.rand(b.shape, generator=gen))


def s3_onnx(model, path):
    """An ONNX graph holding the tokenizer's weights under the names s3tokenizer's onnx2torch maps
    (the v2_25hz conv initializer names, node names for the blocks, the quantizer's two names)."""
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    inits, nodes = [], []

    def init(name, arr):
        inits.append(numpy_helper.from_array(np.ascontiguousarray(arr, dtype=np.float32), name))
        return name

    def node(op, inputs, name, **attrs):
        out = name + "_out"
        nodes.append(helper.make_node(op, inputs, [out], name=name, **attrs))
        return out

    x = node("Conv", ["mel", init("onnx::Conv_2216", sd["encoder.conv1.weight"]), init("onnx::Conv_2217", sd["encoder.conv1.bias"])],
             "/conv1/Conv", strides=[2], pads=[1, 1], kernel_shape=[3])
    x = node("Conv", [x, init("onnx::Conv_2218", sd["encoder.conv2.weight"]), init("onnx::Conv_2219", sd["encoder.conv2.bias"])],
             "/conv2/Conv", strides=[2], pads=[1, 1], kernel_shape=[3])
    n_layer = len(model.encoder.blocks)
    for k in range(n_layer):
        p, q = f"/blocks.{k}", f"encoder.blocks.{k}"
        h = node("LayerNormalization", [x, init(f"{q}.attn_ln.scale", sd[f"{q}.attn_ln.weight"]), init(f"{q}.attn_ln.b", sd[f"{q}.attn_ln.bias"])],
                 f"{p}/attn_ln/LayerNormalization", epsilon=1e-6)
        for proj in ["query", "key", "value", "out"]:
            m = node("MatMul", [h, init(f"onnx::MatMul_{k}_{proj}", sd[f"{q}.attn.{proj}.weight"].T)], f"{p}/attn/{proj}/MatMul")
            if f"{q}.attn.{proj}.bias" in sd:
                node("Add", [m, init(f"{q}.attn.{proj}.bias_init", sd[f"{q}.attn.{proj}.bias"])], f"{p}/attn/{proj}/Add")
        node("Conv", [h, init(f"onnx::Conv_fsmn_{k}", sd[f"{q}.attn.fsmn_block.weight"])], f"{p}/attn/fsmn_block/Conv",
             group=sd[f"{q}.attn.fsmn_block.weight"].shape[0], kernel_shape=[31])
        h = node("LayerNormalization", [x, init(f"{q}.mlp_ln.scale", sd[f"{q}.mlp_ln.weight"]), init(f"{q}.mlp_ln.b", sd[f"{q}.mlp_ln.bias"])],
                 f"{p}/mlp_ln/LayerNormalization", epsilon=1e-5)
        for i in ["0", "2"]:
            m = node("MatMul", [h, init(f"onnx::MatMul_{k}_mlp{i}", sd[f"{q}.mlp.{i}.weight"].T)], f"{p}/mlp/mlp.{i}/MatMul")
            node("Add", [m, init(f"{q}.mlp.{i}.bias_init", sd[f"{q}.mlp.{i}.bias"])], f"{p}/mlp/mlp.{i}/Add")
    m = node("MatMul", [x, init("onnx::MatMul_2536", sd["quantizer._codebook.project_down.weight"].T)], "/quantizer/project_down/MatMul")
    y = node("Add", [m, init("quantizer.project_in.bias", sd["quantizer._codebook.project_down.bias"])], "/quantizer/project_down/Add")
    graph = helper.make_graph(nodes, "s3tokenizer_v2_tiny",
                              [helper.make_tensor_value_info("mel", onnx.TensorProto.FLOAT, [1, 128, None])],
                              [helper.make_tensor_value_info(y, onnx.TensorProto.FLOAT, None)], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def build(out_dir):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(2024)
    rng = np.random.default_rng(11)
    os.makedirs(out_dir, exist_ok=True)
    io, meta = {}, {}

    # a 6 s reference at 24 kHz: a gliding harmonic tone with syllable-like envelope and noise
    n = 6 * 24000
    t = np.arange(n) / 24000.0
    f0 = 140 + 40 * np.sin(2 * np.pi * 0.7 * t)
    ph = 2 * np.pi * np.cumsum(f0) / 24000.0
    env = 0.5 + 0.5 * np.sin(2 * np.pi * 3.0 * t) ** 2
    a24 = (env * (0.3 * np.sin(ph) + 0.1 * np.sin(2 * ph) + 0.05 * np.sin(3 * ph)) + 0.01 * rng.standard_normal(n)).astype(np.float32)
    a24[: 2400] *= np.linspace(0, 1, 2400, dtype=np.float32)
    a16 = torchaudio.transforms.Resample(24000, 16000)(torch.from_numpy(a24)[None])[0]
    io["audio_24k"], io["audio_16k"] = a24, a16.numpy()

    with torch.no_grad():
        # kaldi fbank + mean normalization (token2wav._prepare_prompt)
        fb = kaldi.fbank(a16[None], num_mel_bins=80, dither=0, sample_frequency=16000)
        io["fbank"] = fb.numpy()
        fb_cmn = fb - fb.mean(dim=0, keepdim=True)
        # the flow's prompt mel at 24 kHz
        io["mel_24k"] = mel_spectrogram(torch.from_numpy(a24)[None])[0].numpy()
        # the S3 tokenizer's mel and codes, through its own ONNX loader
        mel128 = s3tokenizer.log_mel_spectrogram(a16)
        io["mel_128"] = mel128.numpy()
        cfg = ModelConfig(n_mels=128, n_audio_state=64, n_audio_head=1, n_audio_layer=2)
        tok = S3TokenizerV2("speech_tokenizer_v2_25hz", cfg).eval()
        perturb(tok, gen)
        path = os.path.join(out_dir, "speech_tokenizer_v2_25hz.onnx")
        s3_onnx(tok, path)
        loaded = S3TokenizerV2("speech_tokenizer_v2_25hz", ModelConfig(n_mels=128, n_audio_state=64, n_audio_head=1, n_audio_layer=2)).eval()
        loaded.load_state_dict(onnx2torch(path), strict=True)
        mels, lens = s3tokenizer.padding([mel128])
        codes, code_lens = loaded.quantize(mels, lens)
        meta["s3_codes"] = [int(c) for c in codes[0, : code_lens[0]].tolist()]
        hidden, _ = loaded.encoder(mels, lens)
        io["s3_hidden"] = hidden[0].numpy()

        # CAM++: speakerlab's model, exported by torch (batch norms folded), run by onnxruntime
        cam = CAMPPlus(feat_dim=80, embedding_size=192, growth_rate=4, bn_size=2, init_channels=16).eval()
        perturb(cam, gen)
        cpath = os.path.join(out_dir, "campplus.onnx")
        x = fb_cmn[None]
        torch.onnx.export(cam, (x,), cpath, input_names=["input"], output_names=["output"],
                          dynamic_axes={"input": {1: "T"}}, opset_version=13, dynamo=False)
        sess = onnxruntime.InferenceSession(cpath, providers=["CPUExecutionProvider"])
        emb = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
        io["spk_emb"] = emb[0]
        io["spk_emb_torch"] = cam(x)[0].numpy()

    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in io.items()}, os.path.join(out_dir, "io.safetensors"))
    with open(os.path.join(out_dir, "io.json"), "w") as fh:
        json.dump(meta, fh, indent=1, sort_keys=True)


if __name__ == "__main__":
    fixturecheck.main(build, OUT)
