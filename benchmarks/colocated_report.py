#!/usr/bin/env python
"""The colocated run's table: trainer memory asleep vs its training peak, sleep / wake seconds, per-phase step times.

Reads `metrics.jsonl` of a `beamrl train` run with `trainer.sleep_during_rollout` on (benchmarks/colocated_h200.yaml,
run by benchmarks/colocated_h200.sh), prints a markdown table per step and a summary, and writes them as JSON.

  python benchmarks/colocated_report.py OUTPUT_DIR [--json PATH] [--target 0.10]

The trainer sleeps at the start of every step (before its rollout), so the memory figures of step k are those of
the sleep after step k-1's training (step 0: after start-up). The summary uses the steady steps (>= 2: the first two
sleeps also allocate and page-lock the host copies, the second one those of the Adam state created by the first
optimizer step; fewer steps: >= 1): the training peak is the largest `memory/trainer_peak_gib` among them (the caching allocator's peak reserved bytes between a wake and the
next sleep, sync included), the asleep figure the largest `memory/trainer_asleep_gib` (what the trainer's allocator
still reserves while asleep; the CUDA context and NCCL's own buffers are outside the allocator and not in it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PHASES = ["time/rollout_s", "time/engine_release_s", "time/trainer_wake_s", "time/train_s", "time/sync_s",
          "time/trainer_sleep_s", "time/engine_resume_kv_s", "time/step_s"]
MEMORY = ["memory/trainer_peak_gib", "memory/trainer_asleep_gib", "memory/trainer_awake_gib",
          "memory/trainer_offloaded_gib"]
REQUIRED = ["time/trainer_sleep_s", "time/trainer_wake_s", "memory/trainer_peak_gib", "memory/trainer_asleep_gib"]


def read_rows(out_dir: Path) -> list[dict]:
    path = out_dir / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"colocated_report: no {path} (did the run start?)")
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    if not rows:
        raise SystemExit(f"colocated_report: {path} is empty")
    missing = [k for k in REQUIRED if k not in rows[0]]
    if missing:
        raise SystemExit(f"colocated_report: {path} lacks {missing}: was trainer.sleep_during_rollout on?")
    return rows


def summarize(rows: list[dict], target: float) -> dict:
    """Per-step figures and the summary (module docstring)."""
    # steady state: step 0's sleep follows start-up and pins the host copies of the params, grads and main params;
    # step 1's also those of the Adam state (created by the first optimizer step). From step 2 on all are reused.
    later = [r for r in rows if r["step"] >= 2] or [r for r in rows if r["step"] >= 1] or rows
    peak = max(r["memory/trainer_peak_gib"] for r in later)
    asleep = max(r["memory/trainer_asleep_gib"] for r in later)
    ratio = asleep / peak if peak > 0 else None

    def mean(key: str) -> float | None:
        vals = [r[key] for r in later if key in r]
        return sum(vals) / len(vals) if vals else None

    return {
        "steps": [{"step": r["step"], **{k: r.get(k) for k in PHASES + MEMORY}} for r in rows],
        "summary": {
            "trainer_peak_gib": peak, "trainer_asleep_gib": asleep, "asleep_over_peak": ratio,
            "target": target, "meets_target": ratio is not None and ratio < target,
            "trainer_offloaded_gib": max(r["memory/trainer_offloaded_gib"] for r in later),
            "sleep_s_mean": mean("time/trainer_sleep_s"), "wake_s_mean": mean("time/trainer_wake_s"),
            **{f"{k.split('/')[1]}_mean": mean(k) for k in PHASES if k not in
               ("time/trainer_sleep_s", "time/trainer_wake_s")},
            "steps_summarized": [r["step"] for r in later],
            "sync_verify_max_abs_logprob_diff": max((r.get("sync/verify_max_abs_logprob_diff", 0.0) for r in rows)),
            "sync_verify_mean_abs_logprob_diff": max((r.get("sync/verify_mean_abs_logprob_diff", 0.0) for r in rows)),
        },
    }


def smi_summary(path: Path) -> dict:
    """Device-level memory per GPU process role from the sampler's CSV (time, pid, MiB, title): the smallest and
    largest MiB seen for the trainer and engine processes (their titles carry `TrainerActor` / `EngineActor`). The
    trainer's smallest sample is its memory while asleep, CUDA context and NCCL included."""
    roles: dict[str, list[float]] = {}
    for line in path.read_text().splitlines():
        parts = line.split(",", 3)
        if len(parts) < 4 or not parts[2].strip().isdigit():
            continue
        role = "trainer" if "TrainerActor" in parts[3] else "engine" if "EngineActor" in parts[3] else None
        if role is not None:
            roles.setdefault(role, []).append(float(parts[2]) / 1024)
    return {role: {"min_gib": min(v), "max_gib": max(v), "samples": len(v)} for role, v in roles.items()}


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def print_table(report: dict, out=sys.stdout) -> None:
    cols = [k.split("/")[1] for k in PHASES + MEMORY]
    print("| step | " + " | ".join(cols) + " |", file=out)
    print("|---" * (len(cols) + 1) + "|", file=out)
    for s in report["steps"]:
        print(f"| {s['step']} | " + " | ".join(_fmt(s[k]) for k in PHASES + MEMORY) + " |", file=out)
    m = report["summary"]
    if m["asleep_over_peak"] is None:  # a CPU run: no device allocator to measure
        verdict = "no device memory measured (CPU run)"
    else:
        verdict = (f"{100 * m['asleep_over_peak']:.2f} % (target < {100 * m['target']:.0f} %: "
                   f"{'met' if m['meets_target'] else 'NOT met'})")
    print(f"\ntrainer memory while asleep: {m['trainer_asleep_gib']:.3f} GiB of a {m['trainer_peak_gib']:.3f} GiB "
          f"training peak = {verdict}; moved to host per sleep: {m['trainer_offloaded_gib']:.3f} GiB", file=out)
    print(f"sleep {_fmt(m['sleep_s_mean'])} s, wake {_fmt(m['wake_s_mean'])} s (means over steps "
          f"{m['steps_summarized']})", file=out)
    for role, v in report.get("nvidia_smi", {}).items():
        print(f"nvidia-smi, {role} process: {v['min_gib']:.3f} .. {v['max_gib']:.3f} GiB over {v['samples']} samples "
              f"(device level: CUDA context and NCCL included)", file=out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path, help="the run's output directory (holds metrics.jsonl)")
    ap.add_argument("--json", type=Path, default=None, help="write the report here")
    ap.add_argument("--target", type=float, default=0.10, help="asleep / peak target (default 0.10)")
    ap.add_argument("--smi", type=Path, default=None, help="the nvidia-smi sampler's CSV of colocated_h200.sh")
    args = ap.parse_args(argv)
    report = summarize(read_rows(args.out_dir), args.target)
    if args.smi is not None and args.smi.is_file():
        report["nvidia_smi"] = smi_summary(args.smi)
    print_table(report)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
