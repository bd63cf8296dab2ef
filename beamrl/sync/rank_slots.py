"""Every trainer rank's persistent shared slots for colocated buckets from every rank (engines of TP > 1, or
engines on other nodes than the shipping rank).

A colocated engine's TP rank r reads its copy of each bucket from the trainer rank on its own device
(`beamrl.sync.rank_payload`). Per sync, every trainer rank (a collective, in lockstep with the export):

1. `ensure(nbytes)`: keeps `num_slots` persistent buffers of the largest bucket's size, shared once
   (`SharedBuffer`: CUDA IPC on GPU, `/dev/shm` on CPU); when they are (re)made, the handles are gathered to the
   shipping rank (`gather_handles`);
2. per bucket k, the shipping rank packs it into its own slot `k % num_slots` (the one `pack_bucket`, through the
   transport's `buffer`), then `spread(k)` broadcasts the packed bytes from that slot into the same slot of every
   other rank (NVLink / the trainer's own process group) and ends with a barrier, so every copy is complete
   before the shipping rank sends the payload;
3. the shipping rank's transport sends one payload entry per engine TP rank (`entries`) and holds the slot
   (`KeepAlive`) until the engines replied; only then does it pack into it again. The other ranks overwrite a
   slot only inside `spread`, which the shipping rank enters after that wait: the collective carries the order;
4. `agree(committed)` after the shipping rank's commit: no rank leaves the sync (and may release its slots, e.g.
   to sleep) while an engine may still read them, and every rank learns whether the commit went through.

A rank that holds no tensors (every rank but the shipping one) follows the buckets with `BucketPlan.completions`;
the shipping rank, after a failure, still completes every remaining `spread` (the session is aborted afterwards),
so no rank is left waiting in a collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from beamrl.protocols.manifest import BucketLayout
from beamrl.sync.rank_payload import Colocation, PayloadError, SharedBuffer, gather_handles, payload_entries
from beamrl.sync.staging import SenderSlot


class RankSlot(SenderSlot):
    """One persistent slot of this rank: its shared buffer and its handle; on the shipping rank the transport keeps
    its sender-side bookkeeping here too (`SenderSlot`; no receiver events: the engines' reply is the copy-done
    signal)."""

    kind = "rank slot"

    def __init__(self, index: int, capacity: int, device: torch.device, rank: int) -> None:
        super().__init__(index, capacity, SharedBuffer.allocate(capacity, device))
        self.handle = SharedBuffer.of(self.buffer, rank, index)

    def close(self) -> None:
        """Also removes the CPU buffer's /dev/shm file now (not when the tensor is collected: a process killed after
        its shutdown never collects it; engines that mapped it keep their mapping)."""
        super().close()
        unlink = getattr(self.buffer, "_beamrl_unlink", None)
        if unlink is not None:
            unlink()


class RankSlots:
    """This trainer rank's slots (module docstring). `shipping_rank`: the rank whose transport sends the payloads
    (rank 0 of the trainer); `group`: the trainer ranks' process group (None: the default one)."""

    def __init__(self, rank: int, device: torch.device | str, num_slots: int = 2, shipping_rank: int = 0,
                 group=None) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.rank, self.device = rank, torch.device(device)
        self.num_slots, self.shipping_rank, self.group = num_slots, shipping_rank, group
        self.slots: list[RankSlot] = []
        self.handles: list[tuple[SharedBuffer, ...]] | None = None  # per trainer rank, its slots (shipping rank)

    @property
    def ships(self) -> bool:
        return self.rank == self.shipping_rank

    @property
    def capacity(self) -> int:
        return self.slots[0].capacity if self.slots else 0

    def ensure(self, nbytes: int) -> None:
        """Collective: slots of at least `nbytes` on every rank (the same plan on every rank gives the same
        decision); new slots' handles are gathered to the shipping rank."""
        if self.slots and self.capacity >= nbytes:
            return
        self.release()
        self.slots = [RankSlot(i, nbytes, self.device, self.rank) for i in range(self.num_slots)]
        self.handles = gather_handles(tuple(s.handle for s in self.slots), dst=self.shipping_rank, group=self.group)

    def slot(self, index: int) -> RankSlot:
        if not self.slots:
            raise PayloadError(f"bucket {index}: this rank's slots are not allocated (ensure() first)")
        return self.slots[index % len(self.slots)]

    def spread(self, bucket: BucketLayout) -> None:
        """Collective, once per bucket on every rank: the shipping rank's packed slot -> the same slot of every
        rank; returns when every rank's copy is complete."""
        if not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return
        data = self.slot(bucket.index).payload(bucket.nbytes)
        dist.broadcast(data, src=self.shipping_rank, group=self.group)
        if data.is_cuda:
            torch.cuda.current_stream(data.device).synchronize()
        dist.barrier(group=self.group)

    def agree(self, ok: bool) -> bool:
        """Collective, once per sync after the shipping rank's commit: whether it went through on every rank. Until
        every rank is past it, no rank releases or reuses its slots (the engines may still be reading them)."""
        if not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def entries(self, bucket: BucketLayout, colocation: Colocation) -> list[SharedBuffer]:
        """Shipping rank: one handle per engine TP rank, the slot of bucket `bucket.index` of the trainer rank on
        that engine rank's device."""
        if self.handles is None:
            raise PayloadError("only the shipping rank, after ensure(), knows every rank's slots")
        k = bucket.index % self.num_slots
        per_rank = [h[k].for_bucket(bucket.index, bucket.nbytes) for h in self.handles]
        return payload_entries(per_rank, colocation, bucket.index)

    def release(self) -> None:
        """Drop this rank's slots (a colocated trainer going to sleep); the next `ensure` makes and shares new
        ones. Every rank releases together (`WeightSync.release_buffers` runs on every rank)."""
        cuda = any(s.buffer.is_cuda for s in self.slots)
        for s in self.slots:
            s.close()
        self.slots, self.handles = [], None
        if cuda:
            torch.cuda.ipc_collect()
