"""One uint8 buffer holding several HF tensors, laid out exactly as SGLang's `FlattenedTensorBucket`.

The disaggregated path broadcasts only the buffer; the engine rebuilds the layout from (names, dtypes,
shapes) with `FlattenedTensorBucket.empty`. So the layout here must agree with SGLang's byte for byte:
tensors are packed back to back in the given order, with no padding, and each tensor's byte offset must be
a multiple of its element size (SGLang refuses an unaligned tensor rather than padding it). Putting wider
dtypes first (`aligned_order`) always satisfies that rule; the sync's bucket plan (`beamrl.sync.plan`) does so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16: the string form SGLang's update APIs take."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """torch dtype from 'bfloat16' / 'torch.bfloat16' / a dtype; ValueError naming the bad string."""
    if isinstance(name, torch.dtype):
        return name
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} (expected a torch dtype name such as 'bfloat16')")
    return dtype


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lives in a flat buffer: bytes [start, end)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def layout(names: Sequence[str], dtypes: Sequence[str | torch.dtype],
           shapes: Sequence[Sequence[int]]) -> list[TensorMeta]:
    """The byte layout implied by (names, dtypes, shapes), as SGLang's `FlattenedTensorBucket.empty` computes it."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}")
    if not names:
        raise ValueError("cannot lay out an empty bucket (no tensors)")
    metas, offset = [], 0
    for name, dt, shape in zip(names, dtypes, shapes):
        dtype = parse_dtype(dt)
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"tensor {name!r} has a negative dimension: {shape}")
        if offset % dtype.itemsize:
            raise ValueError(f"tensor {name!r} ({dtype_name(dtype)}) would start at byte {offset}, not a multiple "
                             f"of its element size {dtype.itemsize}; order tensors by decreasing element size "
                             f"(beamrl.protocols.flat_bucket.aligned_order)")
        size = torch.Size(shape).numel() * dtype.itemsize
        metas.append(TensorMeta(name, shape, dtype, offset, offset + size))
        offset += size
    return metas


def aligned_order(named: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Stable reorder by decreasing element size, so every packed offset is aligned for its dtype."""
    return sorted(named, key=lambda nt: -nt[1].element_size())


class TensorListing:
    """`names`, `dtypes` and `shapes` of `self.metas` (a sequence of `TensorMeta`), in the form SGLang's
    update calls take them; shared by a bucket's layout and its packed form."""

    metas: "tuple[TensorMeta, ...] | list[TensorMeta]"

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.metas]

    @property
    def dtypes(self) -> list[str]:
        """Dtype strings such as 'bfloat16', as SGLang's update_weights_from_distributed takes them."""
        return [dtype_name(m.dtype) for m in self.metas]

    @property
    def shapes(self) -> list[list[int]]:
        return [list(m.shape) for m in self.metas]


class FlatBucket(TensorListing):
    """A uint8 1-D `buffer` plus the `metas` describing the tensors packed in it.

    In a sync session a bucket also carries its `index` in the session's manifest and the sender's raw-bit
    `checksum` of the buffer (`beamrl.protocols.checksum`, two ints); receivers check both before committing it."""

    def __init__(self, buffer: torch.Tensor, metas: list[TensorMeta], index: int | None = None,
                 checksum: tuple[int, int] | None = None) -> None:
        if buffer.dtype != torch.uint8 or buffer.dim() != 1:
            raise ValueError(f"FlatBucket buffer must be 1-D uint8, got {buffer.dtype} with shape "
                             f"{tuple(buffer.shape)}")
        if not metas:
            raise ValueError("FlatBucket needs at least one tensor")
        if metas[-1].end != buffer.numel():
            raise ValueError(f"FlatBucket buffer has {buffer.numel()} bytes but the layout needs {metas[-1].end}")
        self.buffer = buffer
        self.metas = list(metas)
        self.index = index
        self.checksum = checksum

    @classmethod
    def from_named_tensors(cls, named: Sequence[tuple[str, torch.Tensor]],
                           device: torch.device | str | None = None) -> FlatBucket:
        """Pack (name, tensor) pairs in the given order (mixed dtypes allowed) into a new buffer.

        All tensors must be on one device (the buffer's, unless `device` is given)."""
        named = list(named)
        if not named:
            raise ValueError("cannot build a FlatBucket from zero tensors")
        devices = {t.device for _, t in named}
        if device is None:
            if len(devices) > 1:
                raise ValueError(f"FlatBucket tensors are on several devices: {sorted(map(str, devices))}")
            device = next(iter(devices))
        metas = layout([n for n, _ in named], [t.dtype for _, t in named], [tuple(t.shape) for _, t in named])
        buffer = torch.empty(metas[-1].end if metas else 0, dtype=torch.uint8, device=device)
        for meta, (_, tensor) in zip(metas, named):
            if meta.nbytes:
                buffer[meta.start:meta.end].copy_(tensor.detach().reshape(-1).view(torch.uint8))
        return cls(buffer, metas)

    @classmethod
    def empty(cls, names: Sequence[str], dtypes: Sequence[str | torch.dtype], shapes: Sequence[Sequence[int]],
              device: torch.device | str) -> FlatBucket:
        """An uninitialised receive buffer whose layout is implied by names/dtypes/shapes (as SGLang's)."""
        metas = layout(names, dtypes, shapes)
        return cls(torch.empty(metas[-1].end, dtype=torch.uint8, device=device), metas)

    def unflatten(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) views into the buffer (no copies): writes to the buffer show through."""
        return [(m.name, self.buffer[m.start:m.end].view(m.dtype).view(m.shape)) for m in self.metas]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    @property
    def on_cuda(self) -> bool:
        """Whether the bytes are on a CUDA device (what crosses to an SGLang server are then CUDA-IPC handles)."""
        return self.buffer.is_cuda

    def rank_payloads(self, tp_size: int) -> list:
        """What each of an engine's `tp_size` TP ranks deserializes (SGLang's `flattened_bucket`): here the one
        buffer for every rank (a bucket with a copy per rank, `beamrl.sync.rank_payload.RankedFlatBucket`,
        gives each rank its own)."""
        return [self.buffer] * tp_size

    def checkable_copies(self) -> list[tuple[str, torch.Tensor]]:
        """(where, bytes) of every copy of the bucket a receiver can read and checksum: here the one buffer
        (where: '', nothing to add to an error message)."""
        return [("", self.buffer)]

    def __len__(self) -> int:
        return len(self.metas)

    def __repr__(self) -> str:
        return f"FlatBucket({len(self.metas)} tensors, {self.nbytes} bytes, {self.device})"
