"""Fused vs eager trainer logprobs on one GPU, with FP32 as the yardstick of "within bf16 tolerance" (issue #6).

The fused path (Triton norms/gates, FlexAttention, grouped expert GEMMs) is not bit-equal to the eager path:
reductions run in other orders and the grouped GEMM rounds once more (docs/kernels.md). What it must not do is
move logprobs further from exact arithmetic than bf16 itself does. So both bf16 paths are measured against the
same model in FP32, on the same routes:

    E   eager bf16, free routing (its routes R_E are recorded)
    F   fused bf16, free routing (routes R_F recorded)
    Fr  fused bf16, R_E replayed
    X   eager FP32, R_E replayed                     (the yardstick)

`eager_vs_fp32` = |E - X| is bf16's own error on this model; `fused_vs_fp32` = |Fr - X| is the fused path's.
The fused path is within bf16 tolerance when its mean error is at most `MEAN_RATIO` times eager's and its max
at most `MAX_RATIO` times eager's max. |F - E| with free routing and the agreement of R_F with R_E are reported
too: on random weights near-tied top-k choices flip under any 1-ulp change, as between TP1 and TP2.

    python -m beamrl.parity.fused_vs_eager --layers 2 --json /tmp/fused_vs_eager.json   # one CUDA GPU
    python -m beamrl.parity.fused_vs_eager --tiny --self-check                          # the comparison, on CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch

from beamrl.models.beam import preset
from beamrl.models.beam.config import BeamConfig, DENSE, FULL, SLIDING, SPARSE
from beamrl.parity.comparison import routing_matches

#: Fused mean |dlogprob| vs FP32 may be at most this multiple of eager bf16's.
MEAN_RATIO = 1.25
#: Fused max |dlogprob| vs FP32 may be at most this multiple of eager bf16's.
MAX_RATIO = 2.0


@dataclass(frozen=True)
class Gap:
    mean: float
    max: float

    @staticmethod
    def of(a: torch.Tensor, b: torch.Tensor) -> "Gap":
        d = (a.double() - b.double()).abs()
        if not torch.isfinite(d).all():
            raise ValueError("non-finite logprob in the fused/eager comparison")
        return Gap(float(d.mean()), float(d.max()))


@dataclass(frozen=True)
class FusedVsEager:
    tokens: int
    params: int
    eager_vs_fp32: Gap
    fused_vs_fp32: Gap
    fused_vs_eager_replayed: Gap
    fused_vs_eager_free: Gap
    free_route_agreement: float
    seconds: float

    def within_bf16_tolerance(self) -> tuple[bool, str]:
        """(ok, why): the fused path's FP32 gap against eager bf16's, with MEAN_RATIO / MAX_RATIO."""
        e, f = self.eager_vs_fp32, self.fused_vs_fp32
        ok = f.mean <= MEAN_RATIO * e.mean and f.max <= MAX_RATIO * e.max
        why = (f"fused vs fp32 mean {f.mean:.3e} (limit {MEAN_RATIO} x eager's {e.mean:.3e}), max {f.max:.3e} "
               f"(limit {MAX_RATIO} x eager's {e.max:.3e})")
        return ok, why

    def to_dict(self) -> dict:
        out = asdict(self)
        out["within_bf16_tolerance"], out["criterion"] = self.within_bf16_tolerance()
        return out


def route_agreement(a: torch.Tensor, b: torch.Tensor, moe_layers) -> float:
    """Fraction of (token, MoE layer) top-k sets that agree; routes [T, layers, k] (`comparison.routing_matches`)."""
    return float(routing_matches(a.numpy(), b.numpy(), moe_layers).mean())


def real_width_config(layers: int, widths: str = "small") -> BeamConfig:
    """`small`'s real widths (hidden 5120, 48/8 heads x 128, 16 experts of 2560, top-8), or another preset's,
    with `layers` layers: SWA and full/SSMax alternating, the first dense and the rest MoE."""
    kinds = [SLIDING if i % 2 == 0 else FULL for i in range(layers)]
    mlps = [DENSE] + [SPARSE] * (layers - 1)
    return preset(widths).replace(num_hidden_layers=layers, layer_types=kinds, mlp_layer_types=mlps)


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _run(config, weights, batch, dtype: str, fused: bool, routes=None):
    from beamrl.trainer.megatron.config import TrainerConfig
    from beamrl.trainer.megatron.worker import MegatronTrainer, TrainerSetup

    # One rank, scoring only: the learning rate and batch sizes are never used.
    trainer_config = TrainerConfig(num_gpus=1, global_batch_size=1, lr=1e-6, distributed_optimizer=False,
                                   use_fused_kernels=fused)
    trainer = MegatronTrainer(TrainerSetup(model=config, trainer=trainer_config, dtype=dtype))
    try:
        trainer.load_hf_state_dict(weights)
        trainer.set_routing_record(routes is None)
        trainer.set_routing_replay(routes is not None)
        res = trainer.compute_logprobs(batch, temperature=1.0, return_entropy=False, routes=routes)
        return res.logprobs.float().cpu(), (res.routes.cpu() if res.routes is not None else None)
    finally:
        trainer.shutdown()
        del trainer
        _free()


def compare(config: BeamConfig, num_sequences: int, seq_len: int, seed: int = 0,
            log=lambda m: print(m, flush=True), candidate_fused: bool = True) -> FusedVsEager:
    """Run the four passes of the module docstring on one CUDA device (in a 1-rank torch.distributed world, as
    `main` sets up). TF32 is off for the duration (the FP32 yardstick must be FP32) and restored after.

    candidate_fused=False scores the "fused" passes with the eager path too: a self-check of the comparison
    itself (every fused-vs-eager gap must then be exactly 0), which also runs on CPU."""
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        return _compare(config, num_sequences, seq_len, seed, log, candidate_fused)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def _compare(config, num_sequences, seq_len, seed, log, candidate_fused) -> FusedVsEager:
    from beamrl.models.beam.weights import random_state_dict
    from beamrl.trainer.protocol import PackedBatch

    t0 = time.perf_counter()
    weights = random_state_dict(config, seed, torch.bfloat16)  # router / correction bias stay FP32
    g = torch.Generator().manual_seed(seed + 1)
    batch = PackedBatch.from_sequences(list(torch.randint(1, config.vocab_size, (num_sequences, seq_len),
                                                          generator=g)))
    log("eager bf16 (free routing, recorded)")
    e, r_e = _run(config, weights, batch, "bfloat16", fused=False)
    log("fused bf16 (free routing, recorded)")
    f, r_f = _run(config, weights, batch, "bfloat16", fused=candidate_fused)
    log("fused bf16 (eager routes replayed)")
    fr, _ = _run(config, weights, batch, "bfloat16", fused=candidate_fused, routes=r_e)
    log("eager fp32 (eager routes replayed)")
    x, _ = _run(config, {k: v.float() for k, v in weights.items()}, batch, "float32", fused=False, routes=r_e)
    return FusedVsEager(tokens=int(e.numel()), params=config.num_parameters(), eager_vs_fp32=Gap.of(e, x),
                        fused_vs_fp32=Gap.of(fr, x), fused_vs_eager_replayed=Gap.of(fr, e),
                        fused_vs_eager_free=Gap.of(f, e), free_route_agreement=route_agreement(r_f, r_e, config.moe_layers),
                        seconds=time.perf_counter() - t0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2, help="layers at real width (default 2: one dense, one MoE)")
    p.add_argument("--num-sequences", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=str, default=None)
    p.add_argument("--tiny", action="store_true", help="the `tiny` preset's widths instead of the real ones")
    p.add_argument("--self-check", action="store_true",
                   help="score the fused passes with the eager path too (runs on CPU; every fused gap must be 0)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() and not args.self_check:
        print("beamrl.parity.fused_vs_eager needs a CUDA GPU (the fused path is CUDA-only); --self-check runs "
              "the comparison itself on CPU", file=sys.stderr)
        return 2
    from beamrl.trainer.megatron.launch import set_one_rank_world_env
    from beamrl.trainer.megatron.config import ParallelConfig
    from beamrl.trainer.megatron.parallel import initialize_parallel

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    set_one_rank_world_env()
    initialize_parallel(ParallelConfig())
    config = real_width_config(args.layers, "tiny" if args.tiny else "small")
    result = compare(config, args.num_sequences, args.seq_len, args.seed, candidate_fused=not args.self_check)
    out = result.to_dict()
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    ok, why = result.within_bf16_tolerance()
    print(("PASS " if ok else "FAIL ") + why)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
