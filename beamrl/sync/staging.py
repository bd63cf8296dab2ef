"""Staging slots: persistent buffers the trainer packs buckets into and the engine reads them from, shared ONCE.

The colocated fast path (docs/weight-sync.md, "Staged buckets") keeps a few slots (2 = double buffering) for the
whole run. Each slot is one allocation of `capacity` payload bytes plus a 16-byte trailer holding the sender's
checksum of the bucket (two int64, written on the device: no host round trip). The receiver opens every slot once
(`SlotHandle.open`) and keeps it open; per bucket only `(slot, bucket index)` travels.

- GPU: the buffer is shared as a CUDA-IPC handle (torch's own reduction, opened by the receiver once and kept), and
  ordering is carried by one interprocess CUDA event per slot and side: the sender records `sender_event` after
  packing bucket k; the receiver waits on it before reading, records its own event after copying out, and the
  sender waits on that event (on its stream, not on the host) before it packs into the slot again.
- CPU: the buffer is a shared-memory file (`/dev/shm`) that both processes map; ordering is the calls themselves.
- In one process (tests, an in-process engine) the receiver uses the sender's objects directly.

A handle pickles with any pickler (a Ray actor call, a pipe), because it carries its own sharing information.
Both sides checksum `checked(nbytes)`: the bucket's bytes rounded up to whole checksum rows (the slot's padding
is the same memory on both sides, and whole rows need the fewest kernels).
"""

from __future__ import annotations

import weakref

import torch

from beamrl.protocols.checksum import padded_rows
from beamrl.sync import shm
from beamrl.sync.packing import BucketChecksum

TRAILER_BYTES = 16  # int64 [S, W] of `beamrl.protocols.checksum`


def _trailer_offset(capacity: int) -> int:
    return padded_rows(capacity)  # the checksum reads whole 4 KiB rows of the slot




class SlotHandle:
    """What a receiver needs to open slot `index` (picklable). `_local` (never pickled) is the sender's slot when
    sender and receiver share the process."""

    def __init__(self, index: int, capacity: int, device: str, path: str | None, cuda_ipc, event_ipc,
                 local: "StagingSlot | None" = None) -> None:
        self.index, self.capacity, self.device = index, capacity, device
        self.path, self.cuda_ipc, self.event_ipc = path, cuda_ipc, event_ipc
        self._local = local

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_local"] = None
        return state

    def open(self) -> "OpenedSlot":
        """The receiver's side of the slot (maps or IPC-opens the buffer; do it once and keep the result)."""
        if self._local is not None:
            s = self._local
            return OpenedSlot(self.index, self.capacity, s.buffer, s.sender_event, local=True)
        if self.cuda_ipc is not None:
            rebuild, args = self.cuda_ipc
            buffer = rebuild(*args)
            device = buffer.device
            event = torch.cuda.Event.from_ipc_handle(device, self.event_ipc)
            return OpenedSlot(self.index, self.capacity, buffer, event, local=False)
        size = _trailer_offset(self.capacity) + TRAILER_BYTES
        buffer = torch.from_file(self.path, shared=True, size=size, dtype=torch.uint8)
        return OpenedSlot(self.index, self.capacity, buffer, None, local=False)


class SenderSlot:
    """What a transport keeps for each buffer it packs buckets into (the sender's side; `StagingSlot`, and the
    per-rank `beamrl.sync.rank_slots.RankSlot`): the buffer of `capacity` payload bytes, the receivers' calls still
    reading it (`pending`: waited for before the slot is packed again), what to wait on for their copies out of it
    on the device (`receiver_events`), the packing views per bucket layout and the bucket it last held."""

    #: names the slot in errors
    kind = "slot"

    def __init__(self, index: int, capacity: int, buffer: torch.Tensor) -> None:
        self.index, self.capacity, self.buffer = index, int(capacity), buffer
        self.pending: list = []  # PendingCall of every receiver's call on this slot
        self.receiver_events: list = []  # per receiver: what to wait on before packing again (GPU)
        self.views: dict[int, tuple] = {}  # id(layout) -> (layout, packing views) (`pack_bucket`)
        self.last_bucket: int | None = None

    def payload(self, nbytes: int) -> torch.Tensor:
        if nbytes > self.capacity:
            raise ValueError(f"{self.kind} {self.index} holds {self.capacity} bytes, bucket needs {nbytes}")
        return self.buffer[:nbytes]

    def close(self) -> None:
        self.views.clear()
        self.pending.clear()
        self.receiver_events.clear()


class StagingSlot(SenderSlot):
    """The sender's side of one staging slot: a `SenderSlot` whose buffer the receivers open once (shared memory or
    CUDA IPC), with the bucket's checksum trailer and, on GPU, the sender's interprocess event."""

    kind = "staging slot"

    def __init__(self, index: int, capacity: int, device: torch.device | str, shared: bool = True) -> None:
        capacity = int(capacity)
        self.device = torch.device(device)
        size = _trailer_offset(capacity) + TRAILER_BYTES
        self.path: str | None = None
        self.sender_event = None
        if self.device.type == "cuda":
            buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
            if shared:
                self.sender_event = torch.cuda.Event(interprocess=True)
        elif shared:
            self.path = f"{shm.new_path('beamrl-sync')}-{index}"
            buffer = torch.from_file(self.path, shared=True, size=size, dtype=torch.uint8)
            self._finalizer = weakref.finalize(self, shm.remove, self.path)
        else:
            buffer = torch.empty(size, dtype=torch.uint8)
        super().__init__(index, capacity, buffer)
        self.trailer = self.buffer[_trailer_offset(self.capacity):].view(torch.int64)
        # the packer writes the bucket's checksum into the trailer (`pack_bucket`, one pass with the copy on CUDA)
        self.packed = BucketChecksum(self.buffer[:_trailer_offset(self.capacity)], self.trailer)
        self.in_flight = None  # a transport's own work still reading the slot (the distributed broadcast)

    def checked(self, nbytes: int) -> torch.Tensor:
        """The bytes both sides checksum for a bucket of `nbytes` (whole rows of the slot)."""
        return self.buffer[:padded_rows(nbytes)]

    def handle(self) -> SlotHandle:
        cuda_ipc = event_ipc = None
        if self.device.type == "cuda" and self.sender_event is not None:
            from torch.multiprocessing.reductions import reduce_tensor

            cuda_ipc = reduce_tensor(self.buffer)
            self.sender_event.record()  # an interprocess event needs a device before it has a handle
            event_ipc = self.sender_event.ipc_handle()
        return SlotHandle(self.index, self.capacity, str(self.device), self.path, cuda_ipc, event_ipc, local=self)

    def close(self) -> None:
        if self.path is not None:
            self._finalizer()
        super().close()


class OpenedSlot:
    """The receiver's side of a slot. `done_event` (GPU) is recorded after the receiver copied a bucket out."""

    def __init__(self, index: int, capacity: int, buffer: torch.Tensor, sender_event, local: bool) -> None:
        self.index, self.capacity, self.buffer = index, capacity, buffer
        self.trailer = buffer[_trailer_offset(capacity):_trailer_offset(capacity) + TRAILER_BYTES].view(torch.int64)
        self.sender_event = sender_event
        self.done_event = None
        self.reply = None  # what attach_staging returns for this slot
        if buffer.is_cuda:
            self.done_event = torch.cuda.Event(interprocess=not local)
            self.done_event.record(torch.cuda.current_stream(buffer.device))
            self.reply = self.done_event if local else self.done_event.ipc_handle()
        self.views: dict[tuple[str, int], list[torch.Tensor]] = {}  # unpacking views per (manifest, bucket)

    def checked(self, nbytes: int) -> torch.Tensor:
        """The bytes both sides checksum for a bucket of `nbytes` (`StagingSlot.checked`)."""
        return self.buffer[:padded_rows(nbytes)]

    def wait_for_sender(self) -> None:
        if self.sender_event is not None:
            torch.cuda.current_stream(self.buffer.device).wait_event(self.sender_event)

    def signal_done(self) -> None:
        if self.done_event is not None:
            self.done_event.record(torch.cuda.current_stream(self.buffer.device))


def receiver_event(reply, device: torch.device):
    """The sender's handle on a receiver's `done_event` from its `attach_staging` reply (None on CPU)."""
    if reply is None:
        return None
    if isinstance(reply, torch.cuda.Event):
        return reply
    return torch.cuda.Event.from_ipc_handle(device, reply)
