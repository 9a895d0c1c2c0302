#!/usr/bin/env bash
# Each stage's step timed alone (`antiphon profile`) with several binaries and configurations in
# one GPU call: the A/B of a kernel change that has no [engine] key (two builds), or of one that
# has (one build, two configurations).
#
#   OUT=/some/dir RUNS="base:.device/antiphon-base.xz new:.device/antiphon.xz inplace:.device/antiphon.xz:code2wav.pool_attention=\"in_place\"" \
#     PROFILE_ONLY="steady chunk, graphs (server config)" PROFILE_BATCH=1,8,32 scripts/gpu-profile-ab.sh
#
# A run is `name:binary.xz` or `name:binary.xz:key=value,key=value` ([engine] keys, as in
# scripts/gpu-ab.sh). Results: $OUT/profile-<name>.{txt,json}; the B= rows are printed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/antiphon-gpu}
BASE=${CONFIG:-configs/minicpmo45-synthetic.toml}
mkdir -p "$OUT"
SP=$(python3 -c 'import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0]))' 2>/dev/null || true)
export LD_LIBRARY_PATH=${SP:+$SP/nvidia/cu13/lib:}/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
for r in ${RUNS:?name:binary.xz[:key=value,...] ...}; do
  IFS=':' read -r name bin sets <<< "$r"
  xz -dc "$bin" > "/tmp/antiphon-$name" && chmod +x "/tmp/antiphon-$name"
  cfg=configs/_profile-$name.toml
  scripts/engine-variant.sh "$BASE" "$cfg" "${sets:-}"
  echo "=== $name: $bin ${sets:-}"
  timeout "${PROFILE_TIMEOUT:-200}" "/tmp/antiphon-$name" profile --config "$cfg" --iters "${PROFILE_ITERS:-8}" \
    --batch "${PROFILE_BATCH:-1,8,32}" ${PROFILE_ONLY:+--only "$PROFILE_ONLY"} --out "$OUT/profile-$name.json" \
    > "$OUT/profile-$name.txt" 2>&1
  grep -E "B=" "$OUT/profile-$name.txt" || tail -3 "$OUT/profile-$name.txt"
  rm -f "$cfg"
done
