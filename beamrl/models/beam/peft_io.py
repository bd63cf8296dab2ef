"""PEFT-format adapters: `adapter_config.json` + `adapter_model.safetensors` (+ `beamrl_lora.json`) (docs/lora.md).

The files are what the `peft` library writes for a LoRA on `beamrl.models.beam.model.BeamForCausalLM`, so
`peft.PeftModel.from_pretrained(reference_model, directory)` loads them. Every target is a real `nn.Linear` of the
reference model (the routed experts are per-expert modules there), so PEFT round-trips all of them; the
reference MoE reads expert weights directly instead of calling the modules, so evaluate after
`merge_and_unload()` (or `merge_adapter()`), which folds every adapter into its weight.

- `target_modules` is a regular expression (PEFT full-matches it against module names) because the plain suffix
  form cannot tell `mlp.gate_proj` (dense) from `mlp.experts.{e}.gate_proj`;
- tensor names are `base_model.model.<module>.lora_A.weight` / `.lora_B.weight` (PEFT's, without the adapter
  name); an A shared by the experts (`share_expert_a`) is written once per expert, as PEFT has no sharing, and
  collapsed again on import (where every copy must be identical);
- `beamrl_lora.json` keeps the full `LoRAConfig` (sharing, seed); without it, import derives the targets from
  the tensor names.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from beamrl.models.beam.config import BeamConfig
from beamrl.models.beam.lora import adapted_weights, adapter_tensor_shapes
from beamrl.models.beam.lora_config import ALL_TARGETS, LoRAConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BEAMRL_CONFIG = "beamrl_lora.json"
PEFT_PREFIX = "base_model.model."


class PeftAdapterError(ValueError):
    """A PEFT adapter directory does not fit the model (names the file and the tensor)."""


def target_modules_regex(lora: LoRAConfig) -> str:
    """PEFT `target_modules` full-matching exactly the modules of `lora.targets`."""
    parts = []
    for t in lora.targets:
        if t.startswith("mlp.experts."):
            parts.append(r"mlp\.experts\.\d+\." + re.escape(t.rsplit(".", 1)[1]))
        else:
            parts.append(re.escape(t))
    return r"model\.layers\.\d+\.(" + "|".join(parts) + ")"


def save_peft_adapter(directory: str | Path, adapter: dict[str, torch.Tensor], lora: LoRAConfig,
                      config: BeamConfig, base_model_name_or_path: str | None = None) -> list[Path]:
    """Write `adapter` (full tensors in beamrl's adapter names) as a PEFT LoRA adapter; returns the files."""
    from safetensors.torch import save_file

    shapes = adapter_tensor_shapes(config, lora)
    if set(adapter) != set(shapes):
        missing, extra = sorted(set(shapes) - set(adapter)), sorted(set(adapter) - set(shapes))
        raise PeftAdapterError(f"adapter does not match LoRAConfig: missing {missing[:2]}, unexpected {extra[:2]}")
    tensors = {}
    for w in adapted_weights(config, lora):
        module = w.weight.removesuffix(".weight")
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = adapter[w.a].detach().contiguous().cpu()
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = adapter[w.b].detach().contiguous().cpu()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    peft_config = {
        "peft_type": "LORA", "task_type": None, "r": lora.rank, "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout, "target_modules": target_modules_regex(lora), "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": None, "base_model_name_or_path": base_model_name_or_path}
    (directory / ADAPTER_CONFIG).write_text(json.dumps(peft_config, indent=2) + "\n")
    (directory / BEAMRL_CONFIG).write_text(json.dumps(lora.to_dict(), indent=2) + "\n")
    save_file({k: v.clone() for k, v in tensors.items()}, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return [directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS, directory / BEAMRL_CONFIG]


def load_peft_adapter(directory: str | Path, config: BeamConfig) -> tuple[LoRAConfig, dict[str, torch.Tensor]]:
    """Read a PEFT LoRA adapter of the Beam reference model: (LoRAConfig, tensors in beamrl's adapter names)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (directory / f).exists():
            raise PeftAdapterError(f"{directory}: {f} is missing")
    peft_config = json.loads((directory / ADAPTER_CONFIG).read_text())
    if peft_config.get("peft_type") != "LORA":
        raise PeftAdapterError(f"{directory / ADAPTER_CONFIG}: peft_type {peft_config.get('peft_type')!r}, not LORA")
    plain = (not peft_config.get("use_rslora") and not peft_config.get("lora_dropout", 0.0)
             and peft_config.get("bias", "none") == "none")
    if not plain:
        raise PeftAdapterError(f"{directory / ADAPTER_CONFIG}: only plain LoRA (no rsLoRA, no dropout, no bias) "
                               f"is supported")
    raw = load_file(str(directory / ADAPTER_WEIGHTS))
    if not all(k.startswith(PEFT_PREFIX) for k in raw):
        bad = next(k for k in raw if not k.startswith(PEFT_PREFIX))
        raise PeftAdapterError(f"{directory / ADAPTER_WEIGHTS}: tensor {bad!r} lacks the prefix {PEFT_PREFIX!r}")
    named = {k[len(PEFT_PREFIX):]: v for k, v in raw.items()}
    side = directory / BEAMRL_CONFIG
    if side.exists():
        lora = LoRAConfig.from_dict(json.loads(side.read_text()))
    else:
        lora = LoRAConfig(rank=int(peft_config["r"]), alpha=float(peft_config["lora_alpha"]),
                          targets=_targets_of(named))
    if (lora.rank, float(lora.alpha)) != (int(peft_config["r"]), float(peft_config["lora_alpha"])):
        raise PeftAdapterError(f"{directory}: {ADAPTER_CONFIG} (r, lora_alpha) disagree with {BEAMRL_CONFIG}")
    out: dict[str, torch.Tensor] = {}
    for w in adapted_weights(config, lora):
        module = w.weight.removesuffix(".weight")
        for kind, dst in (("A", w.a), ("B", w.b)):
            src = f"{module}.lora_{kind}.weight"
            if src not in named:
                raise PeftAdapterError(f"{directory / ADAPTER_WEIGHTS}: tensor {PEFT_PREFIX + src!r} is missing")
            t = named.pop(src)
            if dst in out and not torch.equal(out[dst], t):
                raise PeftAdapterError(f"{directory}: {src} differs from the other experts' A, but the adapter "
                                       f"shares A across experts ({BEAMRL_CONFIG})")
            out[dst] = t
    if named:
        raise PeftAdapterError(f"{directory / ADAPTER_WEIGHTS}: unexpected tensor {PEFT_PREFIX + next(iter(named))!r}")
    shapes = adapter_tensor_shapes(config, lora)
    for n, t in out.items():
        if tuple(t.shape) != tuple(shapes[n]):
            raise PeftAdapterError(f"{directory}: {n} has shape {tuple(t.shape)}, expected {tuple(shapes[n])}")
    return lora, out


def _targets_of(named: dict[str, torch.Tensor]) -> tuple[str, ...]:
    found = set()
    for name in named:
        module = name.rsplit(".lora_", 1)[0]
        rest = module.split(".", 3)[3] if module.startswith("model.layers.") else module
        rest = re.sub(r"^mlp\.experts\.\d+\.", "mlp.experts.", rest)
        if rest not in ALL_TARGETS:
            raise PeftAdapterError(f"adapter tensor {name!r} is not on a Beam LoRA target")
        found.add(rest)
    return tuple(t for t in ALL_TARGETS if t in found)
