"""What a per-step actor call's payload costs to cross Ray, as Ray's own arguments vs one `Wire` pickle.

The payloads are built like the quickstart's (`recipes/quickstart.yaml`): a rollout's 64 requests, their 64
results with routed experts, and one train step's micro-batch with its loss (the real `PackedBatch`,
`PolicyLoss` and `GenerateRequest`/`GenerateResult` classes, sized like the tiny model's). For each, a local Ray
actor receives the call; the table gives the median submit-to-entry time (arguments) or round trip (results)
over alternating rounds, both ways in the same process, so a shared machine's drift hits both alike.

    PYTHONPATH=. .venv/bin/python benchmarks/ray_payload.py --rounds 6

Times on a shared machine are ratios, not absolutes.
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


def payloads():
    import numpy as np
    import torch

    from beamrl.algorithms import AlgorithmConfig
    from beamrl.loop.losses import PolicyLoss
    from beamrl.protocols.rollout import GenerateRequest, GenerateResult, SamplingParams
    from beamrl.trainer.protocol import PackedBatch

    gen = torch.Generator().manual_seed(0)
    requests = [GenerateRequest([1, 2, 3, 4, 5], SamplingParams(max_new_tokens=3, temperature=1.0, seed=i),
                                return_routed_experts=True, request_id=f"s1-r0-p{i // 8}-n{i % 8}") for i in range(64)]
    results = [GenerateResult(prompt_ids=[1, 2, 3, 4, 5], output_ids=[6, 7, 0], output_logprobs=[-0.1, -0.2, -0.3],
                              finish_reason="stop", weight_version=1, routed_experts=np.zeros((7, 6, 4), np.int32),
                              request_id=r.request_id) for r in requests]
    tokens = 423
    cu = torch.arange(0, tokens + 1, tokens // 64)
    cu[-1] = tokens
    batch = PackedBatch(torch.randint(1, 16, (tokens,), generator=gen), cu, torch.ones(tokens),
                        {"advantages": torch.randn(tokens, generator=gen),
                         "rollout_logprobs": torch.randn(tokens, generator=gen)},
                        torch.randint(0, 16, (tokens, 6, 4), generator=gen, dtype=torch.int32))
    loss = PolicyLoss(AlgorithmConfig(), 167.0, 167.0)
    return requests, results, ([batch], loss)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6, help="alternating rounds (each: 12 calls per way and payload)")
    args = ap.parse_args(argv)
    import ray

    from beamrl.loop.wire import Wire

    requests, results, step = payloads()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})

    @ray.remote
    class Receiver:
        def take(self, payload, *, flag: bool = False):
            t = time.time()
            if isinstance(payload, Wire):
                payload.open()
            return t

        def give(self, wired: bool):
            return Wire(results) if wired else results

    actor = Receiver.remote()
    ray.get(actor.take.remote(None))
    cases = {
        "requests (driver -> engine)": lambda wired: actor.take.remote(Wire(requests) if wired else requests, flag=True),
        "train step (driver -> trainer)": lambda wired: actor.take.remote(Wire(step) if wired else step, flag=True),
        "results (engine -> driver)": lambda wired: actor.give.remote(wired),
    }
    times: dict[tuple[str, bool], list[float]] = {}
    for _ in range(args.rounds):
        for name, call in cases.items():
            for wired in (False, True):
                for i in range(12):
                    t0 = time.time()
                    out = ray.get(call(wired))
                    t1 = time.time()
                    if isinstance(out, Wire):
                        out.open()
                        t1 = time.time()
                    if i >= 2:  # warm-up calls
                        times.setdefault((name, wired), []).append((out - t0) if isinstance(out, float) else t1 - t0)
    ray.shutdown()
    print("| payload | Ray's own serialization, ms | one Wire pickle, ms | saved, ms |")
    print("|---|---|---|---|")
    for name in cases:
        raw, wire = (statistics.median(times[(name, w)]) * 1e3 for w in (False, True))
        print(f"| {name} | {raw:.2f} | {wire:.2f} | {raw - wire:.2f} |")
    print("(arguments: submit to method entry; results: the round trip of a call returning them, unpickled)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
