"""How the cost of one quickstart train step depends on the idle time before it (the hand-off penalty).

A step of the RL loop hands work between processes: the trainer actor idles while the engine generates (~25 ms) and
the engine idles while the trainer trains (~70 ms). This holds the trainer an actor holds (in this process, one
thread, as `profile_step.py` does) and times the captured GRPO `train_step` back to back, and after an idle gap
spent sleeping or spinning; prints the median and min CPU ms per step for each gap, alternating over rounds. A
slower step after a gap, sleeping or spinning alike, is the machine's (caches and the rest of the core's state
going cold), not Python's or Ray's.

    PYTHONPATH=. .venv/bin/python benchmarks/profile_step.py --steps 8 --out runs/profile_step   # the capture
    PYTHONPATH=. OMP_NUM_THREADS=1 TORCHDYNAMO_DISABLE=1 .venv/bin/python benchmarks/step_gap.py --capture runs/profile_step
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capture", type=Path, required=True, help="the --out folder of a profile_step.py run")
    ap.add_argument("--gaps-ms", type=float, nargs="+", default=[0, 5, 20, 50, 100])
    ap.add_argument("--steps", type=int, default=12, help="timed steps per gap and round")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)

    import benchmarks.profile_step as ps

    _, trainer, (grpo_args, grpo_kwargs) = ps.captured_trainer(ps.parse_args(["--out", str(args.capture)]),
                                                               args.capture)
    trainer.set_routing_replay(grpo_kwargs.get("replay", True))

    def step():
        trainer.train_step(grpo_args[0], grpo_args[1], temperature=grpo_kwargs.get("temperature", 1.0))

    def spin(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    for _ in range(3):
        step()
    print(f"| round | gap ms | idle as | train_step CPU ms, median | min |\n|---|---|---|---|---|")
    for rnd in range(args.rounds):
        for gap in args.gaps_ms:
            for idle in (("sleep", "spin") if gap else ("-",)):
                cpu = []
                for _ in range(args.steps):
                    if idle == "sleep":
                        time.sleep(gap / 1e3)
                    elif idle == "spin":
                        spin(gap / 1e3)
                    t0 = time.thread_time()
                    step()
                    cpu.append((time.thread_time() - t0) * 1e3)
                print(f"| {rnd + 1} | {gap:g} | {idle} | {statistics.median(cpu):.1f} | {min(cpu):.1f} |", flush=True)
    trainer.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
