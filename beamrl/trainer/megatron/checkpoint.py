"""Per-rank training checkpoints of a `MegatronTrainer` (exact resume with the same parallel layout).

Format `beamrl-megatron-per-rank-v1`, one directory:

- `rank_{RRRRR}.pt` (one per global rank, `torch.save`):
  - `model`: the state dict of every model chunk (this rank's TP/PP/EP shard; buffers such as the router's
    `expert_bias` included);
  - `optimizer`: for every sub-optimizer (Megatron chains one for dense and one for expert parameters), the
    inner `torch.optim` state dict (Adam moments and step) plus the values of the parameters it updates
    (the FP32 main copies / distributed-optimizer shards, which the model's BF16 weights cannot restore);
  - `scheduler`: the LR scheduler state; `step`: optimizer steps taken;
  - `rng`: Python, NumPy, torch (and CUDA) generator states and Megatron's named model-parallel RNG streams;
  - `layout`: this rank's TP/PP/EP/DP coordinates (checked on load).
- `meta.json`: format, world size, parallel config, dtype, step and the Beam config. Rank 0 writes it after
  every rank has written its file, so its presence marks a complete checkpoint.

Loading needs the same world size and `ParallelConfig`; a different layout raises `CheckpointError` (reshard
through the HF export instead: `export_hf` then `load_hf`).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from beamrl.trainer.megatron.worker import MegatronTrainer

FORMAT = "beamrl-megatron-per-rank-v1"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or was written with another layout; the message says which."""


def _rank_file(directory: Path, rank: int) -> Path:
    return directory / f"rank_{rank:05d}.pt"


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _inner_params(sub) -> list[torch.Tensor]:
    return [p for g in sub.optimizer.param_groups for p in g["params"]]


def _layout(trainer: "MegatronTrainer") -> dict:
    ps = trainer._ps
    return {"tp_rank": ps.get_tensor_model_parallel_rank(), "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "ep_rank": ps.get_expert_model_parallel_rank(), "dp_rank": ps.get_data_parallel_rank()}


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy is a Megatron dependency
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def save(trainer: "MegatronTrainer", directory: str | Path) -> Path:
    """Write this rank's file; rank 0 writes `meta.json` once all ranks are done. Collective."""
    directory = Path(directory)
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "meta.json").unlink(missing_ok=True)  # incomplete until rewritten below
    dist.barrier()
    directory.mkdir(parents=True, exist_ok=True)
    payload = {
        "model": [m.state_dict() for m in trainer.models],
        "optimizer": [{"inner": sub.optimizer.state_dict(),
                       "params": [p.detach().cpu().clone() for p in _inner_params(sub)]}
                      for sub in _sub_optimizers(trainer.optimizer)],
        "scheduler": trainer.scheduler.state_dict(),
        "step": trainer.step,
        "rng": _rng_state(),
        "layout": _layout(trainer),
    }
    path = _rank_file(directory, rank)
    tmp = path.with_suffix(".tmp")
    torch.save(payload, tmp)
    tmp.replace(path)
    dist.barrier()
    if rank == 0:
        meta = {"format": FORMAT, "world_size": world, "parallel": trainer.config.parallel.to_dict(),
                "dtype": trainer.config.dtype, "step": trainer.step, "model": trainer.config.model.to_dict()}
        (directory / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    dist.barrier()
    return directory


def read_meta(directory: str | Path) -> dict:
    """The checkpoint's `meta.json`; `CheckpointError` if absent (missing or incomplete checkpoint)."""
    path = Path(directory) / "meta.json"
    if not path.exists():
        raise CheckpointError(f"{path} not found: {directory} is not a complete beamrl Megatron checkpoint")
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {meta.get('format')!r} is not {FORMAT!r}")
    return meta


def load(trainer: "MegatronTrainer", directory: str | Path) -> None:
    """Restore model, optimizer, scheduler, step and RNG state on every rank. Collective."""
    directory = Path(directory)
    meta = read_meta(directory)
    world = dist.get_world_size()
    if meta["world_size"] != world or meta["parallel"] != trainer.config.parallel.to_dict():
        raise CheckpointError(f"{directory} was written by {meta['world_size']} ranks with parallel="
                              f"{meta['parallel']}; this trainer has {world} ranks with "
                              f"{trainer.config.parallel.to_dict()} (reshard via export_hf/load_hf)")
    if meta["dtype"] != trainer.config.dtype:
        raise CheckpointError(f"{directory} holds dtype {meta['dtype']!r}, the trainer uses {trainer.config.dtype!r}")
    path = _rank_file(directory, dist.get_rank())
    if not path.exists():
        raise CheckpointError(f"{path} is missing")
    payload = torch.load(path, map_location="cpu", weights_only=False)
    if payload["layout"] != _layout(trainer):
        raise CheckpointError(f"{path} was written at {payload['layout']}, this rank is {_layout(trainer)}")
    for model, sd in zip(trainer.models, payload["model"], strict=True):
        model.load_state_dict(sd, strict=True)
    subs = _sub_optimizers(trainer.optimizer)
    if len(subs) != len(payload["optimizer"]):
        raise CheckpointError(f"{path} holds {len(payload['optimizer'])} optimizer groups, the trainer has "
                              f"{len(subs)}")
    for sub, saved in zip(subs, payload["optimizer"]):
        params = _inner_params(sub)
        if [tuple(p.shape) for p in params] != [tuple(t.shape) for t in saved["params"]]:
            raise CheckpointError(f"{path}: optimizer parameter shapes differ from this trainer's")
        with torch.no_grad():
            for p, t in zip(params, saved["params"]):
                p.copy_(t.to(p.device, p.dtype))
        sub.optimizer.load_state_dict(saved["inner"])
    trainer.scheduler.load_state_dict(payload["scheduler"])
    trainer._step = int(payload["step"])
    _set_rng_state(payload["rng"])
    dist.barrier()
