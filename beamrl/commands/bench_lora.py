"""`beamrl bench sync --lora`: an adapter-only sync next to a full sync of the same model (docs/lora.md).

The engine is started with a LoRA config (`--lora-rank`, `--lora-targets`); the full sync of the perturbed
reference goes first (as `beamrl bench sync` does without `--lora`), then an adapter-only sync of a random
adapter (non-zero B) through the same orchestrator in apply mode `adapter`. It is verified where both sides compute
the same thing: the native engine's weights must equal the reference's merged weights bit for bit (SHA-256 of
every parameter, as `weights_checksum` computes it), and in float32 the probe logprobs must match the merged
reference within `--tolerance`. The projection for a LoRA recipe (`--lora-recipe`, default the 32-GPU
`lora_grpo_dapo_math`) gives its bytes per adapter-only sync next to its full sync's, from the weight tables.
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import torch

from beamrl.models.beam.lora_config import ALL_TARGETS, LoRAConfig


def lora_config(args: argparse.Namespace) -> LoRAConfig:
    targets = tuple(t for t in args.lora_targets.split(",") if t) if args.lora_targets else ALL_TARGETS
    return LoRAConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank, targets=targets)


def merged_reference(model: torch.nn.Module, adapter: dict, lora: LoRAConfig) -> None:
    """Merge `adapter` into `model` in place with the contract's rule (what every engine must then hold)."""
    from beamrl.models.beam.lora import adapted_weights, merge_lora_weight

    params = dict(model.named_parameters())
    with torch.no_grad():
        merged = [(w.weight, merge_lora_weight(params[w.weight].data, adapter[w.a].to(params[w.weight].device),
                                               adapter[w.b].to(params[w.weight].device), lora.scale))
                  for w in adapted_weights(model.config, lora)]
        model.load_hf_tensors(merged)


def parameters_sha256(model: torch.nn.Module) -> str:
    """`NativeEngine.weights_checksum` computed on a model here."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def projection(recipe_name: str) -> dict:
    """Bytes per sync of a LoRA recipe: adapter-only vs full, from the weight tables (no device work)."""
    from beamrl.models.beam import preset
    from beamrl.models.beam.config import BeamConfig
    from beamrl.recipe import load_recipe
    from beamrl.recipe.sync_time import adapter_sync_bytes, model_bytes

    r = load_recipe(recipe_name)
    if r.trainer.lora is None:
        raise SystemExit(f"error: --lora-recipe {recipe_name}: the recipe has no trainer.lora")
    config = preset(r.model.preset) if r.model.preset else BeamConfig.from_json_file(r.model.checkpoint)
    full, _ = model_bytes(config, r.model.dtype)
    adapter = adapter_sync_bytes(config, r.trainer.lora, r.model.dtype)
    every = LoRAConfig(**{**r.trainer.lora.to_dict(), "targets": list(ALL_TARGETS)})
    every_bytes = adapter_sync_bytes(config, every, r.model.dtype)
    return {"recipe": r.run.name, "full_bytes": full, "adapter_bytes": adapter, "adapter_over_full": adapter / full,
            "all_targets_adapter_bytes": every_bytes, "all_targets_over_full": every_bytes / full,
            "rank": r.trainer.lora.rank, "targets": list(r.trainer.lora.targets)}


def run_lora_sync(args: argparse.Namespace, trainer: torch.nn.Module, full_report, engine, probes) -> dict:
    """The adapter-only sync into `engine` (already holding `trainer`'s weights from the full sync)."""
    from beamrl.models.beam.lora import random_adapter
    from beamrl.models.beam.lora_payload import ADAPTER, adapter_payload
    from beamrl.commands.bench import sync_once
    from beamrl.sync.export import StateDictSource

    lora = lora_config(args)
    adapter = {k: v.to(device=args.device) for k, v in
               random_adapter(trainer.config, lora, args.seed + 7, dtype=trainer.dtype).items()}
    merged_reference(trainer, adapter, lora)
    exact = args.dtype == "float32"
    score = lambda seqs: [trainer.token_logprobs(torch.tensor([s], device=args.device))[0].tolist()  # noqa: E731
                          for s in seqs]
    with torch.no_grad():
        source = StateDictSource(adapter_payload(adapter, lora), score=score, mode=ADAPTER)
    report = sync_once(args, engine, source, probes if exact else None)
    checks = []
    verified = report.verified if exact else True
    if exact:
        checks.append(f"probe logprobs vs the merged reference <= {args.tolerance:g}")
    if args.engine == "native":
        same = engine.weights_checksum(args.timeout) == parameters_sha256(trainer)
        verified = verified and same
        checks.append("weights bit-identical to the merged reference (SHA-256)")
    out = {"rank": lora.rank, "targets": list(lora.targets), "adapter_bytes": int(report.bytes),
           "adapter_seconds": float(report.seconds), "adapter_gbps": float(report.gbps), "adapter_buckets":
           report.buckets, "full_bytes": int(full_report.bytes), "full_seconds": float(full_report.seconds),
           "bytes_ratio": report.bytes / full_report.bytes, "verified": bool(verified), "check": "; ".join(checks),
           "max_abs_logprob_diff_after_sync": report.max_abs_logprob_diff,
           "projection": projection(args.lora_recipe)}
    print(f"bench sync --lora: adapter rank {lora.rank} on {len(lora.targets)} target kind(s): "
          f"{report.bytes / 2**20:.3f} MiB in {report.seconds:.3f} s vs full {full_report.bytes / 2**20:.3f} MiB in "
          f"{full_report.seconds:.3f} s ({100 * out['bytes_ratio']:.2f} % of the bytes); verified={verified}",
          file=sys.stderr)
    return out


def format_lines(result: dict) -> list[str]:
    lo, p = result["lora"], result["lora"]["projection"]
    return [f"{'adapter':>8} {result['transport']:>12}  {lo['adapter_bytes'] / 2**20:10.3f} MiB  "
            f"{lo['adapter_seconds']:8.3f} s  {lo['adapter_gbps']:8.3f} GB/s  verified={lo['verified']}  "
            f"({100 * lo['bytes_ratio']:.2f} % of the full sync's bytes)",
            f"projected per sync, {p['recipe']} (rank {p['rank']}, {', '.join(p['targets'])}): adapter "
            f"{p['adapter_bytes'] / 1e9:.4f} GB vs full {p['full_bytes'] / 1e9:.1f} GB = "
            f"{100 * p['adapter_over_full']:.3f} %; every target kind: {p['all_targets_adapter_bytes'] / 1e9:.2f} GB "
            f"= {100 * p['all_targets_over_full']:.2f} %"]
