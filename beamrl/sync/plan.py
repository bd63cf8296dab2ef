"""The one bucketing pass of a weight sync: the export's layout -> size-bounded buckets with byte layouts.

`plan_buckets(units, bucket_bytes)` runs once per layout (before any tensor is produced, so the manifest can be
sent at `begin`) and `BucketPlan.assemble(stream)` then groups the streamed tensors into those buckets, checking
each against the layout. `beamrl.sync.packing.pack_bucket` copies a bucket's tensors into its flat buffer.

Rules:
- **Fused groups stay together.** SGLang fuses some HF tensors into one parameter on load; all members of such a
  group travel in one bucket (`beam_atomic_group`): q/k/v/gate of a layer (`qkv_gate_proj`), a dense layer's
  gate/up (`gate_up_proj`), each expert's gate/up (`w13`), the router weight with its correction bias. A group is
  placed when its last member has been exported, so buckets complete in index order whatever the export order.
- **Size.** A bucket holds at most `bucket_bytes`, except that one tensor (or fused group) larger than that
  travels alone in its own, oversized bucket (SGLang has no API to load part of a tensor).
- **Layout.** Inside a bucket tensors are ordered by decreasing element size, so every byte offset is aligned for
  its dtype (SGLang's `FlattenedTensorBucket` refuses an unaligned tensor); dtypes are never changed (the FP32
  router stays FP32; buckets mix bf16 and fp32).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from beamrl.protocols.flat_bucket import layout
from beamrl.protocols.manifest import BucketLayout, SyncManifest
from beamrl.protocols.weights import WeightSyncError
from beamrl.sync.export import NamedTensors, TensorSpec

DEFAULT_BUCKET_BYTES = 512 * 1024 ** 2

# name -> key of its fused group, or None for a tensor that travels on its own.
GroupRule = Callable[[str], "str | None"]

_QKV_GATE = re.compile(r"^(.*\.self_attn\.)(?:q|k|v|gate)_proj\.weight$")
_GATE_UP = re.compile(r"^(.*\.mlp\.(?:experts\.\d+\.)?)(?:gate|up)_proj\.weight$")
_ROUTER = re.compile(r"^(.*\.mlp\.gate\.)(?:weight|e_score_correction_bias)$")


def beam_atomic_group(name: str) -> str | None:
    """Beam's fused-on-load groups (SGLang `srt/models/beam.py` stacked params and router)."""
    for pattern, tag in ((_QKV_GATE, "qkv_gate"), (_GATE_UP, "gate_up"), (_ROUTER, "router")):
        m = pattern.match(name)
        if m:
            return m.group(1) + tag
    return None


@dataclass(frozen=True)
class BucketPlan:
    """Buckets of one export layout. `slots[i]` = (bucket, position in the bucket) of the export's i-th tensor,
    `specs[i]` its spec; `ready[i]` lists the tensors whose fused group is complete once tensor i has arrived.
    `arrived[u]`: tensors exported before unit u (u = 0 .. units); `done_at[b]`: the export index of bucket b's last
    tensor (what `completions` follows, worked out once per layout: a 501B export has ~38K tensors)."""

    buckets: tuple[BucketLayout, ...]
    specs: tuple[TensorSpec, ...]
    slots: tuple[tuple[int, int], ...]
    ready: tuple[tuple[int, ...], ...]
    bucket_bytes: int
    arrived: tuple[int, ...]
    done_at: tuple[int, ...]
    _manifests: dict[str, SyncManifest] = field(default_factory=dict, compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def max_bucket_bytes(self) -> int:
        return max(b.nbytes for b in self.buckets)

    def manifest(self, version: int, mode: str) -> SyncManifest:
        """The session's manifest. The layout's digest (a hash over every tensor) is computed once per mode; each
        sync only sets its version."""
        built = self._manifests.get(mode)
        if built is None:
            built = self._manifests[mode] = SyncManifest.build(version, mode, self.buckets)
        return built.with_version(version)

    def assemble(self, stream: Iterable[NamedTensors]) -> Iterator[tuple[int, list[torch.Tensor]]]:
        """Yield `(bucket index, tensors in the bucket's packing order)` as buckets complete, in index order.
        Every streamed tensor must be the layout's next one (name, dtype and shape), else `WeightSyncError`."""
        pending = [[None] * len(b.metas) for b in self.buckets]
        missing = [len(b.metas) for b in self.buckets]
        held: dict[int, torch.Tensor] = {}
        next_bucket, i, n = 0, 0, len(self.specs)
        for unit in stream:
            for name, tensor in unit:
                if i >= n:
                    raise WeightSyncError(f"export yielded {name!r} after the last tensor of its layout ({n} tensors)")
                spec = self.specs[i]
                if name != spec.name:
                    raise WeightSyncError(f"export yielded {name!r} where its layout has {spec.name!r} (tensor {i})")
                if not isinstance(tensor, torch.Tensor):
                    raise WeightSyncError(f"export yielded {type(tensor).__name__} for {name!r}, expected a tensor")
                if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
                    raise WeightSyncError(f"export yielded {name!r} as {tensor.dtype} {tuple(tensor.shape)}; its layout "
                                          f"says {spec.dtype} {spec.shape}")
                held[i] = tensor
                for j in self.ready[i]:
                    b, pos = self.slots[j]
                    pending[b][pos] = held.pop(j)
                    missing[b] -= 1
                i += 1
                while next_bucket < len(self.buckets) and missing[next_bucket] == 0:
                    yield next_bucket, pending[next_bucket]
                    pending[next_bucket] = None
                    next_bucket += 1
        if i != n:
            raise WeightSyncError(f"export ended after {i} of the {n} tensors of its layout (next: {self.specs[i].name!r})")


    def completions(self, stream: Iterable[NamedTensors], units_done: int = 0,
                    next_bucket: int = 0) -> Iterator[int]:
        """The bucket indices `assemble` would yield, at the same points of the stream (after the unit that
        completes them), from the layout's unit sizes alone: what a trainer rank that holds no tensors (or the
        shipping rank after `assemble` failed, from `units_done` units and `next_bucket` on) iterates to stay in
        lockstep with the buckets of a collective export (`beamrl.sync.rank_slots`). Reads the units, never their
        tensors."""
        done_at, units = self.done_at, len(self.arrived) - 1
        arrived = self.arrived[units_done]

        def ready() -> Iterator[int]:
            nonlocal next_bucket
            while next_bucket < len(self.buckets) and done_at[next_bucket] < arrived:
                yield next_bucket
                next_bucket += 1

        yield from ready()
        for j, _unit in enumerate(stream, start=units_done):
            if j >= units:
                raise WeightSyncError(f"export yielded unit {j} after the last unit of its layout ({units})")
            arrived = self.arrived[j + 1]
            yield from ready()
        if next_bucket != len(self.buckets):
            raise WeightSyncError(f"export ended with bucket {next_bucket} of {len(self.buckets)} incomplete")


def plan_buckets(units: Iterable[Iterable[TensorSpec]], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 group_rule: GroupRule = beam_atomic_group) -> BucketPlan:
    """Bucket an export layout (module docstring). Raises `WeightSyncError` for an empty layout or a name that
    appears twice, before any engine is touched."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    units = [list(unit) for unit in units]
    specs = [s for unit in units for s in unit]
    if not specs:
        raise WeightSyncError("weight export has zero tensors; refusing to run an empty weight sync")
    seen: set[str] = set()
    for s in specs:
        if s.name in seen:
            raise WeightSyncError(f"weight export has tensor {s.name!r} twice")
        seen.add(s.name)
    # Fused groups, each placed when its last member is exported.
    members: dict[str, list[int]] = {}
    for i, s in enumerate(specs):
        key = group_rule(s.name)
        if key is not None:
            members.setdefault(key, []).append(i)
    last_of = {idx[-1]: idx for idx in members.values()}
    grouped = {i for idx in members.values() for i in idx}
    units_in_order = [last_of[i] if i in last_of else [i] for i in range(len(specs)) if i in last_of or i not in grouped]

    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for unit in units_in_order:
        unit_bytes = sum(specs[i].nbytes for i in unit)
        if current and size + unit_bytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current += unit
        size += unit_bytes
        if size >= bucket_bytes:  # full, or one oversized unit alone
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)

    layouts, slots = [], [None] * len(specs)
    for b, idx in enumerate(buckets):
        ordered = sorted(idx, key=lambda i: -specs[i].dtype.itemsize)  # stable: aligned offsets (module doc)
        metas = layout([specs[i].name for i in ordered], [specs[i].dtype for i in ordered],
                       [specs[i].shape for i in ordered])
        layouts.append(BucketLayout(b, tuple(metas)))
        for pos, i in enumerate(ordered):
            slots[i] = (b, pos)
    ready = [tuple(last_of[i]) if i in last_of else (() if i in grouped else (i,)) for i in range(len(specs))]
    arrived = [0]
    for unit in units:
        arrived.append(arrived[-1] + len(unit))
    done_at = [-1] * len(layouts)
    for i, (b, _pos) in enumerate(slots):
        done_at[b] = i  # ascending i: the last one stays
    return BucketPlan(tuple(layouts), tuple(specs), tuple(slots), tuple(ready), bucket_bytes, tuple(arrived),
                      tuple(done_at))

