"""Each launch of a kernel in a profiler trace with the launches around it (diagnostic).

``python bench/trace_neighbours.py TRACE_DIR [PATTERN]`` reads the Perfetto trace that
``bench/profile_step.py --trace-dir TRACE_DIR`` wrote and prints, for the first eight launches
whose kernel name contains ``PATTERN`` (default ``grn_block``), the four device kernels before
and two after it: stream, start, duration and the idle gap since the previous kernel ended (µs;
negative where kernels overlap), kernel and HLO instruction names; then the first match's
profiler arguments (registers, shared memory, grid) as JSON. Text, not a benchmark: it answers
"what ran around this launch", e.g. whether a kernel that is slower in one place of the program
than in another follows an idle device (``docs/model.md``, the whole-block kernel).
"""
from __future__ import annotations

import glob
import gzip
import json
import os
import sys


def device_events(trace) -> list:
    """The trace's device kernel events (``ph == "X"`` on a ``/device:`` process), by start."""
    ev = trace["traceEvents"] if isinstance(trace, dict) else trace
    pname = {e["pid"]: e.get("args", {}).get("name", "") for e in ev
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    dev = [e for e in ev if e.get("ph") == "X" and "/device:" in pname.get(e.get("pid"), "")]
    return sorted(dev, key=lambda e: float(e["ts"]))


def report(trace, pattern: str = "grn_block", shown_max: int = 8) -> list[str]:
    dev = device_events(trace)
    lines = [f"device events {len(dev)} streams {sorted({(e['pid'], e['tid']) for e in dev})}"]
    hits = [i for i, e in enumerate(dev) if pattern in e["name"]]
    for i in hits[:shown_max]:
        lines.append("----")
        for j in range(max(0, i - 4), min(len(dev), i + 3)):
            d = dev[j]
            prev_end = float(dev[j - 1]["ts"]) + float(dev[j - 1].get("dur", 0)) if j else 0
            a = d.get("args", {})
            lines.append(
                f"{'>>' if j == i else '  '} tid={d['tid']} ts={float(d['ts']):.1f} "
                f"dur={float(d.get('dur', 0)):.1f} gap={float(d['ts']) - prev_end:.1f} "
                f"{d['name'][:50]} {str(a.get('hlo_op', ''))[:30]} "
                + (f"correlation_id={a['correlation_id']}" if "correlation_id" in a else ""))
    if hits:
        lines.append(json.dumps(dict(dev[hits[0]].get("args", {})))[:1500])
    else:
        lines.append(f"no device kernel named like {pattern!r}")
    return lines


def main() -> None:
    if len(sys.argv) not in (2, 3):
        raise SystemExit("usage: python bench/trace_neighbours.py TRACE_DIR [PATTERN]")
    files = sorted(glob.glob(os.path.join(sys.argv[1], "**", "*.json.gz"), recursive=True))
    if not files:
        raise SystemExit(f"{sys.argv[1]}: no Perfetto trace (*.json.gz) under it "
                         "(bench/profile_step.py --trace-dir writes one)")
    with gzip.open(files[-1], "rt") as fh:
        trace = json.load(fh)
    print("\n".join(report(trace, *sys.argv[2:3])))


if __name__ == "__main__":
    main()
