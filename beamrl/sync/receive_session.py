"""The receiver's checks of one weight-update session, shared by every receiver (native engine, SGLang adapters).

`ReceiveSession(engine, manifest, served_version, tables)` refuses at `begin`, before anything is applied:
- a stale version (not newer than the one served);
- an apply mode the receiver has no weight table for;
- an unknown name, a wrong shape or dtype, and in mode `full` a missing tensor (checked against `tables[mode]`).
Then, per bucket: it must be the next one (`expect`), laid out as announced (`check_layout`), with intact bytes
(`check_checksum`: eagerly before the bucket is applied, or, on a GPU receiver, compared on the device and
settled at commit with one host read for the whole session). `settle()` at commit also requires every announced
bucket to have arrived.

`UndoLog` keeps host copies of what a session overwrote, so a receiver can roll back a failed session.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from beamrl.protocols.checksum import bucket_checksum, checksum_values
from beamrl.protocols.flat_bucket import TensorMeta, dtype_name
from beamrl.protocols.manifest import FULL, BucketLayout, SyncManifest
from beamrl.protocols.weights import WeightSyncError

#: HF name -> (shape, dtype) of what a receiver holds for one apply mode.
WeightTable = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


def _names(xs, n: int = 3) -> str:
    xs = sorted(xs)
    return ", ".join(repr(x) for x in xs[:n]) + (f" (+{len(xs) - n} more)" if len(xs) > n else "")


class ReceiveSession:
    """One session's checks (module docstring). Raises `WeightSyncError` naming the engine and the problem."""

    def __init__(self, engine: str, manifest: SyncManifest, served_version: int,
                 tables: "Mapping[str, WeightTable] | Callable[[], Mapping[str, WeightTable]]",
                 cache: "ManifestCache | None" = None) -> None:
        """`tables`: apply mode -> weight table, or a callable giving them (called only when the layout is
        checked). `cache`: the layouts of mode `full` this receiver validated before. A reference manifest (digest
        only, `SyncManifest.reference`) is resolved through it, and a known layout is not checked again (only the
        version is): in mode `full` the table is the model's fixed set of parameters. Other modes are checked every
        session (an adapter's table may change), and never cached."""
        if manifest.is_reference:
            if cache is None or manifest.mode != FULL or manifest.digest not in cache:
                raise WeightSyncError(f"{engine}: unknown manifest layout {manifest.digest[:16]!r} (mode "
                                      f"{manifest.mode!r}, sent by digest only); send the full manifest")
            manifest = cache.get(manifest.digest).with_version(manifest.version)
        self.engine, self.manifest = engine, manifest
        if manifest.version <= served_version:
            raise WeightSyncError(f"{engine}: refusing a stale weight version: the session would serve version "
                                  f"{manifest.version} but the engine already serves {served_version}")
        self.next_index = 0
        self._mine: torch.Tensor | None = None  # deferred checksums [bucket, 2]: the receiver's and the sender's
        self._sent: torch.Tensor | None = None
        cacheable = cache is not None and manifest.mode == FULL
        if cacheable and manifest.digest in cache:
            return  # this layout passed the checks below before (the digest names it exactly: `ManifestCache.add`)
        self._check_layout_against(tables() if callable(tables) else tables)
        if cacheable:
            cache.add(manifest, engine)

    def _check_layout_against(self, tables: Mapping[str, WeightTable]) -> None:
        engine, manifest = self.engine, self.manifest
        table = tables.get(manifest.mode)
        if table is None:
            raise WeightSyncError(f"{engine}: unknown apply mode {manifest.mode!r}; this engine applies "
                                  f"{sorted(tables)}")
        announced = manifest.tensors
        unknown = [n for n in announced if n not in table]
        if unknown:
            raise WeightSyncError(f"{engine}: the session announces tensor(s) this engine does not have: "
                                  f"{_names(unknown)}; nothing was applied")
        for name, (_, meta) in announced.items():
            shape, dtype = table[name]
            if tuple(meta.shape) != tuple(shape) or meta.dtype != dtype:
                raise WeightSyncError(f"{engine}: tensor {name!r} is announced as {dtype_name(meta.dtype)} "
                                      f"{tuple(meta.shape)}, the engine holds {dtype_name(dtype)} {tuple(shape)}; "
                                      f"nothing was applied")
        if manifest.mode == FULL and len(announced) != len(table):
            missing = [n for n in table if n not in announced]
            raise WeightSyncError(f"{engine}: a full weight sync must send every tensor; missing {len(missing)}: "
                                  f"{_names(missing)}; nothing was applied")

    @property
    def version(self) -> int:
        return self.manifest.version

    def expect(self, index: int) -> BucketLayout:
        """The layout of bucket `index`, which must be the session's next bucket."""
        if index != self.next_index:
            raise WeightSyncError(f"{self.engine}: bucket {index} arrived, expected bucket {self.next_index} of "
                                  f"{len(self.manifest.buckets)}")
        return self.manifest.bucket(index)

    def check_layout(self, index: int, metas: list[TensorMeta] | tuple[TensorMeta, ...]) -> None:
        """The bucket as it arrived (names, dtypes, shapes, byte ranges) must be the announced bucket."""
        want = self.manifest.bucket(index).metas
        for i, (got, exp) in enumerate(zip(metas, want)):
            if got != exp:
                raise WeightSyncError(
                    f"{self.engine}: bucket {index}, tensor {i}: arrived as {got.name!r} {dtype_name(got.dtype)} "
                    f"{got.shape} at bytes [{got.start}, {got.end}), the manifest announced {exp.name!r} "
                    f"{dtype_name(exp.dtype)} {exp.shape} at [{exp.start}, {exp.end}); bucket refused")
        if len(metas) != len(want):
            raise WeightSyncError(f"{self.engine}: bucket {index} holds {len(metas)} tensors, the manifest announced "
                                  f"{len(want)}; bucket refused")

    def check_checksum(self, index: int, buffer: torch.Tensor, sent: tuple[int, int] | torch.Tensor,
                       defer: bool = False) -> None:
        """Compare the raw-bit checksum of `buffer` (the bucket's bytes as received) with the sender's `sent`.
        `defer`: keep both on the device and compare them all at commit (no host round trip per bucket)."""
        if defer:
            bucket_checksum(buffer, out=self.deferred(index, sent, buffer.device))
            return
        got = checksum_values(bucket_checksum(buffer))
        want = checksum_values(sent) if isinstance(sent, torch.Tensor) else (int(sent[0]), int(sent[1]))
        if got != want:
            raise WeightSyncError(f"{self.engine}: bucket {index} failed its checksum (sent {want}, received {got}): "
                                  f"its bytes changed in transit; bucket refused")

    def deferred(self, index: int, sent: tuple[int, int] | torch.Tensor, device: torch.device) -> torch.Tensor:
        """Keep the sender's checksum of bucket `index` on `device` for `settle`; returns where the receiver's own
        checksum of the bucket goes (int64 [2] on `device`), to be written before commit."""
        if self._mine is None:
            n = len(self.manifest.buckets)
            self._mine = torch.zeros(n, 2, dtype=torch.int64, device=device)
            self._sent = torch.zeros(n, 2, dtype=torch.int64, device=device)
        sent_t = sent if isinstance(sent, torch.Tensor) else torch.tensor(sent, dtype=torch.int64)
        self._sent[index].copy_(sent_t, non_blocking=True)
        return self._mine[index]

    def advance(self) -> None:
        self.next_index += 1

    def settle(self) -> None:
        """At commit: every bucket arrived and every deferred checksum matched."""
        n = len(self.manifest.buckets)
        if self.next_index != n:
            raise WeightSyncError(f"{self.engine}: commit after {self.next_index} of {n} buckets; the session is "
                                  f"incomplete")
        if self._mine is not None:
            bad = torch.nonzero((self._mine != self._sent).any(1)).flatten().tolist()
            if bad:
                raise WeightSyncError(f"{self.engine}: bucket(s) {bad[:5]} failed their checksum (compared on the "
                                      f"device after loading): their bytes changed in transit")


class ManifestCache:
    """The last few `full` layouts a receiver validated, by digest (a sender may then send a reference manifest).
    `add` recomputes the digest from the layout, so a digest always names the layout it stands for."""

    def __init__(self, size: int = 16) -> None:
        self.size = size
        self._items: dict[str, SyncManifest] = {}

    def __contains__(self, digest: str) -> bool:
        return digest in self._items

    def get(self, digest: str) -> SyncManifest:
        return self._items[digest]

    def add(self, manifest: SyncManifest, engine: str = "receiver") -> None:
        actual = SyncManifest.build(manifest.version, manifest.mode, manifest.buckets).digest
        if actual != manifest.digest:
            raise WeightSyncError(f"{engine}: the manifest's digest {manifest.digest[:16]!r} is not that of its layout "
                                  f"({actual[:16]!r}); nothing was applied")
        self._items.pop(manifest.digest, None)
        self._items[manifest.digest] = manifest
        while len(self._items) > self.size:
            self._items.pop(next(iter(self._items)))


class UndoLog:
    """Host copies of the tensors a session overwrote, in the order they were first overwritten."""

    def __init__(self) -> None:
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._ids: set[int] = set()

    def save(self, targets: list[torch.Tensor]) -> None:
        """Keep a host copy of each target before its first overwrite in this session."""
        for t in targets:
            key = t.data_ptr()
            if key not in self._ids:
                self._ids.add(key)
                self._saved.append((t, t.detach().to("cpu", copy=True)))

    def restore(self) -> None:
        with torch.no_grad():
            for target, old in reversed(self._saved):
                target.copy_(old.to(target.device))
        if self._saved and self._saved[0][0].is_cuda:
            torch.cuda.synchronize(self._saved[0][0].device)
        self.clear()

    def clear(self) -> None:
        self._saved.clear()
        self._ids.clear()

    def __len__(self) -> int:
        return len(self._saved)
