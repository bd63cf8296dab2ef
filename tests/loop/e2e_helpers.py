"""Run `beamrl train` end to end in a subprocess and read its outputs back."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
# A short, small version of the quickstart: 4 prompts x 4 samples, no SFT, float32, the probe after every sync
# (the tests check the engine's logprobs at every step).
SMALL = ["sft=null", "rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=4",
         "trainer.global_batch_size=16", "trainer.micro_batch_size=8", "logging.plot_reward_curve=false",
         "timeouts.generate_s=300", "timeouts.train_step_s=300", "timeouts.sync_s=120", "sync.probe_every=1"]


def train_cmd(out_dir: Path, *overrides: str, resume: bool = False, recipe: Path = QUICKSTART) -> list[str]:
    cmd = [sys.executable, "-m", "beamrl.cli", "train", str(recipe), f"run.output_dir={out_dir}", *SMALL,
           *overrides]
    return cmd + (["--resume"] if resume else [])


def env() -> dict[str, str]:
    e = dict(os.environ, PYTHONUNBUFFERED="1", TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    return e


def run_train(out_dir: Path, *overrides: str, resume: bool = False, timeout: float = 900,
              recipe: Path = QUICKSTART) -> subprocess.CompletedProcess:
    p = subprocess.run(train_cmd(out_dir, *overrides, resume=resume, recipe=recipe), env=env(), cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout)
    return p


def metrics(out_dir: Path) -> list[dict]:
    path = out_dir / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def kill_after(out_dir: Path, marker: Path, *overrides: str, timeout: float = 900,
               recipe: Path = QUICKSTART) -> None:
    """Start a run and SIGKILL its whole process group as soon as `marker` exists (a crash mid-run). Polled every
    10 ms: a quickstart step takes ~0.2 s, so a coarser poll can let a short run finish before the kill."""
    p = subprocess.Popen(train_cmd(out_dir, *overrides, recipe=recipe), env=env(), cwd=ROOT,
                         stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + timeout
    try:
        while not marker.exists():
            if p.poll() is not None:
                raise AssertionError(f"run exited (rc={p.returncode}) before {marker} appeared")
            if time.time() > deadline:
                raise AssertionError(f"{marker} did not appear within {timeout} s")
            time.sleep(0.01)
        if p.poll() is not None:  # the kill must cut the run, or the test after it checks nothing
            raise AssertionError(f"the run ended (rc={p.returncode}) before it could be killed at {marker}")
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(timeout=60)


def assert_engine_routes_replayed(rows):
    """R3, from the trainer's replay self-check: in every step the training forward routed every (token, MoE layer)
    pair the engine routed through exactly the engine's experts (docs/metrics.md, replay/*)."""
    for r in rows:
        assert r["train/replay/routes_checked"] > 0, r  # replay was on and the engine's routes reached the trainer
        assert r["train/replay/route_mismatches"] == 0, r


def assert_importance_metrics_in_bounds(rows, cap):
    """TIS metrics: present, finite and inside the range their definitions allow."""
    for r in rows:
        m = {k[len("train/is/"):]: v for k, v in r.items() if k.startswith("train/is/")}
        assert {"ratio_mean", "train_rollout_kl", "train_rollout_logprob_abs_diff", "truncated_fraction",
                "masked_fraction"} <= set(m), sorted(m)
        assert all(math.isfinite(v) for v in m.values()), m
        assert m["ratio_mean"] > 0 and m["train_rollout_kl"] >= 0 and m["train_rollout_logprob_abs_diff"] >= 0
        assert 0 <= m["truncated_fraction"] <= 1 and m["masked_fraction"] == 0  # TIS truncates, never masks
        assert m["truncated_fraction"] > 0 or m["ratio_mean"] <= cap  # nothing truncated: every ratio <= cap


def trainer_pids(console: str) -> list[int]:
    """The trainer ranks' process ids in rank order, as the console names them at start-up (`beamrl train`'s
    "rank k on node n, slot s (pid p)"; a run with an SFT warm start names its SFT trainer's first)."""
    return [int(pid) for pid in re.findall(r"rank \d+ on node \d+, slot \d+ \(pid (\d+)\)", console)]
