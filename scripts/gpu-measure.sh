#!/usr/bin/env bash
# One whole measurement on the GPU machine, as one command: unpack the CUDA binary built by
# scripts/build-cuda.sh, start the server on configs/minicpmo45-synthetic.toml (full-size synthetic
# weights made on the GPU, bf16), wait until it is warm (weights, kernel JIT, one request through
# all stages), run the bench on each workload, snapshot /metrics after each (per-stage step times),
# and pack everything into $OUT/results.tgz (+ the server log). Before the server: the parity
# fixtures on the GPU (PARITY=1) and each stage's step timed alone (PROFILE=1, antiphon profile;
# PROFILE_ONLY= picks rows by name, as `--only`). BINARY= picks another packed binary than
# .device/antiphon.xz (the A/B of two builds: scripts/gpu-ab.sh twice, OUT and BINARY apart).
#
#   OUT=/some/dir WORKLOADS="tts clone" LEVELS=1,2,4,8,16,32 REQUESTS=16 scripts/gpu-measure.sh
#
# LEVELS_<workload> and REQUESTS_<workload> (e.g. LEVELS_duplex=32,64) override them for one
# workload; a workload written `name@levels:requests` (e.g. `tts@1,8:32 tts@64:64`) runs at its own
# levels and requests, into $RES/name-levels.
#
# RATES=2,4,8 then runs the open-loop conversations workload (Poisson arrivals at each rate;
# CONVERSATIONS per rate, default 120, of TURNS text turns, default 3, THINK_MS apart, default 1000)
# into $RES/conversations; BENCH_TIMEOUT bounds all the rates together (each rate's outputs are
# written when it ends).
#
# Memory: the server's resident set and its GPU memory go to memory.txt when it is warm and after
# each workload; SOAK_ROUNDS=n then runs n more rounds of conversations (SOAK_LEVEL sessions of
# SOAK_TURNS turns each, tts) and snapshots after each, to show whether memory comes back.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/antiphon-gpu}
WORKLOADS=${WORKLOADS:-"tts clone"}
LEVELS=${LEVELS:-1,2,4,8,16,32}
REQUESTS=${REQUESTS:-16}
WARMUP=${WARMUP:-2}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-240}
CONFIG=${CONFIG:-configs/minicpmo45-synthetic.toml}
EXTRA=${EXTRA:-}
RES=/tmp/antiphon-results
rm -rf "$RES" && mkdir -p "$RES" "$OUT"
SP=$(python3 -c 'import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0]))' 2>/dev/null || true)
export LD_LIBRARY_PATH=${SP:+$SP/nvidia/cu13/lib:}/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
xz -dc "${BINARY:-.device/antiphon.xz}" > /tmp/antiphon && chmod +x /tmp/antiphon
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > "$RES/gpu.txt" 2>&1
cat "$RES/gpu.txt"
# the bench's label names the card the numbers came from
GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
date -u +%FT%TZ > "$RES/date.txt"
# correctness first: the parity fixtures on the GPU (f32 <= 1e-3 relative), if they were built
# (and the pooled / mixed Code2Wav steps against streams alone, tests/integration/flow_slots.rs, on
# CUDA): the modules of the one integration-test binary (or, from a build before it, one binary each)
# (either kind present: `ls` of both failed once the build had removed the old per-binary files)
if [ "${PARITY:-1}" = 1 ] && { [ -f .device/integration.xz ] || compgen -G ".device/parity_*.xz" > /dev/null; }; then
  [ -f .device/integration.xz ] && xz -dc .device/integration.xz > /tmp/integration && chmod +x /tmp/integration
  for t in ${PARITY_MODULES:-parity_lm parity_c2w parity_prompt parity_stream flow_slots}; do
    if [ -f .device/integration.xz ]; then
      run=(/tmp/integration "$t::")
    elif [ -f ".device/$t.xz" ]; then
      xz -dc ".device/$t.xz" > "/tmp/$t" && chmod +x "/tmp/$t"
      run=("/tmp/$t")
    else
      continue
    fi
    ANTIPHON_TEST_DEVICE=cuda ANTIPHON_REPO=$PWD timeout "${PARITY_TIMEOUT:-150}" "${run[@]}" --test-threads 1 > "$RES/parity-$t.txt" 2>&1
    echo "$t: $(grep -E '^test result' "$RES/parity-$t.txt" || echo "DID NOT RUN: $(tail -2 "$RES/parity-$t.txt")")"
    cat "$RES/parity-$t.txt" >> "$RES/parity.txt"
  done
  grep -E "relative error|FAILED|panicked" "$RES/parity.txt" | sort | uniq -c | sort -rn | head -5
fi
# each stage's step alone (antiphon profile), before the server takes the GPU
if [ "${PROFILE:-1}" = 1 ]; then
  timeout "${PROFILE_TIMEOUT:-200}" /tmp/antiphon profile --config "$CONFIG" --iters "${PROFILE_ITERS:-8}" --batch "${PROFILE_BATCH:-1,8,32}" ${PROFILE_ONLY:+--only "$PROFILE_ONLY"} --out "$RES/profile.json" \
    > "$RES/profile.txt" 2>&1
  grep -E "B=" "$RES/profile.txt"
fi
# the server's resident set (VmRSS) and the GPU memory its process holds
mem() {
  local rss gpu
  rss=$(awk '/VmRSS/ {print $2 / 1024}' "/proc/$SERVER/status" 2>/dev/null)
  gpu=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null | awk -F', ' -v p="$SERVER" '$1 == p {print $2}')
  echo "$1: rss ${rss:-?} MiB, gpu ${gpu:-?} MiB" | tee -a "$RES/memory.txt"
}
t0=$(date +%s)
RUST_LOG=${SERVER_LOG:-info,tower_http=warn} /tmp/antiphon serve --config "$CONFIG" --listen 127.0.0.1:8080 > "$RES/server.log" 2>&1 &
SERVER=$!
ready=0
for i in $(seq 1 600); do
  if curl -sf http://127.0.0.1:8080/readyz > /dev/null; then ready=1; break; fi
  if ! kill -0 $SERVER 2>/dev/null; then break; fi
  sleep 0.5
done
echo "ready=$ready after $(( $(date +%s) - t0 )) s" | tee "$RES/startup.txt"
grep -E "warm-up|loading|listening|error|panic" "$RES/server.log" | tail -5
if [ $ready = 1 ]; then
  curl -sf http://127.0.0.1:8080/api/build_info > "$RES/build_info.json"
  curl -sf http://127.0.0.1:8080/metrics > "$RES/metrics-0-warm.txt"
  mem "warm"
  for spec in $WORKLOADS; do
    # (LEVELS_<workload> / REQUESTS_<workload>, e.g. LEVELS_duplex=32,64, override them for one;
    # a workload written `tts@64:128` runs at those levels with that many requests, into tts-64)
    w=${spec%%@*}
    lv="LEVELS_${w//-/_}"; lv=${!lv:-$LEVELS}
    rq="REQUESTS_${w//-/_}"; rq=${!rq:-$REQUESTS}
    name=$w
    if [ "$spec" != "$w" ]; then
      rest=${spec#*@}; lv=${rest%%:*}
      if [ "$rest" != "$lv" ]; then rq=${rest#*:}; fi
      name="$w-${lv//,/-}"
    fi
    echo "== $w at C=$lv, $rq requests ($(( $(date +%s) - t0 )) s)"
    timeout "$BENCH_TIMEOUT" /tmp/antiphon bench --url ws://127.0.0.1:8080/v1/realtime --workload "$w" \
      --concurrency "$lv" --requests "$rq" --warmup "$WARMUP" --no-progress --timeout-s 120 \
      --label "${GPU_NAME:-unknown GPU}, full-size synthetic bf16, $CONFIG" --out "$RES/$name" $EXTRA 2>&1 | tail -12
    curl -sf http://127.0.0.1:8080/metrics > "$RES/metrics-$name.txt"
    mem "after $name"
  done
  if [ -n "${RATES:-}" ]; then
    echo "== conversations at $RATES/s ($(( $(date +%s) - t0 )) s)"
    timeout "$BENCH_TIMEOUT" /tmp/antiphon bench --url ws://127.0.0.1:8080/v1/realtime --workload conversations \
      --rates "$RATES" --conversations "${CONVERSATIONS:-120}" --turns "${TURNS:-3}" --think-ms "${THINK_MS:-1000}" --no-progress --timeout-s 120 \
      --label "${GPU_NAME:-unknown GPU}, full-size synthetic bf16, $CONFIG" --out "$RES/conversations" $EXTRA 2>&1 | tail -12
    curl -sf http://127.0.0.1:8080/metrics > "$RES/metrics-conversations.txt"
    mem "after conversations"
  fi
  for r in $(seq 1 "${SOAK_ROUNDS:-0}"); do
    n=$(( ${SOAK_LEVEL:-8} * ${SOAK_TURNS:-15} ))
    timeout "$BENCH_TIMEOUT" /tmp/antiphon bench --url ws://127.0.0.1:8080/v1/realtime --workload tts \
      --concurrency "${SOAK_LEVEL:-8}" --requests "$n" --warmup 0 --no-progress --timeout-s 120 \
      --label "soak round $r" --out "$RES/soak-$r" 2>&1 | tail -3
    mem "after soak round $r ($n turns over ${SOAK_LEVEL:-8} sessions)"
  done
  nvidia-smi --query-gpu=memory.used --format=csv >> "$RES/gpu.txt" 2>&1
fi
kill -TERM $SERVER 2>/dev/null; sleep 2; kill -9 $SERVER 2>/dev/null
# with every step logged (SERVER_LOG=...,antiphon_engine=debug): where the stages' time went, in the
# results (the device returns 8 files a call: no file of its own)
if [[ "${SERVER_LOG:-}" == *antiphon_engine=debug* ]]; then
  python3 scripts/steplog.py "$RES/server.log" > "$RES/steplog.txt" 2>&1 && head -24 "$RES/steplog.txt"
fi
cp "$RES/server.log" "$OUT/server.log" 2>/dev/null
tar czf "$OUT/results.tgz" -C /tmp antiphon-results
echo "done in $(( $(date +%s) - t0 )) s"
