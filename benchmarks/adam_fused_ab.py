"""CPU time of the quickstart's captured GRPO `train_step` with the optimizer's Adam as Megatron builds it on CPU
(torch's per-tensor loop) against torch's fused CPU Adam (`fused=True` set on the param groups, measurement only:
the trainer does not offer it, because it rounds differently and would change the quickstart's curve).

    PYTHONPATH=. .venv/bin/python benchmarks/adam_fused_ab.py --capture runs/profile_step [--rounds 6]

Alternates the two per round in one process (8 steps each, median); prints the per-round medians.
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


def _torch_optimizers(opt) -> list:
    """The torch optimizers under Megatron's (chained) optimizer."""
    if hasattr(opt, "chained_optimizers"):
        return [o for c in opt.chained_optimizers for o in _torch_optimizers(c)]
    return [opt.optimizer]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--capture", type=Path, default=ROOT / "runs" / "profile_step", help="profile_step.py's --out")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args(argv)
    if not (args.capture / "capture" / "grpo_train_step.pkl").exists():
        ap.error(f"{args.capture}/capture/ has no grpo_train_step.pkl: run benchmarks/profile_step.py first")
    from benchmarks import profile_step

    _, trainer, (train_args, kw) = profile_step.captured_trainer(
        profile_step.parse_args(["--out", str(args.capture)]), args.capture)
    micro, loss = train_args[0], train_args[1]
    trainer.set_routing_replay(kw.get("replay", True))
    optimizers = _torch_optimizers(trainer.optimizer)

    def step() -> None:
        trainer.train_step(micro, loss, temperature=kw.get("temperature", 1.0))

    def use_fused(on: bool) -> None:
        for o in optimizers:
            for g in o.param_groups:
                g["fused"], g["foreach"] = on, False

    try:
        for _ in range(3):
            step()
        rounds: dict[str, list[float]] = {"per-tensor Adam": [], "fused Adam": []}
        for _ in range(args.rounds):
            for name, on in (("per-tensor Adam", False), ("fused Adam", True)):
                use_fused(on)
                step()
                times = []
                for _ in range(8):
                    t0 = time.thread_time()
                    step()
                    times.append((time.thread_time() - t0) * 1e3)
                rounds[name].append(statistics.median(times))
    finally:
        trainer.shutdown()
    for name, v in rounds.items():
        print(f"{name}: train_step CPU ms by round {' / '.join(f'{x:.1f}' for x in v)}; median "
              f"{statistics.median(v):.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
