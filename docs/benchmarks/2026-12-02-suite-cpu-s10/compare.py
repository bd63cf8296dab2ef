"""Reduce the two suite runs of this folder: per-module test time (JUnit XML), serial vs two xdist workers, and the
machine's CPU use per minute from proc_stat.log (`<epoch> cpu <the first line of /proc/stat>`, every 10 s).

    python3 compare.py
"""
import collections
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).parent


def per_module(path: Path) -> collections.Counter:
    out = collections.Counter()
    for case in ET.parse(path).getroot().iter("testcase"):
        out[case.get("classname")] += float(case.get("time"))
    return out


serial, parallel = per_module(HERE / "serial_junit.xml"), per_module(HERE / "parallel_junit.xml")
print(f"summed test time: serial {sum(serial.values()) / 60:.1f} min, two workers {sum(parallel.values()) / 60:.1f} min")
print("| module | serial s | two workers s | ratio |\n|---|---|---|---|")
for name in sorted(serial, key=lambda k: -serial[k])[:20]:
    print(f"| {name} | {serial[name]:.1f} | {parallel.get(name, 0):.1f} | {parallel.get(name, 0) / serial[name]:.2f} |")

rows = [line.split() for line in (HERE / "proc_stat.log").read_text().splitlines()]
per_minute = collections.defaultdict(list)
for prev, cur in zip(rows, rows[1:]):
    d = [int(b) - int(a) for a, b in zip(prev[2:], cur[2:])]
    per_minute[int(cur[0]) // 60].append((sum(d) - d[3] - d[4]) / sum(d) * 200)
print("CPU busy, % of 2 cores (200 = both), per minute:")
print(" ".join(f"{time.strftime('%H:%M', time.gmtime(m * 60))}={sum(v) / len(v):.0f}" for m, v in sorted(per_minute.items())))
