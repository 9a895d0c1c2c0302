#!/usr/bin/env bash
# Builds the CUDA binary on a machine without a GPU (the toolchain: scripts/cuda-env.sh).
# Output: .device/antiphon.xz (git-ignored), ready to be carried to the GPU machine with the
# measurement script.
#
#   scripts/build-cuda.sh            # then: scripts/gpu-measure.sh on the GPU machine
set -euo pipefail
cd "$(dirname "$0")/.."
# the bundled libopus builds with cmake (a fresh machine has none)
if ! command -v cmake > /dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq cmake
fi
source scripts/cuda-env.sh
# the revision /api/build_info reports, marked `-dirty` when the tree has uncommitted changes
# (a measurement then names a build no commit holds)
ANTIPHON_GIT=$(git describe --always --dirty --abbrev=7 2>/dev/null || echo unknown)
export ANTIPHON_GIT
cargo build --release --features cuda --bin antiphon
mkdir -p .device
strip -o .device/antiphon "$CARGO_TARGET_DIR/release/antiphon"
xz -T0 -6 -f .device/antiphon
# the parity tests, to run against the fixtures on the GPU (ANTIPHON_TEST_DEVICE=cuda)
if [ "${PARITY:-1}" = 1 ]; then
  for t in parity_lm parity_c2w parity_prompt parity_stream flow_slots; do
    exe=$(cargo test --release --features cuda --test $t --no-run --message-format=json 2>/dev/null \
      | python3 -c 'import json,sys; t=sys.argv[1]; print([m["executable"] for m in map(json.loads, sys.stdin) if m.get("executable") and m["target"]["name"] == t and "test" in m["target"]["kind"]][-1])' "$t")
    strip -o .device/$t "$exe"
    xz -T0 -6 -f .device/$t
  done
fi
ls -l .device/
