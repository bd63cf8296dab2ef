"""`Wire`: the payload of a per-step actor call as one pickle.

Ray serializes every argument and return value of an actor call on its own (its serialization context, numpy
arrays out of band), about 0.1 ms per argument before its size counts, more for pydantic configs and for each
array. The calls made every step (a rollout's requests and results, a train step's micro-batches and loss) carry
many small objects: pickled once, they cross in about half the time (`benchmarks/ray_payload.py`).

Large arrays keep Ray's zero-copy path: the pickle takes them out of band (protocol 5), and when they hold more
than `INLINE_MAX_BYTES` in all, Ray ships them as out-of-band buffers, as it would the arrays themselves (a
production rollout's routed experts run to gigabytes; copying them into one blob would cost more than the
per-argument overhead saved). Below that, they travel inside the message. Only data travels this way; actor
handles stay plain arguments, so Ray keeps tracking them.
"""

from __future__ import annotations

import pickle
from typing import Generic, TypeVar

T = TypeVar("T")

INLINE_MAX_BYTES = 1 << 20  # out-of-band bytes up to which they ride inside the message


class Wire(Generic[T]):
    """`value` pickled once by the sender; `open()` unpickles it on the receiver (arrays may be read-only views of
    the received buffers, as Ray's own deserialization gives them)."""

    __slots__ = ("blob", "buffers")

    def __init__(self, value: T):
        out_of_band: list[pickle.PickleBuffer] = []
        self.blob = pickle.dumps(value, protocol=5, buffer_callback=out_of_band.append)
        raw = [b.raw() for b in out_of_band]
        # small: copied into bytes, pickled with the message; large: PickleBuffers, which Ray sends out of band
        self.buffers = [m.tobytes() for m in raw] if sum(m.nbytes for m in raw) <= INLINE_MAX_BYTES else out_of_band

    def open(self) -> T:
        return pickle.loads(self.blob, buffers=self.buffers)

    def __reduce__(self):
        return _from_parts, (self.blob, self.buffers)

    @property
    def nbytes(self) -> int:
        """The payload's size: the pickle and its out-of-band buffers."""
        return len(self.blob) + sum(memoryview(b).nbytes for b in self.buffers)


def _from_parts(blob: bytes, buffers: list) -> Wire:
    w = Wire.__new__(Wire)
    w.blob, w.buffers = blob, buffers
    return w
