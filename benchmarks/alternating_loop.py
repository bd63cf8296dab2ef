"""The quickstart's two computations alternating in one process, as an RL loop runs them: `generate` of the captured
requests, a pause (sleeping or spinning) standing in for the rewards, the captured GRPO `train_step` and an in-process
weight sync, the pause again. CPU ms of `generate` and of `train_step` per kind of pause, `--rounds` rounds.

Against each call run back to back (`generate_time.py`, `profile_step.py`'s "Inside the calls") this shows what
alternating alone costs: the engine's and the trainer's working sets evict each other even with no pause at all.
The weights are the random init `sync_step.build` makes (as `hybrid_probe.py`'s), trained on every iteration, not
the captures' SFT checkpoint: they sample a few more tokens per request (on the fifteenth session's captures,
`generate` took 15.4 ms back to back with them against 14.7 ms with the SFT weights).

    PYTHONPATH=. .venv/bin/python benchmarks/alternating_loop.py --capture runs/profile_step
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: (pause in seconds, spin instead of sleep)
PAUSES = ((0.0, False), (0.008, False), (0.008, True), (0.03, False))


def _pause(seconds: float, spin: bool) -> None:
    if not spin:
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--capture", type=Path, default=ROOT / "runs" / "profile_step", help="profile_step.py's --out")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=15, help="loop iterations per pause and round")
    args = ap.parse_args(argv)
    if not (args.capture / "capture" / "grpo_train_step.pkl").exists():
        ap.error(f"{args.capture}/capture/ has no grpo_train_step.pkl: run benchmarks/profile_step.py first")
    from benchmarks import sync_step
    from benchmarks.profile_step import load_capture

    (train_args, train_kwargs) = load_capture(args.capture, "grpo_train_step")
    requests = [r for g in load_capture(args.capture, "generate_requests") for r in g]
    micro, loss = train_args[0], train_args[1]

    def iteration(pause: float, spin: bool) -> tuple[float, float]:  # uses the objects built below
        c0 = time.thread_time()
        engine.generate(requests, 60.0)
        gen = time.thread_time() - c0
        _pause(pause, spin)
        c1 = time.thread_time()
        trainer.set_routing_replay(train_kwargs.get("replay", True))
        trainer.train_step(micro, loss, temperature=train_kwargs.get("temperature", 1.0))
        train = time.thread_time() - c1
        sync.sync(source())
        _pause(pause, spin)
        return gen * 1e3, train * 1e3

    work = Path(tempfile.mkdtemp(prefix="beamrl-alternating-"))
    built = None
    try:
        built = trainer, engine, sync, source = sync_step.build(work, 10, in_process=True)
        for _ in range(5):
            iteration(0.0, False)
        results: dict[tuple[float, bool], list[tuple[float, float]]] = {}
        for _ in range(args.rounds):
            for pause, spin in PAUSES:
                rows = [iteration(pause, spin) for _ in range(args.iterations)]
                results.setdefault((pause, spin), []).append((statistics.median(r[0] for r in rows),
                                                              statistics.median(r[1] for r in rows)))
    finally:
        if built is not None:
            sync.close()
            engine.shutdown()
            trainer.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    print("| pause between the calls | generate CPU ms, by round | train_step CPU ms, by round |\n|---|---|---|")
    for (pause, spin), v in results.items():
        print(f"| {pause * 1e3:.0f} ms {'spinning' if spin else 'sleeping'} | {' / '.join(f'{g:.1f}' for g, _ in v)} "
              f"| {' / '.join(f'{t:.1f}' for _, t in v)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
