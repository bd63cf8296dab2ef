"""`BeamForCausalLM` for SGLang 0.5.23 with beamrl's adapter-only updates (docs/lora.md "SGLang").

A subclass of SGLang's own Beam class (same name: SGLang's config and override hooks look the class up by name)
that changes two things and nothing in the forward:

- `load_weights` diverts the tensors of an adapter-only sync (`beamrl.models.beam.lora_payload`) to an
  `AdapterMerger`, which stages them (the scale starts an adapter and must be this engine's), and when the
  adapter is complete (its last bucket, which the engine adapter has checksummed before handing it over) merges
  every targeted weight from W0 with the contract's `merge_lora_weight` and loads the merged HF tensors through
  SGLang's own loaders (so every sharding and packing SGLang chooses applies). Base tensors of the targeted
  weights are copied as W0 while they stream through the loader (at start-up and on every base update), on the
  model's device. The LoRA config comes from the HF config field `beamrl_lora` (the trainer's `trainer.lora`),
  set by the engine launcher through SGLang's `json_model_override_args`.
- A refused adapter must not raise out of `load_weights` (the tensor path of SGLang 0.5.23 does not catch it and
  the scheduler would die): the error is recorded and the weights stay as they were. `get_weights_by_name`
  answers `beamrl.lora.status` with the number of adapters applied, the tensors staged and the last error (a
  JSON string as the float list
  of its UTF-8 bytes, the only reply type SGLang's API carries), and an HF weight name with that weight as the
  engine now computes with it (this rank's shard).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Iterable, Iterator

import torch
from sglang.srt.models.beam import BeamForCausalLM as _SGLangBeamForCausalLM

from beamrl.models.beam.config import BeamConfig
from beamrl.models.beam.lora import adapted_weights
from beamrl.models.beam.lora_config import LoRAConfig
from beamrl.models.beam.lora_payload import SCALE_NAME, is_adapter_tensor_name
from beamrl.models.beam.lora_receiver import AdapterMerger, AdapterRejected
from beamrl.rollout.sglang.config import LORA_FIELD
from beamrl.rollout.sglang.models import STATUS_NAME

logger = logging.getLogger(__name__)



def beam_config_of(hf_config) -> BeamConfig:
    """beamrl's `BeamConfig` from SGLang's HF config object (same field names)."""
    known = {f.name for f in dataclasses.fields(BeamConfig)} - {"extra"}
    data = {k: getattr(hf_config, k) for k in known if hasattr(hf_config, k)}
    dtype = data.get("dtype")
    if isinstance(dtype, torch.dtype):
        data["dtype"] = str(dtype).removeprefix("torch.")
    return BeamConfig.from_dict(data)


class BeamForCausalLM(_SGLangBeamForCausalLM):
    """SGLang's Beam plus adapter payloads merged from kept W0 (module docstring)."""

    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__(config, quant_config=quant_config, prefix=prefix)
        settings = getattr(config, LORA_FIELD, None)
        self._beam = beam_config_of(config)
        self._targeted: set[str] = set()
        self._lora: AdapterMerger | None = None
        if settings:
            lora = LoRAConfig.from_dict(dict(settings))
            self._targeted = {w.weight for w in adapted_weights(self._beam, lora)
                              if self.start_layer <= w.layer < self.end_layer}
            self._lora = AdapterMerger(self._beam, lora, self._base_weight, self._write_merged,
                                       owns=self._on_this_stage)
        self._w0: dict[str, torch.Tensor] = {}
        self._lora_error: str | None = None

    # ------------------------------------------------------------------ loading
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        adapter: list[tuple[str, torch.Tensor]] = []
        base_names: list[str] = []
        loaded = super().load_weights(self._split(weights, adapter, base_names))
        if base_names and self._lora is not None:
            self._lora.reapply(base_names)  # new W0 of targeted weights: merge the applied adapter again
        if adapter:
            if any(n == SCALE_NAME for n, _ in adapter):
                self._lora_error = None  # a new adapter starts
            try:
                if self._lora is None:
                    raise AdapterRejected("this engine was launched without a LoRA config (SGLangEngineConfig.lora)")
                self._lora.stage(adapter)
                if self._lora.complete:
                    self._lora.commit()
            except AdapterRejected as e:
                self._lora_error = str(e)
                logger.error("beamrl LoRA adapter refused (weights unchanged): %s", e)
        return loaded

    def _split(self, weights, adapter: list, base_names: list) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield base tensors to SGLang's loader (copying W0 of targeted ones), divert adapter tensors."""
        device = next(self.parameters()).device
        for name, w in weights:
            if is_adapter_tensor_name(name):
                adapter.append((name, w))
                continue
            for hf_name, t in self._per_expert(name, w):
                if hf_name in self._targeted:
                    self._w0[hf_name] = t.detach().to(device=device, copy=True)
                    base_names.append(hf_name)
            yield name, w

    def _per_expert(self, name: str, w: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Packed checkpoint expert tensors as per-expert HF names (the weight table's form)."""
        if name.endswith(".mlp.experts.gate_up_proj"):
            p = name[: -len("gate_up_proj")]
            return [pair for e, ew in enumerate(w) for pair in zip(
                (f"{p}{e}.gate_proj.weight", f"{p}{e}.up_proj.weight"), ew.chunk(2, dim=0))]
        if name.endswith(".mlp.experts.down_proj"):
            p = name[: -len("down_proj")]
            return [(f"{p}{e}.down_proj.weight", ew) for e, ew in enumerate(w)]
        return [(name, w)]

    def _on_this_stage(self, name: str) -> bool:
        return self.start_layer <= int(name.split(".")[2]) < self.end_layer

    def _base_weight(self, name: str) -> torch.Tensor:
        if name not in self._w0:
            raise AdapterRejected(f"{name} is not a LoRA target of this engine (launched with targets "
                                  f"{sorted({n.split('.', 3)[3].rsplit('.', 1)[0] for n in self._targeted})[:6]})")
        return self._w0[name]

    def _write_merged(self, named: list[tuple[str, torch.Tensor]]) -> None:
        _SGLangBeamForCausalLM.load_weights(self, named)  # SGLang's loaders shard and pack; no W0 capture

    # ------------------------------------------------------------------ queries
    def get_weights_by_name(self, name: str, truncate_size: int = 100, tp_size: int = 1):
        if name == STATUS_NAME:
            lora = self._lora
            status = {"lora_class": True, "targets": len(self._targeted),
                      "applied": 0 if lora is None else lora.num_applied,
                      "staged": 0 if lora is None else len(lora.staged), "error": self._lora_error}
            return [float(b) for b in json.dumps(status).encode()]
        return self._effective_weight(name).float().tolist()

    def _effective_weight(self, name: str) -> torch.Tensor:
        """The HF weight `name` as this rank computes with it (its TP shard), read from SGLang's parameters."""
        params = dict(self.named_parameters())
        prefix, _, rest = name.partition(".self_attn.")
        if rest:
            proj = rest.removesuffix(".weight")
            packed = params.get(f"{prefix}.self_attn.qkv_gate_proj.weight")
            if proj in ("q_proj", "k_proj", "v_proj", "gate_proj") and packed is not None:
                attn = dict(self.named_modules())[prefix + ".self_attn"]
                q, kv = attn.q_size, attn.kv_size  # this rank's widths; packed rows are [q, k, v, gate]
                start, size = {"q_proj": (0, q), "k_proj": (q, kv), "v_proj": (q + kv, kv),
                               "gate_proj": (q + 2 * kv, q)}[proj]
                return packed.data[start:start + size]
        if ".mlp.experts." in name:
            head, tail = name.split(".mlp.experts.")
            e, proj = int(tail.split(".")[0]), tail.split(".")[1]
            experts = dict(self.named_modules())[head + ".mlp.experts"]
            local = e - getattr(experts, "moe_ep_rank", 0) * experts.num_local_experts
            if proj == "down_proj":
                return experts.w2_weight.data[local]
            w13 = experts.w13_weight.data[local]
            half = w13.shape[0] // 2
            return w13[:half] if proj == "gate_proj" else w13[half:]
        if name.endswith((".mlp.gate_proj.weight", ".mlp.up_proj.weight")):
            packed = params[name.rsplit(".mlp.", 1)[0] + ".mlp.gate_up_proj.weight"].data
            half = packed.shape[0] // 2
            return packed[:half] if ".gate_proj." in name else packed[half:]
        if name in params:
            return params[name].data
        raise KeyError(f"{name!r} is not a weight of this engine")


EntryClass = BeamForCausalLM
