"""Colocated buckets from every trainer rank: one payload entry per engine TP rank, each kept alive until copied.

A colocated engine of TP > 1 has its TP ranks on several GPUs, each shared with a trainer rank. SGLang's
`update_weights_from_tensor(load_format="flattened_bucket")` takes one serialized flattened bucket per engine TP
rank; engine rank r opens entry r. For the copy to stay on one device, entry r must be a buffer on engine rank r's
GPU: the trainer rank sharing that GPU holds a copy of the bucket there (CUDA IPC on GPU, a shared-memory file on
CPU). So:

1. every trainer rank keeps its own shared buffers (`SharedBuffer.allocate` / `SharedBuffer.of`, made and shared
   once); the shipping rank packs bucket k into its own (the one `pack_bucket`), and the packed bytes are
   broadcast into the other ranks' (`beamrl.sync.rank_slots`);
2. the handles are gathered to the shipping rank once (`gather_handles`, a collective over the trainer ranks);
3. the shipping rank builds each engine's payload (`payload_entries`): entry r = the buffer of
   `Colocation.trainer_rank_of[r]`, sent as a `RankedFlatBucket`;
4. the shipping rank holds the buffers of bucket k (`KeepAlive.hold`) until every engine replied for it, then
   releases them (`KeepAlive.release`, then `torch.cuda.ipc_collect()` on GPU); the other ranks write into theirs
   only in the next collective broadcast, which the shipping rank enters after that release.

The rules (`tests/sync/test_rank_payload.py`): every engine TP rank gets exactly one entry, from the trainer rank on
its device (a layout where an engine rank shares no trainer rank's device is refused by name); a bucket is held once
and released once; at most `max_outstanding` buckets are in flight per rank (the caller waits for replies first);
`finalize` finds nothing outstanding; `release_all` (abort) drops everything.

Wiring: `beamrl.sync.rank_slots.RankSlots` keeps every trainer rank's buffers (persistent slots, shared once) and
spreads each packed bucket to them; the colocated transport's per-rank mode sends each engine a `RankedFlatBucket`
(its entries, the layout, the index and the shipping rank's checksum) and holds each slot in a `KeepAlive`
(docs/colocated.md, "Buckets from every trainer rank").
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from beamrl.protocols.flat_bucket import FlatBucket, TensorMeta
from beamrl.sync import shm


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


class SharedBuffer:
    """A picklable handle on one trainer rank's packed bucket: a CUDA-IPC handle (torch's own reduction) on GPU, a
    shared-memory file on CPU. `rank`: the trainer rank that owns it; `index`: the bucket."""

    def __init__(self, rank: int, index: int, nbytes: int, cuda_ipc=None, path: str | None = None,
                 device_uuid: str | None = None) -> None:
        self.rank, self.index, self.nbytes = rank, index, nbytes
        self.cuda_ipc, self.path, self.device_uuid = cuda_ipc, path, device_uuid

    @classmethod
    def of(cls, buffer: torch.Tensor, rank: int, index: int) -> "SharedBuffer":
        """Share `buffer` (uint8, the packed bucket). On CPU it must come from `SharedBuffer.allocate`."""
        if buffer.dtype != torch.uint8 or buffer.dim() != 1:
            raise PayloadError(f"bucket {index} on trainer rank {rank}: a packed bucket is a 1-D uint8 buffer")
        if buffer.is_cuda:
            from torch.multiprocessing.reductions import reduce_tensor

            uuid_ = str(torch.cuda.get_device_properties(buffer.device).uuid)
            return cls(rank, index, buffer.numel(), cuda_ipc=reduce_tensor(buffer), device_uuid=uuid_)
        path = getattr(buffer, "_beamrl_shm_path", None)
        if path is None:
            raise PayloadError(f"bucket {index} on trainer rank {rank}: a CPU buffer must come from "
                               f"SharedBuffer.allocate (shared memory) to be opened by another process")
        return cls(rank, index, buffer.numel(), path=path)

    @staticmethod
    def allocate(nbytes: int, device: torch.device | str) -> torch.Tensor:
        """A buffer another process can open: device memory on GPU, a `/dev/shm` file on CPU, removed when the
        buffer is garbage-collected or, earlier, by calling the tensor's `_beamrl_unlink()` (its owner's close)."""
        device = torch.device(device)
        if device.type == "cuda":
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        path = shm.new_path("beamrl-rank-bucket")
        buf = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        buf._beamrl_shm_path = path
        buf._beamrl_unlink = weakref.finalize(buf, shm.remove, path)  # also called by its owner's close()
        return buf

    def for_bucket(self, index: int, nbytes: int) -> "SharedBuffer":
        """The first `nbytes` of this (persistent, `beamrl.sync.rank_slots`) buffer as the handle of bucket
        `index`: the same memory, nothing is shared again."""
        if nbytes > self.nbytes:
            raise PayloadError(f"bucket {index} has {nbytes} bytes; trainer rank {self.rank}'s buffer holds "
                               f"{self.nbytes}")
        return SharedBuffer(self.rank, index, nbytes, cuda_ipc=self.cuda_ipc, path=self.path,
                            device_uuid=self.device_uuid)

    def open(self) -> torch.Tensor:
        """The receiver's view of the buffer's `nbytes` (same memory; no copy)."""
        if self.cuda_ipc is not None:
            rebuild, args = self.cuda_ipc
            return rebuild(*args)[:self.nbytes]
        if self.path is None or not os.path.exists(self.path):
            raise PayloadError(f"bucket {self.index} of trainer rank {self.rank} is gone (released before the "
                               f"engine copied it)")
        return torch.from_file(self.path, shared=True, size=self.nbytes, dtype=torch.uint8)


class _CudaTensorByUUID:
    """Pickles as torch's rebuild of a shared CUDA buffer with the device named by its UUID, which SGLang's
    unpickler maps to its own device index (`sglang.srt.utils.patch_torch`): the trainer process and the engine's
    scheduler number their visible GPUs differently. The consumer gets the whole slot; the flattened bucket's
    metadata says which bytes are the bucket."""

    _DEVICE_ARG = 6  # of torch's `rebuild_cuda_tensor` arguments (SGLang relies on the same position)

    def __init__(self, handle: SharedBuffer) -> None:
        self.handle = handle

    def __reduce__(self):
        rebuild, args = self.handle.cuda_ipc
        args = tuple(self.handle.device_uuid if i == self._DEVICE_ARG else a for i, a in enumerate(args))
        return rebuild, args


def gather_handles(handle, dst: int = 0, group=None) -> list | None:
    """Collective over the trainer ranks: every rank's handle (a `SharedBuffer`, or a tuple of them: a rank's
    persistent slots), on `dst`, indexed by rank (None elsewhere)."""
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


class RankedFlatBucket(FlatBucket):
    """A colocated bucket whose bytes stay where the trainer ranks packed them: one `SharedBuffer` per engine TP
    rank (`entries[r]` from the trainer rank on engine rank r's device, `payload_entries`), with the bucket's
    layout, index and the shipping rank's checksum of the bytes. Picklable (the handles, never the bytes).

    `buffer` is TP rank 0's entry, opened on first use (what an engine of TP 1, e.g. the native engine, reads);
    `rank_buffers()` opens every entry (an engine of TP > 1 hands entry r to its rank r and checks each one's
    checksum: a corrupted copy on one trainer rank is refused, naming the rank)."""

    def __init__(self, entries: Sequence[SharedBuffer], metas: list[TensorMeta], index: int,
                 checksum: tuple[int, int]) -> None:
        if not entries:
            raise PayloadError(f"bucket {index}: no payload entries")
        if not metas:
            raise ValueError("FlatBucket needs at least one tensor")
        for r, e in enumerate(entries):
            if e.index != index or e.nbytes != metas[-1].end:
                raise PayloadError(f"bucket {index}: entry {r} is bucket {e.index} with {e.nbytes} bytes, the "
                                   f"layout needs bucket {index} with {metas[-1].end}")
        self.entries = list(entries)
        self.metas = list(metas)
        self.index = index
        self.checksum = checksum
        self._opened: list[torch.Tensor | None] = [None] * len(self.entries)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_opened"] = [None] * len(self.entries)  # mappings are per process
        return state

    def rank_buffer(self, r: int) -> torch.Tensor:
        if self._opened[r] is None:
            self._opened[r] = self.entries[r].open()
        return self._opened[r]

    def rank_buffers(self) -> list[torch.Tensor]:
        return [self.rank_buffer(r) for r in range(len(self.entries))]

    @property
    def on_cuda(self) -> bool:
        return self.entries[0].cuda_ipc is not None

    def payload_tensors(self) -> list:
        """What engine TP rank r deserializes, per rank: on CPU the opened shared-memory entry; on GPU an object
        that pickles as the trainer rank's own CUDA-IPC handle (a CUDA tensor received by IPC cannot be shared
        again, so the engine adapter never opens it)."""
        if self.on_cuda:
            return [_CudaTensorByUUID(e) for e in self.entries]
        return self.rank_buffers()

    def rank_payloads(self, tp_size: int) -> list:
        """Each TP rank's own entry (`payload_tensors`); a CPU entry is a file mapping, which SGLang's serializer
        cannot share by file descriptor, so each rank gets a copy of its own entry (CPU rehearsal only; on GPU the
        trainer rank's handle passes through)."""
        return [b.clone() if isinstance(b, torch.Tensor) else b for b in self.payload_tensors()]

    def checkable_copies(self) -> list[tuple[str, torch.Tensor]]:
        """Every TP rank's copy, from its trainer rank (a corrupted copy on one trainer rank is refused, naming
        it). None on GPU: each entry is on its TP rank's device, which the engine's adapter process does not open
        (the payload passes the trainer rank's handle through); the post-sync probe is the check there."""
        if self.on_cuda:
            return []
        return [(f" (the copy for engine TP rank {r}, from trainer rank {e.rank})", self.rank_buffer(r))
                for r, e in enumerate(self.entries)]

    @property
    def buffer(self) -> torch.Tensor:  # type: ignore[override]
        return self.rank_buffer(0)

    @property
    def nbytes(self) -> int:
        return self.metas[-1].end

    def __repr__(self) -> str:
        return (f"RankedFlatBucket(bucket {self.index}, {len(self.metas)} tensors, {self.nbytes} bytes, entries "
                f"from trainer ranks {[e.rank for e in self.entries]})")
