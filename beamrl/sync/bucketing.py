"""Turn the trainer's streaming HF export into size-bounded `Bucket`s that keep SGLang's atomic groups whole.

SGLang fuses some HF tensors into one parameter on load (Beam: q/k/v/gate -> `qkv_gate_proj`; dense
gate/up -> `gate_up_proj`; each expert's gate/up -> `w13`; router weight with its correction bias). All
members of such a group travel in the same bucket, whatever order the exporter yields them in.

Size rule: a bucket holds at most `bucket_bytes`, except that a single tensor (or atomic group) larger than
`bucket_bytes` travels alone in its own, oversized bucket (splitting a tensor would need a partial-load API
that SGLang does not have). Dtypes are never changed (the FP32 router stays FP32). Inside a bucket tensors
are ordered by decreasing element size so the flat layout is aligned (see `flat_bucket.py`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

from beamrl.protocols.flat_bucket import aligned_order
from beamrl.protocols.weights import WeightSyncError
from beamrl.sync.protocol import Bucket

DEFAULT_BUCKET_BYTES = 512 * 1024 ** 2

NamedTensors = Sequence[tuple[str, torch.Tensor]]
# name -> (group key, number of members) for tensors of a fused group; None for a free tensor.
GroupRule = Callable[[str], "tuple[str, int] | None"]

_QKV_GATE = re.compile(r"^(.*\.self_attn\.)(?:q|k|v|gate)_proj\.weight$")
_GATE_UP = re.compile(r"^(.*\.mlp\.(?:experts\.\d+\.)?)(?:gate|up)_proj\.weight$")
_ROUTER = re.compile(r"^(.*\.mlp\.gate\.)(?:weight|e_score_correction_bias)$")


def beam_atomic_group(name: str) -> tuple[str, int] | None:
    """Beam's fused-on-load groups (sglang `srt/models/beam.py` stacked params and router)."""
    for pattern, members, tag in ((_QKV_GATE, 4, "qkv_gate"), (_GATE_UP, 2, "gate_up"), (_ROUTER, 2, "router")):
        m = pattern.match(name)
        if m:
            return m.group(1) + tag, members
    return None


def _nbytes(tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in tensors)


def bucketize(chunks: Iterable[NamedTensors], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
              group_rule: GroupRule = beam_atomic_group, require_complete_groups: bool = True) -> Iterator[Bucket]:
    """Yield `Bucket`s from an iterable of (name, tensor) lists (the exporter's chunks), streaming.

    Raises `WeightSyncError` when the export yields no tensor at all (a zero-chunk export must be loud), when a
    name repeats, or (with `require_complete_groups`) when the stream ends with a fused group missing members.
    Adapter-only syncs that update part of a group pass `require_complete_groups=False`.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    seen: set[str] = set()
    pending: dict[str, list[tuple[str, torch.Tensor]]] = {}  # incomplete fused groups
    current: list[tuple[str, torch.Tensor]] = []
    current_bytes = 0

    def emit(items: list[tuple[str, torch.Tensor]]) -> Bucket:
        ordered = aligned_order(items)
        return Bucket(names=[n for n, _ in ordered], tensors=[t for _, t in ordered])

    def add(unit: list[tuple[str, torch.Tensor]]) -> Iterator[Bucket]:
        nonlocal current, current_bytes
        size = _nbytes(unit)
        if current and current_bytes + size > bucket_bytes:
            yield emit(current)
            current, current_bytes = [], 0
        current.extend(unit)
        current_bytes += size
        if current_bytes >= bucket_bytes:  # full, or one oversized unit alone
            yield emit(current)
            current, current_bytes = [], 0

    for chunk in chunks:
        for name, tensor in chunk:
            if not isinstance(tensor, torch.Tensor):
                raise WeightSyncError(f"export yielded {type(tensor).__name__} for {name!r}, expected a tensor")
            if name in seen:
                raise WeightSyncError(f"export yielded tensor {name!r} twice")
            seen.add(name)
            group = group_rule(name)
            if group is None:
                yield from add([(name, tensor)])
                continue
            key, members = group
            pending.setdefault(key, []).append((name, tensor))
            if len(pending[key]) == members:
                yield from add(pending.pop(key))
    if not seen:
        raise WeightSyncError("weight export yielded zero tensors; refusing to run an empty weight sync")
    if pending and require_complete_groups:
        missing = ", ".join(f"{k} ({len(v)}/{group_rule(v[0][0])[1]}: {[n for n, _ in v]})"
                            for k, v in sorted(pending.items()))
        raise WeightSyncError(f"export ended with incomplete fused groups: {missing}")
    for key in sorted(pending):
        yield from add(pending[key])
    if current:
        yield emit(current)
