#!/usr/bin/env python3
"""Parity fixtures for Code2Wav: the flow (causal Conformer encoder, DiT estimator, CFM sampler)
and the vocoders (the causal HiFT that minicpmo-utils 1.0.7 streams, and the original HiFT).

The reference classes come from the PyPI package minicpmo-utils 1.0.7 (imported module by module;
its CUDA-only Token2wav wrapper is not instantiated, only some of its methods are called on a
stand-in object so that the cache trimming and the streaming vocoder run exactly as the reference
runs them). Weights are saved the way the real assets are (torch state dicts in flow.pt / hift.pt
/ hift_original.pt, hyper-parameters in flow.yaml / config.yaml) and the fixed random buffers the
reference creates at construction (the CFM noise, the vocoder's noise table) are saved with the
inputs and outputs:

    tests/fixtures/parity_c2w/token2wav/   flow.pt flow.yaml hift.pt config.yaml hift_original.pt
    tests/fixtures/parity_c2w/io.safetensors, io.json

    python3 tests/parity/make_c2w_fixtures.py [--check]
"""
import json
import math
import os
import sys
import types

import numpy as np
import torch
from safetensors.numpy import load_file, save_file

from stepaudio2.causal_vocoder.bounded_vocoder import BoundedVocoder
from stepaudio2.flashcosyvoice.modules.hifigan import HiFTGenerator
from stepaudio2.token2wav import Token2wav, _load_config

import fixturecheck  # noqa: E402 (beside this script)

OUT = os.path.join(os.path.dirname(__file__), "..", "fixtures", "parity_c2w")
SILENCE = 4218

FLOW_YAML = """\
# tiny dimensions, every structural switch of the real flow kept
flow: !new:cosyvoice2.flow.flow.CausalMaskedDiffWithXvec
    input_size: 32
    output_size: 80
    spk_embed_dim: 192
    output_type: 'mel'
    vocab_size: 6561
    encoder: !new:cosyvoice2.transformer.upsample_encoder_v2.UpsampleConformerEncoderV2
        input_size: 32
        output_size: 32
        input_layer: 'linear'
        pre_lookahead_len: 3
        num_blocks: 2
        num_up_blocks: 2
        up_stride: 2
        up_scale_factor: 2
        attention_heads: 2
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        key_bias: true
        linear_units: 64
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.1
        normalize_before: true
    decoder: !new:cosyvoice2.flow.flow_matching.CausalConditionalCFM
        inference_cfg_rate: 0.7
        estimator: !new:cosyvoice2.flow.decoder_dit.DiT
            in_channels: 320
            out_channels: 80
            mlp_ratio: 2.0
            depth: 2
            num_heads: 2
            head_dim: 32
            hidden_size: 64
"""

HIFT_YAML = """\
sample_rate: 24000
hift: !new:cosyvoice.hifigan.generator.CausalHiFTGenerator
    in_channels: 80
    base_channels: 32
    nb_harmonics: 8
    sampling_rate: !ref <sample_rate>
    nsf_alpha: 0.1
    nsf_sigma: 0.003
    nsf_voiced_threshold: 10
    upsample_rates: [8, 5, 3]
    upsample_kernel_sizes: [16, 11, 7]
    istft_params:
        n_fft: 16
        hop_len: 4
    resblock_kernel_sizes: [3, 7, 11]
    resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    source_resblock_kernel_sizes: [7, 7, 11]
    source_resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    lrelu_slope: 0.1
    audio_limit: 0.99
    conv_pre_look_right: 4
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.CausalConvRNNF0Predictor
        num_class: 1
        in_channels: 80
        cond_channels: 32
feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: 1920
    num_mels: 80
    sampling_rate: !ref <sample_rate>
    hop_size: 480
    win_size: 1920
    fmin: 0
    fmax: 8000
    center: False
"""

NOISE_FRAMES = 400       # of the CFM's fixed noise buffer (the real one holds 30000)
TABLE_SAMPLES = 24000    # of the causal vocoder's noise table (the real one holds 300 s)


def perturb(module, gen, scale=1.0):
    """Seeded noise in every parameter (the reference initializes the adaLN and output layers to
    zero, which would make the estimator trivial)."""
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            if p.dim() == 1:
                base = 1.0 if (name.endswith("weight") or name.endswith("original0") or name.endswith("alpha")) else 0.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = int(np.prod(p.shape[1:]))
                p.copy_(scale * torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))


def voiced_f0(pred):
    """F0 around 100-250 Hz, so that both the voiced (> 10 Hz) and unvoiced paths are taken."""
    with torch.no_grad():
        pred.classifier.weight.mul_(4000.0)
        pred.classifier.bias.fill_(100.0)


def build(out_dir):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(4321)
    rng = np.random.default_rng(7)
    assets = os.path.join(out_dir, "token2wav")
    os.makedirs(assets, exist_ok=True)
    with open(os.path.join(assets, "flow.yaml"), "w") as fh:
        fh.write(FLOW_YAML)
    with open(os.path.join(assets, "config.yaml"), "w") as fh:
        fh.write(HIFT_YAML)

    # ---------------- flow ----------------
    flow = _load_config(os.path.join(assets, "flow.yaml"))["flow"].eval()
    perturb(flow, gen)
    torch.save(flow.state_dict(), os.path.join(assets, "flow.pt"))
    cfm, dit = flow.decoder, flow.decoder.estimator
    hidden, depth = dit.in_proj.out_features, len(dit.blocks)
    heads, hd = dit.blocks[0].attn.num_heads, dit.blocks[0].attn.head_dim
    # the package sizes these scratch buffers for the real dimensions; resize them for tiny ones
    cfm.cnn_cache_buffer = torch.zeros(16, depth, 2, 2 * hidden, 2)
    cfm.att_cache_buffer = torch.zeros(16, depth, 2, heads, 1000, 2 * hd)
    dit.cnn_cache_buffer = torch.zeros(depth, 2, 2 * hidden, 2)
    dit.att_cache_buffer = torch.zeros(depth, 2, heads, 1000, 2 * hd)
    noise = torch.randn(1, 80, NOISE_FRAMES, generator=gen)
    cfm.rand_noise = noise

    io, meta = {"cfm_noise": noise[0].numpy()}, {}
    prompt_tokens = [int(v) for v in rng.integers(0, 6561, 20)]
    prompt_mel = torch.from_numpy((rng.standard_normal((1, 40, 80)) * 2.0 - 5.0).astype(np.float32))
    spk = torch.from_numpy(rng.standard_normal((1, 192)).astype(np.float32))
    io["prompt_mel"] = prompt_mel[0].numpy()
    io["spk"] = spk[0].numpy()
    meta["prompt_tokens"] = prompt_tokens

    # chunks: [3 left context + 25 new] x 4, then a last chunk of [3 + 9]; the first chunk's left
    # context is the silence code
    codes = [int(v) for v in rng.integers(0, 6561, 25 * 4 + 9)]
    payloads, prev = [], [SILENCE] * 3
    pos = 0
    for n in [25, 25, 25, 25, 9]:
        new = codes[pos:pos + n]
        payloads.append(prev + new)
        prev = (prev + new)[-3:]
        pos += n
    meta["payloads"] = payloads

    with torch.no_grad():
        tokens = torch.tensor([prompt_tokens + [SILENCE] * 3])
        cache = flow.setup_cache(tokens, prompt_mel, spk, n_timesteps=10)
        for k, v in cache.items():
            if k == "estimator_cnn_cache":
                v = v[:10]
            if k == "estimator_att_cache":
                v = v[[0, 9]]  # the first and last Euler steps (kept small)
            io[f"setup_{k}"] = v.clone().numpy()

        # one estimator step in isolation (chunk 0's first Euler step)
        t = torch.tensor([0.0, 0.0])
        x = torch.from_numpy(rng.standard_normal((2, 80, 25)).astype(np.float32))
        mu = torch.from_numpy(rng.standard_normal((2, 80, 25)).astype(np.float32))
        spks = torch.from_numpy(rng.standard_normal((2, 80)).astype(np.float32))
        cond = torch.zeros(2, 80, 25)
        t = torch.tensor([0.3, 0.3])
        att0 = cache["estimator_att_cache"][0].clone()
        cnn0 = cache["estimator_cnn_cache"][0].clone()
        v, ncnn, natt = dit.forward_chunk(x, mu, t, spks, cond, cnn0, att0)
        io["dit_x"], io["dit_mu"], io["dit_spks"] = x.numpy(), mu.numpy(), spks.numpy()
        io["dit_out"] = v.clone().numpy()
        io["dit_new_cnn"] = ncnn.clone().numpy()
        io["dit_new_att"] = natt.clone().numpy()
        meta["dit_t"] = 0.3

        # the stream: Token2wav.stream's flow part and trimming, then the causal vocoder
        stub = types.SimpleNamespace(stream_cache=cache, flow=flow,
                                     CONFORMER_HISTORY_FRAMES=Token2wav.CONFORMER_HISTORY_FRAMES)
        for i, p in enumerate(payloads):
            last = i == len(payloads) - 1
            mel, stub.stream_cache = flow.inference_chunk(torch.tensor([p]), spk, stub.stream_cache,
                                                          last_chunk=last, n_timesteps=10)
            if i == 0:
                # the encoder's part of chunk 0 on its own
                h, _, _ = flow.encoder.forward_chunk(flow.input_embedding(torch.tensor([p])), False,
                                                     cache["conformer_cnn_cache"], cache["conformer_att_cache"])
                io["chunk0_mu"] = flow.encoder_proj(h)[0].numpy()
            Token2wav._trim_estimator_cache(stub, prompt_mel.shape[1])
            Token2wav._trim_conformer_cache(stub, prompt_mel.shape[1])
            io[f"chunk{i}_mel"] = mel[0].clone().numpy()
            io[f"chunk{i}_estimator_att_len"] = np.array([stub.stream_cache["estimator_att_cache"].shape[4]], np.float32)
        io["final_conformer_att_cache"] = stub.stream_cache["conformer_att_cache"].clone().numpy()

    # ---------------- causal vocoder (minicpmo-utils 1.0.7 streaming) ----------------
    cfg = _load_config(os.path.join(assets, "config.yaml"), {"hifigan": None})
    hift = cfg["hift"].eval()
    perturb(hift, gen, scale=0.4)
    voiced_f0(hift.f0_predictor)
    torch.save(hift.state_dict(), os.path.join(assets, "hift.pt"))
    osc = hift.m_source.l_sin_gen
    osc.sine_waves = torch.rand(1, TABLE_SAMPLES, 9, generator=gen)
    io["vocoder_noise_table"] = osc.sine_waves[0].numpy()
    bounded = BoundedVocoder(hift)
    meta["vocoder_limits"] = {k: int(v) for k, v in bounded.limits.items()}
    vstub = types.SimpleNamespace(bounded_vocoder=bounded, hift_cache_dict=bounded.cache,
                                  source_cache_len=8 * 480)
    vstub.hift_cache_dict["first_chunk"] = torch.ones(1, dtype=torch.long)
    with torch.no_grad():
        for i in range(len(payloads)):
            last = i == len(payloads) - 1
            mel = torch.from_numpy(io[f"chunk{i}_mel"])[None]
            speech = Token2wav._stream_vocode(vstub, mel, last)
            io[f"chunk{i}_audio"] = speech[0].numpy()
        # one bounded-vocoder step on its own: the F0 of a mel block
        melx = torch.from_numpy(io["chunk1_mel"])[None].double()
        io["f0_block"] = hift.f0_predictor(melx[:, :, :30], finalize=False).float()[0].numpy()

    # ---------------- original HiFT (whole utterance) ----------------
    orig = HiFTGenerator(base_channels=32).eval()
    # the original F0 predictor's width is fixed at 512 by its class; shrink it like the rest
    from stepaudio2.flashcosyvoice.modules.hifigan import ConvRNNF0Predictor
    orig.f0_predictor = ConvRNNF0Predictor(num_class=1, in_channels=80, cond_channels=32)
    perturb(orig, gen, scale=0.4)
    voiced_f0(orig.f0_predictor)
    torch.save({"generator." + k: v for k, v in orig.state_dict().items()}, os.path.join(assets, "hift_original.pt"))
    with torch.no_grad():
        mel = torch.from_numpy(np.concatenate([io[f"chunk{i}_mel"] for i in range(2)], 1))[None]
        f0 = orig.f0_predictor(mel)
        io["orig_mel"] = mel[0].numpy()
        io["orig_f0"] = f0[0].numpy()
        # the source with its random parts switched off (zero initial phase, zero noise), so the
        # deterministic path can be compared; the random parts are drawn from a seed in antiphon
        src_mod = orig.m_source
        real_rand, real_randn = torch.rand, torch.randn_like
        torch.rand = lambda *a, **k: torch.zeros(*a, **{kk: vv for kk, vv in k.items() if kk in ("device", "dtype")})
        torch.randn_like = lambda x, **k: torch.zeros_like(x)
        try:
            s = orig.f0_upsamp(f0[:, None]).transpose(1, 2)
            s, _, _ = src_mod(s)
            s = s.transpose(1, 2)
        finally:
            torch.rand, torch.randn_like = real_rand, real_randn
        io["orig_source"] = s[0].numpy()
        io["orig_audio"] = orig.decode(x=mel, s=s)[0].numpy()

    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in io.items()},
              os.path.join(out_dir, "io.safetensors"))
    with open(os.path.join(out_dir, "io.json"), "w") as fh:
        json.dump(meta, fh, indent=1, sort_keys=True)


if __name__ == "__main__":
    fixturecheck.main(build, OUT)
