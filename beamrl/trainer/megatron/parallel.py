"""The process groups of a Megatron trainer for a `ParallelConfig` (`config.py`, which holds the layout rules).

`initialize_parallel` joins the `torch.distributed` world (NCCL on GPU, gloo on CPU with
`beamrl.compat.megatron_cpu` activated) and creates Megatron's groups with
`parallel_state.initialize_model_parallel`. Rank order is Megatron's default `tp-cp-ep-dp-pp`.
"""

from __future__ import annotations

import datetime
import os
import platform

import torch
import torch.distributed as dist

from beamrl.trainer.megatron.config import ParallelConfig


def device_for_rank(expected: str | None = None) -> torch.device:
    """CUDA device `LOCAL_RANK` when CUDA is available, else CPU. `expected` (the recipe's cluster.device): a
    `RuntimeError` naming it when this process has the other kind (a GPU run must not train on CPU unnoticed)."""
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() \
        else torch.device("cpu")
    if expected is not None and device.type != expected:
        why = ("torch.cuda.is_available() is False in this process" if expected == "cuda"
               else "this process sees CUDA, where the CPU compatibility layer never runs")
        raise RuntimeError(f"cluster.device={expected!r}, but {why} (trainer rank {os.environ.get('RANK', '?')} on "
                           f"{platform.node()})")
    return device


def initialize_parallel(parallel: ParallelConfig, seed: int = 1234, timeout_s: float = 600.0,
                        expected_device: str | None = None) -> torch.device:
    """Join the world (from the torchrun-style env) and create Megatron's parallel groups; returns the device.

    On a machine without CUDA this activates `beamrl.compat.megatron_cpu` and uses gloo. If Megatron's groups
    already exist (e.g. several trainers in one test process) they are destroyed and rebuilt. `expected_device`:
    see `device_for_rank`."""
    device = device_for_rank(expected_device)
    if device.type == "cpu":
        from beamrl.compat import megatron_cpu

        megatron_cpu.activate()
        backend = "gloo"
    else:
        torch.cuda.set_device(device)
        backend = "nccl"
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(f"initialize_parallel: env {missing} not set; start ranks with torchrun or "
                               f"beamrl.trainer.megatron.launch")
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    world = dist.get_world_size()
    parallel.dp_size(world)  # the layout rules for this world size, with a clear message

    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.etp,
        distributed_timeout_minutes=max(1, int(timeout_s // 60)),
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return device


def destroy_parallel() -> None:
    """Tear down Megatron's groups (keeps the default process group, which the launcher owns)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
