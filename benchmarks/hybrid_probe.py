"""What an engine inside the trainer's process (verl's "hybrid engine" layout, which beamrl does not have) would
give the quickstart's step: one Ray actor holds the quickstart's `MegatronTrainer` and `NativeEngine` (built as
`sync_step.py --in-process` builds them: the real trainer, engine and `WeightSync` with the colocated transport),
and the driver replays a captured step per iteration as the RL loop would call it: `generate` of the captured
requests (one Ray call), a pause standing in for the driver's rewards and packing, then the captured GRPO
`train_step` followed by an in-process weight sync (one Ray call).

It needs the captures of `benchmarks/profile_step.py` (`--out` of that run, default runs/profile_step):

    PYTHONPATH=. .venv/bin/python benchmarks/profile_step.py --steps 8 --out runs/profile_step
    PYTHONPATH=. .venv/bin/python benchmarks/hybrid_probe.py --capture runs/profile_step [--steps 60]

Prints the medians (over the steps after `--warmup`) of the whole step, of each call as the driver sees it, and of
the work inside the actor (thread CPU time and wall time of the train step, the sync and `generate`). The same
batch is trained on every iteration, so the numbers are timings only. Compare the step with the real run's
`time/step_s` (two actors) measured in the same sitting.

`--in-driver`: the same host object in the driver's own process, called directly (no Ray: TRL's layout, one process
that generates, waits for its rewards and trains), for the floor that no placement of Ray actors can go under.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


class HybridHost:
    """The trainer and the engine in one process, fed the captured quickstart calls."""

    def __init__(self, capture: str):
        from benchmarks import sync_step
        from benchmarks.profile_step import load_capture

        work = Path(capture) / "hybrid_probe"  # the trainer's initial checkpoint: kept with the captures, replaced
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        self.trainer, self.engine, self.sync, self.source = sync_step.build(work, 10, in_process=True)
        self.train_args, self.train_kwargs = load_capture(Path(capture), "grpo_train_step")
        self.requests = [r for g in load_capture(Path(capture), "generate_requests") for r in g]

    def close(self) -> None:
        self.sync.close()
        self.engine.shutdown()
        self.trainer.shutdown()

    def generate(self) -> tuple[float, float]:
        c, w = time.thread_time(), time.perf_counter()
        self.engine.generate(self.requests, 60.0)
        return time.thread_time() - c, time.perf_counter() - w

    def train_then_sync(self) -> tuple[float, float, float, float]:
        micro, loss = self.train_args[0], self.train_args[1]
        c, w = time.thread_time(), time.perf_counter()
        self.trainer.set_routing_replay(self.train_kwargs.get("replay", True))
        self.trainer.train_step(micro, loss, temperature=self.train_kwargs.get("temperature", 1.0))
        c1, w1 = time.thread_time(), time.perf_counter()
        self.sync.sync(self.source())
        return c1 - c, w1 - w, time.thread_time() - c1, time.perf_counter() - w1


def _steps(host, call, args) -> list[dict]:
    """The timed loop: `call(host.generate)` then `call(host.train_then_sync)`, the driver's pause between them."""
    call(host.generate)
    call(host.train_then_sync)
    rows = []
    for _ in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        gen_cpu, gen_wall = call(host.generate)
        t1 = time.perf_counter()
        time.sleep(args.driver_ms / 1e3)
        t2 = time.perf_counter()
        train_cpu, train_wall, sync_cpu, sync_wall = call(host.train_then_sync)
        t3 = time.perf_counter()
        rows.append({"step": t3 - t0, "generate call": t1 - t0, "train+sync call": t3 - t2,
                     "generate CPU": gen_cpu, "generate wall": gen_wall, "train_step CPU": train_cpu,
                     "train_step wall": train_wall, "sync CPU (calling thread)": sync_cpu, "sync wall": sync_wall})
    return rows[args.warmup:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--capture", type=Path, default=ROOT / "runs" / "profile_step", help="profile_step.py's --out")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--driver-ms", type=float, default=4.0, help="the driver's work between the two calls")
    ap.add_argument("--in-driver", action="store_true", help="the host in this process, without Ray (docstring)")
    args = ap.parse_args(argv)
    if not (args.capture / "capture" / "grpo_train_step.pkl").exists():
        ap.error(f"{args.capture}/capture/ has no grpo_train_step.pkl: run benchmarks/profile_step.py first")
    if args.in_driver:
        import torch

        torch.set_num_threads(1)  # as in the actor (OMP_NUM_THREADS=1)
        host = HybridHost(str(args.capture.resolve()))
        try:
            rows = _steps(host, lambda call: call(), args)
        finally:
            host.close()
        where = "in the driver's process (no Ray)"
    else:
        import ray

        ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR",
                 runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}})
        try:
            host = ray.remote(HybridHost).remote(str(args.capture.resolve()))
            rows = _steps(host, lambda call: ray.get(call.remote(), timeout=600), args)
        finally:
            ray.shutdown()
        where = "in one Ray actor"
    print(f"hybrid probe, {where}: {args.steps} steps (after {args.warmup}), driver pause {args.driver_ms:g} ms\n")
    print("| ms, median | value |\n|---|---|")
    for key in rows[0]:
        print(f"| {key} | {statistics.median(r[key] for r in rows) * 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
