"""`beamrl init-checkpoint`: write a random Beam checkpoint in SGLang's format (docs/model.md).

Tensors come from `weights.random_tensors(config, seed)` and are streamed shard by shard, so memory stays at
about one shard. `beam-501b` (about 1 TB in bf16) is refused unless `--allow-large` is given. `--tokenizer`
saves a tokenizer beside the weights (the built-in byte-level one, or a copy of an HF tokenizer directory), so
a recipe with `data.tokenizer: null` finds it offline; it must fit the preset's vocabulary and eos id.
"""

from __future__ import annotations

import argparse
import math
import shutil
import time
from pathlib import Path

import torch

from beamrl.dtypes import RUN_DTYPES, torch_dtype
from beamrl.models.beam.checkpoint import EXPERT_LAYOUTS, output_specs, save_checkpoint
from beamrl.models.beam.presets import PRESETS, preset
from beamrl.models.beam.weights import random_tensors

NAME = "init-checkpoint"
HELP = "Write a random Beam checkpoint (config.json + safetensors, SGLang's names) for a preset."
LARGE_BYTES = 64 * 2**30  # above this a checkpoint needs --allow-large


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS), help="model preset")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    parser.add_argument("--out", required=True, type=Path, help="output directory (created; must be empty)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(RUN_DTYPES),
                        help="dtype of every tensor except the FP32 router weight and correction bias")
    parser.add_argument("--expert-layout", default="per_expert", choices=EXPERT_LAYOUTS,
                        help="per_expert: experts.{e}.*_proj.weight; packed: experts.gate_up_proj / down_proj")
    parser.add_argument("--max-shard-gb", type=float, default=5.0, help="max safetensors shard size (GB, 1e9 bytes)")
    parser.add_argument("--allow-large", action="store_true",
                        help=f"allow checkpoints over {LARGE_BYTES // 2**30} GiB (beam-501b is about 1 TB)")
    parser.add_argument("--tokenizer", metavar="byte|DIR", default=None,
                        help="also save a tokenizer beside the weights: 'byte' (built in: 259 tokens, eos 0, a chat "
                             "template) or an HF tokenizer directory to copy; it must fit the preset's vocab_size "
                             "and eos id (a preset without an eos id takes the tokenizer's)")


def checkpoint_bytes(config, dtype: torch.dtype, layout: str) -> int:
    return sum(math.prod(s.shape) * torch.empty((), dtype=s.dtype(dtype)).element_size()
               for s in output_specs(config, layout).values())


def load_tokenizer_for(name: str, config) -> tuple[object, object]:
    """The tokenizer `--tokenizer` names and the config it fits (eos id filled in when the preset has none);
    ValueError saying what does not fit."""
    from beamrl.data.prompts import load_tokenizer

    if name == "digit":
        raise ValueError("--tokenizer digit is built in and has no files: set data.tokenizer: digit in the recipe")
    if name != "byte" and not Path(name).is_dir():
        raise ValueError(f"--tokenizer {name!r}: not 'byte' and not a directory (offline, copy an HF tokenizer "
                         "directory here first)")
    try:
        tokenizer = load_tokenizer(name, None)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds
        raise ValueError(f"--tokenizer {name!r} cannot be loaded: {type(e).__name__}: {e}") from None
    if len(tokenizer) > config.vocab_size:
        raise ValueError(f"--tokenizer {name!r} has {len(tokenizer)} tokens but preset vocab_size is "
                         f"{config.vocab_size}")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(f"--tokenizer {name!r} has no eos token")
    if config.eos_token_id is None:
        config = config.replace(eos_token_id=int(eos))
    elif int(eos) not in (config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]):
        raise ValueError(f"--tokenizer {name!r} has eos id {eos} but the preset's eos_token_id is "
                         f"{config.eos_token_id}")
    return tokenizer, config


def run(args: argparse.Namespace) -> int:
    dtype = torch_dtype(args.dtype)
    config = preset(args.preset).replace(dtype=args.dtype)
    tokenizer = None
    if args.tokenizer is not None:
        try:
            tokenizer, config = load_tokenizer_for(args.tokenizer, config)
        except ValueError as e:
            print(f"error: {e}")
            return 2
    total = checkpoint_bytes(config, dtype, args.expert_layout)
    if total > LARGE_BYTES and not args.allow_large:
        print(f"error: preset {args.preset!r} needs {total / 1e9:.1f} GB of disk ({args.dtype}); "
              f"pass --allow-large to write it (streamed shard by shard, about {args.max_shard_gb:g} GB of RAM)")
        return 2
    if args.out.exists() and any(args.out.iterdir()):
        print(f"error: output directory {args.out} is not empty")
        return 2
    print(f"init-checkpoint: preset={args.preset} seed={args.seed} dtype={args.dtype} "
          f"layout={args.expert_layout} params={config.num_parameters():,} size={total / 1e9:.3f} GB -> {args.out}")
    start = time.monotonic()
    try:
        files = save_checkpoint(config, random_tensors(config, args.seed, dtype), args.out,
                                expert_layout=args.expert_layout, max_shard_bytes=int(args.max_shard_gb * 1e9),
                                progress=lambda msg: print(f"  {msg} [{time.monotonic() - start:.0f}s]", flush=True))
        if tokenizer is not None:
            files += [Path(f) for f in tokenizer.save_pretrained(str(args.out)) if Path(f).is_file()]
    except BaseException:
        shutil.rmtree(args.out, ignore_errors=True)  # never leave a half-written checkpoint behind
        raise
    for f in files:
        print(f"  {f} ({f.stat().st_size:,} bytes)")
    print(f"done in {time.monotonic() - start:.1f}s")
    return 0
