#!/usr/bin/env python3
"""Runs README.md's "Running on a MiniCPM-o 4.5 checkpoint" commands verbatim against a generated
checkpoint, and checks that the server they start serves the demo at `/`.

    python3 tests/readme/checkpoint_recipe.py --checkpoint DIR [--voice WAV]

DIR is a checkpoint in the published layout (`antiphon synth-checkpoint --out DIR --preset tiny`
writes one; the published one also holds `assets/HT_ref_audio.wav`, which --voice supplies). The
recipe's shell block is read from the README, so the test follows the README: each command is run
as written, from the repository root, with bash. Between the `cp` and the rest it makes the edit
the recipe asks for (`model.path` and the voice's wav); because CI has no GPU it also sets
`device = "cpu"` (the `--features cuda` build serves on the CPU when asked to). The `serve` command
runs until `/readyz` answers 200; then `/` must be the demo's `web/index.html`, byte for byte, and
the server must stop on SIGTERM.
"""
import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECTION = "## Running on a MiniCPM-o 4.5 checkpoint"


def recipe_commands(readme: str) -> list[str]:
    """The first ```bash block after SECTION, one command a line, comments dropped."""
    at = readme.index(SECTION)
    block = re.search(r"```bash\n(.*?)```", readme[at:], re.S)
    if block is None:
        sys.exit(f"README.md: no bash block after {SECTION!r}")
    cmds = [line.split("  #")[0].strip() for line in block.group(1).splitlines()]
    return [c for c in cmds if c and not c.startswith("#")]


def edit_config(path: str, checkpoint: str, voice: str) -> None:
    """The edit the recipe asks for (model.path, the voice), and the CPU as the device."""
    text = open(path).read()
    edits = [
        (r'(?m)^path = ".*"$', f'path = "{checkpoint}"'),
        (r'(?m)^wav = ".*"$', f'wav = "{voice}"'),
        (r'(?m)^device = ".*"$', 'device = "cpu"'),
    ]
    for pattern, new in edits:
        text, n = re.subn(pattern, new, text)
        if n != 1:
            sys.exit(f"{path}: expected one line matching {pattern!r}, found {n}")
    open(path, "w").write(text)


def listen_port(path: str) -> int:
    m = re.search(r'(?m)^listen = "[^"]*:(\d+)"$', open(path).read())
    if m is None:
        sys.exit(f"{path}: no listen address")
    return int(m.group(1))


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--voice", default=os.path.join(ROOT, "assets/voices/default.wav"))
    ap.add_argument("--ready-timeout", type=float, default=1800.0, help="seconds for the build and the warm-up")
    args = ap.parse_args()
    checkpoint = os.path.abspath(args.checkpoint)
    voice = os.path.join(checkpoint, "assets", "HT_ref_audio.wav")
    if not os.path.exists(voice):
        shutil.copyfile(args.voice, voice)

    cmds = recipe_commands(open(os.path.join(ROOT, "README.md")).read())
    kinds = [c.split()[0] if c.startswith("cp ") else c.split(" -- ")[-1].split()[0] for c in cmds]
    if kinds != ["cp", "check-config", "serve"]:
        sys.exit(f"README.md: the recipe is {cmds}; this test knows cp, check-config, serve")
    copied = cmds[0].split()[2]
    served = None
    try:
        for cmd, kind in zip(cmds, kinds):
            print(f"$ {cmd}", flush=True)
            if kind == "serve":
                served = subprocess.Popen(["bash", "-c", f"exec {cmd}"], cwd=ROOT, start_new_session=True)
                break
            subprocess.run(["bash", "-c", cmd], cwd=ROOT, check=True)
            if kind == "cp":
                edit_config(os.path.join(ROOT, copied), checkpoint, voice)
        port = listen_port(os.path.join(ROOT, copied))
        deadline = time.monotonic() + args.ready_timeout
        while True:
            if served.poll() is not None:
                sys.exit(f"the server of {cmds[2]!r} exited with {served.returncode} before it was ready")
            try:
                if get(f"http://127.0.0.1:{port}/readyz")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                sys.exit(f"the server of {cmds[2]!r} was not ready in {args.ready_timeout} s")
            time.sleep(1)
        status, body = get(f"http://127.0.0.1:{port}/")
        want = open(os.path.join(ROOT, "web", "index.html"), "rb").read()
        if status != 200 or body != want:
            sys.exit(f"GET /: {status}, {len(body)} bytes; the demo's index.html is {len(want)} bytes")
        print(f"GET / on :{port}: the demo's index.html ({len(body)} bytes)", flush=True)
        os.killpg(served.pid, signal.SIGTERM)
        code = served.wait(timeout=60)
        served = None
        if code != 0:
            sys.exit(f"the server exited with {code} on SIGTERM")
        print("the README's checkpoint recipe: check-config passed, the demo served at /, stopped on SIGTERM")
    finally:
        if served is not None and served.poll() is None:
            os.killpg(served.pid, signal.SIGKILL)
        path = os.path.join(ROOT, copied)
        if os.path.exists(path):
            os.remove(path)


if __name__ == "__main__":
    main()
