"""Export sources: what a weight sync sends, as the trainer side produces it.

An `ExportSource` is the trainer end of one sync: the named tensors to send (in export order, grouped in *units*,
the pieces the trainer produces at once, e.g. one layer's attention), the receivers' apply mode for them, and the
logprobs of probe sequences under exactly these weights (for the post-sync check). Sizes and bucketing are not its
business: the sync layer alone packs tensors into buckets (`beamrl.sync.plan`).

- `StateDictSource`: tensors held in memory (`beamrl bench sync`, `benchmarks/sync_h200.py`, tests).
- The Megatron trainer's collective export (`beamrl.loop.weight_sync.MegatronExportSource`): every trainer rank
  iterates it, rank 0 holds the tensors.
- A LoRA adapter-only source (docs/weight-sync.md, "Export sources and apply modes") yields the adapter tensors
  with `mode = "adapter"` through the same session.

The layout (`units`) must be known on every rank before any tensor is produced (the manifest is sent at `begin`);
`stream` must then yield exactly those tensors, in that order (the sync layer checks every name, dtype and shape).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import torch

from beamrl.protocols.manifest import FULL


class TensorSpec(NamedTuple):
    """A tensor of the export, known before its data: HF name, dtype, shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


NamedTensors = list[tuple[str, torch.Tensor]]


class ExportSource(abc.ABC):
    """The trainer side of a sync (module docstring). Collective where the trainer is: every rank calls the
    same methods in the same order; `stream` yields the data on the shipping rank only."""

    #: The receivers' apply mode (`beamrl.protocols.manifest`): `full` replaces every weight.
    mode: str = FULL

    @abc.abstractmethod
    def units(self) -> list[list[TensorSpec]]:
        """The export's tensors in order, grouped by the unit they are produced in. Same on every rank."""

    @property
    def layout_key(self) -> object:
        """Identifies `units()` between syncs (a sync layer caches its bucket plan under it)."""
        return id(self)

    @abc.abstractmethod
    def stream(self) -> Iterator[NamedTensors]:
        """The units with their tensors, in `units()` order (empty lists on ranks that do not ship)."""

    def finish(self, ok: bool) -> bool:
        """After `stream`: whether every rank finished its part and this one shipped (`ok`). Collective in a
        multi-rank trainer (so that a failure on the shipping rank stops the others too); local: `ok`."""
        return ok

    @abc.abstractmethod
    def logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Per sequence, logprob of token i given tokens < i (i >= 1, T = 1, free routing), under the exported
        weights (`RolloutEngine.score`'s convention). Collective."""


def specs_of(named: Sequence[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    return [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in named]


class StateDictSource(ExportSource):
    """Named tensors held in memory, exported as one unit per `unit_size` tensors (in the given order).

    `score(sequences)` gives the reference logprobs (e.g. the model's `token_logprobs` per sequence); leave it
    None when the sync is not verified with probes."""

    def __init__(self, named: Sequence[tuple[str, torch.Tensor]],
                 score: Callable[[list[list[int]]], list[list[float]]] | None = None, unit_size: int = 16,
                 mode: str = FULL) -> None:
        if unit_size < 1:
            raise ValueError(f"unit_size must be >= 1, got {unit_size}")
        self.named = [(n, t.detach()) for n, t in named]
        self._units = [self.named[i:i + unit_size] for i in range(0, len(self.named), unit_size)]
        self._specs = [specs_of(u) for u in self._units]
        self._score = score
        self.mode = mode

    @classmethod
    def of_model(cls, model: torch.nn.Module, unit_size: int = 16) -> "StateDictSource":
        """A model's parameters under their own names; probes scored with `model.token_logprobs` (Beam's
        reference model)."""
        def score(seqs: list[list[int]]) -> list[list[float]]:
            with torch.no_grad():
                return [model.token_logprobs(torch.tensor([s], device=next(model.parameters()).device))[0].tolist()
                        for s in seqs]

        return cls(list(model.named_parameters()), score=score, unit_size=unit_size)

    def units(self) -> list[list[TensorSpec]]:
        return self._specs

    @property
    def layout_key(self) -> object:
        return tuple(tuple(u) for u in self._specs), self.mode

    def stream(self) -> Iterator[NamedTensors]:
        yield from self._units

    def logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        if self._score is None:
            raise ValueError("this StateDictSource was built without `score`, so it cannot give probe logprobs")
        return self._score(sequences)
