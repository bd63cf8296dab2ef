"""Sharded tensors to and from a torch_dist checkpoint directory (Megatron's `dist_checkpointing` format).

Writing is split in the three phases of Megatron's asynchronous save, so the middle one can run in the background:

1. `plan` (collective): apply ShardedTensor factories, validate that the main replicas cover every global tensor
   exactly once (first save only), translate Megatron ShardedTensors to torch DCP items (main replicas only), plan
   the files, and *stage* the data: device tensors are copied to host memory here (`HostStaging`: pinned buffers
   reused from save to save), so training may go on changing them.
2. `write_files` (local, no collectives): write this rank's files (`file_writer`: `__<rank>_<i>.distcp`, up to
   `file_writer.WRITE_THREADS` of them written in parallel, digests computed while writing) and a JSON of its
   write results, file digests and costs. Runs inline, or in a forked child (`async_writer`), whose
   copy-on-write memory snapshot keeps host tensors consistent while the parent trains on.
3. `finalize` (collective): gather the write results, the coordinator writes DCP's `.metadata` and Megatron's
   `metadata.json` (backend `torch_dist`).

Reading (`load`) applies the same factories, reads only what this rank's (possibly different) layout needs, with
`SafeFileSystemReader` (no unpickling of anything but allowlisted metadata classes).
"""

from __future__ import annotations

import gc
import json
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
from megatron.core.dist_checkpointing.mapping import ShardedObject, apply_factory_merges
from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess, save_preprocess
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreLoadPlanner,
    MCoreSavePlanner,
    _replace_sharded_keys_with_state_dict_keys,
    _replace_state_dict_keys_with_sharded_keys,
    _restore_dict_types,
    _unwrap_pyt_sharded_tensor,
    mcore_to_pyt_state_dict,
)
from megatron.core.dist_checkpointing.utils import extract_sharded_base
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from beamrl import manifest
from beamrl.trainer.megatron.checkpoint.file_writer import write_rank_files
from beamrl.trainer.megatron.pinned import pinned_host
from beamrl.trainer.megatron.checkpoint.safe_unpickle import SafeFileSystemReader, load_metadata, refuse_bytes_items

#: Per-rank write results + digests, folded into the checkpoint manifest at finalize and then removed.
RESULTS_DIR = ".write_results"


class StorageError(RuntimeError):
    """Writing or reading the sharded tensors failed; the message names the directory and, where known, the file."""


@dataclass
class PendingWrite:
    """One rank's share of a checkpoint between `plan` and `finalize`."""

    directory: Path
    rank: int
    plan: SavePlan
    staged: dict = field(repr=False)
    metadata: object = None  # DCP Metadata, coordinator only

    @property
    def results_file(self) -> Path:
        return self.directory / RESULTS_DIR / f"rank_{self.rank:05d}.json"


class _TensorOnlyLoadPlanner(MCoreLoadPlanner):
    """Megatron's load planner (global-shape checks), refusing pickled items instead of unpickling them."""

    def load_bytes(self, read_item, value) -> None:
        refuse_bytes_items(read_item)


def _writer(directory: Path) -> FileSystemWriter:
    # Plans the files (`__<rank>_` prefixes) and writes `.metadata`; the data files are written by `file_writer`.
    return FileSystemWriter(directory, single_file_per_rank=True, sync_files=True)


class HostStaging:
    """Host copies of a save's device tensors, made before the step goes on (the write may run after training
    changed them). Host tensors are written as they are: inline before training goes on, or by a forked child
    that sees them as of the fork.

    CUDA tensors are copied into page-locked host buffers of their exact size (`beamrl.trainer.megatron.pinned`:
    fast copies, one synchronisation for all), kept from one
    save to the next: a run's saves hold the same tensors, so later saves allocate nothing. The buffers cost host
    memory of the size of the rank's device-resident checkpoint state for the run's lifetime. They are rewritten
    only by the next save, which first waits for the previous one's writer."""

    def __init__(self):
        self._buffers: dict = {}
        self.last_bytes = 0  # bytes copied from the device by the last `stage`
        self.last_s = 0.0

    def stage(self, items: dict) -> dict:
        """`{index: tensor}` -> `{index: host tensor}`."""
        t0 = time.perf_counter()
        out, kept, copied, devices = {}, {}, 0, set()
        for index, data in items.items():
            if not isinstance(data, torch.Tensor):
                raise StorageError(f"non-tensor checkpoint item {type(data).__name__}: beamrl stores tensors only")
            data = data.detach()
            if data.device.type == "cpu":
                out[index] = data
                continue
            if data.device.type != "cuda":  # other accelerators: a plain (synchronous) copy
                out[index] = data.to("cpu")
            else:
                held = self._buffers.get(index)
                if held is None or held[1].shape != data.shape or held[1].dtype != data.dtype:
                    # exactly sized (`pinned.py`), shared with the forked writer; kept: it holds the registration
                    base = pinned_host(data.nbytes, fork_shared=True)
                    held = (base, base.view(data.dtype).view(data.shape))
                held[1].copy_(data, non_blocking=True)
                kept[index] = held
                out[index] = held[1]
                devices.add(data.device)
            copied += data.nbytes
        for device in devices:
            torch.cuda.synchronize(device)
        self._buffers = kept  # buffers of tensors no longer saved are released
        self.last_bytes, self.last_s = copied, time.perf_counter() - t0
        return out


def plan(sharded_state_dict: dict, directory: Path, *, validate: bool,
         staging: HostStaging | None = None) -> PendingWrite:
    """Phase 1 (collective). `sharded_state_dict` must hold Megatron ShardedTensors/factories only. Device
    tensors are staged through `staging` (a fresh `HostStaging` if None: nothing reused)."""
    sharded_part, common = save_preprocess(sharded_state_dict, validate_access_integrity=validate)
    leftovers = [k for k, _ in _flat_items(common)]
    if leftovers:
        raise StorageError(f"non-tensor values reached the tensor store: {leftovers[:5]} (they belong in JSON)")
    flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_part, keep_only_main_replica=True)
    objects = [k for k, v in flat.items() if isinstance(v[0], ShardedObject)]
    if objects:
        raise StorageError(f"pickled objects are not stored in beamrl checkpoints: {objects[:5]}")
    pyt = mcore_to_pyt_state_dict(flat, is_loading=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    planner = MCoreSavePlanner(flatten_state_dict=False, can_run_decentralized_global_plan=False)
    writer = _writer(directory)
    planner.set_up_planner(state_dict=pyt, storage_meta=writer.storage_meta(), is_coordinator=rank == 0)
    writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
    local = writer.prepare_local_plan(planner.create_local_plan())
    plans = [None] * world if rank == 0 else None
    dist.gather_object(local, plans, dst=0)
    metadata, global_plans = None, None
    if rank == 0:
        global_plans, metadata = planner.create_global_plan(plans)
        global_plans = writer.prepare_global_plan(global_plans)
    mine = [None]
    dist.scatter_object_list(mine, global_plans, src=0)
    final = planner.finish_plan(mine[0])
    staging = staging if staging is not None else HostStaging()
    staged = staging.stage({item.index: planner.resolve_data(item) for item in final.items})
    return PendingWrite(directory, rank, final, staged, metadata)


def write_files(pending: PendingWrite) -> None:
    """Phase 2 (local): this rank's data files, then `RESULTS_DIR/rank_N.json` (results, digests computed while
    writing, costs). Raises on any failure; the results file exists only after a complete write."""
    gc.disable()  # a forked child must not run finalizers of the parent's (device) objects
    try:
        results, files, stats = [], {}, None
        if pending.plan.items:
            results, files, stats = write_rank_files(pending.directory, pending.plan, pending.staged)
        payload = {"results": [_result_to_json(r) for r in results], "files": files,
                   "stats": stats.to_json() if stats else None}
        out = pending.results_file
        out.parent.mkdir(parents=True, exist_ok=True)
        manifest.write_json_atomic(out, payload)
    finally:
        gc.enable()


def finalize(pending: PendingWrite, write_ok: bool) -> tuple[dict[str, dict], list[dict]]:
    """Phase 3 (collective). Every rank passes whether its `write_files` succeeded; if any failed, every rank raises
    `StorageError`. Returns (on the coordinator; empty elsewhere) the manifest entries of every data file written
    and each writing rank's costs (`file_writer.WriteStats.to_json`)."""
    results, error = None, None
    if write_ok:
        try:
            results = json.loads(pending.results_file.read_text())
        except (OSError, ValueError) as e:
            error = f"rank {pending.rank}: {pending.results_file} unreadable ({e})"
    else:
        error = f"rank {pending.rank}: writing its files in {pending.directory} failed (see that rank's log)"
    gathered = [None] * dist.get_world_size() if pending.rank == 0 else None
    dist.gather_object((results, error), gathered, dst=0)
    status = [None]
    files: dict[str, dict] = {}
    stats: list[dict] = []
    if pending.rank == 0:
        errors = [e for _, e in gathered if e]
        if not errors:
            try:
                all_results = [[_result_from_json(r) for r in res["results"]] for res, _ in gathered]
                _writer(pending.directory).finish(pending.metadata, all_results)
                save_config(CheckpointingConfig("torch_dist", 1), str(pending.directory))
                for res, _ in gathered:
                    files.update(res["files"])
                    stats += [res["stats"]] if res.get("stats") else []
            except Exception as e:  # noqa: BLE001 - reported to every rank below
                errors.append(f"rank 0: writing {pending.directory}/.metadata failed: {type(e).__name__}: {e}")
        status = ["; ".join(errors)]
    dist.broadcast_object_list(status, src=0)
    if status[0]:
        raise StorageError(f"checkpoint {pending.directory} was not completed: {status[0]}")
    return files, stats


def load(sharded_state_dict: dict, directory: Path) -> dict:
    """Read the tensors `sharded_state_dict` asks for (this rank's layout) from `directory`; returns the state dict
    with ShardedTensors replaced by loaded tensors (factories merged back). Missing keys or global shapes that
    differ from the checkpoint's raise `StorageError` naming them."""
    sharded, _nonpersistent, factories = load_preprocess(sharded_state_dict)
    sharded, rest = extract_sharded_base(sharded)
    if list(_flat_items(rest)):
        raise StorageError("load: non-tensor values in the requested state (they come from JSON)")
    metadata = load_metadata(directory)
    flat, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(sharded)
    _check_keys(flat, metadata, directory)
    tensors = [sh for shards in flat.values() for sh in shards]
    pyt = mcore_to_pyt_state_dict(flat, is_loading=True)
    planner = _TensorOnlyLoadPlanner(shapes_validation_sharded_tensors=tensors, flatten_state_dict=False,
                                     flatten_sharded_tensors=False)
    with warnings.catch_warnings():  # every rank reads what it needs on its own, on purpose (no_dist)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        torch.distributed.checkpoint.load(pyt, storage_reader=SafeFileSystemReader(directory), planner=planner,
                                          no_dist=True)
    loaded = {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt.items()}
    loaded = _replace_sharded_keys_with_state_dict_keys(loaded, flat_mapping, rename_mapping)
    _restore_dict_types(loaded, sharded)
    return apply_factory_merges(loaded, factories)


def _check_keys(flat: dict, metadata, directory: Path) -> None:
    stored = metadata.state_dict_metadata
    missing = sorted(k for k in flat if k not in stored)
    if missing:
        raise StorageError(f"{directory} lacks {len(missing)} tensor(s) this trainer needs, e.g. {missing[:3]} (a "
                           f"checkpoint of another model or optimizer kind?)")
    for key, shards in flat.items():
        md = stored[key]
        if not isinstance(md, TensorStorageMetadata):
            raise StorageError(f"{directory}: {key!r} is stored as a pickled object, not a tensor (refused)")
        if tuple(md.size) != tuple(shards[0].global_shape):
            raise StorageError(f"{directory}: {key!r} has global shape {tuple(md.size)} in the checkpoint but "
                               f"{tuple(shards[0].global_shape)} in this model (another model config?)")


def _flat_items(x, prefix=()):
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _flat_items(v, prefix + (k,))
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _flat_items(v, prefix + (i,))
    else:
        yield prefix, x


def _result_to_json(r: WriteResult) -> dict:
    s = r.storage_data
    return {"fqn": r.index.fqn, "offset": list(r.index.offset) if r.index.offset is not None else None,
            "index": r.index.index, "size": r.size_in_bytes, "path": s.relative_path, "at": s.offset,
            "length": s.length, "transforms": list(s.transform_descriptors) if s.transform_descriptors else None}


def _result_from_json(d: dict) -> WriteResult:
    index = MetadataIndex(d["fqn"], torch.Size(d["offset"]) if d["offset"] is not None else None, d["index"])
    return WriteResult(index=index, size_in_bytes=d["size"],
                       storage_data=_StorageInfo(d["path"], d["at"], d["length"], d["transforms"]))


def remove_results(directory: Path) -> None:
    """Drop the per-rank results once the manifest holds them (coordinator, after finalize)."""
    results = directory / RESULTS_DIR
    if results.exists():
        for f in results.iterdir():
            f.unlink()
        os.rmdir(results)
