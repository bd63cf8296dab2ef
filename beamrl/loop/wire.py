"""`Wire`: the payload of a per-step actor call as one pickle.

Ray serializes every argument and return value of an actor call on its own (its serialization context, numpy
arrays out of band as read-only views), about 0.1 ms per argument before its size counts, more for pydantic
configs and lists of arrays. The calls made every step (a rollout's requests and results, a train step's
micro-batches and loss) carry many small objects: as one in-band pickle they cross in about half the time
(`benchmarks/ray_payload.py`). Only data travels this way; actor handles stay plain arguments, so Ray keeps
tracking them.
"""

from __future__ import annotations

import pickle
from typing import Generic, TypeVar

T = TypeVar("T")


class Wire(Generic[T]):
    """`value` pickled once by the sender; `open()` unpickles it (a fresh, writable copy) on the receiver."""

    __slots__ = ("blob",)

    def __init__(self, value: T):
        self.blob = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)

    def open(self) -> T:
        return pickle.loads(self.blob)

    def __reduce__(self):
        return _from_blob, (self.blob,)

    def __len__(self) -> int:
        return len(self.blob)


def _from_blob(blob: bytes) -> Wire:
    w = Wire.__new__(Wire)
    w.blob = blob
    return w

