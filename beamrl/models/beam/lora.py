"""LoRA in Beam's numerics contract: the one merge rule and the adapter weight table (docs/lora.md).

**The merge rule.** Every side (the Megatron trainer's forward, the embedded engine, the SGLang model class,
the PEFT check) computes the weight it runs with as

    W' = round_to_dtype(W0)( fp32(W0) + s * acc ),   acc = sum_{r=0}^{R-1} fp32(B[:, r]) * fp32(A[r, :])

by `merge_lora_weight`: the rank sum runs in index order as separate FP32 elementwise multiplies and adds (each
product and each partial sum rounded to FP32, so no FMA contraction and no GEMM whose blocking could change the
order), then one FP32 multiply by `s = fp32(alpha / rank)`, one FP32 add of W0, and one rounding to W0's dtype
(round-to-nearest-even to BF16 in BF16 models; nothing in FLOAT32 models, where W' is the FP32 result). Each
output element depends only on its own row of B, column of A and element of W0, so any sharding of the rows or
the columns (TP, EP) and any device computes the same bits: IEEE FP32 multiply and add are correctly rounded
everywhere (denormals are not flushed by PyTorch's elementwise kernels).

**The adapter weight table.** Adapter tensors have PEFT's names without PEFT's `base_model.model.` prefix:
`<module>.lora_A.weight` [r, in] and `<module>.lora_B.weight` [out, r] for the HF module `<module>` of a targeted
weight `<module>.weight`. With `share_expert_a` the experts of one layer share one A per projection, named
without an expert id (`model.layers.i.mlp.experts.gate_proj.lora_A.weight`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from beamrl.models.beam.config import BeamConfig
from beamrl.models.beam.lora_config import LoRAConfig

#: Merge at most this many output elements at once (the temporaries are FP32; elementwise, so chunking
#: cannot change a bit).
_MERGE_CHUNK_ELEMENTS = 1 << 26


def merge_lora_weight(w0: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """`W' = dtype(W0)(fp32(W0) + s * sum_r fp32(B[..., :, r]) * fp32(A[..., r, :]))` (module docstring).

    w0 [..., out, in]; a [..., r, in] and b [..., out, r] with leading dims broadcastable to w0's (e.g. a shared
    A [r, in] against per-expert w0 [E, out, in]). Returns a new tensor of w0's dtype, shape and device; the
    inputs are not modified. `scale` must be an FP32-representable number (`LoRAConfig.scale`). Never compiled:
    a compiled graph could fuse the multiply and the add into an FMA."""
    return _never_compiled(_merge_lora_weight)(w0, a, b, scale)


@functools.cache
def _never_compiled(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`torch.compiler.disable(fn)`, made at the first call rather than at import: it imports torch's compiler
    stack (~1.5 s of CPU), which would tax every process importing this module (the driver, the engines)."""
    return torch.compiler.disable(fn)


@torch.no_grad()
def _merge_lora_weight(w0: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    if a.shape[-2] != b.shape[-1] or a.shape[-1] != w0.shape[-1] or b.shape[-2] != w0.shape[-2]:
        raise ValueError(f"LoRA shapes do not fit: W0 {tuple(w0.shape)}, A {tuple(a.shape)}, B {tuple(b.shape)}")
    if torch.tensor(scale, dtype=torch.float32).item() != float(scale):
        raise ValueError(f"LoRA scale {scale!r} is not representable in FP32 (use LoRAConfig.scale)")
    s = torch.tensor(scale, dtype=torch.float32, device=w0.device)
    out = torch.empty_like(w0)
    rows = w0.shape[-2]
    per_row = max(1, w0.numel() // max(rows, 1))
    step = max(1, _MERGE_CHUNK_ELEMENTS // per_row)
    af = a.to(device=w0.device, dtype=torch.float32)
    bf = b.to(device=w0.device, dtype=torch.float32)
    for start in range(0, rows, step):
        sl = slice(start, min(rows, start + step))
        out[..., sl, :] = _merge_rows(w0[..., sl, :], af, bf[..., sl, :], s)
    return out


def _merge_rows(w0: torch.Tensor, af: torch.Tensor, bf: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    acc = bf[..., :, 0:1] * af[..., 0:1, :]
    prod = torch.empty_like(acc)
    for r in range(1, af.shape[-2]):
        # A rounded product into its own buffer, then a rounded add (alpha = 1: exact even where the kernel is
        # `a + alpha * b` as an FMA). Two kernels, so the product is never contracted into the add.
        torch.mul(bf[..., :, r:r + 1], af[..., r:r + 1, :], out=prod)
        acc.add_(prod)
    acc.mul_(s)
    acc.add_(w0)  # fp32(W0): an exact upcast inside the add (type promotion), then one rounded FP32 add
    return acc.to(w0.dtype)


# ------------------------------------------------------------------------------------------ weight table


@dataclass(frozen=True)
class AdaptedWeight:
    """One targeted HF weight and the names of its factors (A may be shared by the experts of a layer)."""

    weight: str
    a: str
    b: str
    out_features: int
    in_features: int
    layer: int
    target: str
    expert: int | None = None


def adapter_names(module: str) -> tuple[str, str]:
    """(A name, B name) of the HF module path `module` (e.g. `model.layers.0.self_attn.q_proj`)."""
    return module + ".lora_A.weight", module + ".lora_B.weight"


def adapted_weights(config: BeamConfig, lora: LoRAConfig) -> list[AdaptedWeight]:
    """Every targeted HF weight of the model, in layer order (attention, then dense MLP or experts)."""
    c = config
    H, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    attn_shapes = {"self_attn.q_proj": (q, H), "self_attn.k_proj": (kv, H), "self_attn.v_proj": (kv, H),
                   "self_attn.gate_proj": (q, H), "self_attn.o_proj": (H, q)}
    dense_shapes = {"mlp.gate_proj": (c.intermediate_size, H), "mlp.up_proj": (c.intermediate_size, H),
                    "mlp.down_proj": (H, c.intermediate_size)}
    I = c.moe_intermediate_size
    expert_shapes = {"mlp.experts.gate_proj": (I, H), "mlp.experts.up_proj": (I, H), "mlp.experts.down_proj": (H, I)}
    out: list[AdaptedWeight] = []
    for layer in range(c.num_hidden_layers):
        p = f"model.layers.{layer}."
        for t in lora.attention_targets:
            a, b = adapter_names(p + t)
            out.append(AdaptedWeight(p + t + ".weight", a, b, *attn_shapes[t], layer, t))
        if not c.is_moe(layer):
            for t in lora.dense_mlp_targets:
                a, b = adapter_names(p + t)
                out.append(AdaptedWeight(p + t + ".weight", a, b, *dense_shapes[t], layer, t))
            continue
        for t in lora.expert_targets:
            proj = t.rsplit(".", 1)[1]
            shared_a = adapter_names(p + t)[0]
            for e in range(c.num_experts):
                module = f"{p}mlp.experts.{e}.{proj}"
                a, b = adapter_names(module)
                out.append(AdaptedWeight(module + ".weight", shared_a if lora.share_expert_a else a, b,
                                         *expert_shapes[t], layer, t, e))
    return out


def adapter_tensor_shapes(config: BeamConfig, lora: LoRAConfig) -> dict[str, tuple[int, int]]:
    """Every adapter tensor name -> shape, in table order (a shared A appears once)."""
    out: dict[str, tuple[int, int]] = {}
    for w in adapted_weights(config, lora):
        out.setdefault(w.a, (lora.rank, w.in_features))
        out[w.b] = (w.out_features, lora.rank)
    return out


def adapter_num_parameters(config: BeamConfig, lora: LoRAConfig) -> int:
    """Parameters of the adapter (A shared across experts counted once)."""
    return sum(r * c for r, c in adapter_tensor_shapes(config, lora).values())


def adapted_num_parameters(config: BeamConfig, lora: LoRAConfig) -> int:
    """Parameters of the targeted base weights (what a merged-weight sync would move)."""
    return sum(w.out_features * w.in_features for w in adapted_weights(config, lora))


def init_lora_a(shape: tuple[int, int], seed: int, key: str) -> torch.Tensor:
    """PEFT's A initialisation, `kaiming_uniform_(a=sqrt(5))` = U(-1/sqrt(in), 1/sqrt(in)), in FP32, from a
    generator seeded by (seed, key) so every parallel layout and process draws the same full tensor."""
    import hashlib

    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    bound = 1.0 / shape[-1] ** 0.5
    return (torch.rand(shape, generator=g, dtype=torch.float32) * 2 - 1) * bound


def random_adapter(config: BeamConfig, lora: LoRAConfig, seed: int, dtype: torch.dtype = torch.float32,
                   b_std: float = 0.02) -> dict[str, torch.Tensor]:
    """A reproducible adapter with non-zero B (A as `init_lora_a`, B ~ N(0, b_std^2)): for tests and benchmarks,
    where a freshly initialised adapter (B = 0) would merge to W0 and hide the merge."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in adapter_tensor_shapes(config, lora).items():
        if name.endswith("lora_A.weight"):
            out[name] = init_lora_a(shape, seed, name).to(dtype)
        else:
            out[name] = (torch.randn(shape, generator=g) * b_std).to(dtype)
    return out
