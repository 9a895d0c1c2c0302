#!/usr/bin/env bash
# Where the GPU time of chosen `antiphon profile` rows goes, kernel by kernel, on the GPU machine:
# Nsight Compute times every kernel (graph nodes one by one) of the rows' timed runs only (the
# profile marks them with cuProfilerStart/Stop), and the table sums each kernel's time per run.
#
#   OUT=/some/dir ONLY="thinker decode step (graph)" ITERS=3 [BATCH=8] [NCU_ARGS="--launch-count 2000"] scripts/gpu-kernels.sh
#
# ncu runs kernels one at a time with its own overhead between them: the per-kernel times are the
# GPU's, their sum is the time the step would take with no gaps between kernels.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/antiphon-kernels}
ONLY=${ONLY:?rows to profile, e.g. ONLY="thinker decode step (graph)"}
ITERS=${ITERS:-3}
CONFIG=${CONFIG:-configs/minicpmo45-synthetic.toml}
mkdir -p "$OUT"
SP=$(python3 -c 'import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0]))' 2>/dev/null || true)
export LD_LIBRARY_PATH=${SP:+$SP/nvidia/cu13/lib:}/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
[ -x /tmp/antiphon ] || { xz -dc .device/antiphon.xz > /tmp/antiphon && chmod +x /tmp/antiphon; }
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
IFS=';' read -ra rows <<< "$ONLY"
for row in "${rows[@]}"; do
  # (the name's start plus a hash of all of it: rows that share a long prefix keep apart)
  tag=$(echo "$row" | tr -c 'A-Za-z0-9\n' '_' | cut -c1-40)_$(echo "$row" | md5sum | cut -c1-6)
  timeout "${NCU_TIMEOUT:-400}" "$NCU" --profile-from-start off --clock-control none --cache-control none ${NCU_ARGS:-} \
    --metrics gpu__time_duration.sum --print-units base --csv --page raw --log-file "$OUT/ncu-$tag.csv" \
    /tmp/antiphon profile --config "$CONFIG" --iters "$ITERS" --batch "${BATCH:-1}" --only "$row" > "$OUT/profile-$tag.txt" 2>&1
  echo "== $row (ncu exit $?)"
  grep -E "B=" "$OUT/profile-$tag.txt"
  python3 - "$OUT/ncu-$tag.csv" "$ITERS" <<'PY' | tee "$OUT/kernels-$tag.txt"
import csv, sys, collections
path, iters = sys.argv[1], int(sys.argv[2])
lines = [l for l in open(path) if l.startswith('"')]
rows = list(csv.DictReader(lines))
rows = [r for r in rows if r.get("gpu__time_duration.sum", "").replace(".", "").replace(",", "").isdigit()]
unit = "ns"
by = collections.defaultdict(lambda: [0, 0.0])
for r in rows:
    name = r["Kernel Name"].split("(")[0][:90]
    by[name][0] += 1
    by[name][1] += float(r["gpu__time_duration.sum"].replace(",", ""))
total = sum(v[1] for v in by.values())
print(f"{len(rows) / iters:.0f} kernels per run, {total / iters / 1e3:.1f} us of kernel time per run ({unit} from ncu)")
print(f"{'kernel':<90} {'per run':>8} {'us/run':>9} {'avg us':>8} {'share':>6}")
for name, (n, t) in sorted(by.items(), key=lambda kv: -kv[1][1])[:30]:
    print(f"{name:<90} {n / iters:>8.0f} {t / iters / 1e3:>9.1f} {t / n / 1e3:>8.2f} {100 * t / total:>5.1f}%")
PY
done
