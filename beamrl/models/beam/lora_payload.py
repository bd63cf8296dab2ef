"""What an adapter-only weight sync sends (docs/lora.md "Adapter sync"): the apply mode, the tensor names, the
scale tensor and the payload layout, shared by the trainer's export source and every receiver.

A sync in apply mode `adapter` (`ADAPTER`) carries, through the one orchestrator and its transports:

1. `beamrl.lora.scale` (`SCALE_NAME`): FP32 [1], `fp32(alpha / rank)`; always the first tensor of the first
   bucket, it starts a new adapter on the receiver (which refuses a scale other than its own config's);
2. every adapter tensor, full (TP/EP-gathered), named as in `beamrl.models.beam.lora` (`...lora_A.weight` /
   `...lora_B.weight`), in the model's dtype.

Every name, shape and dtype is announced in the session manifest at `begin` and checked against the receiver's
table (`adapter_table`: the receiver's model and LoRA config), and every bucket's bytes are checked by the
session's raw-bit checksum before anything is merged, so a wrong or corrupted adapter is refused whole.
"""

from __future__ import annotations

import torch

from beamrl.models.beam.config import BeamConfig
from beamrl.models.beam.lora import adapted_weights, adapter_tensor_shapes
from beamrl.models.beam.lora_config import LoRAConfig

#: The apply mode of an adapter-only sync (`beamrl.protocols.manifest`; `full` is the ordinary sync).
ADAPTER = "adapter"
SCALE_NAME = "beamrl.lora.scale"
_ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


class AdapterPayloadError(ValueError):
    """An adapter payload fails a check; the message names the tensor and the check."""


def is_adapter_tensor_name(name: str) -> bool:
    """True for the scale and the adapter tensor names (receivers route these away from base loading)."""
    return name == SCALE_NAME or name.endswith(_ADAPTER_SUFFIXES)


def scale_tensor(lora: LoRAConfig) -> torch.Tensor:
    return torch.tensor([lora.scale], dtype=torch.float32)


def adapter_table(config: BeamConfig, lora: LoRAConfig, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...],
                                                                                              torch.dtype]]:
    """name -> (shape, dtype) of every tensor an adapter sync sends for this model and LoRA config: the scale
    first, then the adapter tensors layer by layer (the trainer's export order)."""
    shapes = adapter_tensor_shapes(config, lora)
    names = [n for layer in adapter_layers(config, lora).values() for n in layer]
    return {SCALE_NAME: ((1,), torch.float32), **{n: (tuple(shapes[n]), dtype) for n in names}}


def adapter_layers(config: BeamConfig, lora: LoRAConfig) -> dict[int, list[str]]:
    """Adapter tensor names per layer, in export order (the export's units)."""
    by_layer: dict[int, list[str]] = {}
    seen: set[str] = set()
    for w in adapted_weights(config, lora):
        names = by_layer.setdefault(w.layer, [])
        for n in (w.a, w.b):
            if n not in seen:
                seen.add(n)
                names.append(n)
    return by_layer


def adapter_payload(tensors: dict[str, torch.Tensor], lora: LoRAConfig) -> list[tuple[str, torch.Tensor]]:
    """[scale, *tensors]: every tensor of one adapter as an adapter sync sends it."""
    return [(SCALE_NAME, scale_tensor(lora))] + list(tensors.items())


def check_scale(t: torch.Tensor, lora: LoRAConfig) -> None:
    """Refuse a scale tensor that is not bit for bit this receiver's `fp32(alpha / rank)`."""
    want = scale_tensor(lora)
    if t.dtype != torch.float32 or tuple(t.shape) != (1,) or \
            not torch.equal(t.detach().cpu().view(torch.int32), want.view(torch.int32)):
        raise AdapterPayloadError(f"{SCALE_NAME} arrived as {t.detach().cpu().tolist()} ({t.dtype}), this engine's "
                                  f"LoRA config has scale alpha/rank = {lora.alpha}/{lora.rank} = {lora.scale!r}: "
                                  f"the trainer and the engine disagree on trainer.lora; adapter refused")
