"""Random tiny Beam checkpoints of different shapes for parity runs (variants of `preset("tiny")`).

Every variant keeps num_experts_per_tok / topk_group == 2 (as the real model; beam-numerics.md §3.10)."""

from __future__ import annotations

from pathlib import Path

import torch

from beamrl.dtypes import RUN_DTYPES, dtype_name, torch_dtype
from beamrl.models.beam.config import DENSE, FULL, SLIDING, SPARSE, BeamConfig
from beamrl.models.beam.presets import preset

# name -> (overrides of preset("tiny"), weight seed)
PARITY_VARIANTS: dict[str, tuple[dict, int]] = {
    "tiny": ({}, 0),
    "wide": (dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=16, intermediate_size=192,
                  moe_intermediate_size=48, num_experts=32, num_experts_per_tok=8, n_group=8, topk_group=4,
                  sliding_window=16), 1),
    "deep": (dict(num_hidden_layers=8, hidden_size=64, num_attention_heads=8, num_key_value_heads=4, head_dim=8,
                  layer_types=[SLIDING, FULL, SLIDING, SLIDING, SLIDING, FULL, SLIDING, FULL],
                  mlp_layer_types=[DENSE, DENSE] + [SPARSE] * 6, num_experts=8, num_experts_per_tok=2, n_group=2,
                  topk_group=1, sliding_window=4), 2),
}


def variant_config(name: str) -> BeamConfig:
    try:
        overrides, _ = PARITY_VARIANTS[name]
    except KeyError:
        raise ValueError(f"unknown parity variant {name!r}; allowed: {sorted(PARITY_VARIANTS)}") from None
    return preset("tiny").replace(**overrides)


def write_variant(name: str, out: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write variant `name` (weights from its own seed) to `out`; returns the directory."""
    from beamrl.models.beam.checkpoint import save_checkpoint
    from beamrl.models.beam.weights import random_state_dict

    config = variant_config(name).replace(dtype=dtype_name(dtype))
    _, seed = PARITY_VARIANTS[name]
    save_checkpoint(config, random_state_dict(config, seed, dtype), out)
    return Path(out)


def main(argv: list[str] | None = None) -> int:
    """`python -m beamrl.parity.checkpoints OUT_DIR [--dtype bfloat16|float32]`: write every variant under OUT_DIR."""
    import argparse

    parser = argparse.ArgumentParser(description="Write the parity checkpoint variants (tiny, wide, deep).")
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(RUN_DTYPES))
    args = parser.parse_args(argv)
    for name in PARITY_VARIANTS:
        path = write_variant(name, args.out / name, torch_dtype(args.dtype))
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
