"""CPU time of the native engine's `generate` on the quickstart's captured requests (64 requests, 8 prompts), in this
process with one thread, as the engine actor runs it. For A/B runs of two trees, run it from each tree in turn.

It needs the captures of `benchmarks/profile_step.py` (`--out` of that run; its SFT checkpoint is the weights):

    PYTHONPATH=. .venv/bin/python benchmarks/profile_step.py --steps 8 --out runs/profile_step
    PYTHONPATH=. .venv/bin/python benchmarks/generate_time.py --capture runs/profile_step [--repeats 10 --rounds 5]

Prints the median CPU ms of each round (`--repeats` calls each) and a digest of the outputs (token ids, routes and
logprobs), so two trees can be compared for what they sampled as well as for time.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--capture", type=Path, default=ROOT / "runs" / "profile_step", help="profile_step.py's --out")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    if not (args.capture / "capture" / "generate_requests.pkl").exists():
        ap.error(f"{args.capture}/capture/ has no generate_requests.pkl: run benchmarks/profile_step.py first")
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the engine actor
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace) -> int:
    from benchmarks.profile_step import load_capture
    from beamrl.rollout.native.config import NativeEngineConfig
    from beamrl.rollout.native.engine import NativeEngine

    requests = [r for g in load_capture(args.capture, "generate_requests") for r in g]
    engine = NativeEngine(NativeEngineConfig(model_path=str(args.capture / "run" / "sft_checkpoint"),
                                             dtype="float32", device="cpu", name="native-0", num_threads=1))
    engine.generate(requests, 60.0)
    rounds = []
    for _ in range(args.rounds):
        times = []
        for _ in range(args.repeats):
            t0 = time.thread_time()
            results = engine.generate(requests, 60.0)
            times.append((time.thread_time() - t0) * 1e3)
        rounds.append(statistics.median(times))
    tokens = hashlib.sha256(repr([r.output_ids for r in results]).encode()).hexdigest()[:12]
    routes = hashlib.sha256(b"".join(b"" if r.routed_experts is None else r.routed_experts.tobytes()
                                     for r in results)).hexdigest()[:12]
    logprobs = hashlib.sha256(repr([r.output_logprobs for r in results]).encode()).hexdigest()[:12]
    distinct = len({tuple(r.prompt_ids) for r in requests})
    print(f"generate: {len(requests)} requests, {distinct} distinct prompts; CPU ms per call, median of "
          f"{args.repeats}, by round: {' '.join(f'{t:.2f}' for t in rounds)}; median {statistics.median(rounds):.2f}")
    print(f"outputs: tokens {tokens} routes {routes} logprobs {logprobs}")
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
