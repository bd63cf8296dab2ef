#!/usr/bin/env python
"""Issue 12's four measurements on one `nvidia-h200-x2` (two H200s), each a stage run in its own process:

  sync      disaggregated weight sync through the training code path (`sync_h200.py --mode distributed`): trainer
            GPU0 -> native engine GPU1, `small` state dict, 64 MiB / 512 MiB / 2 GiB buckets, against raw NCCL
            broadcasts of the same bytes in the same run (target >= 80 %), checksums equal after every sync
  teardown  20 open-sync-close cycles of the update group (`sync_h200.py --mode teardown`), each close timed
            (target < 2 s, no timeout)
  rl        `beamrl train` for 4 steps (>= 3), disaggregated, one step off-policy: the Megatron trainer on GPU0, the
            embedded native engine on GPU1, a real-width model (`small`: hidden 5120, 16 experts; the quickstart's
            16-token vocabulary and task), bf16, NCCL weight sync; per-phase times per step and the overlap achieved
            (the rollout of step k+1 runs while step k trains; `time/rollout_wait_s` is what was not hidden)
  trainer   the Megatron trainer at TP2 (+SP), EP2 and TP2 x EP2 across the two GPUs vs TP1, bf16: logprobs and
            forward+backward tokens/s (`trainer_parallel_h200.py`)

Logs and JSON of every stage go to --out; a summary is printed and written to <out>/two_gpu_h200.json. A failing
stage does not stop the others (its rc is in the summary; the script's rc is 1 if any stage failed).

  # nvidia-h200-x2 (megatron-core and ray carried, e.g. in /tmp/site): one device call per stage or two
  EXTRA_PYTHONPATH=/tmp/site python benchmarks/two_gpu_h200.py --out $OUT --stages sync,teardown
  EXTRA_PYTHONPATH=/tmp/site python benchmarks/two_gpu_h200.py --out $OUT --stages rl
  EXTRA_PYTHONPATH=/tmp/site python benchmarks/two_gpu_h200.py --out $OUT --stages trainer
  # CPU smoke run of all four (gloo, tiny model, the same code): tests/benchmarks/test_two_gpu_h200.py
  python benchmarks/two_gpu_h200.py --smoke --out /tmp/two_gpu_smoke
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("sync", "teardown", "rl", "trainer")

# `beamrl train` on the quickstart recipe: trainer and engine on their own GPU, one step off-policy, NCCL sync.
RL_COMMON = ["placement.mode=disaggregated", "placement.off_policy_steps=1", "algorithm.importance.mode=tis",
             "algorithm.importance.cap=2.0", "sync.transport=distributed", "trainer.num_gpus=1",
             "cluster.gpus_per_node=2", "rollout.num_engines=1", "rollout.engine_tp=1", "sft=null",
             "logging.plot_reward_curve=false", "run.num_steps=4"]
RL_GPU = ["cluster.device=cuda", "model.preset=small", "model.dtype=bfloat16", "timeouts.generate_s=300",
          "timeouts.train_step_s=300", "timeouts.sync_s=300"]
RL_SMOKE = ["model.dtype=float32", "rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=4",
            "trainer.global_batch_size=16", "trainer.micro_batch_size=8", "timeouts.generate_s=300",
            "timeouts.train_step_s=300", "timeouts.sync_s=120"]


def stage_commands(stage: str, out: Path, smoke: bool, rl_extra: list[str]) -> list[str]:
    py = sys.executable
    if stage == "sync":
        extra = ["--device", "cpu", "--repeats", "1", "--bucket-mb", "0.0625,2"] if smoke else []
        return [py, str(ROOT / "benchmarks" / "sync_h200.py"), "--mode", "distributed", "--json",
                str(out / "sync_distributed.json"), *extra]
    if stage == "teardown":
        extra = ["--device", "cpu", "--cycles", "3"] if smoke else ["--cycles", "20"]
        return [py, str(ROOT / "benchmarks" / "sync_h200.py"), "--mode", "teardown", "--json",
                str(out / "sync_teardown.json"), *extra]
    if stage == "rl":
        return [py, "-m", "beamrl.cli", "train", str(ROOT / "recipes" / "quickstart.yaml"),
                f"run.output_dir={out / 'rl_run'}", *RL_COMMON, *(RL_SMOKE if smoke else RL_GPU), *rl_extra]
    if stage == "trainer":
        extra = ["--device", "cpu", "--steps", "1", "--warmup", "1"] if smoke else []
        return [py, str(ROOT / "benchmarks" / "trainer_parallel_h200.py"), "--json",
                str(out / "trainer_parallel.json"), *extra]
    raise ValueError(f"unknown stage {stage!r}; stages: {STAGES}")


def rl_phases(rows: list[dict]) -> dict:
    """Per-step phase times of a one-step-off run and the overlap achieved.

    Step 0's rollout runs alone (nothing to overlap with): its `time/rollout_s` is the un-overlapped rollout time.
    Every later step's rollout was started before the previous step trained; the driver then waited
    `time/rollout_wait_s` for it, so about `rollout(step 0) - wait` seconds of it were hidden behind training."""
    if not rows:
        raise ValueError("the RL run logged no steps")
    keys = {"rollout_s": "time/rollout_s", "rollout_wait_s": "time/rollout_wait_s", "logprob_s": "time/logprob_s",
            "train_s": "time/train_s", "sync_s": "time/sync_s", "step_s": "time/step_s",
            "weight_version": "rollout/weight_version", "sync_gbps": "sync/gbps"}
    missing = sorted({v for r in rows for v in keys.values() if v not in r})
    if missing:
        raise ValueError(f"the RL run's metrics lack {missing}")
    steps = [{"step": r["step"], **{k: r[v] for k, v in keys.items()}} for r in rows]
    alone = steps[0]["rollout_s"]
    for s in steps[1:]:
        s["hidden_rollout_s"] = max(0.0, alone - s["rollout_wait_s"])
        s["overlap_fraction"] = s["hidden_rollout_s"] / alone if alone > 0 else 0.0
    later = steps[1:]
    return {"steps": steps, "rollout_alone_s": alone,
            "mean_overlap_fraction": sum(s["overlap_fraction"] for s in later) / len(later) if later else None,
            "one_step_off": [s["weight_version"] for s in steps] == [0] + list(range(len(steps) - 1))}


def format_rl(summary: dict) -> str:
    lines = ["| step | sampled version | rollout s | waited s | hidden s | overlap | logprob s | train s | sync s | "
             "sync GB/s | step s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary["steps"]:
        hidden = f"{s['hidden_rollout_s']:.2f}" if "hidden_rollout_s" in s else "-"
        overlap = f"{100 * s['overlap_fraction']:.0f} %" if "overlap_fraction" in s else "- (alone)"
        lines.append(f"| {s['step']} | {s['weight_version']:.0f} | {s['rollout_s']:.2f} | {s['rollout_wait_s']:.2f} | "
                     f"{hidden} | {overlap} | {s['logprob_s']:.2f} | {s['train_s']:.2f} | {s['sync_s']:.2f} | "
                     f"{s['sync_gbps']:.2f} | {s['step_s']:.2f} |")
    return "\n".join(lines)


def run_stage(stage: str, out: Path, smoke: bool, rl_extra: list[str], timeout: float) -> dict:
    cmd = stage_commands(stage, out, smoke, rl_extra)
    env = dict(os.environ, PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0")
    extra_path = os.environ.get("EXTRA_PYTHONPATH")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, str(ROOT), os.environ.get("PYTHONPATH")) if p)
    if smoke:
        env.update(OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1")
    log = out / f"{stage}.log"
    print(f"== {stage}: {' '.join(cmd)}  (log: {log})", flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    result = {"stage": stage, "rc": rc, "seconds": time.perf_counter() - t0, "command": cmd}
    tail = log.read_text()[-4000:]
    print("\n".join(tail.splitlines()[-25:]), flush=True)
    if stage == "rl" and rc == 0:
        try:
            rows = [json.loads(x) for x in (out / "rl_run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
            result["rl"] = rl_phases(rows)
        except (OSError, ValueError) as exc:  # the run finished but its metrics cannot be summarised: a failure
            result["rc"] = 1
            result["error"] = f"{type(exc).__name__}: {exc}"
            print(f"rl: {result['error']}", flush=True)
        else:
            (out / "rl_phases.json").write_text(json.dumps(result["rl"], indent=2))
            print(format_rl(result["rl"]), flush=True)
    print(f"== {stage}: rc {result['rc']} in {result['seconds']:.0f} s", flush=True)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for logs, JSON and the RL run")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {list(STAGES)}")
    p.add_argument("--smoke", action="store_true", help="CPU smoke run (gloo, tiny model) of the same stages")
    p.add_argument("--stage-timeout", type=float, default=570.0, help="seconds per stage (a device call has 600)")
    p.add_argument("--rl-override", action="append", default=[], help="extra recipe override for the rl stage")
    args = p.parse_args(argv)
    stages = [s for s in args.stages.split(",") if s]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        print(f"error: --stages {bad} unknown; choose from {list(STAGES)}")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = [run_stage(s, out, args.smoke, args.rl_override, args.stage_timeout) for s in stages]
    summary = {"smoke": args.smoke, "stages": results}
    for name, file in (("sync", "sync_distributed.json"), ("teardown", "sync_teardown.json"),
                       ("trainer", "trainer_parallel.json")):
        if name in stages and (out / file).exists():
            summary[name] = json.loads((out / file).read_text())
    (out / "two_gpu_h200.json").write_text(json.dumps(summary, indent=2))
    print("\n" + " ".join(f"{r['stage']}: rc {r['rc']}" for r in results))
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
