"""`beamrl bench sync`: time a real, verified weight sync into an engine (docs/weight-sync.md).

The trainer side is the reference model loaded from `--checkpoint`, with Gaussian noise added to every weight
(so the sync visibly changes what the engine computes). The perturbed weights go through the sync orchestrator
training uses (`WeightSync`: the same plan, packing, transports, manifest and per-bucket checksums) into a freshly
started engine, and the result is verified where both sides compute the same thing:
- float32: the engine's prompt logprobs on random probes must match the reference model's within `--tolerance`
  (1e-4). SGLang runs with its FP32 lm_head GEMM (`enable_fp32_lm_head`) and, since its Beam stores lm_head in
  BF16, the perturbed lm_head is kept BF16-representable;
- bfloat16: the engine after the sync must score the probes bit for bit like the same engine loaded from a
  checkpoint of the same weights (`update_weights_from_disk`).
Prints a summary; `--json FILE` writes exactly `{"engine", "transport", "dtype", "bytes", "seconds", "gbps",
"verified", "check", "max_abs_logprob_diff_after_sync", "code_path"}`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from beamrl.dtypes import RUN_DTYPES, torch_dtype
from beamrl.sync.plan import DEFAULT_BUCKET_BYTES

if TYPE_CHECKING:
    from beamrl.sync.orchestrator import SyncReport

NAME = "bench"
HELP = "Benchmarks (sync: a verified weight sync of perturbed weights into an engine)."
ENGINES = ("native", "sglang")
TRANSPORTS = ("colocated", "distributed")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = sub.add_parser("sync", help="sync perturbed weights into an engine; report bytes, seconds, GB/s",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, type=Path, help="Beam checkpoint directory (SGLang format)")
    p.add_argument("--engine", required=True, choices=ENGINES, help="engine receiving the weights")
    p.add_argument("--transport", required=True, choices=TRANSPORTS, help="weight transport")
    p.add_argument("--json", type=Path, default=None, help="write the result as JSON to this file")
    p.add_argument("--bucket-mb", type=float, default=DEFAULT_BUCKET_BYTES / 2**20,
                   help=f"bucket size in MiB (default {DEFAULT_BUCKET_BYTES // 2**20})")
    p.add_argument("--dtype", default="float32", choices=sorted(RUN_DTYPES),
                   help="dtype of trainer and engine weights (router stays float32; default float32: exact on CPU)")
    p.add_argument("--noise", type=float, default=0.02, help="std of the noise added to every weight (default 0.02)")
    p.add_argument("--seed", type=int, default=0, help="seed of the noise and of the probe sequences")
    p.add_argument("--tolerance", type=float, default=1e-4,
                   help="float32: max |engine - reference| prompt logprob to pass verification (default 1e-4); "
                        "bfloat16 is checked by exact agreement with a freshly loaded engine")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed for each engine call")
    p.add_argument("--lora", action="store_true", help="after the full sync, an adapter-only sync into an engine "
                   "started with a LoRA config; reports both and the projection for --lora-recipe (docs/lora.md)")
    p.add_argument("--lora-rank", type=int, default=8, help="--lora: adapter rank (alpha = 2 * rank)")
    p.add_argument("--lora-targets", default="", help="--lora: comma-separated targets (default: every kind)")
    p.add_argument("--lora-recipe", default="lora_grpo_dapo_math",
                   help="--lora: the LoRA recipe whose bytes per sync are projected (default lora_grpo_dapo_math)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="device of trainer buffers and engine (default: cuda if available)")


def probe_sequences(vocab: int, seed: int, n: int = 4, length: int = 24) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(1, vocab, (n, length), generator=g).tolist()


def perturb_(model: torch.nn.Module, std: float, seed: int, bf16_lm_head: bool = False) -> None:
    """Add N(0, std^2) noise to every weight, generated on CPU so it is the same on every device. `bf16_lm_head`:
    round lm_head to BF16-representable values (SGLang's Beam stores lm_head in BF16 even in float32)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_((std * torch.randn(p.shape, generator=g)).to(device=p.device, dtype=p.dtype))
            if bf16_lm_head and name == "lm_head.weight":
                p.copy_(p.to(torch.bfloat16).to(p.dtype))


def start_engine(args: argparse.Namespace):
    """The engine as (receiver, engine view): a NativeEngine in its own process, or an SGLang engine."""
    if args.engine == "native":
        from beamrl.rollout.native.config import NativeEngineConfig
        from beamrl.rollout.native.engine import NativeEngine
        from beamrl.sync.process_receiver import HostedEngine

        # Its own process, as in deployment: the distributed group needs a separate rank, and the colocated
        # path then really crosses a process boundary (shared memory on CPU, CUDA-IPC on GPU).
        cfg = NativeEngineConfig(model_path=str(args.checkpoint), dtype=args.dtype, device=args.device,
                                 name="native-0", lora=_lora(args))
        engine = HostedEngine(NativeEngine, (cfg,), name="native-0", start_timeout=args.timeout)
        return engine, engine.shutdown
    from beamrl.rollout.sglang.config import SGLangEngineConfig
    from beamrl.rollout.sglang.engine import SGLangEngine

    fp32_head = args.dtype == "float32"  # the head GEMM in FP32, as the trainer computes it
    if args.device == "cpu":
        cfg = SGLangEngineConfig.on_cpu(str(args.checkpoint), dtype=args.dtype, return_routed_experts=False,
                                        enable_fp32_lm_head=fp32_head, lora=_lora(args))
    else:
        cfg = SGLangEngineConfig(model_path=str(args.checkpoint), dtype=args.dtype, device="cuda",
                                 enable_fp32_lm_head=fp32_head, lora=_lora(args))
    engine = SGLangEngine(cfg, start_timeout=args.timeout)
    return engine, engine.shutdown


def _lora(args: argparse.Namespace):
    if not getattr(args, "lora", False):
        return None
    from beamrl.commands.bench_lora import lora_config

    return lora_config(args)


def sync_once(args: argparse.Namespace, engine, source, probes) -> "SyncReport":
    """One sync of `source` into `engine` through the orchestrator training uses (the transport, bucket size and
    timeout of the command line); with `probes`, verified on them at `--tolerance`. Returns the report."""
    from beamrl.sync.orchestrator import ProbeCheck, SyncTimeouts, WeightSync
    from beamrl.sync.transports import TRANSPORTS

    sync = WeightSync(lambda receivers: TRANSPORTS.get(args.transport)(receivers, device=args.device), [engine],
                      bucket_bytes=int(args.bucket_mb * 2**20), timeouts=SyncTimeouts.uniform(args.timeout),
                      initial_version=engine.served_weight_version(args.timeout),
                      probe=ProbeCheck(probes, args.tolerance) if probes is not None else None)
    try:
        return sync.sync(source)
    finally:
        sync.close()


def run_sync(args: argparse.Namespace) -> dict:
    import tempfile

    from beamrl.models.beam.model import BeamForCausalLM
    from beamrl.sync.export import StateDictSource
    from beamrl.sync.orchestrator import logprob_gap

    if args.bucket_mb <= 0:
        raise SystemExit(f"error: --bucket-mb must be > 0, got {args.bucket_mb}")
    if args.lora and args.engine == "sglang" and args.dtype != "float32":
        raise SystemExit("error: --lora with --engine sglang is verified in float32 only (its weights cannot be read "
                         "back whole); use --dtype float32")
    trainer = BeamForCausalLM.from_pretrained(args.checkpoint, dtype=torch_dtype(args.dtype), device=args.device).eval()
    exact = args.dtype == "float32"
    perturb_(trainer, args.noise, args.seed, bf16_lm_head=args.engine == "sglang")
    source = StateDictSource.of_model(trainer)
    probes = probe_sequences(trainer.config.vocab_size, args.seed)
    want = source.logprobs(probes)

    print(f"bench sync: starting {args.engine} engine on {args.checkpoint} ({args.dtype}, {args.device})",
          file=sys.stderr, flush=True)
    engine, stop = start_engine(args)
    try:
        before = logprob_gap(engine.score(probes, args.timeout), want).max
        report = sync_once(args, engine, source, probes if exact else None)
        if exact:
            after, check = report.max_abs_logprob_diff, f"probe logprobs vs the reference model <= {args.tolerance:g}"
            verified = report.verified and after <= args.tolerance
        else:
            synced = engine.score(probes, args.timeout)
            with tempfile.TemporaryDirectory(prefix="beamrl-bench-sync-") as tmp:
                trainer.save_pretrained(tmp)
                engine.update_weights_from_disk(tmp, args.timeout)
                loaded = engine.score(probes, args.timeout)
            after, check = logprob_gap(synced, loaded).max, "bit-exact vs the engine loaded from a checkpoint"
            verified = synced == loaded
            print(f"bench sync: max |synced - freshly loaded| prompt logprob {after:.3e} (must be 0); vs the "
                  f"reference model {logprob_gap(synced, want).max:.3e}", file=sys.stderr)
        lora = None
        if args.lora:  # the engine holds the perturbed base (synced, or reloaded from its checkpoint)
            from beamrl.commands.bench_lora import run_lora_sync

            lora = run_lora_sync(args, trainer, report, engine, probes)
    finally:
        stop()
    print(f"bench sync: {report.code_path}; max |engine - perturbed reference| prompt logprob: before sync "
          f"{before:.3e}, after sync {logprob_gap(synced, want).max if not exact else after:.3e}", file=sys.stderr)
    return {"engine": args.engine, "transport": args.transport, "dtype": args.dtype, "bytes": int(report.bytes),
            "seconds": float(report.seconds), "gbps": float(report.gbps), "verified": bool(verified), "check": check,
            "max_abs_logprob_diff_after_sync": float(after), "code_path": report.code_path,
            **({"lora": lora} if lora is not None else {})}


def run(args: argparse.Namespace) -> int:
    if args.action != "sync":  # argparse only offers 'sync' today
        raise SystemExit(f"error: unknown bench action {args.action!r}")
    if not (args.checkpoint / "config.json").exists():
        print(f"error: --checkpoint {args.checkpoint} has no config.json (not a Beam checkpoint directory)")
        return 2
    result = run_sync(args)
    print(f"{result['engine']:>8} {result['transport']:>12}  {result['bytes'] / 2**20:10.2f} MiB  "
          f"{result['seconds']:8.3f} s  {result['gbps']:8.3f} GB/s  verified={result['verified']}  "
          f"max|dlogprob|={result['max_abs_logprob_diff_after_sync']:.2e}")
    if "lora" in result:
        from beamrl.commands.bench_lora import format_lines

        print("\n".join(format_lines(result)))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["verified"] and result.get("lora", {}).get("verified", True) else 1
