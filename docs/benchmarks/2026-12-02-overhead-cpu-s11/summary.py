"""Medians of steps 11-60 of each run's metrics.jsonl here (time/* in ms) and the reward of the last 12 steps;
then the medians of the two throwaway timing files (the trainer actor's and the engine actor's calls, last 50)."""
import collections
import json
import statistics as st
from pathlib import Path

HERE = Path(__file__).parent
KEYS = ("time/step_s", "time/rollout_s", "time/train_s", "time/sync_s")
print("| run | step | rollout | train call | sync | reward, last 12 steps |\n|---|---|---|---|---|---|")
for f in sorted(HERE.glob("*_metrics.jsonl")):
    rows = [json.loads(line) for line in f.open()]
    med = [round(st.median(r[k] for r in rows[10:] if k in r) * 1000, 1) for k in KEYS]
    print(f"| {f.name[:-len('_metrics.jsonl')]} | " + " | ".join(map(str, med))
          + f" | {st.mean(r['reward/mean'] for r in rows[-12:]):.3f} |")
rows = [list(map(float, line.split())) for line in (HERE / "trainer_call_timing.txt").open()][-50:]
print("\ntrainer actor, train_step_then_sync (ms, median of the last 50): train_step wall / CPU, sync wall / CPU:",
      [round(st.median(c) * 1000, 1) for c in zip(*rows)])
calls = collections.defaultdict(list)
for line in (HERE / "engine_call_timing.txt").open():
    name, _start, *vals = line.split()
    calls[name].append([float(v) for v in vals])
print("engine actor calls (ms, median of the last 50: wall, thread CPU[, generate alone]):")
for name, vals in calls.items():
    print(f"  {name} x{len(vals)}:", [round(st.median(c) * 1000, 2) for c in zip(*vals[-50:])])
