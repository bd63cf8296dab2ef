"""`beamrl bench sync`: time a real, verified weight sync into an engine (docs/weight-sync.md).

The trainer side is the reference model loaded from `--checkpoint`, with Gaussian noise added to every weight
(so the sync visibly changes what the engine computes). The perturbed weights go through the chosen transport
into a freshly started engine; then the engine's prompt logprobs on fixed random probes are compared with the
reference's for the perturbed weights. Prints a summary; `--json FILE` writes exactly
`{"engine", "transport", "bytes", "seconds", "gbps", "verified", "max_abs_logprob_diff_after_sync"}`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from beamrl.dtypes import RUN_DTYPES, torch_dtype
from beamrl.sync.bucketing import DEFAULT_BUCKET_BYTES

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
    p.add_argument("--tolerance", type=float, default=None,
                   help="max |engine - reference| prompt logprob to pass verification (default: 1e-4 for the "
                        "native engine in float32; 0.05 otherwise: bf16, or SGLang's CPU path with BF16 RoPE)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed for each engine call")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="device of trainer buffers and engine (default: cuda if available)")


def default_tolerance(engine: str, dtype: str) -> float:
    return 1e-4 if (engine == "native" and dtype == "float32") else 0.05


def probe_sequences(vocab: int, seed: int, n: int = 4, length: int = 24) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(1, vocab, (n, length), generator=g).tolist()


def perturb_(model: torch.nn.Module, std: float, seed: int) -> None:
    """Add N(0, std^2) noise to every weight, generated on CPU so it is the same on every device."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((std * torch.randn(p.shape, generator=g)).to(device=p.device, dtype=p.dtype))


def start_engine(args: argparse.Namespace):
    """The engine as (receiver, engine view): a NativeEngine in its own process, or an SGLang engine."""
    if args.engine == "native":
        from beamrl.rollout.native.config import NativeEngineConfig
        from beamrl.rollout.native.engine import NativeEngine
        from beamrl.sync.process_receiver import HostedEngine

        # Its own process, as in deployment: the distributed group needs a separate rank, and the colocated
        # path then really crosses a process boundary (shared memory on CPU, CUDA-IPC on GPU).
        cfg = NativeEngineConfig(model_path=str(args.checkpoint), dtype=args.dtype, device=args.device,
                                 name="native-0")
        engine = HostedEngine(NativeEngine, (cfg,), name="native-0", start_timeout=args.timeout)
        return engine, engine.shutdown
    from beamrl.rollout.sglang.config import SGLangEngineConfig
    from beamrl.rollout.sglang.engine import SGLangEngine

    if args.device == "cpu":
        cfg = SGLangEngineConfig.on_cpu(str(args.checkpoint), dtype=args.dtype, return_routed_experts=False)
    else:
        cfg = SGLangEngineConfig(model_path=str(args.checkpoint), dtype=args.dtype, device="cuda")
    engine = SGLangEngine(cfg, start_timeout=args.timeout)
    return engine, engine.shutdown


def run_sync(args: argparse.Namespace) -> dict:
    from beamrl.models.beam.model import BeamForCausalLM
    from beamrl.sync.session import SyncTimeouts, WeightSyncManager, max_abs_diff
    from beamrl.sync.transports import TRANSPORTS as REGISTRY

    if args.bucket_mb <= 0:
        raise SystemExit(f"error: --bucket-mb must be > 0, got {args.bucket_mb}")
    trainer = BeamForCausalLM.from_pretrained(args.checkpoint, dtype=torch_dtype(args.dtype), device=args.device).eval()
    perturb_(trainer, args.noise, args.seed)
    probes = probe_sequences(trainer.config.vocab_size, args.seed)
    want = [trainer.token_logprobs(torch.tensor([s], device=trainer.device))[0].tolist() for s in probes]
    tolerance = args.tolerance if args.tolerance is not None else default_tolerance(args.engine, args.dtype)

    print(f"bench sync: starting {args.engine} engine on {args.checkpoint} ({args.dtype}, {args.device})",
          file=sys.stderr, flush=True)
    engine, stop = start_engine(args)
    try:
        before = max_abs_diff(engine.score(probes, args.timeout), want)
        kwargs = {"device": args.device} if args.transport == "distributed" else {}
        transport = REGISTRY.get(args.transport)([engine], **kwargs)
        t = args.timeout
        manager = WeightSyncManager(transport, engines=[engine], bucket_bytes=int(args.bucket_mb * 2**20),
                                    timeouts=SyncTimeouts(connect=t, call=t, bucket=t, verify=t),
                                    initial_version=engine.weight_version)
        try:
            report = manager.sync([[(n, p.detach()) for n, p in trainer.named_parameters()]])
        finally:
            manager.close()
        after = max_abs_diff(engine.score(probes, args.timeout), want)
    finally:
        stop()
    print(f"bench sync: max |engine - perturbed reference| prompt logprob: before sync {before:.3e}, "
          f"after sync {after:.3e} (tolerance {tolerance:g})", file=sys.stderr)
    return {"engine": args.engine, "transport": args.transport, "bytes": int(report.bytes),
            "seconds": float(report.seconds), "gbps": float(report.gbps), "verified": bool(after <= tolerance),
            "max_abs_logprob_diff_after_sync": float(after)}


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
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["verified"] else 1
