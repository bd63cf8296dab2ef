"""The embedded engine's LoRA apply targets (docs/lora.md "Embedded engine"): mode `adapter` stages the adapter
tensors of a sync in buffers of their own and merges them into the targeted weights at commit; mode `full`
(a base-weight sync) keeps the new W0 of targeted weights and merges the applied adapter over it again."""

from __future__ import annotations

import torch

from beamrl.models.beam.lora_config import LoRAConfig
from beamrl.models.beam.lora_payload import adapter_table
from beamrl.models.beam.lora_receiver import AdapterMerger
from beamrl.protocols.flat_bucket import TensorMeta
from beamrl.sync.local_receiver import ApplyTarget, ModelWeights
from beamrl.sync.receive_session import WeightTable


class AdapterTarget(ApplyTarget):
    """Apply mode `adapter` of a `LocalWeightReceiver` over a `BeamForCausalLM`. The W0 of a targeted weight is
    copied from its parameter before its first merge and kept (device memory of the model)."""

    staged = True  # the weights change only at commit, after every bucket passed its checksum

    def __init__(self, model: torch.nn.Module, lora: LoRAConfig) -> None:
        self.model = model
        self._table = adapter_table(model.config, lora, model.dtype)
        self._buffers: dict[str, torch.Tensor] = {}
        self._session_names: list[str] = []
        self.w0: dict[str, torch.Tensor] = {}
        self.merger = AdapterMerger(model.config, lora, self._base, self._write)

    def table(self) -> WeightTable:
        self._session_names = []
        return self._table

    def destinations(self, metas: tuple[TensorMeta, ...]) -> list[torch.Tensor]:
        out = []
        for m in metas:
            if m.end == m.start:
                continue
            buf = self._buffers.get(m.name)
            if buf is None:
                buf = self._buffers[m.name] = torch.empty(m.shape, dtype=m.dtype, device=self.model.device)
            self._session_names.append(m.name)
            out.append(buf)
        return out

    def commit(self) -> None:
        """Check the scale, merge every targeted weight from W0 and write them (AdapterRejected: nothing written)."""
        self.merger.stage(((n, self._buffers[n]) for n in self._session_names), copy=False)
        self._session_names = []
        self.merger.commit()

    def discard(self) -> None:
        self._session_names = []
        self.merger.discard()

    def _base(self, name: str) -> torch.Tensor:
        if name not in self.w0:
            self.w0[name] = dict(self.model.named_parameters())[name].detach().clone()
        return self.w0[name]

    def _write(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self.model.load_hf_tensors(named)

    def base_replaced(self, names) -> None:
        """New base weights `names` were written: keep them as W0 and merge the applied adapter over them."""
        params = dict(self.model.named_parameters())
        replaced = [n for n in names if n in self.w0]
        for n in replaced:
            self.w0[n] = params[n].detach().clone()
        self.merger.reapply(replaced)

    @property
    def adapter_version(self) -> int:
        """How many adapters were applied (0: the base weights only)."""
        return self.merger.num_applied


class LoRABaseWeights(ModelWeights):
    """Mode `full` with an adapter target: after every base-weight update the adapter is merged again."""

    def __init__(self, model: torch.nn.Module, adapter: AdapterTarget) -> None:
        super().__init__(model)
        self.adapter = adapter

    def commit(self) -> None:
        self.adapter.base_replaced(list(self.adapter.w0))

    def load_state(self, state) -> None:
        super().load_state(state)
        self.adapter.base_replaced(list(self.adapter.w0))
