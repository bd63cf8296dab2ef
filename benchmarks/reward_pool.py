"""Throughput of the reward worker pool: per-call overhead (exact_match) and DAPO math verification.

    .venv/bin/python benchmarks/reward_pool.py [--samples 512] [--workers 1 2]
"""

from __future__ import annotations

import argparse
import random
import time

from beamrl.rewards import RewardComponentConfig, RewardManager, RewardSample
from beamrl.rewards.invoke import invoke


def math_samples(n: int, seed: int = 0) -> list[RewardSample]:
    rng = random.Random(seed)
    forms = [
        lambda a, b: (f"\\boxed{{\\frac{{{a}}}{{{b}}}}}", f"{a / b:.6g}"),
        lambda a, b: (f"Answer: {a + b}", str(a + b)),
        lambda a, b: (f"\\boxed{{{a}\\sqrt{{2}}}}", f"\\sqrt{{{2 * a * a}}}"),
        lambda a, b: (f"\\boxed{{{a * b + 1}}}", str(a * b)),  # wrong
    ]
    out = []
    for _ in range(n):
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        completion, gold = rng.choice(forms)(a, b)
        out.append(RewardSample(completion="Let me think... " * 20 + completion, ground_truth=gold))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    samples = math_samples(args.samples)

    t0 = time.perf_counter()
    for s in samples:
        invoke("beamrl.rewards.math:dapo_math", {"completion": s.completion, "ground_truth": s.ground_truth})
    inproc = time.perf_counter() - t0
    print(f"{'setup':<34} {'workers':>7} {'start s':>8} {'batch s':>8} {'calls/s':>9} {'mean acc':>8}")
    print(f"{'dapo_math in-process (no pool)':<34} {'-':>7} {'-':>8} {inproc:>8.2f} {len(samples) / inproc:>9.0f} {'':>8}")
    for fn in ("exact_match", "dapo_math"):
        for w in args.workers:
            t0 = time.perf_counter()
            with RewardManager([RewardComponentConfig("r", fn, timeout_s=30)], num_workers=w) as rm:
                rm.score(samples[:w])  # wait until every worker is up and warm
                start = time.perf_counter() - t0
                t1 = time.perf_counter()
                res = rm.score(samples)
                batch = time.perf_counter() - t1
            acc = res.metrics.get("reward/r/mean", float("nan"))
            print(f"{fn + ' in pool':<34} {w:>7} {start:>8.2f} {batch:>8.2f} {len(samples) / batch:>9.0f} {acc:>8.3f}")


if __name__ == "__main__":
    main()
