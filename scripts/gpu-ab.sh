#!/usr/bin/env bash
# Several engine configurations measured in one GPU call, one server each (scripts/gpu-measure.sh
# per variant, the same workloads): the A/B of a change that ships behind an [engine] key.
#
#   OUT=/some/dir VARIANTS="base mixed:code2wav.mixed_steps=true apart:code2wav.mixed_steps=true,code2wav.first_chunks_apart=true" \
#     WORKLOADS=" " RATES=4,8 PARITY=0 PROFILE=0 scripts/gpu-ab.sh
#
# A variant is `name` (the configuration as it is) or `name:key=value,key=value` ([engine] keys:
# a key the file sets is replaced, another one is added under [engine]). Every other variable goes
# to gpu-measure.sh as it is (CONFIG picks the base file), but the parity tests (PARITY) run
# before the first variant only. Results: $OUT/<name>/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/antiphon-gpu}
BASE=${CONFIG:-configs/minicpmo45-synthetic.toml}
# ROUNDS=n measures the variants n times over, alternating (A B A B: a difference smaller than one
# machine's spread shows as such); round k > 1 goes to $OUT/<name>.k
for round in $(seq 1 "${ROUNDS:-1}"); do
  for v in ${VARIANTS:-base}; do
    name=${v%%:*}
    cfg=configs/_ab-$name.toml
    sets=""
    [ "$v" = "$name" ] || sets=${v#*:}
    scripts/engine-variant.sh "$BASE" "$cfg" "$sets"
    echo "=== variant $name, round $round: $(grep -E "^($(echo "${v#*:}" | sed 's/=[^,]*//g; s/[a-z0-9_]*\.//g; s/,/|/g')) = " "$cfg" | tr '\n' ' ')"
    dir=$OUT/$name
    [ "$round" = 1 ] || dir=$OUT/$name.$round
    OUT=$dir CONFIG=$cfg scripts/gpu-measure.sh
    rm -f "$cfg"
    export PARITY=0
  done
done
