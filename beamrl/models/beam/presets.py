"""Named Beam configurations: `beam-501b` (the real model), `tiny` (CPU tests), `small` (GPU benchmarks)."""

from __future__ import annotations

from beamrl.models.beam.config import DENSE, FULL, SLIDING, SPARSE, BeamConfig


def beam_501b() -> BeamConfig:
    """The released Beam: 52 layers, 256 experts top-8; every default of SGLang's BeamConfig."""
    return BeamConfig()


def tiny() -> BeamConfig:
    """~0.5M parameters for CPU tests: 1 dense + 5 MoE layers, SWA and full layers, 4 routing groups.

    top-k / topk_group == 2 as in the real model, so Megatron's top-(k/groups) group score equals SGLang's
    fixed top-2 (beam-numerics.md §3.10)."""
    return BeamConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        sliding_window=8, layer_types=[SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL],
        mlp_layer_types=[DENSE] + [SPARSE] * 5, moe_intermediate_size=32, num_experts=16,
        num_experts_per_tok=4, n_group=4, topk_group=2, eos_token_id=0, pad_token_id=0,
    )


def small() -> BeamConfig:
    """Real widths (hidden 5120, 48/8 heads x 128, experts of 2560, top-8) with 4 layers and 16 experts,
    for one-GPU benchmarks of the trainer (fits an H200 with an FP32 Adam state)."""
    return BeamConfig(
        num_hidden_layers=4, layer_types=[SLIDING, SLIDING, SLIDING, FULL],
        mlp_layer_types=[DENSE, SPARSE, SPARSE, SPARSE], num_experts=16, n_group=8, topk_group=4,
        num_experts_per_tok=8, max_position_embeddings=131072,
    )


PRESETS = {"beam-501b": beam_501b, "tiny": tiny, "small": small}


def preset(name: str) -> BeamConfig:
    """Return a fresh config for a preset name; unknown names list the allowed ones."""
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown Beam preset {name!r}; allowed: {sorted(PRESETS)}") from None
