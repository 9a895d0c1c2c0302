#!/usr/bin/env bash
# Writes a configuration variant: BASE with engine keys set, for scripts/gpu-ab.sh and
# scripts/gpu-profile-ab.sh.
#
#   scripts/engine-variant.sh BASE OUT "key=value,section.key=value"
#
# `key` is a key of [engine], `section.key` one of [engine.section] (thinker, talker, code2wav,
# prefetch, duplex). A key the file sets there is replaced; another one is added to its section
# (the section is added at the end of the file if the file has none). An empty list copies BASE.
set -euo pipefail
base=$1 out=$2 sets=${3:-}
cp "$base" "$out"
[ -n "$sets" ] || exit 0
python3 - "$out" "$sets" <<'PY'
import re, sys
path, sets = sys.argv[1], sys.argv[2]
lines = open(path).read().split("\n")
for kv in sets.split(","):
    key, value = kv.split("=", 1)
    section, _, leaf = key.rpartition(".")
    header = "[engine." + section + "]" if section else "[engine]"
    if header not in lines:
        lines += ["", header]
    start = lines.index(header) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("[")), len(lines))
    at = next((i for i in range(start, end) if re.match(re.escape(leaf) + r" = ", lines[i])), None)
    if at is None:
        lines.insert(start, leaf + " = " + value)
    else:
        lines[at] = leaf + " = " + value
text = "\n".join(lines)
open(path, "w").write(text if text.endswith("\n") else text + "\n")
PY
