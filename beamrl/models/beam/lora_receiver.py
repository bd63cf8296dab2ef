"""`AdapterMerger`: the engine side of an adapter-only sync, shared by the embedded engine and the SGLang model
class (docs/lora.md "Adapter sync").

It stages the tensors of one adapter (`stage`; the scale tensor starts a new adapter and is checked against the
engine's own LoRA config), and on `commit` merges every targeted weight from its kept W0 with
`merge_lora_weight` and hands the merged HF-named weights to the engine's writer. Every merge is computed before
anything is written, so a refused or incomplete adapter leaves the weights as they were. Weights the previous
adapter merged but the new one does not target are written back to W0.

The engine supplies two callables:
- `base(name) -> W0`: the unmerged HF weight `name` (the embedded engine keeps a copy taken before its first
  merge; the SGLang class keeps the copies it saw stream through its loader);
- `write([(name, W'), ...])`: place merged HF-named weights into the engine's parameters.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from beamrl.models.beam.config import BeamConfig
from beamrl.models.beam.lora import adapted_weights, merge_lora_weight
from beamrl.models.beam.lora_config import LoRAConfig
from beamrl.models.beam.lora_payload import SCALE_NAME, AdapterPayloadError, adapter_table, check_scale


class AdapterRejected(AdapterPayloadError):
    """An adapter was refused; the engine's weights are unchanged."""


class AdapterMerger:
    """Stages, checks and applies adapters of one LoRA config for one model (module docstring)."""

    def __init__(self, config: BeamConfig, lora: LoRAConfig, base: Callable[[str], torch.Tensor],
                 write: Callable[[list[tuple[str, torch.Tensor]]], None],
                 owns: Callable[[str], bool] | None = None):
        """owns(name): whether this engine holds the HF weight `name` (e.g. its pipeline stage's layers); weights
        it does not hold are neither merged nor written. Default: all."""
        self.config, self.lora = config, lora
        self._base, self._write = base, write
        self._owns = owns or (lambda name: True)
        self.names = set(adapter_table(config, lora, torch.float32))  # every tensor of an adapter, with the scale
        self.staged: dict[str, torch.Tensor] = {}
        self._merged: set[str] = set()
        self.applied: dict[str, torch.Tensor] | None = None  # the adapter now merged into the weights
        self.num_applied = 0  # adapters applied so far (receivers compare it across a session)

    @property
    def merged_weights(self) -> set[str]:
        """HF names of the weights that now hold a merged W' (not W0)."""
        return set(self._merged)

    @property
    def complete(self) -> bool:
        return len(self.staged) == len(self.names)

    def stage(self, named: Iterable[tuple[str, torch.Tensor]], copy: bool = True) -> None:
        """Keep adapter tensors until `commit`; the scale starts a new adapter (forgetting a partial one). Raises
        `AdapterRejected` for a scale that is not this config's or a name outside the adapter."""
        named = sorted(named, key=lambda nt: nt[0] != SCALE_NAME)  # buckets reorder tensors by element size
        for name, t in named:
            if name == SCALE_NAME:
                self.staged = {}
                try:
                    check_scale(t, self.lora)
                except AdapterPayloadError as e:
                    raise AdapterRejected(str(e)) from None
            elif name not in self.names:
                self.staged = {}
                raise AdapterRejected(f"{name!r} is not an adapter tensor of this engine's LoRA config")
            self.staged[name] = t.detach().clone() if copy else t

    def discard(self) -> None:
        self.staged = {}

    def commit(self) -> None:
        """Merge the staged adapter into the weights (all of it computed before anything is written)."""
        if not self.complete:
            missing = sorted(self.names - set(self.staged))
            self.staged = {}
            raise AdapterRejected(f"incomplete adapter: {len(missing)} tensor(s) missing (e.g. {missing[:2]}); "
                                  f"nothing was merged")
        staged, self.staged = self.staged, {}
        merged: list[tuple[str, torch.Tensor]] = []
        names: set[str] = set()
        for w in adapted_weights(self.config, self.lora):
            if not self._owns(w.weight):
                continue
            merged.append((w.weight, merge_lora_weight(self._base(w.weight), staged[w.a], staged[w.b],
                                                       self.lora.scale)))
            names.add(w.weight)
        restored = [(n, self._base(n)) for n in sorted(self._merged - names)]
        self._write(merged + restored)
        self._merged = names
        self.applied = staged
        self.num_applied += 1

    def reapply(self, weight_names: Iterable[str]) -> None:
        """After the engine loaded new base weights `weight_names` (so their W0 changed and they no longer hold a
        merge), write the applied adapter's merge of those it targets."""
        if self.applied is None:
            return
        wanted = set(weight_names) & self._merged
        t = self.applied
        out = [(w.weight, merge_lora_weight(self._base(w.weight), t[w.a], t[w.b], self.lora.scale))
               for w in adapted_weights(self.config, self.lora) if w.weight in wanted and self._owns(w.weight)]
        if out:
            self._write(out)
