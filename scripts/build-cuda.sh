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
# the integration tests (one binary), to run the parity modules against the fixtures on the GPU
# (ANTIPHON_TEST_DEVICE=cuda; scripts/gpu-measure.sh)
if [ "${PARITY:-1}" = 1 ]; then
  rm -f .device/parity_*.xz .device/flow_slots.xz
  exe=$(cargo test --release --features cuda --test integration --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys; print([m["executable"] for m in map(json.loads, sys.stdin) if m.get("executable") and m["target"]["name"] == "integration" and "test" in m["target"]["kind"]][-1])')
  strip -o .device/integration "$exe"
  xz -T0 -6 -f .device/integration
fi
ls -l .device/
