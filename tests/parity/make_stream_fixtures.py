#!/usr/bin/env python3
"""Parity fixtures for the Talker's turn-mode streaming (text chunks, `engine.talker.text_chunk`).

The reference is the model authors' own streaming generator: `TTSStreamingGenerator` in
`MiniCPMO45/utils.py` of OpenBMB's minicpm-o-4_5-pytorch-simple-demo (not on PyPI: point
MINICPMO_DEMO at a checkout of it; nothing of it is copied here). It runs the Talker of the
`parity_lm` fixture checkpoint (built by make_lm_fixtures.py, loaded back here) in the checkpoint's
attention mode, `sliding_recompute`, over three text chunks of one reply (10, 10 and 3 rows, the
last one ending the text). Every call it makes into the Llama backbone is recorded: the input
embeddings and positions of each chunk's prefill (the window: the chunk before, its codes, this
chunk), and the logits of the last row of every call. The codes it sampled are saved too, so the
Rust side can feed the same codes and compare every step.

    tests/fixtures/parity_stream/io.safetensors   chunk rows, windows, logits
    tests/fixtures/parity_stream/io.json          chunk ids, codes, positions, sizes

Run from the repository root:
    MINICPMO_DEMO=/path/to/minicpm-o-4_5-pytorch-simple-demo python3 tests/parity/make_stream_fixtures.py
    MINICPMO_DEMO=... python3 tests/parity/make_stream_fixtures.py --check
"""
import importlib.util
import json
import os
import sys
import types

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.numpy import load_file, save_file

sys.path.insert(0, os.path.dirname(__file__))
import fixturecheck  # noqa: E402
from make_lm_fixtures import LLM, TTS, Talker  # noqa: E402

HERE = os.path.dirname(__file__)
CHECKPOINT = os.path.join(HERE, "..", "fixtures", "parity_lm")
OUT = os.path.join(HERE, "..", "fixtures", "parity_stream")
CHUNKS = [10, 10, 3]
# codes per text chunk at most (the reference's `max_new_token`; 500 in the demo, small here so
# that every chunk ends within the fixture)
MAX_NEW = 6


def reference_module():
    demo = os.environ.get("MINICPMO_DEMO")
    if not demo:
        sys.exit("MINICPMO_DEMO: the path of a checkout of OpenBMB/minicpm-o-4_5-pytorch-simple-demo")
    path = os.path.join(demo, "MiniCPMO45", "utils.py")
    spec = importlib.util.spec_from_file_location("minicpmo45_utils", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_talker():
    talker = Talker().eval()
    tensors = {}
    for f in sorted(os.listdir(CHECKPOINT)):
        if f.startswith("model-") and f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(CHECKPOINT, f)))
    state = {k[len("tts."):]: torch.from_numpy(v) for k, v in tensors.items() if k.startswith("tts.")}
    talker.load_state_dict(state, strict=True)
    return talker


class Recorder:
    """Every backbone call and the logits of its last row, in order."""

    def __init__(self):
        self.calls = []

    def backbone(self, model):
        rec = self

        class Backbone(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = model
                # what the generator reads of the backbone's config (rope_theta for `reindex` only)
                self.config = types.SimpleNamespace(rope_theta=10000.0, hidden_size=TTS["hidden_size"],
                                                    num_attention_heads=TTS["num_attention_heads"])

            def forward(self, position_ids, past_key_values, inputs_embeds, use_cache):
                out = self.inner(position_ids=position_ids, past_key_values=past_key_values,
                                 inputs_embeds=inputs_embeds, use_cache=use_cache)
                rec.calls.append({"embeds": inputs_embeds[0].detach().clone(),
                                  "positions": position_ids[0].tolist(), "fresh": past_key_values is None})
                return out

        return Backbone()

    def head(self, head):
        rec = self

        class Head(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = head

            def forward(self, hidden):
                logits = self.inner(hidden)
                rec.calls[-1]["logits"] = logits[0, -1].detach().clone()
                return logits

        return Head()


def build(out_dir):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    rng = np.random.default_rng(7)
    ref = reference_module()
    talker = load_talker()
    rec = Recorder()
    # the attributes of MiniCPMTTS that TTSStreamingGenerator reads, over the fixture's Talker
    tts = torch.nn.Module()
    tts.device = torch.device("cpu")
    tts.num_vq = 1
    tts.num_audio_tokens = TTS["num_audio_tokens"]
    tts.recomputed_chunks = 1
    tts.attention_type = "sliding_recompute"
    tts.chunk_window_size = 2
    tts.token_window_size = 300
    tts.emb_code = talker.emb_code
    tts.emb_text = talker.emb_text
    tts.head_code = torch.nn.ModuleList([rec.head(talker.head_code[0])])
    tts.model = rec.backbone(talker.model)
    tts.audio_bos_token_id = TTS["audio_bos_token_id"]
    tts.config = types.SimpleNamespace(text_eos_token_id=TTS["text_eos_token_id"])
    eos = TTS["num_audio_tokens"] - 1

    io, meta = {}, {"chunks": [], "max_new": MAX_NEW, "eos": eos}
    with torch.no_grad():
        gen = ref.TTSStreamingGenerator(tts, temperature=0.8, eos_token=eos, chunk_size=25)
        torch.manual_seed(11)
        for k, n in enumerate(CHUNKS):
            last = k == len(CHUNKS) - 1
            ids = [int(v) for v in rng.integers(0, 280, n)]
            hidden = torch.from_numpy(rng.standard_normal((n, LLM["hidden_size"])).astype(np.float32) * 2.0)
            # a chunk's rows, as the caller of the generator makes them
            p = talker.projector_semantic.linear2(F.relu(talker.projector_semantic.linear1(hidden)))
            rows = talker.emb_text(torch.tensor(ids)) + F.normalize(p, p=2, dim=-1)
            first_call = len(rec.calls)
            before = len(gen.all_generated_tokens)
            for _ in gen.generate_with_buffer(rows[None], text_finished=last, max_new_token=MAX_NEW):
                pass
            codes = [int(t.item()) for t in gen.all_generated_tokens[before:]]
            calls = rec.calls[first_call:]
            io[f"chunk{k}_hidden"] = hidden.numpy()
            io[f"chunk{k}_window"] = calls[0]["embeds"].numpy()
            io[f"chunk{k}_logits"] = torch.stack([c["logits"] for c in calls]).numpy()
            meta["chunks"].append({"ids": ids, "last": last, "codes": codes, "steps": len(calls),
                                   "fresh": calls[0]["fresh"], "positions": [c["positions"] for c in calls]})

    os.makedirs(out_dir, exist_ok=True)
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in io.items()},
              os.path.join(out_dir, "io.safetensors"))
    with open(os.path.join(out_dir, "io.json"), "w") as fh:
        json.dump(meta, fh, indent=1, sort_keys=True)


if __name__ == "__main__":
    fixturecheck.main(build, OUT)
