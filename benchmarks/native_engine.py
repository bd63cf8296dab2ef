"""Generation throughput of the embedded native engine (CPU or one GPU) on a random Beam preset.

    .venv/bin/python benchmarks/native_engine.py [--preset tiny] [--batch 8 32] [--new-tokens 64]
        [--dtype float32 bfloat16] [--threads 1] [--device cpu]

Prints one row per (dtype, batch): wall time of one `generate` call and output tokens per second.
"""

from __future__ import annotations

import argparse
import time

import torch

from beamrl.models.beam import BeamForCausalLM, preset
from beamrl.rollout.native import NativeEngine
from beamrl.protocols.rollout import GenerateRequest, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--routes", action="store_true", help="also return routed experts")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = preset(args.preset)
    print(f"preset={args.preset} params={cfg.num_parameters():,} threads={args.threads} device={args.device} "
          f"prompt={args.prompt_len} new={args.new_tokens}")
    print(f"{'dtype':>9} {'batch':>6} {'seconds':>8} {'out tok/s':>10}")
    for dtype in args.dtype:
        model = BeamForCausalLM(cfg, dtype=getattr(torch, dtype), device=args.device, seed=0)
        engine = NativeEngine.from_model(model, max_batch_size=max(args.batch))
        g = torch.Generator().manual_seed(0)
        for batch in args.batch:
            reqs = [GenerateRequest(prompt_ids=torch.randint(1, cfg.vocab_size, (args.prompt_len,), generator=g).tolist(),
                                    sampling=SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True, seed=i),
                                    return_routed_experts=args.routes) for i in range(batch)]
            engine.generate(reqs[:1], 600)  # warm-up
            t0 = time.perf_counter()
            out = engine.generate(reqs, 3600)
            dt = time.perf_counter() - t0
            n = sum(len(r.output_ids) for r in out)
            print(f"{dtype:>9} {batch:>6} {dt:>8.2f} {n / dt:>10.0f}")
        engine.shutdown()


if __name__ == "__main__":
    main()
