#!/usr/bin/env python
"""Megatron trainer on one H200: bf16 logprob parity with the reference model, and train-step throughput.

Sections (each in its own try/except, so one failure keeps the others' results):
  parity_tiny          TP1 Megatron vs the reference model, bf16, `preset("tiny")`: max / mean |delta logprob|
  parity_real_width_2l the same on a 2-layer real-width config (`small` widths: hidden 5120, 48/8 heads x 128,
                       one dense + one MoE layer of 16 experts top-8)
  train_small          bf16 train step of the `small` preset (4 layers, 16 experts): forward+backward tokens/s
                       (median of the timed steps after warm-up), full step time (with the Adam update)
  train_small_fused    the same with `use_fused_kernels=True` (Triton / FlexAttention ops), if triton exists

  python benchmarks/trainer_h200.py                       # one H200 (writes $OUT/trainer_h200.json)
  python benchmarks/trainer_h200.py --device cpu --tiny   # CPU smoke run of every section at tiny sizes

Needs torch, megatron-core 0.19.2 (no TE) and the repo on PYTHONPATH; no sglang, no ray. Runs in this process as
a 1-rank world (NCCL on GPU, gloo + the CPU compatibility layer on CPU).
"""

from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
if "--tiny" in __import__("sys").argv:  # CPU smoke run: Megatron's jit_fuser would compile each tiny op
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from beamrl.models.beam import preset  # noqa: E402
from benchmarks._bench_utils import (free_device_memory, random_micro_batches, run_sections, sync_device,  # noqa: E402
                                     time_train_steps)
from beamrl.parity.fused_vs_eager import real_width_config  # noqa: E402




def _trainer(config, use_fused_kernels: bool = False):
    from beamrl.trainer.megatron.config import TrainerConfig
    from beamrl.trainer.megatron.worker import MegatronTrainer, TrainerSetup

    trainer_config = TrainerConfig(num_gpus=1, global_batch_size=1, lr=1e-6, distributed_optimizer=False,
                                   use_fused_kernels=use_fused_kernels)
    return MegatronTrainer(TrainerSetup(model=config, trainer=trainer_config, dtype="bfloat16"))


def parity(config, device: str, num_sequences: int, seq_len: int, seed: int = 0) -> dict:
    """Megatron (TP1) vs the reference model in bf16 on the same random weights and prompts."""
    from beamrl.models.beam.model import BeamForCausalLM
    from beamrl.models.beam.weights import random_state_dict
    from beamrl.trainer.protocol import PackedBatch

    t0 = time.perf_counter()
    weights = random_state_dict(config, seed, torch.bfloat16)  # router / correction bias stay FP32
    g = torch.Generator().manual_seed(seed + 1)
    prompts = torch.randint(1, config.vocab_size, (num_sequences, seq_len), generator=g)
    trainer = _trainer(config)
    trainer.load_hf_state_dict(weights)
    batch = PackedBatch.from_sequences(list(prompts))
    meg = trainer.compute_logprobs(batch, temperature=1.0, return_entropy=False).logprobs
    meg = meg.view(num_sequences, seq_len)[:, 1:]  # token t >= 1 of each sequence
    trainer.shutdown()
    del trainer
    free_device_memory()
    ref_model = BeamForCausalLM(config, dtype=torch.bfloat16, device=device)
    ref_model.load_hf_tensors(weights, strict=True)
    del weights
    with torch.no_grad():
        ref = ref_model.token_logprobs(prompts.to(device)).float().cpu()
    del ref_model
    free_device_memory()
    d = (meg.float() - ref).abs()
    return {"tokens": d.numel(), "max_abs_dlogprob": d.max().item(), "mean_abs_dlogprob": d.mean().item(),
            "params": config.num_parameters(), "seconds": time.perf_counter() - t0}


def train_throughput(config, use_fused_kernels: bool, seq_len: int, seqs_per_micro_batch: int, micro_batches: int,
                     warmup: int, steps: int, seed: int = 0) -> dict:
    """bf16 forward+backward tokens/s and full step time of `config` (Megatron's random init)."""
    trainer = _trainer(config, use_fused_kernels)
    batches = random_micro_batches(config.vocab_size, seq_len, seqs_per_micro_batch, micro_batches, seed)
    timed = time_train_steps(trainer, batches, warmup, steps)
    fb, full, losses, tokens, peak = (timed[k] for k in ("fwd_bwd_s", "step_s", "losses", "tokens", "peak_mem_gib"))
    trainer.shutdown()
    del trainer
    free_device_memory()
    fb_s, full_s = statistics.median(fb), statistics.median(full)
    return {"tokens_per_step": tokens, "micro_batches": micro_batches, "seq_len": seq_len,
            "fwd_bwd_ms": 1e3 * fb_s, "step_ms": 1e3 * full_s, "fwd_bwd_tokens_per_s": tokens / fb_s,
            "step_tokens_per_s": tokens / full_s, "peak_mem_gib": peak, "losses": losses,
            "params": config.num_parameters()}


def fused_kernels_available(device: str) -> tuple[bool, str]:
    if device != "cuda":
        return False, "fused kernels need CUDA"
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed"
    return True, ""


def fused_vs_eager(config, num_sequences: int, seq_len: int, seed: int = 0) -> dict:
    """Fused vs eager trainer logprobs with FP32 as the yardstick (beamrl/parity/fused_vs_eager.py, issue #6)."""
    from beamrl.parity.fused_vs_eager import compare

    return compare(config, num_sequences, seq_len, seed).to_dict()


def sections(args) -> list[tuple[str, callable]]:
    dev = args.device
    if args.tiny:
        two_layers, train_cfg = real_width_config(2, "tiny"), preset("tiny")
        n, s, tr = 2, 16, dict(seq_len=16, seqs_per_micro_batch=2, micro_batches=2, warmup=1, steps=2)
    else:
        two_layers, train_cfg = real_width_config(2), preset("small")
        n, s, tr = args.num_sequences, args.seq_len, dict(seq_len=args.train_seq_len,
                                                           seqs_per_micro_batch=args.seqs_per_micro_batch,
                                                           micro_batches=args.micro_batches, warmup=args.warmup,
                                                           steps=args.steps)
    out = [("parity_tiny", lambda: parity(preset("tiny"), dev, n, s)),
           ("parity_real_width_2l", lambda: parity(two_layers, dev, n, s)),
           ("train_small", lambda: train_throughput(train_cfg, False, **tr))]
    ok, why = fused_kernels_available(dev)
    if ok:
        out.append(("train_small_fused", lambda: train_throughput(train_cfg, True, **tr)))
        out.append(("fused_vs_eager_2l", lambda: fused_vs_eager(two_layers, n, s)))
    else:
        out.append(("train_small_fused", lambda: {"skipped": why}))
    return out


def format_table(results: dict) -> str:
    lines = [f"{'section':<22} {'result':<80}", "-" * 103]
    for name, r in results.items():
        if name == "meta":
            continue
        if "error" in r:
            text = "ERROR " + r["error"].strip().splitlines()[-1][:74]
        elif "skipped" in r:
            text = "skipped: " + r["skipped"]
        elif "criterion" in r:
            text = ("PASS " if r["within_bf16_tolerance"] else "FAIL ") + r["criterion"][:74]
        elif "max_abs_dlogprob" in r:
            text = (f"max|dlp| {r['max_abs_dlogprob']:.3e}  mean|dlp| {r['mean_abs_dlogprob']:.3e}  "
                    f"tokens {r['tokens']}  params {r['params'] / 1e6:.1f}M")
        else:
            text = (f"fwd+bwd {r['fwd_bwd_tokens_per_s']:,.0f} tok/s ({r['fwd_bwd_ms']:.1f} ms)  step "
                    f"{r['step_ms']:.1f} ms  {r['tokens_per_step']} tok  peak {r['peak_mem_gib']:.1f} GiB")
        lines.append(f"{name:<22} {text}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny sizes everywhere (CPU smoke run)")
    p.add_argument("--num-sequences", type=int, default=8, help="parity: sequences (default 8)")
    p.add_argument("--seq-len", type=int, default=512, help="parity: tokens per sequence (default 512)")
    p.add_argument("--train-seq-len", type=int, default=2048, help="train: tokens per sequence (default 2048)")
    p.add_argument("--seqs-per-micro-batch", type=int, default=2, help="train: sequences per micro-batch (default 2)")
    p.add_argument("--micro-batches", type=int, default=2, help="train: micro-batches per step (default 2)")
    p.add_argument("--warmup", type=int, default=2, help="train: untimed steps (default 2)")
    p.add_argument("--steps", type=int, default=5, help="train: timed steps (default 5)")
    p.add_argument("--only", nargs="*", default=None, help="run only these sections")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")), help="directory of the JSON")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available (use --device cpu --tiny)")
    from beamrl.trainer.megatron.launch import set_one_rank_world_env

    set_one_rank_world_env()
    from beamrl.trainer.megatron.config import ParallelConfig
    from beamrl.trainer.megatron.parallel import initialize_parallel

    initialize_parallel(ParallelConfig())
    results = {"meta": {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                        "torch": torch.__version__, "argv": sys.argv[1:], "date": time.strftime("%Y-%m-%d %H:%M")}}
    path = args.out / "trainer_h200.json"
    rc = run_sections([(n, f) for n, f in sections(args) if not args.only or n in args.only], results, path)
    print(format_table(results))
    print(f"wrote {path}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
