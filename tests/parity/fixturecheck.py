"""The command line every fixture script shares: write the fixtures, or (--check) build them again
in a temporary folder and report every file or array that differs."""
import argparse
import os
import shutil
import sys
import tempfile

import numpy as np


def _same(a, b):
    if a.endswith(".safetensors"):
        from safetensors.numpy import load_file
        ta, tb = load_file(a), load_file(b)
        return ta.keys() == tb.keys() and all(np.array_equal(ta[k], tb[k]) for k in ta)
    if a.endswith(".pt"):
        import torch
        ta, tb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
        return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    if a.endswith(".onnx"):
        import onnx
        from onnx import numpy_helper
        ia = {i.name: numpy_helper.to_array(i) for i in onnx.load(a).graph.initializer}
        ib = {i.name: numpy_helper.to_array(i) for i in onnx.load(b).graph.initializer}
        return ia.keys() == ib.keys() and all(np.array_equal(ia[k], ib[k]) for k in ia)
    return open(a, "rb").read() == open(b, "rb").read()


def main(build, out):
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="regenerate into a temp dir and compare")
    if not ap.parse_args().check:
        build(out)
        print("wrote", os.path.abspath(out))
        return
    tmp = tempfile.mkdtemp()
    try:
        build(tmp)
        bad = 0
        for root, _, files in os.walk(out):
            for f in sorted(files):
                a = os.path.join(root, f)
                b = os.path.join(tmp, os.path.relpath(a, out))
                if not os.path.exists(b) or not _same(a, b):
                    print("differs:", os.path.relpath(a, out))
                    bad += 1
        print("fixtures reproduce" if bad == 0 else f"{bad} differences")
        sys.exit(1 if bad else 0)
    finally:
        shutil.rmtree(tmp)
