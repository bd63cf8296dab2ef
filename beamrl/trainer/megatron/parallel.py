"""Model-parallel layout of a Megatron trainer and the process-group setup for it.

`ParallelConfig` names the sizes (TP, SP, EP, ETP, PP, VPP); DP is derived from the world size. `initialize_parallel`
joins the `torch.distributed` world (NCCL on GPU, gloo on CPU with `beamrl.compat.megatron_cpu` activated) and
creates Megatron's groups with `parallel_state.initialize_model_parallel`.

Rank order is Megatron's default `tp-cp-ep-dp-pp`: TP ranks are adjacent, PP is outermost.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from beamrl.models.beam.config import BeamConfig


class ParallelConfigError(ValueError):
    """A parallel size is invalid or does not divide the world / model; the message names the field."""


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel sizes of one trainer. `dp` follows from the world size (`world / (tp * pp)`).

    - tp: tensor parallel; sp: sequence parallel (required with MoE + TP when training, §6 of the note).
    - ep: expert parallel; etp: expert tensor parallel (Beam default 1: each expert whole on one rank).
    - pp: pipeline stages; vpp: virtual stages (model chunks) per pipeline rank, None = no interleaving.
    """

    tp: int = 1
    sp: bool = False
    ep: int = 1
    etp: int = 1
    pp: int = 1
    vpp: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "ep", "etp", "pp"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ParallelConfigError(f"ParallelConfig.{name}={v!r} must be a positive integer")
        if self.vpp is not None:
            if not isinstance(self.vpp, int) or self.vpp < 2:
                raise ParallelConfigError(f"ParallelConfig.vpp={self.vpp!r} must be None or an integer >= 2")
            if self.pp < 2:
                raise ParallelConfigError(f"ParallelConfig.vpp={self.vpp} needs pp >= 2 (got pp={self.pp})")
        if self.sp and self.tp == 1:
            raise ParallelConfigError("ParallelConfig.sp=True needs tp > 1")

    @property
    def num_model_chunks(self) -> int:
        return self.vpp or 1

    def dp(self, world_size: int) -> int:
        """Data-parallel size for `world_size` ranks; raises if the sizes do not divide it."""
        mp = self.tp * self.pp
        if world_size % mp:
            raise ParallelConfigError(f"world size {world_size} is not divisible by tp*pp = {mp} ({self})")
        emp = self.etp * self.ep * self.pp
        if world_size % emp:
            raise ParallelConfigError(f"world size {world_size} is not divisible by etp*ep*pp = {emp} ({self})")
        return world_size // mp

    def validate(self, config: "BeamConfig") -> None:
        """Raise `ParallelConfigError` (naming the field) if Beam `config` cannot be split this way."""
        stages = self.pp * self.num_model_chunks
        if config.num_hidden_layers % stages:
            raise ParallelConfigError(f"num_hidden_layers={config.num_hidden_layers} must be divisible by pp*vpp = "
                                      f"{stages}")
        for name in ("num_attention_heads", "num_key_value_heads", "vocab_size"):
            if getattr(config, name) % self.tp:
                raise ParallelConfigError(f"ParallelConfig.tp={self.tp} must divide {name}={getattr(config, name)}")
        if self.etp != 1:
            raise ParallelConfigError(f"ParallelConfig.etp={self.etp}: only etp=1 is supported (Beam's per-expert BF16 "
                                      "rounding after the weighted down GEMM needs whole experts per rank)")
        if config.moe_layers:
            if config.num_experts % self.ep:
                raise ParallelConfigError(f"ParallelConfig.ep={self.ep} must divide num_experts={config.num_experts}")
            if self.tp > 1 and not self.sp:
                raise ParallelConfigError("ParallelConfig.sp must be True with tp > 1 and MoE layers (Megatron "
                                          "refuses MoE + TP without sequence parallelism)")

    def to_dict(self) -> dict:
        return asdict(self)


def device_for_rank() -> torch.device:
    """CUDA device `LOCAL_RANK` when CUDA is available, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def initialize_parallel(parallel: ParallelConfig, seed: int = 1234, timeout_s: float = 600.0) -> torch.device:
    """Join the world (from the torchrun-style env) and create Megatron's parallel groups; returns the device.

    On a machine without CUDA this activates `beamrl.compat.megatron_cpu` and uses gloo. If Megatron's groups
    already exist (e.g. several trainers in one test process) they are destroyed and rebuilt."""
    device = device_for_rank()
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
    parallel.dp(world)  # validates divisibility with a clear message

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
