"""The trainer-side API used by the RL loop: packed batches, the loss-function contract and `TrainerWorker`.

One `TrainerWorker` runs per rank (a Ray actor wraps it later). All ranks of a job receive the same method
calls in the same order (SPMD); every rank returns the full result of the calls that return data.

**Token alignment.** A `PackedBatch` holds several token sequences concatenated into one 1-D stream
(`tokens[T]`) with `cu_seqlens[B+1]` boundaries. Every per-token tensor is index-aligned with `tokens`:

- `logprobs[t]` / `entropy[t]` computed by the trainer are those of *predicting token t* from the tokens
  before it in its own sequence, i.e. `log p(tokens[t] | tokens[start:t])` under
  `softmax(softcap(logits) / T)`. The first token of every sequence has no prediction: its logprob and
  entropy are 0.
- `loss_mask[t]` (float) says whether token t contributes to the loss (typically: t is a response token). It
  is forced to 0 at the first token of each sequence.
- `fields` are extra per-token tensors the loss needs (advantages, old/reference logprobs, ...), `[T, ...]`.
- `routes` (optional) are the engine's routed experts for R3 replay: int `[T, num_hidden_layers, k]`; row t,
  column l = the experts that routed token t in layer l (SGLang's layout: dense-layer columns are ignored).
  A row with any -1 routes freely. SGLang returns `len-1` rows per sequence; the caller pads the last row
  (its output is unused), e.g. with -1.

**Loss contract.** `train_step(micro_batches, loss_fn)` calls `loss_fn(logprobs, entropy, batch)` once per
micro-batch with FP32 `[T]` tensors that carry gradients. It returns `(loss, metrics)`, where `loss` is this
micro-batch's *contribution to the global loss*: e.g. `sum(mask * per_token_loss) / global_num_tokens`
with the global token count of the whole step (all micro-batches of all data-parallel ranks), which the
caller knows and passes in (a closure or a `fields` entry). The trainer sums these contributions over
micro-batches and data-parallel ranks, without any further division; gradients are those of that sum.
`metrics` are scalar tensors summed the same way (so normalise them like the loss), except those the loss
function names in its optional attribute `metric_reductions` ({name: "sum" | "max" | "min"}, read by
`metric_reductions(loss_fn)`): a "max" ("min") metric is the largest (smallest) of its per-micro-batch values over
every micro-batch of every data-parallel rank. A micro-batch with nothing to take the max (min) of gives -inf
(+inf), which counts for nothing; a step where none has a value reports that infinity.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch


class BatchError(ValueError):
    """A batch field has the wrong shape, dtype or values; the message names the field."""


class _WireArray:
    """A CPU tensor as it crosses a pickle (`PackedBatch.__getstate__`): its numpy array."""

    __slots__ = ("array",)

    def __init__(self, array) -> None:
        self.array = array

    def __getstate__(self):
        return self.array

    def __setstate__(self, array) -> None:
        self.array = array

    def tensor(self) -> torch.Tensor:
        # A zero-copy read (Ray's object store) is read-only; the batch's tensors must stay writable.
        return torch.from_numpy(self.array if self.array.flags.writeable else self.array.copy())


def _to_wire(value):
    """Pickling a torch tensor costs ~0.2 ms whatever its size (a batch has about six); its numpy array ~0.02 ms.
    Tensors numpy cannot hold (bfloat16, ...), on a device or needing grad cross as they are."""
    if (torch.is_tensor(value) and value.device.type == "cpu" and not value.requires_grad
            and value.dtype in _NUMPY_DTYPES):
        return _WireArray(value.numpy())
    return value


def _from_wire(value):
    return value.tensor() if isinstance(value, _WireArray) else value


_NUMPY_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
                           torch.int8, torch.uint8, torch.bool})


@dataclass
class PackedBatch:
    """Token sequences concatenated in one stream. See the module docstring for the alignment rules."""

    tokens: torch.Tensor
    cu_seqlens: torch.Tensor
    loss_mask: torch.Tensor | None = None
    fields: dict[str, torch.Tensor] = field(default_factory=dict)
    routes: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.tokens = torch.as_tensor(self.tokens)
        self.cu_seqlens = torch.as_tensor(self.cu_seqlens).to(torch.int64)
        if self.tokens.dim() != 1 or self.tokens.dtype not in (torch.int32, torch.int64):
            raise BatchError(f"PackedBatch.tokens must be a 1-D integer tensor, got {tuple(self.tokens.shape)} "
                             f"{self.tokens.dtype}")
        self.tokens = self.tokens.to(torch.int64)
        T = self.tokens.numel()
        cu = self.cu_seqlens
        if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != T:
            raise BatchError(f"PackedBatch.cu_seqlens must be 1-D, start at 0 and end at len(tokens)={T}, "
                             f"got {cu.tolist()}")
        if bool((cu[1:] - cu[:-1] <= 0).any()):
            raise BatchError(f"PackedBatch.cu_seqlens must be strictly increasing (no empty sequence), "
                             f"got {cu.tolist()}")
        if self.loss_mask is None:
            self.loss_mask = torch.ones(T, dtype=torch.float32)
        self.loss_mask = torch.as_tensor(self.loss_mask).to(torch.float32).clone()
        if self.loss_mask.shape != (T,):
            raise BatchError(f"PackedBatch.loss_mask must have shape ({T},), got {tuple(self.loss_mask.shape)}")
        self.loss_mask[cu[:-1]] = 0.0  # the first token of a sequence is never predicted
        for name, value in self.fields.items():
            if not torch.is_tensor(value) or value.shape[:1] != (T,):
                raise BatchError(f"PackedBatch.fields[{name!r}] must be a tensor with leading dim {T}, "
                                 f"got {getattr(value, 'shape', type(value))}")
        if self.routes is not None:
            r = torch.as_tensor(self.routes)
            if r.dim() != 3 or r.shape[0] != T or r.dtype.is_floating_point or r.dtype == torch.bool:
                raise BatchError(f"PackedBatch.routes must be an integer tensor [T={T}, num_layers, top_k], "
                                 f"got {tuple(r.shape)} {r.dtype}")
            # Kept in its integer dtype (the engines' int32 is half the bytes to ship); the trainer widens it.
            self.routes = r

    def __getstate__(self) -> dict:
        """Batches cross to the trainer's actors every step: CPU tensors travel as numpy arrays (`_to_wire`) and come
        back as the same tensors, bit for bit."""
        state = {k: _to_wire(v) for k, v in self.__dict__.items()}
        state["fields"] = {k: _to_wire(v) for k, v in self.fields.items()}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update({k: _from_wire(v) for k, v in state.items()})
        self.fields = {k: _from_wire(v) for k, v in self.fields.items()}

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def seqlens(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    @property
    def num_loss_tokens(self) -> int:
        """Tokens that contribute to the loss (sum of `loss_mask`)."""
        return int(self.loss_mask.sum().item())

    @classmethod
    def from_sequences(cls, sequences: list[list[int]] | list[torch.Tensor],
                       loss_masks: list | None = None, fields: dict[str, list] | None = None,
                       routes: list[torch.Tensor] | None = None) -> "PackedBatch":
        """Pack a list of token sequences (and optional per-sequence masks, fields and routes)."""
        if not sequences:
            raise BatchError("PackedBatch.from_sequences needs at least one sequence")
        toks = [torch.as_tensor(s, dtype=torch.int64).view(-1) for s in sequences]
        cu = torch.zeros(len(toks) + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(torch.tensor([t.numel() for t in toks]), 0)
        mask = None if loss_masks is None else torch.cat([torch.as_tensor(m, dtype=torch.float32).view(-1)
                                                          for m in loss_masks])
        packed_fields = {k: torch.cat([torch.as_tensor(x).view(-1) for x in v]) for k, v in (fields or {}).items()}
        packed_routes = None if routes is None else torch.cat([torch.as_tensor(r) for r in routes])
        return cls(torch.cat(toks), cu, mask, packed_fields, packed_routes)

    def to(self, device: torch.device | str) -> "PackedBatch":
        """This batch with every tensor on `device` (the loss function sees its fields where the logprobs are)."""
        if self.tokens.device == torch.device(device):
            return self
        return PackedBatch(self.tokens.to(device), self.cu_seqlens.to(device), self.loss_mask.to(device),
                           {k: v.to(device) for k, v in self.fields.items()},
                           None if self.routes is None else self.routes.to(device))

    def sequences(self) -> list[torch.Tensor]:
        """The token ids of each sequence."""
        return [self.tokens[a:b] for a, b in zip(self.cu_seqlens[:-1].tolist(), self.cu_seqlens[1:].tolist())]




class LossFn(Protocol):
    """`(logprobs [T], entropy [T] | None, batch) -> (loss scalar, {name: scalar})` (see the module doc).

    It may also carry `metric_reductions` ({metric name: "sum" | "max" | "min"}); metrics it does not name are
    summed."""

    def __call__(self, logprobs: torch.Tensor, entropy: torch.Tensor | None,
                 batch: PackedBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


#: How `train_step` may combine one metric over micro-batches and data-parallel ranks (see the module doc).
METRIC_REDUCTION_OPS: tuple[str, ...] = ("sum", "max", "min")


def metric_reductions(loss_fn) -> dict[str, str]:
    """The loss function's `metric_reductions` ({} when it has none), checked: each value is "sum", "max" or
    "min", and "loss" (always summed) is not a metric; a metric not named is summed."""
    declared = dict(getattr(loss_fn, "metric_reductions", None) or {})
    bad = {k: v for k, v in declared.items() if v not in METRIC_REDUCTION_OPS or k == "loss"}
    if bad:  # the loss itself is always summed
        raise ValueError(f"the loss function's metric_reductions must map names to one of "
                         f"{METRIC_REDUCTION_OPS}, got {bad}")
    return declared


@dataclass
class LogprobResult:
    """Per-token results of `compute_logprobs`, aligned with the batch's tokens (FP32 `[T]`)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None
    #: Routed experts recorded during the forward (`[T, num_hidden_layers, k]`, dense columns -1), when
    #: routing record mode is on.
    routes: torch.Tensor | None = None


@dataclass
class TrainStepResult:
    """Result of one optimizer step. `loss` and `metrics` are summed over micro-batches and DP ranks; a metric the
    loss function declares "max" or "min" (`metric_reductions`) is the max or min over them instead."""

    loss: float
    grad_norm: float
    lr: float
    num_micro_batches: int
    skipped: bool = False  # the optimizer skipped the update (non-finite gradients raise before it: never those)
    metrics: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, float]:
        out = {"loss": self.loss, "grad_norm": self.grad_norm, "lr": self.lr,
               "num_micro_batches": float(self.num_micro_batches), "skipped": float(self.skipped)}
        out.update(self.metrics)
        return out


@dataclass(frozen=True)
class TrainerWorker(abc.ABC):
    """One rank of a policy trainer. All ranks must receive the same calls in the same order."""

    @abc.abstractmethod
    def compute_logprobs(self, batch: PackedBatch, temperature: float = 1.0, return_entropy: bool = True,
                         routes: torch.Tensor | None = None) -> LogprobResult:
        """Forward only: per-token logprobs (and entropy) of `batch` at `temperature` (see module doc).

        `routes` (or `batch.routes`) replays the engine's routing (R3); otherwise the model routes itself."""

    @abc.abstractmethod
    def train_step(self, micro_batches: list[PackedBatch], loss_fn: LossFn,
                   temperature: float = 1.0) -> TrainStepResult:
        """Forward+backward over this data-parallel rank's micro-batches, then one optimizer step. The
        logprobs given to `loss_fn` are taken at `temperature` (the rollout's sampling temperature)."""

    @abc.abstractmethod
    def save_checkpoint(self, directory: str | Path, async_save: bool = False) -> Path:
        """Save model, optimizer, scheduler and RNG state so that `load_checkpoint` resumes exactly. With
        `async_save` the files are written in the background until `finalize_checkpoint`."""

    @abc.abstractmethod
    def finalize_checkpoint(self, blocking: bool = True, timeout_s: float | None = None) -> Path | None:
        """Complete the save in flight: its directory once complete, else None (nothing in flight, or still being
        written with `blocking=False`)."""

    @abc.abstractmethod
    def load_checkpoint(self, directory: str | Path) -> None:
        """Restore a checkpoint written by `save_checkpoint`, also at another parallel layout of the same model."""

    @abc.abstractmethod
    def export_hf(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Stream the current weights as full HF tensors, one list per export unit (no size budget: the weight
        sync buckets them). Collective: every rank must iterate it to the end; the tensors arrive on global
        rank 0, other ranks get empty lists."""

    @abc.abstractmethod
    def export_hf_layout(self) -> list[list[tuple[str, tuple[int, ...], torch.dtype]]]:
        """(name, shape, dtype) of every tensor `export_hf` yields, per unit and in the same order; known on
        every rank without communication."""

    @abc.abstractmethod
    def set_routing_replay(self, enabled: bool) -> None:
        """Replay given routes (`routes` / `batch.routes`) in later forwards (True) or route freely (False)."""

    @abc.abstractmethod
    def set_routing_record(self, enabled: bool) -> None:
        """Record the routes of later `compute_logprobs` calls into `LogprobResult.routes`."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release process groups and memory."""
