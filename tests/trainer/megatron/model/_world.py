"""Process-group helpers for the Beam Megatron model/mapping/replay tests (gloo, CPU, float32).

`world1()` initialises a 1-process Megatron world inside the pytest process (reused across tests);
`spawn(fn, world, *args)` runs `fn(rank, world, port, *args)` in `world` fresh processes with a timeout and
re-raises the first child failure. Children set OMP_NUM_THREADS=1 / TORCHDYNAMO_DISABLE=1."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from beamrl.net import reserve_port


def _cpu_only() -> None:
    """These worlds run Megatron through the CPU compat layer, which refuses to activate where CUDA is present (it
    would redirect every CUDA call): on a GPU machine the test is skipped, not failed."""
    if torch.cuda.is_available():
        pytest.skip("CPU-only: Megatron on gloo through beamrl.compat.megatron_cpu, which never runs where CUDA is")


def init_megatron(rank: int, world: int, port: int, *, tp: int = 1, ep: int = 1, pp: int = 1, vpp=None,
                  seed: int = 1234) -> None:
    """gloo process group + Megatron parallel state + RNG tracker (CPU compat layer activated first)."""
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    from beamrl.compat import megatron_cpu

    megatron_cpu.activate()
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=vpp,
                                             expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def world1(**layout) -> None:
    """(Re)initialise a 1-process world in this process with the given layout (tp=ep=pp=1). Port 0: the only
    rank hosts the store, so the OS picks the port as it binds."""
    _cpu_only()
    init_megatron(0, 1, 0, **layout)


def _child(rank, fn, world, port, args):
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    torch.set_num_threads(1)
    try:
        fn(rank, world, port, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn, world: int, *args, timeout: float = 90.0) -> None:
    """Run `fn(rank, world, port, *args)` on `world` processes; raise on failure or after `timeout` s."""
    _cpu_only()
    with reserve_port() as reserved:  # held until the children are done: rank 0's store binds it meanwhile
        ctx = mp.start_processes(_child, args=(fn, world, reserved.port, args), nprocs=world, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.terminate()
                raise TimeoutError(f"{getattr(fn, '__name__', fn)} on {world} processes did not finish in {timeout} s")
