#!/usr/bin/env python3
"""Where the stages' time went, from a server log with every step logged.

Run the server with `SERVER_LOG="info,tower_http=warn,antiphon_engine=debug"` (scripts/gpu-ab.sh
passes it on), then:

    scripts/steplog.py server.log            # the last 45 s of the log
    scripts/steplog.py server.log --window 30

It reads the engine's debug lines (`talker step`, `thinker step`, `thinker_prefill step`,
`code2wav batch`, `talker chunk out`) and prints, over the window:
- each stage's busy fraction (the sum of its step times over the window);
- the Thinker's decode steps by streams, and its steps with prompt rows by those rows;
- the Talker's step time by percentile and by streams in the step, and how much of its long steps
  (over 10 ms) and its short ones (up to 3 ms) overlap a Thinker step or a Code2Wav step;
- chunk 0s: their codes (a small first chunk or a full one), the wait from the Talker's send to
  the start of their Code2Wav step, and that step's time.
"""

import argparse
import datetime
import re
import statistics
import sys
from collections import Counter, defaultdict

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def stamp(token):
    return datetime.datetime.strptime(token[:26], "%Y-%m-%dT%H:%M:%S.%f").timestamp()


def percentiles(values, qs=(0.5, 0.9, 0.95, 0.99)):
    v = sorted(values)
    if not v:
        return "-"
    return " / ".join(f"{v[min(len(v) - 1, int(len(v) * q))]:.1f}" for q in qs)


def overlap(span, others):
    a0, a1 = span
    return sum(max(0.0, min(a1, b1) - max(a0, b0)) for b0, b1 in others if b0 < a1 and b1 > a0)


def read(lines):
    talker, thinker, prefill, code2wav, sent = [], [], [], [], {}
    chunk0 = []  # (start of its Code2Wav step, step seconds, request)
    for raw in lines:
        line = ANSI.sub("", raw)
        if " DEBUG " not in line:
            continue
        t = stamp(line.split()[0])
        if "talker step" in line:
            m = re.search(r"streams=(\d+) .*ms=([\d.]+)", line)
            if m:
                talker.append((t - float(m[2]) / 1000, t, int(m[1])))
        elif "thinker_prefill step" in line or "thinker step (" in line:
            m = re.search(r"streams=(\d+) rows=(\d+) .*total_ms=([\d.]+)", line)
            if m:
                step = (t - float(m[3]) / 1000, t, int(m[1]), int(m[2]))
                (prefill if "thinker_prefill" in line else thinker).append(step)
        elif "talker chunk out" in line:
            m = re.search(r"request=(\S+) seq=(\d+) codes=(\d+)", line)
            if m and m[2] == "0":
                sent[m[1]] = (t, int(m[3]))
        elif "code2wav batch" in line:
            m = re.search(r"batch=(\d+) ms=([\d.]+) chunks=(\S+)", line)
            if not m:
                continue
            took = float(m[2]) / 1000
            code2wav.append((t - took, t, int(m[1])))
            for c in m[3].split(","):
                request, _, rest = c.partition("#")
                if rest.startswith("0:"):
                    chunk0.append((t - took, took, request))
    return talker, thinker, prefill, code2wav, sent, chunk0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("log")
    ap.add_argument("--window", type=float, default=45.0, help="seconds at the log's end")
    args = ap.parse_args()
    with open(args.log, errors="replace") as f:
        talker, thinker, prefill, code2wav, sent, chunk0 = read(f)
    if not talker:
        sys.exit("no `talker step` lines: was the server run with antiphon_engine=debug?")
    end = talker[-1][1]
    since = end - args.window

    def last(spans):
        return [s for s in spans if s[1] > since]

    talker, thinker, prefill, code2wav = last(talker), last(thinker), last(prefill), last(code2wav)
    span = args.window
    print(f"the last {span:.0f} s of {args.log}")
    for name, spans in (("thinker", thinker), ("thinker prefill", prefill),
                        ("talker", talker), ("code2wav", code2wav)):
        busy = sum(b - a for a, b, *_ in spans)
        print(f"  {name:16} {len(spans):6} steps, busy {busy / span:5.0%}")
    for name, spans, key in (("thinker decode", thinker, lambda st: min(st[2], 9)),
                             ("thinker prompt", prefill, lambda st: min((st[3] - st[2]) // 64, 4))):
        by = defaultdict(list)
        for st in spans:
            by[key(st)].append((st[1] - st[0]) * 1000)
        for k in sorted(by):
            what = (f"{k}{'+' if k == 9 else ' '} streams" if name == "thinker decode"
                    else f"{k * 64}{'+' if k == 4 else '-' + str(k * 64 + 63)} prompt rows")
            print(f"  {name} steps, {what:18}: {len(by[k]):5}, median "
                  f"{statistics.median(by[k]):6.2f} ms, p90 {percentiles(by[k], (0.9,))}")
    ms = [(b - a) * 1000 for a, b, _ in talker]
    print(f"talker step ms p50 / p90 / p95 / p99: {percentiles(ms)}, at most {max(ms):.1f}")
    long_steps = [s for s in talker if (s[1] - s[0]) > 0.010]
    print(f"  steps over 10 ms: {len(long_steps)}, "
          f"{sum(b - a for a, b, _ in long_steps):.1f} s of {sum(ms) / 1000:.1f}")
    by = defaultdict(list)
    for a, b, n in talker:
        by[min(n, 8)].append((b - a) * 1000)
    for n in sorted(by):
        label = f"{n}+" if n == 8 else f"{n} "
        print(f"  {label} streams: {len(by[n]):6} steps, median {statistics.median(by[n]):6.2f} ms,"
              f" mean {statistics.mean(by[n]):6.2f}")
    short_steps = [s for s in talker if (s[1] - s[0]) <= 0.003]
    for name, spans in (("a Thinker step", [(a, b) for a, b, *_ in thinker]),
                        ("a Code2Wav step", [(a, b) for a, b, _ in code2wav])):
        def share(steps):
            if not steps:
                return 0.0
            return statistics.mean(overlap((a, b), spans) / (b - a) for a, b, _ in steps)
        print(f"  time beside {name}: long steps {share(long_steps):.0%}, "
              f"short steps {share(short_steps):.0%}")
    zeros = [(start, took, r) for start, took, r in chunk0 if start + took > since and r in sent]
    if zeros:
        sizes = Counter(sent[r][1] for _, _, r in zeros)
        waits = [(start - sent[r][0]) * 1000 for start, _, r in zeros]
        steps = [took * 1000 for _, took, _ in zeros]
        print(f"chunk 0s: {len(zeros)}, codes {dict(sizes.most_common())}")
        print(f"  wait for their Code2Wav step ms p50 / p90 / p95 / p99: {percentiles(waits)}")
        print(f"  their step ms p50 / p90 / p95 / p99: {percentiles(steps)}")


if __name__ == "__main__":
    main()
