"""What a receiver is told at `begin_weight_update`: the whole session, before any byte moves.

A `SyncManifest` names the version the session will serve, its apply mode and, for every bucket, the byte layout
of the tensors it will carry (`TensorMeta`: name, shape, dtype, byte range; SGLang's `FlattenedTensorBucket`
layout). A receiver checks it against its own weight table first and refuses, before applying anything, a stale
version, an unknown name, a wrong shape or dtype, or (in mode `full`) a missing tensor. Each bucket then arrives
with its index and raw-bit checksum (`beamrl.protocols.checksum`), and the receiver checks that the bucket is the
next one, that its layout is the announced one and that its bytes are intact before it commits it.

Apply modes: `full` replaces every weight of the model (the manifest must cover the receiver's whole table);
another mode (e.g. LoRA's `adapter`) is a different set of named tensors the receiver applies its own way. A
receiver refuses a mode it does not know.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property

from beamrl.protocols.flat_bucket import TensorListing, TensorMeta, dtype_name, parse_dtype

FULL = "full"  # the apply mode of an ordinary weight sync


@dataclass(frozen=True)
class BucketLayout(TensorListing):
    """Bucket `index`: its tensors in packing order, back to back (`metas`), `nbytes` in all."""

    index: int
    metas: tuple[TensorMeta, ...]

    @property
    def nbytes(self) -> int:
        return self.metas[-1].end if self.metas else 0


@dataclass(frozen=True)
class SyncManifest:
    """One session: `version` to serve after it, apply `mode`, the buckets in sending order. `digest` identifies
    the layout (mode and every bucket's tensors), not the version: the same model yields the same digest every
    sync, so receivers can cache what they derive from it."""

    version: int
    mode: str
    buckets: tuple[BucketLayout, ...]
    digest: str = field(default="")

    @classmethod
    def build(cls, version: int, mode: str, buckets: tuple[BucketLayout, ...]) -> "SyncManifest":
        h = hashlib.sha256(mode.encode())
        for b in buckets:
            for m in b.metas:
                h.update(f"{b.index}|{m.name}|{dtype_name(m.dtype)}|{m.shape}|{m.start}|{m.end};".encode())
        return cls(int(version), mode, tuple(buckets), h.hexdigest())

    def with_version(self, version: int) -> "SyncManifest":
        return SyncManifest(int(version), self.mode, self.buckets, self.digest)

    def reference(self) -> "SyncManifest":
        """This session by digest only (no layout): what a sender ships to a receiver that already holds the
        layout (`ManifestCache`); a 501B layout is ~38K tensors."""
        return SyncManifest(self.version, self.mode, (), self.digest)

    @property
    def is_reference(self) -> bool:
        return not self.buckets

    @cached_property
    def tensors(self) -> dict[str, tuple[int, TensorMeta]]:
        """name -> (bucket index, meta)."""
        return {m.name: (b.index, m) for b in self.buckets for m in b.metas}

    @property
    def num_tensors(self) -> int:
        return sum(len(b.metas) for b in self.buckets)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def bucket(self, index: int) -> BucketLayout:
        if not 0 <= index < len(self.buckets):
            raise IndexError(f"bucket {index} is outside the session's {len(self.buckets)} bucket(s)")
        return self.buckets[index]

    def __reduce__(self):
        # Shipped as plain tuples (5x cheaper to pickle than the dataclasses: a 501B manifest has ~38K tensors);
        # cached_property values are derived, not shipped.
        compact = tuple(tuple((m.name, dtype_name(m.dtype), m.shape, m.start, m.end) for m in b.metas)
                        for b in self.buckets)
        return _from_compact, (self.version, self.mode, self.digest, compact)


def _from_compact(version: int, mode: str, digest: str, compact) -> SyncManifest:
    dtypes: dict[str, object] = {}
    buckets = tuple(BucketLayout(i, tuple(TensorMeta(n, shape, dtypes.get(d) or dtypes.setdefault(d, parse_dtype(d)),
                                                     start, end)
                                          for n, d, shape, start, end in metas))
                    for i, metas in enumerate(compact))
    return SyncManifest(version, mode, buckets, digest)
