"""Trainer sleep/wake for colocated placement: give the device memory of a `MegatronTrainer` rank to the rollout
engines between train steps, and take it back bit-exactly.

Dependency-free (no `torch-memory-saver`): every device storage the rank owns long-term -- Megatron's contiguous
param and grad buffers (`DistributedDataParallel.buffers` / `expert_parallel_buffers`), the modules' parameters and
buffers outside them, the optimizer's FP32 main params, their grads and the Adam state -- is copied into a host
buffer (page-locked on CUDA, exactly sized, allocated once and reused every cycle) and its storage is resized to 0 bytes
(`untyped_storage().resize_(0)`). Every tensor viewing such a storage keeps its shape, strides and identity, so
Megatron's views (params into `param_data`, `main_grad` into `grad_data`, bucket views, the optimizer's
references) stay valid; waking resizes each storage back and copies the bytes in. On CUDA the freed blocks go back
to the driver (`torch.cuda.empty_cache`), so another process (the engine) can use them.

Gradients are the exception (`megatron_grad_tensors`): every train step starts by zeroing them, so a storage that
only gradients view (the DDP grad buffers, the optimizer's main-param grads) is freed without a host copy and comes
back zero-filled: nothing is lost, and a sleep moves ~20 % fewer bytes each way (FP32 grads of bf16 training).

What stays on the device while asleep (docs/colocated.md): the CUDA context, NCCL communicators and their buffers
(the process groups are kept: rebuilding Megatron's groups every step costs more than the memory of an idle
communicator on one node), Megatron's lazily allocated global memory buffer (SP
all-gathers) and small scratch tensors (e.g. the optimizer's overflow flag). `SleepReport.asleep_bytes` measures
what the caching allocator still holds.

On CPU the same code really moves the bytes (the storages are freed to 0 bytes and restored), so CPU tests check the
release, the bit-exact restore and identical training after a cycle.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from beamrl.trainer.megatron.pinned import pinned_host


class TrainerAsleepError(RuntimeError):
    """A call that needs the trainer's device state was made while the trainer sleeps."""


class GradientsPendingError(RuntimeError):
    """A sleep was asked for between a step's backward and its optimizer update (it would drop the gradients)."""


@dataclass(frozen=True)
class SleepReport:
    """What one `sleep` or `wake` did. `seconds`: wall time (device work included). `bytes`: bytes moved between
    device storages and host copies. `storages`: how many storages (gradient ones included). `dropped_bytes`:
    bytes of gradient storages freed without a copy (zero-filled at wake). `asleep_bytes` (sleep) /
    `awake_bytes` (wake): device bytes the caching allocator of this process reserves afterwards (0 on CPU).
    `peak_bytes` (sleep): the allocator's peak reserved bytes since the previous wake (the training peak; 0 on
    CPU)."""

    seconds: float
    bytes: int
    storages: int
    dropped_bytes: int = 0
    asleep_bytes: int = 0
    awake_bytes: int = 0
    peak_bytes: int = 0

    def as_dict(self) -> dict:
        return {"seconds": self.seconds, "bytes": self.bytes, "storages": self.storages,
                "dropped_bytes": self.dropped_bytes, "asleep_bytes": self.asleep_bytes,
                "awake_bytes": self.awake_bytes, "peak_bytes": self.peak_bytes}


def _tensors(obj) -> Iterator[torch.Tensor]:
    """Tensors inside an optimizer state value (tensors, or dicts / lists / tuples of them)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def megatron_state_tensors(chunks: Iterable, optimizer) -> Iterator[torch.Tensor]:
    """Every long-lived tensor of a trainer rank: DDP param/grad buffers, module params (+ `main_grad`) and
    buffers, and for each (chained) optimizer its torch optimizer's params, their grads and its state."""
    return _megatron_tensors(chunks, optimizer, grads_only=False)


def megatron_grad_tensors(chunks: Iterable, optimizer) -> Iterator[torch.Tensor]:
    """The gradients among `megatron_state_tensors`: DDP grad buffers, `main_grad` and `.grad` of the module params,
    the optimizer params' `.grad`. Every train step zeroes them before use (`zero_grad_buffer`, `zero_grad`)."""
    return _megatron_tensors(chunks, optimizer, grads_only=True)


def _megatron_tensors(chunks: Iterable, optimizer, grads_only: bool) -> Iterator[torch.Tensor]:
    for chunk in chunks:
        for buf in list(getattr(chunk, "buffers", [])) + list(getattr(chunk, "expert_parallel_buffers", [])):
            for t in (None if grads_only else getattr(buf, "param_data", None), getattr(buf, "grad_data", None)):
                if t is not None:
                    yield t
        module = getattr(chunk, "module", chunk)
        for p in module.parameters():
            if not grads_only:
                yield p.data
            for g in (getattr(p, "main_grad", None), p.grad):
                if g is not None:
                    yield g
        if not grads_only:
            yield from module.buffers()
    if optimizer is None:
        return
    for sub in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(sub, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                if not grads_only:
                    yield p.data
                if p.grad is not None:
                    yield p.grad
        if not grads_only:
            for state in inner.state.values():
                yield from _tensors(state)


class _Held:
    """One device storage while asleep: the storage object (resizing it resizes it for every view) and its bytes."""

    __slots__ = ("storage", "nbytes", "host")

    def __init__(self, storage: torch.UntypedStorage, nbytes: int, host: torch.Tensor | None) -> None:
        self.storage, self.nbytes, self.host = storage, nbytes, host  # host None: gradients, dropped


def _bytes_view(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,), (1,))


class DeviceStateSleeper:
    """Moves a trainer rank's long-lived device storages to host copies and back (module docstring).

    `tensors`: a callable returning the tensors to release (called at every `sleep`: the optimizer creates its
    state lazily at its first step). `grads`: a callable returning those of them whose contents need not survive
    (gradients): a storage viewed by nothing else is freed without a copy and zero-filled at wake. `device`: the
    rank's device; tensors elsewhere (Adam's CPU `step` counters on a GPU rank) are left alone."""

    def __init__(self, tensors, device: torch.device, grads=None) -> None:
        self._tensors = tensors
        self._grads = grads
        self.device = torch.device(device)
        self._held: list[_Held] | None = None
        self._host_cache: dict[int, list[torch.Tensor]] = {}  # nbytes -> host buffers reused across cycles

    @property
    def asleep(self) -> bool:
        return self._held is not None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def _storages(self) -> list[tuple[torch.UntypedStorage, int, bool]]:
        """(storage, bytes, keep) per device storage; keep False: only gradients view it."""
        grads_held = list(self._grads()) if self._grads is not None else []  # alive while their ids are compared
        grads = {id(g) for g in grads_held}
        seen: dict[int, tuple[torch.UntypedStorage, int]] = {}
        kept: set[int] = set()
        for t in self._tensors():
            if t.device != self.device:
                continue
            s = t.untyped_storage()
            n = s.nbytes()
            if n == 0:
                continue
            seen.setdefault(s.data_ptr(), (s, n))
            if id(t) not in grads:
                kept.add(s.data_ptr())
        # Largest first: a stable, deterministic order (and the big buffers' copies start first).
        return sorted(((s, n, ptr in kept) for ptr, (s, n) in seen.items()), key=lambda snk: -snk[1])

    def _host_buffer(self, nbytes: int, pool: dict[int, list[torch.Tensor]]) -> torch.Tensor:
        free = pool.get(nbytes)
        if free:
            return free.pop()
        return pinned_host(nbytes) if self.cuda else torch.empty(nbytes, dtype=torch.uint8)

    def sleep(self) -> SleepReport:
        """Copy every storage to host and free it on the device. Idempotent (a second call does nothing)."""
        t0 = time.perf_counter()
        if self._held is not None:
            return SleepReport(0.0, 0, 0, asleep_bytes=self._reserved())
        peak = torch.cuda.max_memory_reserved(self.device) if self.cuda else 0
        pool, self._host_cache = self._host_cache, {}
        held = []
        for storage, n, keep in self._storages():
            host = None
            if keep:
                host = self._host_buffer(n, pool)
                host.copy_(_bytes_view(storage, n), non_blocking=self.cuda)
            held.append(_Held(storage, n, host))
        if self.cuda:
            torch.cuda.synchronize(self.device)  # every copy landed before a storage is freed
        for h in held:
            h.storage.resize_(0)
        self._held = held
        if self.cuda:
            torch.cuda.empty_cache()  # hand the blocks back to the driver: the engine is another process
        moved = sum(h.nbytes for h in held if h.host is not None)
        return SleepReport(time.perf_counter() - t0, moved, len(held), dropped_bytes=_dropped(held),
                           asleep_bytes=self._reserved(), peak_bytes=peak)

    def wake(self) -> SleepReport:
        """Re-allocate every storage and copy its bytes back (bit-exact; gradient storages zero-filled). Idempotent."""
        t0 = time.perf_counter()
        held, self._held = self._held, None
        if held is None:
            return SleepReport(0.0, 0, 0, awake_bytes=self._reserved())
        for h in held:
            h.storage.resize_(h.nbytes)
            if h.host is None:
                _bytes_view(h.storage, h.nbytes).zero_()
            else:
                _bytes_view(h.storage, h.nbytes).copy_(h.host, non_blocking=self.cuda)
        if self.cuda:
            torch.cuda.synchronize(self.device)  # the host buffers are reused by the next sleep
            torch.cuda.reset_peak_memory_stats(self.device)
        for h in held:
            if h.host is not None:
                self._host_cache.setdefault(h.nbytes, []).append(h.host)
        moved = sum(h.nbytes for h in held if h.host is not None)
        return SleepReport(time.perf_counter() - t0, moved, len(held), dropped_bytes=_dropped(held),
                           awake_bytes=self._reserved())

    def _reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device) if self.cuda else 0


def _dropped(held: list[_Held]) -> int:
    return sum(h.nbytes for h in held if h.host is None)
