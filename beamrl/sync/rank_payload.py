"""Colocated buckets from every trainer rank: one payload entry per engine TP rank, each kept alive until copied.

A colocated engine of TP > 1 has its TP ranks on several GPUs, each shared with a trainer rank. SGLang's
`update_weights_from_tensor(load_format="flattened_bucket")` takes one serialized flattened bucket per engine TP
rank; engine rank r opens entry r. For the copy to stay on one device, entry r must be a buffer on engine rank r's
GPU: the trainer rank sharing that GPU packs the bucket there (CUDA IPC on GPU, a shared-memory file on CPU). So:

1. every trainer rank packs bucket k into its own buffer and shares it (`SharedBuffer.of`);
2. the handles are gathered to the shipping rank (`gather_handles`, a collective over the trainer ranks);
3. the shipping rank builds the payload (`payload_entries`): entry r = the handle of `Colocation.trainer_rank_of[r]`;
4. every rank holds its buffer (`KeepAlive.hold`) until the engine has copied bucket k (the engine's reply, plus
   its copy-done event on GPU: SGLang may reply before its device copy finished), then releases it
   (`KeepAlive.release`, then `torch.cuda.ipc_collect()` so the IPC mapping goes).

The rules (`tests/sync/test_rank_payload.py`): every engine TP rank gets exactly one entry, from the trainer rank on
its device (a layout where an engine rank shares no trainer rank's device is refused by name); a bucket is held once
and released once; at most `max_outstanding` buckets are in flight per rank (the caller waits for replies first);
`finalize` finds nothing outstanding; `release_all` (abort) drops everything.

Status: the payload, the handles and the keep-alive rules, and the SGLang payload builder's per-rank buffers
(`beamrl.rollout.sglang.payloads.flattened_bucket_payloads(..., buffers=...)`), are here and tested on CPU with
gloo; the RL loop's colocated sync still ships from trainer rank 0 (docs/colocated.md, "Not done yet").
"""

from __future__ import annotations

import os
import tempfile
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch


class PayloadError(ValueError):
    """A per-rank payload or keep-alive rule was broken; the message names the rank or bucket."""


@dataclass(frozen=True)
class Colocation:
    """Which trainer rank shares its device with each TP rank of one engine: `trainer_rank_of[r]` for engine TP
    rank r."""

    trainer_rank_of: tuple[int, ...]

    @classmethod
    def from_devices(cls, trainer_devices: Sequence[str], engine_devices: Sequence[str]) -> "Colocation":
        """Match each engine TP rank's device (e.g. 'cuda:3' on a node, or a CPU slot name) to the trainer rank on
        it; `PayloadError` naming the engine TP rank if no trainer rank is there."""
        where = {}
        for rank, dev in enumerate(trainer_devices):
            where.setdefault(str(dev), rank)
        mapping = []
        for r, dev in enumerate(engine_devices):
            if str(dev) not in where:
                raise PayloadError(f"engine TP rank {r} runs on {dev!r}, where no trainer rank runs (trainer ranks "
                                   f"on {list(map(str, trainer_devices))}): a colocated engine must sit on a trainer "
                                   f"slice")
            mapping.append(where[str(dev)])
        return cls(tuple(mapping))

    @property
    def tp_size(self) -> int:
        return len(self.trainer_rank_of)


def _shm_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class SharedBuffer:
    """A picklable handle on one trainer rank's packed bucket: a CUDA-IPC handle (torch's own reduction) on GPU, a
    shared-memory file on CPU. `rank`: the trainer rank that owns it; `index`: the bucket."""

    def __init__(self, rank: int, index: int, nbytes: int, cuda_ipc=None, path: str | None = None) -> None:
        self.rank, self.index, self.nbytes = rank, index, nbytes
        self.cuda_ipc, self.path = cuda_ipc, path

    @classmethod
    def of(cls, buffer: torch.Tensor, rank: int, index: int) -> "SharedBuffer":
        """Share `buffer` (uint8, the packed bucket). On CPU it must come from `SharedBuffer.allocate`."""
        if buffer.dtype != torch.uint8 or buffer.dim() != 1:
            raise PayloadError(f"bucket {index} on trainer rank {rank}: a packed bucket is a 1-D uint8 buffer")
        if buffer.is_cuda:
            from torch.multiprocessing.reductions import reduce_tensor

            return cls(rank, index, buffer.numel(), cuda_ipc=reduce_tensor(buffer))
        path = getattr(buffer, "_beamrl_shm_path", None)
        if path is None:
            raise PayloadError(f"bucket {index} on trainer rank {rank}: a CPU buffer must come from "
                               f"SharedBuffer.allocate (shared memory) to be opened by another process")
        return cls(rank, index, buffer.numel(), path=path)

    @staticmethod
    def allocate(nbytes: int, device: torch.device | str) -> torch.Tensor:
        """A buffer another process can open: device memory on GPU, a `/dev/shm` file on CPU (removed when the
        buffer is garbage-collected)."""
        device = torch.device(device)
        if device.type == "cuda":
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        path = str(_shm_dir() / f"beamrl-rank-bucket-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        buf = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        buf._beamrl_shm_path = path
        weakref.finalize(buf, _unlink, path)
        return buf

    def open(self) -> torch.Tensor:
        """The receiver's view of the buffer (same memory; no copy)."""
        if self.cuda_ipc is not None:
            rebuild, args = self.cuda_ipc
            return rebuild(*args)
        if self.path is None or not os.path.exists(self.path):
            raise PayloadError(f"bucket {self.index} of trainer rank {self.rank} is gone (released before the "
                               f"engine copied it)")
        return torch.from_file(self.path, shared=True, size=self.nbytes, dtype=torch.uint8)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def gather_handles(handle: SharedBuffer, dst: int = 0, group=None) -> list[SharedBuffer] | None:
    """Collective over the trainer ranks: every rank's handle, on `dst` (None elsewhere)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [handle]
    out = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    dist.gather_object(handle, out, dst=dst, group=group)
    return out


def payload_entries(handles: Sequence[SharedBuffer | None], colocation: Colocation, index: int) -> list[SharedBuffer]:
    """One handle per engine TP rank: entry r is the buffer of the trainer rank on engine rank r's device."""
    out = []
    for r, t in enumerate(colocation.trainer_rank_of):
        h = handles[t] if t < len(handles) else None
        if h is None:
            raise PayloadError(f"bucket {index}: trainer rank {t} (on engine TP rank {r}'s device) shared no buffer")
        if h.index != index or h.rank != t:
            raise PayloadError(f"bucket {index}: engine TP rank {r} would get bucket {h.index} of trainer rank "
                               f"{h.rank}, expected bucket {index} of trainer rank {t}")
        out.append(h)
    return out


class KeepAlive:
    """One trainer rank's buffers that an engine may still read, by bucket index (module docstring, step 4)."""

    def __init__(self, max_outstanding: int = 2) -> None:
        if max_outstanding < 1:
            raise PayloadError(f"max_outstanding must be >= 1, got {max_outstanding}")
        self.max_outstanding = max_outstanding
        self._held: dict[int, torch.Tensor] = {}

    def hold(self, index: int, buffer: torch.Tensor) -> None:
        if index in self._held:
            raise PayloadError(f"bucket {index} is already held (sent twice?)")
        if len(self._held) >= self.max_outstanding:
            raise PayloadError(f"bucket {index}: {len(self._held)} bucket(s) {sorted(self._held)} not yet copied by "
                               f"the engine (max_outstanding={self.max_outstanding}); wait for their replies first")
        self._held[index] = buffer

    def release(self, index: int) -> None:
        """The engine has copied bucket `index` (its reply and, on GPU, its copy-done event)."""
        buf = self._held.pop(index, None)
        if buf is None:
            raise PayloadError(f"release of bucket {index}, which is not held (held: {sorted(self._held)})")
        cuda = buf.is_cuda
        del buf
        if cuda:
            torch.cuda.ipc_collect()  # the engine's IPC mapping of the freed block can go

    def outstanding(self) -> list[int]:
        return sorted(self._held)

    def check_finished(self) -> None:
        """At commit: nothing may still be in flight."""
        if self._held:
            raise PayloadError(f"commit with bucket(s) {self.outstanding()} not yet copied by the engine")

    def release_all(self) -> None:
        """Abort: drop every buffer (the engine's session is aborted, so nothing reads them any more)."""
        cuda = any(b.is_cuda for b in self._held.values())
        self._held.clear()
        if cuda:
            torch.cuda.ipc_collect()
