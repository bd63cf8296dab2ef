#!/usr/bin/env python
"""The Megatron trainer split across two GPUs (issue 12, item 4): TP2 (+SP), EP2 and TP2 x EP2 against TP1, in bf16.

For each layout, on the same random HF weights (`random_state_dict`, router FP32) and the same batches:
  - logprobs of a fixed batch against the TP1 run (one process, GPU0): max and mean |delta|;
  - forward+backward tokens/s: median over the timed steps after warm-up, counting the tokens of every
    data-parallel rank (EP2 over two ranks is data-parallel for the dense weights: each rank trains its own
    micro-batches), and the full step time (with the Adam update); peak memory of rank 0.

Model: `small` (4 layers at real width, 16 experts; ~8.4 GB in bf16) on cuda; `tiny` with `--device cpu` (the
smoke run: gloo, same code). Ranks are spawned by `beamrl.trainer.megatron.launch` (one process per GPU; the two-GPU
layouts run one after the other in the same two processes).

  python benchmarks/trainer_parallel_h200.py --json $OUT/trainer_parallel.json     # nvidia-h200-x2
  python benchmarks/trainer_parallel_h200.py --device cpu --steps 1 --warmup 1     # CPU smoke run

Needs torch, megatron-core 0.19.2 and the repo on PYTHONPATH (no sglang, no ray).
"""

from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

LAYOUTS = {"tp2_sp": {"tp": 2, "sp": True}, "ep2": {"ep": 2}, "tp2_sp_ep2": {"tp": 2, "sp": True, "ep": 2}}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_layouts(layouts: list[tuple[str, dict]], opts: dict) -> list[dict] | None:
    """Rank function: every layout in turn; rank 0 returns one result per layout (logprobs kept for comparison)."""
    import gc

    import torch.distributed as dist

    from beamrl.models.beam import preset
    from beamrl.models.beam.weights import random_state_dict
    from beamrl.trainer.megatron.config import TrainerConfig
    from beamrl.trainer.megatron.worker import MegatronTrainer, TrainerSetup
    from beamrl.trainer.protocol import PackedBatch

    world = int(os.environ["WORLD_SIZE"])
    config = preset(opts["preset"])
    weights = random_state_dict(config, opts["seed"], torch.bfloat16)  # router / correction bias stay FP32
    g = torch.Generator().manual_seed(opts["seed"] + 1)
    probe = PackedBatch.from_sequences([torch.randint(1, config.vocab_size, (opts["probe_len"],), generator=g)
                                        for _ in range(opts["probe_seqs"])])
    out = []
    for name, parallel in layouts:
        trainer_config = TrainerConfig(**parallel, num_gpus=world, global_batch_size=world, lr=1e-6,
                                       distributed_optimizer=False)
        trainer = MegatronTrainer(TrainerSetup(model=config, trainer=trainer_config, dtype="bfloat16"))
        trainer.load_hf_state_dict(weights)
        logprobs = trainer.compute_logprobs(probe, temperature=1.0, return_entropy=False).logprobs.float().cpu()
        dp = trainer_config.dp_size(world)
        dp_rank = trainer._ps.get_data_parallel_rank()
        gen = torch.Generator().manual_seed(1000 + dp_rank)  # each data-parallel rank trains its own tokens
        batches = [PackedBatch.from_sequences([torch.randint(1, config.vocab_size, (opts["seq_len"],), generator=gen)
                                               for _ in range(opts["seqs_per_micro_batch"])])
                   for _ in range(opts["micro_batches"])]
        norm = sum(b.num_loss_tokens for b in batches)

        def loss_fn(lp, entropy, batch):
            return -(lp * batch.loss_mask).sum() / norm, {}

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        fb, full = [], []
        for i in range(opts["warmup"] + opts["steps"]):
            dist.barrier()
            _sync()
            t0 = time.perf_counter()
            trainer.forward_backward(batches, loss_fn)
            _sync()
            t1 = time.perf_counter()
            trainer.optimizer_step()
            _sync()
            t2 = time.perf_counter()
            if i >= opts["warmup"]:
                fb.append(t1 - t0)
                full.append(t2 - t0)
        tokens = sum(b.num_tokens for b in batches) * dp
        peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
        trainer.shutdown()
        del trainer
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        fb_s, full_s = statistics.median(fb), statistics.median(full)
        out.append({"layout": name, "parallel": parallel, "world": world, "dp": dp, "logprobs": logprobs,
                    "tokens_per_step": tokens, "fwd_bwd_ms": 1e3 * fb_s, "step_ms": 1e3 * full_s,
                    "fwd_bwd_tokens_per_s": tokens / fb_s, "step_tokens_per_s": tokens / full_s,
                    "peak_mem_gib_rank0": peak})
    return out if dist.get_rank() == 0 else None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--preset", default=None, help="model (default: small on cuda, tiny on cpu)")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"two-GPU layouts, of {list(LAYOUTS)}")
    p.add_argument("--seq-len", type=int, default=None, help="training tokens per sequence (default 2048; cpu 16)")
    p.add_argument("--seqs-per-micro-batch", type=int, default=None, help="default 4 (cpu 2)")
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--probe-seqs", type=int, default=None, help="logprob batch: sequences (default 8; cpu 2)")
    p.add_argument("--probe-len", type=int, default=None, help="logprob batch: tokens each (default 512; cpu 16)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1500.0, help="seconds for each launch (all its layouts)")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    from beamrl.trainer.megatron.launch import launch

    args = parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and torch.cuda.device_count() < 2:
        print(f"error: needs 2 GPUs, {torch.cuda.device_count()} visible (use --device cpu for the smoke run)")
        return 2
    names = [n for n in args.layouts.split(",") if n]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        print(f"error: --layouts {unknown} unknown; choose from {list(LAYOUTS)}")
        return 2
    opts = {"preset": args.preset or ("small" if cuda else "tiny"), "seed": args.seed,
            "seq_len": args.seq_len or (2048 if cuda else 16),
            "seqs_per_micro_batch": args.seqs_per_micro_batch or (4 if cuda else 2),
            "micro_batches": args.micro_batches, "probe_seqs": args.probe_seqs or (8 if cuda else 2),
            "probe_len": args.probe_len or (512 if cuda else 16), "warmup": args.warmup, "steps": args.steps}
    env = {} if cuda else {"CUDA_VISIBLE_DEVICES": ""}
    print(f"trainer_parallel_h200: device={args.device} preset={opts['preset']} bf16 layouts=tp1,{','.join(names)} "
          f"tokens/micro-batch={opts['seq_len'] * opts['seqs_per_micro_batch']} x {opts['micro_batches']}", flush=True)
    t0 = time.perf_counter()
    (tp1,) = launch(run_layouts, 1, ([("tp1", {})], opts), timeout_s=args.timeout, env=env)[0]
    print(f"  tp1 done in {time.perf_counter() - t0:.0f} s", flush=True)
    t0 = time.perf_counter()
    two = launch(run_layouts, 2, ([(n, LAYOUTS[n]) for n in names], opts), timeout_s=args.timeout, env=env)[0]
    print(f"  two-GPU layouts done in {time.perf_counter() - t0:.0f} s", flush=True)
    ref = tp1["logprobs"]
    rows = []
    for r in [tp1, *two]:
        d = (r.pop("logprobs") - ref).abs()
        rows.append({**r, "max_abs_dlogprob_vs_tp1": d.max().item(), "mean_abs_dlogprob_vs_tp1": d.mean().item(),
                     "speedup_vs_tp1": r["fwd_bwd_tokens_per_s"] / tp1["fwd_bwd_tokens_per_s"]})
    print()
    print("| layout | GPUs | dp | max abs dlogprob vs TP1 | mean | fwd+bwd tok/s | vs TP1 | fwd+bwd ms | step ms | "
          "peak GiB (rank 0) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        peak = "n/a" if r["peak_mem_gib_rank0"] is None else f"{r['peak_mem_gib_rank0']:.1f}"
        print(f"| {r['layout']} | {r['world']} | {r['dp']} | {r['max_abs_dlogprob_vs_tp1']:.3e} | "
              f"{r['mean_abs_dlogprob_vs_tp1']:.3e} | {r['fwd_bwd_tokens_per_s']:,.0f} | {r['speedup_vs_tp1']:.2f}x | "
              f"{r['fwd_bwd_ms']:.1f} | {r['step_ms']:.1f} | {peak} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "options": opts, "device": args.device, "torch": torch.__version__,
                       "gpu": torch.cuda.get_device_name(0) if cuda else None}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
