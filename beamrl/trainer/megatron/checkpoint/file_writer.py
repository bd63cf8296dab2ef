"""Write one rank's planned tensors into torch DCP data files, fast: several files written in parallel (one writer
thread each), each file's SHA-256 computed from the bytes as they are written (no second read), one fsync per
file at its end, and no zip CRC-32 (torch does not check it on load; the SHA-256 is what a load verifies).

The files are ordinary torch DCP data files (`__<rank>_<i>.distcp`: each item a `torch.save` record at the offset
its `WriteResult` names), so torch's and beamrl's readers load them unchanged.

Safe in a forked child (`async_writer`): plain Python threads and file I/O; no device calls, no collectives, and
tensors are never copied (a view of a larger buffer, as the optimizer's state is, is re-wrapped zero-copy so that
`torch.save` writes only its own bytes).
"""

from __future__ import annotations

import hashlib
import io
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, SerializationFormat, _StorageWriterTransforms, _write_item
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

#: Writer threads (and data files) per rank. Four saturate a ~1-2 GB/s local disk with SHA-256 (about 1-2 GB/s
#: per core) computed inline; more files per rank only add metadata for a load to open.
WRITE_THREADS = 4


class FileWriteError(RuntimeError):
    """Writing a data file failed; the message names the file."""


@dataclass
class WriteStats:
    """What one rank's write cost: bytes, wall seconds, and per phase the seconds summed over the writer threads
    (`write_s`: serialisation + write + SHA-256, interleaved per chunk; `fsync_s`)."""

    bytes: int = 0
    files: int = 0
    wall_s: float = 0.0
    write_s: float = 0.0
    fsync_s: float = 0.0
    per_file: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"bytes": self.bytes, "files": self.files, "wall_s": self.wall_s, "write_s": self.write_s,
                "fsync_s": self.fsync_s}


class _DigestingFile:
    """The stream `torch.save` writes to: every byte goes to the file and into a SHA-256; position tracked here.
    Seeking is refused (`torch.save` seeks only with `skip_data`, which would leave holes the digest misses)."""

    def __init__(self, raw, path: Path):
        self._raw = raw
        self._path = path
        self._sha = hashlib.sha256()
        self._pos = 0

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        self._sha.update(view)  # releases the GIL for large buffers: the threads hash in parallel
        self._raw.write(view)  # a BufferedWriter writes everything or raises
        self._pos += view.nbytes
        return view.nbytes

    def tell(self) -> int:
        return self._pos

    def seek(self, *args):
        raise io.UnsupportedOperation(f"{self._path}: seeking while writing a checkpoint file")

    def flush(self) -> None:
        self._raw.flush()

    def writable(self) -> bool:
        return True

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


def write_rank_files(directory: Path, plan: SavePlan, staged: dict, threads: int | None = None
                     ) -> tuple[list[WriteResult], dict[str, dict], WriteStats]:
    """Write the plan's items (tensors in `staged`, keyed by item index) into up to `threads` (default
    `WRITE_THREADS`) files in parallel. Returns the DCP write results, the manifest entry (size + SHA-256) of every
    file written, and the costs."""
    threads = WRITE_THREADS if threads is None else threads
    bad = [item.index.fqn for item in plan.items if item.type == WriteItemType.BYTE_IO]
    if bad:
        raise FileWriteError(f"non-tensor items reach the data files: {bad[:5]} (beamrl stores tensors only)")
    buckets = [b for b in _balanced(plan.items, staged, threads) if b]
    prefix = plan.storage_data.prefix  # "__<rank>_", assigned by the DCP writer's global plan
    jobs = [(Path(directory) / f"{prefix}{i}{DEFAULT_SUFFIX}", f"{prefix}{i}{DEFAULT_SUFFIX}", bucket)
            for i, bucket in enumerate(buckets)]
    stats = WriteStats()
    t0 = time.perf_counter()
    results: list[WriteResult] = []
    entries: dict[str, dict] = {}
    with _zip_crc32_off():
        if len(jobs) <= 1:
            done = [_write_file(*job, staged) for job in jobs]
        else:
            with ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="beamrl-ckpt-write") as pool:
                done = [f.result() for f in [pool.submit(_write_file, *job, staged) for job in jobs]]
    for name, file_results, entry, write_s, fsync_s in done:
        results.extend(file_results)
        entries[name] = entry
        stats.bytes += entry["size"]
        stats.write_s += write_s
        stats.fsync_s += fsync_s
        stats.per_file[name] = {"bytes": entry["size"], "write_s": write_s, "fsync_s": fsync_s}
    stats.files = len(done)
    stats.wall_s = time.perf_counter() - t0
    return results, entries, stats


def _write_file(path: Path, name: str, items: list, staged: dict):
    transforms = _StorageWriterTransforms()
    results = []
    try:
        t0 = time.perf_counter()
        with open(path, "wb") as raw:
            out = _DigestingFile(raw, path)
            for item in items:
                results.append(_write_item(transforms, out, _own_storage(staged[item.index]), item, name,
                                           SerializationFormat.TORCH_SAVE))
            raw.flush()
            size = os.fstat(raw.fileno()).st_size
            t1 = time.perf_counter()
            os.fsync(raw.fileno())
            fsync_s = time.perf_counter() - t1
    except Exception as e:  # noqa: BLE001 - re-raised naming the file
        raise FileWriteError(f"writing {path} failed: {type(e).__name__}: {e}") from e
    if size != out.tell():
        raise FileWriteError(f"{path}: {size} bytes on disk after writing {out.tell()}")
    return name, results, {"size": size, "sha256": out.hexdigest()}, t1 - t0, fsync_s


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` with a storage of exactly its own bytes (`torch.save` writes a tensor's whole storage). A
    contiguous view of a larger buffer is re-wrapped without a copy; only a non-contiguous view is copied."""
    if tensor.untyped_storage().nbytes() == tensor.nbytes:
        return tensor
    if not tensor.is_contiguous():
        return tensor.clone(memory_format=torch.contiguous_format)
    as_bytes = tensor.reshape(-1).view(torch.uint8).numpy()  # shares memory with `tensor`
    return torch.from_numpy(as_bytes).view(tensor.dtype).view(tensor.shape)


def _balanced(items: list, staged: dict, n: int) -> list[list]:
    """`items` in `n` buckets of about equal bytes (largest first, each to the lightest bucket)."""
    buckets: list[list] = [[] for _ in range(max(1, n))]
    loads = [0] * len(buckets)
    for item in sorted(items, key=lambda it: staged[it.index].nbytes, reverse=True):
        i = loads.index(min(loads))
        buckets[i].append(item)
        loads[i] += staged[item.index].nbytes
    return buckets


@contextmanager
def _zip_crc32_off():
    """`torch.save` without the per-record CRC-32 of its zip container (process-wide setting, restored after):
    computing it costs about as much as the write (about 1.7 GB/s), and `torch.load` never checks it."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)
