"""`Checkpointer`: save (sync or async), finalize and load a `MegatronTrainer`'s checkpoints. Every method is
collective: all ranks call it in the same order (the trainer's contract)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import merge

from beamrl import manifest
from beamrl.trainer.megatron.checkpoint import format as fmt
from beamrl.trainer.megatron.checkpoint import rng, state, storage
from beamrl.trainer.megatron.checkpoint.async_writer import BackgroundWrite
from beamrl.trainer.megatron.checkpoint.format import CheckpointDamagedError, CheckpointError


def _log(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[beamrl] {msg}", flush=True)


@dataclass
class _Pending:
    write: storage.PendingWrite
    meta: dict | None  # rank 0 only
    background: BackgroundWrite | None  # None: written inline
    costs: dict = field(default_factory=dict)
    started: float = 0.0


class Checkpointer:
    """One per trainer. At most one save is in flight: `save` first completes the previous one."""

    def __init__(self, trainer):
        self.trainer = trainer
        self._pending: _Pending | None = None
        self._validated = False  # the sharding layout is checked once (it does not change during a run)
        self._staging = storage.HostStaging()
        #: The costs (seconds, bytes) of the last published save and of the last load, {} before the first;
        #: logged on rank 0 as well. Rank 0's save costs include every rank's writers.
        self.last_costs: dict = {}
        self.last_load_costs: dict = {}

    # ------------------------------------------------------------------------------------------------ save
    def save(self, directory: str | Path, async_save: bool) -> Path:
        """Write a checkpoint to `directory` (absent or empty). Returns once the files are written (sync) or once
        the data is staged and a background writer runs (async); call `finalize` to complete an async save."""
        t0 = time.perf_counter()
        self.finalize(blocking=True)
        directory = Path(directory)
        t = self.trainer
        t1 = time.perf_counter()
        self._agree(_prepare_directory(directory) if dist.get_rank() == 0 else None)
        sharded, common = state.sharded_state(t, is_loading=False)
        manifest.write_json_atomic(directory / fmt.rng_file(dist.get_rank()), rng.capture())
        t2 = time.perf_counter()
        write = storage.plan(sharded, directory, validate=not self._validated, staging=self._staging)
        self._validated = True
        meta = self._meta(common) if dist.get_rank() == 0 else None
        costs = {"async": async_save, "previous_save_wait_s": t1 - t0, "state_s": t2 - t1,
                 "plan_s": time.perf_counter() - t2 - self._staging.last_s, "stage_s": self._staging.last_s,
                 "staged_from_device_bytes": self._staging.last_bytes}
        background = BackgroundWrite(lambda: storage.write_files(write), str(directory)) if async_save else None
        costs["blocking_s"] = time.perf_counter() - t1
        self._pending = _Pending(write, meta, background, costs, t1)
        if not async_save:
            self.finalize(blocking=True)
        return directory

    def _meta(self, common: dict) -> dict:
        t = self.trainer
        return {"format": fmt.FORMAT, "step": t.step, "adam_step": state.adam_step(t, common),
                "world_size": dist.get_world_size(), "parallel": t.config.parallel.to_dict(), "dtype": t.config.dtype,
                "model": t.config.model.to_dict(), "optimizer": _optimizer_settings(t),
                "scheduler": t.scheduler.state_dict(), "sharding": dict(state.SHARDING_METADATA)}

    def finalize(self, blocking: bool = True, timeout_s: float | None = None) -> Path | None:
        """Complete the save in flight: returns its directory once published, None if there is none or (with
        `blocking=False`) if some rank's writer is still running. Raises `CheckpointError` if a write failed."""
        p = self._pending
        if p is None:
            return None
        timeout = self.trainer.config.timeout_s if timeout_s is None else timeout_s
        if p.background is None:  # sync: write here
            ok = _write_inline(p.write)
        elif not blocking and not self._all_ranks(p.background.done()):
            return None
        else:
            ok = p.background.wait(timeout)
        self._pending = None
        t0 = time.perf_counter()
        p.costs["written_s"] = t0 - p.started  # from the start of the save until every rank's files are written
        try:
            files, stats = storage.finalize(p.write, ok)
        except storage.StorageError as e:
            raise CheckpointError(str(e)) from None
        if dist.get_rank() == 0:
            directory = p.write.directory
            for name in [".metadata", "metadata.json"] + [fmt.rng_file(r) for r in range(dist.get_world_size())]:
                files[name] = manifest.file_entry(directory / name)
            p.meta["files"] = files
            fmt.write_meta(directory, p.meta)  # last: its presence marks a complete checkpoint
            storage.remove_results(directory)
        dist.barrier()
        p.costs["publish_s"] = time.perf_counter() - t0
        p.costs["total_s"] = time.perf_counter() - p.started
        p.costs["step_waited_s"] = step_waited_s(p.costs)
        if dist.get_rank() == 0:
            p.costs.update(_write_costs(stats, sum(e["size"] for e in files.values())))
            _log(_describe_costs(p.write.directory, p.costs))
        self.last_costs = p.costs
        return p.write.directory

    # ------------------------------------------------------------------------------------------------ load
    def load(self, directory: str | Path) -> dict:
        """Restore model, optimizer, scheduler, step (and RNG when the layout is unchanged) from `directory`,
        written at any layout of the same model. Every data file's digest is verified first (the ranks share the
        work); a damaged file raises `CheckpointError` naming it before anything is loaded. Returns the metadata."""
        self.finalize(blocking=True)
        directory = Path(directory)
        t = self.trainer
        t0 = time.perf_counter()
        try:
            meta = fmt.read_meta(directory)
        except CheckpointError as e:
            raise CheckpointDamagedError(str(e)) from None
        _check_compatible(meta, t, directory)
        self._verify(directory, meta)
        t1 = time.perf_counter()
        sharded, common = state.sharded_state(t, is_loading=True)
        t2 = time.perf_counter()
        try:
            loaded = storage.load(sharded, directory)
        except Exception as e:  # noqa: BLE001 - name the checkpoint; the digests above were fine
            raise CheckpointError(f"loading {directory} failed: {type(e).__name__}: {e}") from e
        t3 = time.perf_counter()
        merged = merge(common, loaded)
        state.load_model(t, merged)
        state.load_optimizer(t, merged, meta["adam_step"])
        t.scheduler.load_state_dict(meta["scheduler"])
        t._step = int(meta["step"])
        same_layout = meta["world_size"] == dist.get_world_size() and meta["parallel"] == t.config.parallel.to_dict()
        if same_layout:
            rng.restore(manifest.read_json(directory / fmt.rng_file(dist.get_rank()), "RNG state"))
        else:
            _log(f"{directory} was written with {meta['world_size']} ranks, parallel={meta['parallel']}; resharded "
                 f"to {dist.get_world_size()} ranks, parallel={t.config.parallel.to_dict()}. Weights, optimizer state, "
                 f"LR schedule and step carried over; RNG streams are per rank and layout, so they keep this run's "
                 f"seeding (seed={t.config.seed})")
        dist.barrier()
        t4 = time.perf_counter()
        self.last_load_costs = {"bytes": sum(e["size"] for e in meta["files"].values()), "verify_s": t1 - t0,
                                "state_s": t2 - t1, "read_s": t3 - t2, "restore_s": t4 - t3, "total_s": t4 - t0}
        c = self.last_load_costs
        _log(f"loaded {directory} ({c['bytes'] / 1e9:.2f} GB) in {c['total_s']:.1f} s: digests verified in "
             f"{c['verify_s']:.1f} s, state built in {c['state_s']:.1f} s, tensors read in {c['read_s']:.1f} s, "
             f"restored in {c['restore_s']:.1f} s")
        return meta

    def _verify(self, directory: Path, meta: dict) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        names = sorted(meta["files"])
        mine = {n: meta["files"][n] for n in names[rank::world]}
        problems = manifest.check(directory, mine, full=True)
        gathered = [None] * world
        dist.all_gather_object(gathered, problems)
        problems = [p for g in gathered for p in g]
        if problems:
            raise CheckpointDamagedError(f"{directory} is damaged: " + "; ".join(problems))

    # ------------------------------------------------------------------------------------------- helpers
    def _agree(self, error: str | None) -> None:
        """Broadcast rank 0's verdict; every rank raises the same error."""
        box = [error]
        dist.broadcast_object_list(box, src=0)
        if box[0]:
            raise CheckpointError(box[0])

    def _all_ranks(self, flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.trainer.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())


def step_waited_s(costs: dict) -> float:
    """How long `save` held the training step: the wait for the previous save to complete, then this save's
    staging (async) or all of it (sync)."""
    return costs["previous_save_wait_s"] + (costs["blocking_s"] if costs["async"] else costs["total_s"])


def _write_costs(stats: list[dict], total_bytes: int) -> dict:
    """The writers' costs summed over ranks (rank 0's view; other ranks' `last_costs` lack them)."""
    return {"bytes": total_bytes, "data_files": sum(s["files"] for s in stats),
            "write_wall_s": max((s["wall_s"] for s in stats), default=0.0),
            "write_thread_s": sum(s["write_s"] for s in stats), "fsync_thread_s": sum(s["fsync_s"] for s in stats)}


def _describe_costs(directory: Path, c: dict) -> str:
    gb = c["bytes"] / 1e9
    rate = f"{gb / c['write_wall_s']:.2f} GB/s" if c["write_wall_s"] > 0 else "-"
    previous = c["previous_save_wait_s"]
    of_which = f", {previous:.1f} s of it for the previous save to complete" if previous >= 0.05 else ""
    return (f"checkpoint {directory}: {gb:.2f} GB in {c['total_s']:.1f} s ({'async' if c['async'] else 'sync'}, "
            f"the step waited {c['step_waited_s']:.1f} s{of_which}): state {c['state_s']:.1f} s, staging "
            f"{c['staged_from_device_bytes'] / 1e9:.2f} GB from the device {c['stage_s']:.1f} s, plan "
            f"{c['plan_s']:.1f} s, {c['data_files']} data files written in {c['write_wall_s']:.1f} s ({rate}, "
            f"fsync {c['fsync_thread_s']:.1f} s summed over threads); published in {c['publish_s']:.1f} s")


def _write_inline(write: storage.PendingWrite) -> bool:
    try:
        storage.write_files(write)
        return True
    except Exception as e:  # noqa: BLE001 - every rank learns of it in finalize
        print(f"[beamrl] rank {write.rank}: writing {write.directory} failed: {type(e).__name__}: {e}", flush=True)
        return False


def _prepare_directory(directory: Path) -> str | None:
    if directory.exists() and any(directory.iterdir()):
        return f"{directory} exists and is not empty: save each checkpoint to a new directory"
    (directory / fmt.RNG_DIR).mkdir(parents=True, exist_ok=True)
    return None


def _check_compatible(meta: dict, trainer, directory: Path) -> None:
    path = directory / fmt.META_FILE
    mine, theirs = trainer.config.model.to_dict(), meta["model"]
    diff = [k for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k) and k != "dtype"]
    if diff:
        raise CheckpointError(f"{path}: model config field {diff[0]!r} is {theirs.get(diff[0])!r} in the checkpoint but "
                              f"{mine.get(diff[0])!r} in this trainer (a checkpoint of another model)")
    if meta["dtype"] != trainer.config.dtype:
        raise CheckpointError(f"{path}: written with dtype {meta['dtype']!r}, this trainer uses {trainer.config.dtype!r}")
    optimizer_format = meta.get("sharding", {}).get("distrib_optim_sharding_type")
    if optimizer_format != state.OPTIMIZER_STATE_FORMAT:
        raise CheckpointError(f"{path}: its optimizer state is in the {optimizer_format!r} format; this trainer reads "
                              f"{state.OPTIMIZER_STATE_FORMAT!r} (per-parameter tensors in the model's space)")
    dist_opt = trainer.config.trainer.distributed_optimizer
    if meta.get("optimizer", {}).get("distributed_optimizer") != dist_opt:
        raise CheckpointError(f"{path}: written with distributed_optimizer="
                              f"{meta.get('optimizer', {}).get('distributed_optimizer')}, this trainer uses "
                              f"{dist_opt} (their optimizer states are stored differently)")
    now = _optimizer_settings(trainer)
    changed = {k: (v, now[k]) for k, v in meta.get("optimizer", {}).items() if k in now and v != now[k]}
    if changed:
        _log(f"optimizer settings differ from {path} (checkpoint -> now): {changed}; this run's settings apply "
             f"from here on, at the checkpoint's position in the LR schedule (its step {meta.get('step')})")


def _optimizer_settings(trainer) -> dict:
    """The trainer section's optimizer fields (`OptimizerConfig`), as recorded in a checkpoint's JSON."""
    from beamrl.trainer.megatron.config import OptimizerConfig

    return {k: getattr(trainer.config.trainer, k) for k in OptimizerConfig.model_fields}
