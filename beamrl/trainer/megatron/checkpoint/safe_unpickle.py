"""Read torch DCP's `.metadata` without running code from the checkpoint.

torch's `FileSystemReader.read_metadata` calls `pickle.load` on the file, and its default load planner reads
non-tensor items with an unrestricted `torch.load`: a checkpoint written by someone else could run their code on
load. `SafeFileSystemReader` unpickles the metadata with an allowlist of the plain dataclasses, enums and
torch value types the format consists of (anything else is refused with the class named), and
`refuse_bytes_items` is the planner hook that refuses non-tensor items (beamrl checkpoints hold none: every
non-tensor value is JSON).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_METADATA_FILE = ".metadata"

#: (module, name) of every class a DCP `.metadata` of this torch version may reference.
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "_MEM_FORMAT_ENCODING", "MetadataIndex", "StorageMeta")
} | {
    ("torch.distributed.checkpoint.planner", n) for n in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a lookup of torch.strided & co. by name
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
    ("collections", "OrderedDict"),
}
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint's metadata references a class outside the allowlist (it was not loaded)."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: Path):
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and "." not in name and isinstance(getattr(torch, name, None), _TORCH_VALUES):
            return getattr(torch, name)  # torch.float32, torch.strided, ... (pickled as globals)
        raise UnsafeCheckpointError(f"{self._path}: refusing to load {module}.{name} (not a checkpoint metadata "
                                    f"class; the file is corrupted or was not written by torch DCP)")


def load_metadata(directory: str | Path) -> Metadata:
    """The DCP `Metadata` of a checkpoint directory, unpickled through the allowlist."""
    path = Path(directory) / _METADATA_FILE
    with path.open("rb") as f:
        metadata = _MetadataUnpickler(f, path).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """`FileSystemReader` whose metadata is unpickled through the allowlist (`load_metadata`)."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if kwargs.get("rank") is not None:
            raise UnsafeCheckpointError("per-rank DCP metadata files are not used by beamrl checkpoints")
        metadata = load_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def refuse_bytes_items(read_item) -> None:
    """Planner hook for non-tensor items: beamrl never stores any, so one in a checkpoint is refused unread."""
    raise UnsafeCheckpointError(f"checkpoint item {read_item.dest_index.fqn!r} is a pickled object; beamrl "
                                f"checkpoints hold tensors only (refusing to unpickle it)")
