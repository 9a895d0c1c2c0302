#!/usr/bin/env bash
# Writes a configuration variant: BASE with [engine] keys set, for scripts/gpu-ab.sh and
# scripts/gpu-profile-ab.sh.
#
#   scripts/engine-variant.sh BASE OUT "key=value,key=value"
#
# A key the file sets is replaced; another one is added under [engine]. An empty list copies BASE.
set -euo pipefail
base=$1 out=$2 sets=${3:-}
cp "$base" "$out"
[ -n "$sets" ] || exit 0
IFS=',' read -ra kvs <<< "$sets"
for kv in "${kvs[@]}"; do
  k=${kv%%=*}
  if grep -q "^$k = " "$out"; then
    sed -i "s|^$k = .*|$k = ${kv#*=}|" "$out"
  else
    sed -i "s|^\[engine\]$|[engine]\n${k} = ${kv#*=}|" "$out"
  fi
done
