#!/usr/bin/env python3
"""Parity fixtures for semantic turn detection (Smart Turn v3.2, `antiphon_models::smart_turn`).

The reference is pipecat-ai 1.14.0 as CI installs it from PyPI: its vendored Whisper feature
extractor (`pipecat/audio/turn/smart_turn/_whisper_features.py`, which mirrors transformers'
`WhisperFeatureExtractor(chunk_length=8)`) and its bundled model
(`pipecat/audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx`) run by onnxruntime, the way its
`LocalSmartTurnAnalyzerV3._predict_endpoint` runs them: the last 8 s, zero-padded at the front.

The model is an int8 QDQ export. antiphon evaluates it with its activations in float (only the
weights dequantized; `OnnxGraph::with_float_activations` says why), so the reference is
onnxruntime over the same graph with every activation's QuantizeLinear / DequantizeLinear pair
taken out (`float_activations` below). What onnxruntime gives for the graph as shipped (its
integer kernels) is saved beside it as `probability_int8`, for the record: it is not compared.

Inputs: the 16 kHz clips of `assets/turns/` (assets/turns/README.md says how they were made),
each as it is and with 200 ms of silence after it. Saved for each: the model's probability, and
the features' sum and every 1013th value (the features are 64 000 floats a clip).

    tests/fixtures/parity_turn/io.json

Run from the repository root, in a venv with pipecat-ai==1.14.0, onnxruntime and onnx:
    python3 tests/parity/make_turn_fixtures.py           # rewrite the fixture
    python3 tests/parity/make_turn_fixtures.py --check   # regenerate and compare
"""
import glob
import hashlib
import json
import os
import sys
import wave

import numpy as np
import onnx
import onnxruntime as ort
from pipecat.audio.turn.smart_turn import _whisper_features
from pipecat.audio.turn.smart_turn._whisper_features import compute_whisper_log_mel_features

WINDOW = 8 * 16000
TAILS_MS = [0, 200]
STRIDE = 1013
OUT = "tests/fixtures/parity_turn/io.json"


def model_path():
    return os.path.join(os.path.dirname(_whisper_features.__file__), "data", "smart-turn-v3.2-cpu.onnx")


def read_clip(path):
    with wave.open(path) as w:
        assert w.getframerate() == 16000 and w.getnchannels() == 1 and w.getsampwidth() == 2, path
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.float32) / 32768.0


def float_activations(model):
    """The graph without the QuantizeLinear / DequantizeLinear pairs around computed values."""
    g = model.graph
    inits = {t.name for t in g.initializer}
    quantized = {n.output[0]: n.input[0] for n in g.node if n.op_type == "QuantizeLinear" and n.input[0] not in inits}
    same = {n.output[0]: quantized[n.input[0]] for n in g.node if n.op_type == "DequantizeLinear" and n.input[0] in quantized}
    kept = []
    for n in g.node:
        if n.output[0] in quantized or n.output[0] in same:
            continue
        n = onnx.NodeProto.FromString(n.SerializeToString())
        for i, name in enumerate(n.input):
            n.input[i] = same.get(name, name)
        kept.append(n)
    outputs = {o.name for o in g.output}
    # a graph output read back from its quantized copy: an Identity of the float value
    kept += [onnx.helper.make_node("Identity", [same[o]], [o]) for o in outputs if o in same]
    del g.node[:]
    g.node.extend(kept)
    return model


def build():
    path = model_path()
    with open(path, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    sess_int8 = ort.InferenceSession(path, sess_options=so)
    # (onnxruntime's extended optimizations fuse a weight's DequantizeLinear into its MatMul and
    # quantize the activation on the fly, which is the int8 path again: basic ones only)
    fo = ort.SessionOptions()
    fo.intra_op_num_threads = 1
    fo.log_severity_level = 3
    fo.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    sess = ort.InferenceSession(float_activations(onnx.load(path)).SerializeToString(), sess_options=fo)
    cases = []
    for clip in sorted(glob.glob("assets/turns/*.wav")):
        x = read_clip(clip)
        for tail in TAILS_MS:
            z = np.concatenate([x, np.zeros(tail * 16, np.float32)])[-WINDOW:]
            z = np.pad(z, (WINDOW - len(z), 0))
            feats = compute_whisper_log_mel_features(z, do_normalize=True)
            p = sess.run(None, {"input_features": feats[None]})[0]
            p_int8 = sess_int8.run(None, {"input_features": feats[None]})[0]
            flat = feats.reshape(-1)
            cases.append({
                "clip": os.path.basename(clip),
                "tail_ms": tail,
                "probability": float(p.reshape(-1)[0]),
                "probability_int8": float(p_int8.reshape(-1)[0]),
                "features_sum": float(flat.astype(np.float64).sum()),
                "features_every": [float(v) for v in flat[::STRIDE]],
            })
    return {"model": "smart-turn-v3.2-cpu.onnx", "model_sha256": sha, "stride": STRIDE, "cases": cases}


def main():
    fixture = build()
    if "--check" in sys.argv:
        with open(OUT) as f:
            old = json.load(f)
        assert old == fixture, "the fixture differs from a fresh build"
        print(f"{OUT}: matches ({len(fixture['cases'])} cases)")
        return
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(fixture, f, indent=1)
        f.write("\n")
    print(f"wrote {OUT}: {len(fixture['cases'])} cases")


if __name__ == "__main__":
    main()
