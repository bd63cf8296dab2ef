"""`AdapterReceiver`: the engine side of an adapter-only sync, shared by the embedded engine and the SGLang
model class (docs/lora.md "Adapter sync").

It takes the payload's named tensors in any number of calls (`receive`), checks each on arrival against the
manifest (`lora_payload`), stages them, and when the last announced tensor has arrived merges every targeted
weight from its kept W0 with `merge_lora_weight` and hands the merged HF-named weights to the engine's writer.
Nothing is written before every tensor of the adapter has arrived and passed its checks, so a refused adapter
leaves the engine's weights as they were. Weights the previous adapter merged but the new one does not target
are written back to W0.

The engine supplies two callables:
- `base(name) -> W0`: the unmerged HF weight `name` (the embedded engine keeps a copy taken before its first
  merge; the SGLang class keeps the copies it saw stream through its loader);
- `write([(name, W'), ...])`: place merged HF-named weights into the engine's parameters.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from beamrl.models.beam.config import BeamConfig
from beamrl.models.beam.lora import adapted_weights, adapter_tensor_shapes, merge_lora_weight
from beamrl.models.beam.lora_payload import MANIFEST_NAME, AdapterManifest, AdapterPayloadError, decode_manifest


class AdapterRejected(AdapterPayloadError):
    """An adapter payload was refused; the engine's weights are unchanged."""


class AdapterReceiver:
    """Checks, stages and applies adapter payloads for one model (module docstring)."""

    def __init__(self, config: BeamConfig, base: Callable[[str], torch.Tensor],
                 write: Callable[[list[tuple[str, torch.Tensor]]], None],
                 owns: Callable[[str], bool] | None = None):
        """owns(name): whether this engine holds the HF weight `name` (e.g. its pipeline stage's layers); weights
        it does not hold are neither merged nor written. Default: all."""
        self.config = config
        self._base, self._write = base, write
        self._owns = owns or (lambda name: True)
        self._manifest: AdapterManifest | None = None
        self._staged: dict[str, torch.Tensor] = {}
        self._merged: set[str] = set()
        self.applied: AdapterManifest | None = None  # the adapter now merged into the weights
        self._applied_tensors: dict[str, torch.Tensor] = {}

    @property
    def merged_weights(self) -> set[str]:
        """HF names of the weights that now hold a merged W' (not W0)."""
        return set(self._merged)

    def receive(self, named: Iterable[tuple[str, torch.Tensor]]) -> bool:
        """Check and stage adapter tensors (a manifest starts a new adapter); returns True when this call
        completed and applied an adapter. Raises `AdapterRejected` (and forgets the staged adapter) on any failed
        check; the weights are then untouched."""
        named = list(named)
        # A manifest in this call is taken first (buckets reorder tensors by element size for alignment).
        named.sort(key=lambda nt: nt[0] != MANIFEST_NAME)
        try:
            for name, t in named:
                if name == MANIFEST_NAME:
                    self._start(decode_manifest(t))
                    continue
                if self._manifest is None:
                    raise AdapterPayloadError(f"adapter tensor {name!r} arrived before {MANIFEST_NAME}")
                self._manifest.check_tensor(name, t)
                self._staged[name] = t.detach().clone()
        except AdapterPayloadError as e:
            self._manifest, self._staged = None, {}
            raise AdapterRejected(str(e)) from None
        if self._manifest is not None and len(self._staged) == len(self._manifest.tensors):
            self._apply()
            return True
        return False

    def _start(self, manifest: AdapterManifest) -> None:
        expected = adapter_tensor_shapes(self.config, manifest.lora)
        announced = {n: shape for n, (shape, _, _) in manifest.tensors.items()}
        if announced != {n: tuple(s) for n, s in expected.items()}:
            extra = sorted(set(announced) - set(expected))
            missing = sorted(set(expected) - set(announced))
            wrong = sorted(n for n in set(announced) & set(expected) if announced[n] != tuple(expected[n]))
            raise AdapterPayloadError(
                f"adapter {manifest.adapter_id!r} does not fit this model: unexpected {extra[:2]}, missing "
                f"{missing[:2]}, wrong shape {wrong[:2]}")
        self._manifest, self._staged = manifest, {}

    def _apply(self) -> None:
        manifest, staged = self._manifest, self._staged
        self._manifest, self._staged = None, {}
        merged: list[tuple[str, torch.Tensor]] = []
        names: set[str] = set()
        for w in adapted_weights(self.config, manifest.lora):
            if not self._owns(w.weight):
                continue
            w0 = self._base(w.weight)
            merged.append((w.weight, merge_lora_weight(w0, staged[w.a], staged[w.b], manifest.scale)))
            names.add(w.weight)
        restored = [(n, self._base(n)) for n in sorted(self._merged - names)]
        self._write(merged + restored)
        self._merged = names
        self.applied, self._applied_tensors = manifest, staged

    def reapply(self, weight_names: Iterable[str]) -> None:
        """After the engine loaded new base weights `weight_names` (so their W0 changed and they no longer hold a
        merge), write the applied adapter's merge of those it targets."""
        if self.applied is None:
            return
        wanted = set(weight_names) & self._merged
        t = self._applied_tensors
        out = [(w.weight, merge_lora_weight(self._base(w.weight), t[w.a], t[w.b], self.applied.scale))
               for w in adapted_weights(self.config, self.applied.lora) if w.weight in wanted and self._owns(w.weight)]
        if out:
            self._write(out)
