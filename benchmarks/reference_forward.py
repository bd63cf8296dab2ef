"""The Beam reference model's inference forward on CPU by sequence length, at the quickstart's batch (64 samples):
what generating without a KV cache costs against generating with one.

`benchmarks/trl_vs_beamrl.py --trl-model beam` drives this model through TRL's generate() without a cache (a full
forward over the prompt and every token so far, per new token); beamrl's native engine prefills once and then
decodes one position per token from its KV cache. With prompts of P tokens and N new tokens, the uncached side runs
forwards of P, P+1, ..., P+N-1 positions, the cached side one of P and N-1 of 1 (their attention reads the cache, a
small part of a forward at these lengths). The difference of the two sums is the TRL-Beam side's handicap per
step, an estimate that leaves out the cached decode's attention over the cache.

    PYTHONPATH=. .venv/bin/python benchmarks/reference_forward.py [--batch 64] [--lengths 1 4 5 6 7] [--repeats 30]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1, 4, 5, 6, 7])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--vocab", type=int, default=16, help="the quickstart's digit vocabulary")
    args = ap.parse_args(argv)
    import torch

    from beamrl.models.beam import BeamForCausalLM, preset

    torch.set_num_threads(1)
    model = BeamForCausalLM(dataclasses.replace(preset("tiny"), vocab_size=args.vocab)).eval()
    print(f"tiny Beam (vocab {args.vocab}), batch {args.batch}, 1 thread, CPU ms per forward (median of "
          f"{args.repeats}, after 5)\n\n| positions | ms |\n|---|---|")
    for length in args.lengths:
        x = torch.randint(1, args.vocab, (args.batch, length))
        mask = torch.ones_like(x)
        times = []
        for _ in range(args.repeats + 5):
            t0 = time.thread_time()
            with torch.inference_mode():
                model(x, attention_mask=mask)
            times.append(time.thread_time() - t0)
        print(f"| {length} | {statistics.median(times[5:]) * 1e3:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
