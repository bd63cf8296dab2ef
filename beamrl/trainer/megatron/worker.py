"""`MegatronTrainer`: one rank of the Beam policy trainer on Megatron-core (docs/trainer.md).

A plain class (the Ray actor wrapper lives with the RL loop). Construction joins the world, creates the
model-parallel groups, builds the Beam model chunks (one per virtual pipeline stage), wraps them in Megatron's
`DistributedDataParallel` (`grad_reduce_in_fp32=True`), builds Megatron's (distributed) Adam optimizer and a
learning-rate scheduler, and optionally loads an HF checkpoint through the mapping.

All ranks must make the same calls in the same order. Each data-parallel rank passes its own micro-batches to
`train_step`; all ranks of one model-parallel group (TP/PP/EP peers with the same DP rank) pass identical ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from beamrl.models.beam.config import BeamConfig
from beamrl.models.beam.lora_config import LoRAConfig
from beamrl.trainer.megatron import train_step as schedule
from beamrl.trainer.megatron.parallel import ParallelConfig, destroy_parallel, initialize_parallel
from beamrl.trainer.protocol import (HFBucket, LogprobResult, LossFn, PackedBatch, TrainerWorker,
                                     TrainStepResult)

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class TrainerConfigError(ValueError):
    """An optimizer/trainer setting is invalid; the message names the field."""


@dataclass(frozen=True)
class OptimizerSettings:
    """Adam + gradient clipping + a linear-warmup, then constant/cosine/linear decay, LR schedule."""

    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    warmup_steps: int = 0
    decay_steps: int = 1
    decay_style: str = "constant"
    use_distributed_optimizer: bool = True
    #: Fraction of the optimizer state (and its update) kept in host memory (Megatron's HybridDeviceOptimizer,
    #: `OptimizerConfig.optimizer_cpu_offload`/`optimizer_offload_fraction`); needs the distributed optimizer.
    #: Not exercised by the CPU suite (it has no device memory to save); see docs/trainer.md.
    cpu_offload_fraction: float = 0.0
    #: Accumulate and reduce main gradients in FP32 (`DistributedDataParallelConfig.grad_reduce_in_fp32`).
    grad_reduce_in_fp32: bool = True

    def __post_init__(self) -> None:
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise TrainerConfigError(f"OptimizerSettings.lr={self.lr!r} must be a positive number")
        if not 0 <= self.min_lr <= self.lr:
            raise TrainerConfigError(f"OptimizerSettings.min_lr={self.min_lr!r} must be in [0, lr={self.lr}]")
        if self.clip_grad < 0:
            raise TrainerConfigError(f"OptimizerSettings.clip_grad={self.clip_grad!r} must be >= 0 (0 = off)")
        if self.warmup_steps < 0 or self.decay_steps < 1:
            raise TrainerConfigError("OptimizerSettings: warmup_steps must be >= 0 and decay_steps >= 1")
        if not 0.0 <= self.cpu_offload_fraction <= 1.0:
            raise TrainerConfigError(f"OptimizerSettings.cpu_offload_fraction={self.cpu_offload_fraction!r} must be "
                                     f"in [0, 1]")
        if self.cpu_offload_fraction > 0 and not self.use_distributed_optimizer:
            raise TrainerConfigError("OptimizerSettings.cpu_offload_fraction > 0 needs use_distributed_optimizer=True")
        if self.decay_style not in ("constant", "linear", "cosine"):
            raise TrainerConfigError(f"OptimizerSettings.decay_style={self.decay_style!r}; allowed: constant, "
                                     f"linear, cosine")


@dataclass(frozen=True)
class TrainerConfig:
    """Everything a `MegatronTrainer` rank needs besides the process env."""

    model: BeamConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    dtype: str = "bfloat16"
    seed: int = 1234
    use_fused_kernels: bool = False
    recompute: bool = False
    #: Sequences per micro-batch in `compute_logprobs` (a packed batch is split into such micro-batches).
    logprob_micro_batch_sequences: int = 8
    #: Timeout of every collective (seconds).
    timeout_s: float = 600.0
    #: LoRA adapters (docs/lora.md): only they train, the base is frozen. None = full-parameter training.
    lora: LoRAConfig | None = None

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise TrainerConfigError(f"TrainerConfig.dtype={self.dtype!r}; allowed: {sorted(_DTYPES)}")
        if self.logprob_micro_batch_sequences < 1:
            raise TrainerConfigError("TrainerConfig.logprob_micro_batch_sequences must be >= 1")
        m = self.model
        self.parallel.validate(m)

    @property
    def params_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


#: (transformer_config, pre_process, post_process, vp_stage) -> a Megatron GPTModel chunk.
ModelBuilder = Callable[..., torch.nn.Module]


def _beam_builder(cfg: TrainerConfig):
    """The Beam model's TransformerConfig and chunk builder (beamrl.trainer.megatron.model)."""
    from beamrl.trainer.megatron.model import beam_transformer_config, build_beam_gpt_model

    tconfig = beam_transformer_config(cfg.model, cfg.parallel, dtype=cfg.params_dtype,
                                      use_fused_kernels=cfg.use_fused_kernels,
                                      recompute="full" if cfg.recompute else "none", lora=cfg.lora)

    def build(tc, pre_process: bool, post_process: bool, vp_stage: int | None):
        return build_beam_gpt_model(cfg.model, pre_process=pre_process, post_process=post_process,
                                    vp_stage=vp_stage, transformer_config=tc)

    return tconfig, build


class MegatronTrainer(TrainerWorker):
    """One rank of the Megatron policy trainer (see the module docstring and `TrainerWorker`)."""

    def __init__(self, config: TrainerConfig, hf_checkpoint: str | Path | None = None,
                 model_factory: Callable[[TrainerConfig], tuple[object, ModelBuilder]] | None = None):
        """`model_factory(config) -> (TransformerConfig, builder)` replaces the Beam model (tests of the
        training plumbing with stock Megatron models); leave it None for Beam."""
        self.config = config
        self.device = initialize_parallel(config.parallel, seed=config.seed, timeout_s=config.timeout_s)
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.router_replay import RouterReplay

        self._ps = ps
        RouterReplay.clear_global_router_replay_instances()  # a class-level registry (note §6)
        tconfig, builder = (model_factory or _beam_builder)(config)
        self.transformer_config = tconfig
        self._configure_schedule(tconfig)
        self.chunks = self._build_chunks(tconfig, builder)
        self.optimizer, self.scheduler = self._build_optimizer()
        self._replay_enabled = False
        self._record_enabled = False
        self._step = 0
        if hf_checkpoint is not None:
            self.load_hf(hf_checkpoint)

    # ------------------------------------------------------------------------------------------------ setup
    def _configure_schedule(self, tc) -> None:
        from megatron.core.distributed import finalize_model_grads

        tc.calculate_per_token_loss = True  # no implicit /num_microbatches or /dp (see train_step.py)
        tc.pipeline_dtype = self.config.params_dtype
        # gloo matches the ops of one batch_isend_irecv by (peer, tag) in posting order: at PP=2 + VPP the two
        # directions share a peer and swap (note §3, gotcha 2). The unbatched parity-ordered p2p is correct.
        tc.batch_p2p_comm = self.device.type != "cpu"
        if tc.batch_p2p_comm is False:
            tc.overlap_p2p_comm = False

        def finalize(model_chunks, num_tokens=None, **kwargs):
            # The loss is already normalised by the caller's global token count: never divide again.
            finalize_model_grads(model_chunks, None, **kwargs)

        tc.finalize_model_grads_func = finalize

    def _build_chunks(self, tc, builder: ModelBuilder) -> list:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.enums import ModelType
        from megatron.core.tensor_parallel import set_defaults_if_not_set_tensor_model_parallel_attributes

        ps, vpp = self._ps, self.config.parallel.vpp
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=self.config.optimizer.grad_reduce_in_fp32, overlap_grad_reduce=False,
            use_distributed_optimizer=self.config.optimizer.use_distributed_optimizer,
            check_for_nan_in_grad=False, average_in_collective=False)
        chunks = []
        for i in range(self.config.parallel.num_model_chunks):
            vp_stage = i if vpp else None
            pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
            post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
            model = builder(tc, pre, post, vp_stage)
            model.model_type = ModelType.encoder_or_decoder
            for p in model.parameters():
                set_defaults_if_not_set_tensor_model_parallel_attributes(p)
            model.to(self.device)
            chunks.append(DistributedDataParallel(config=tc, ddp_config=ddp_config, module=model,
                                                  disable_bucketing=i > 0))
        return chunks

    def _build_optimizer(self):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        o = self.config.optimizer
        opt_config = OptimizerConfig(
            optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad,
            bf16=self.config.params_dtype == torch.bfloat16, params_dtype=self.config.params_dtype,
            use_distributed_optimizer=o.use_distributed_optimizer,
            optimizer_cpu_offload=o.cpu_offload_fraction > 0, optimizer_offload_fraction=o.cpu_offload_fraction)
        optimizer = get_megatron_optimizer(opt_config, [c for c in self.chunks])
        self.transformer_config.grad_scale_func = optimizer.scale_loss
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0 if o.warmup_steps else o.lr, max_lr=o.lr, min_lr=o.min_lr,
            lr_warmup_steps=o.warmup_steps, lr_decay_steps=o.warmup_steps + o.decay_steps,
            lr_decay_style=o.decay_style, start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=1,
            wd_incr_style="constant")
        return optimizer, scheduler

    # ------------------------------------------------------------------------------------------- properties
    @property
    def models(self) -> list[torch.nn.Module]:
        """The unwrapped model chunks (no DDP wrapper), in virtual-stage order."""
        return [c.module for c in self.chunks]

    @property
    def step(self) -> int:
        """Optimizer steps taken (restored by `load_checkpoint`)."""
        return self._step

    def _logits_spec(self, temperature: float, return_entropy: bool) -> schedule.LogitsSpec:
        ps = self._ps
        tp_group = ps.get_tensor_model_parallel_group()
        vocab_local = self._vocab_per_rank()
        # BeamGPTModel returns softcapped FP32 logits; other models (plumbing tests) get the cap applied here.
        softcap = None if _applies_softcap(self.models[-1]) else self.config.model.final_logit_softcapping
        return schedule.LogitsSpec(temperature, softcap, tp_group, ps.get_tensor_model_parallel_rank() * vocab_local,
                                   return_entropy)

    def _vocab_per_rank(self) -> int:
        return self.config.model.vocab_size // self.config.parallel.tp  # the config bridge checks divisibility

    def _min_micro_batches(self) -> int:
        return self.config.parallel.pp if self.config.parallel.vpp else 1

    def _seq_multiple(self) -> int:
        return self.config.parallel.tp if self.config.parallel.sp else 1

    # ----------------------------------------------------------------------------------------- train step
    def train_step(self, micro_batches: list[PackedBatch], loss_fn: LossFn,
                   temperature: float = 1.0) -> TrainStepResult:
        sums = self.forward_backward(micro_batches, loss_fn, temperature)
        update_ok, grad_norm, lr = self.optimizer_step()
        loss = sums.pop("loss")
        return TrainStepResult(loss=loss, grad_norm=grad_norm, lr=lr, num_micro_batches=len(micro_batches),
                               skipped=not update_ok, metrics=sums)

    def forward_backward(self, micro_batches: list[PackedBatch], loss_fn: LossFn,
                         temperature: float = 1.0) -> dict[str, float]:
        """The first half of `train_step`: gradients of this step's loss in the DDP grad buffers (reduced over
        DP), no optimizer update. Returns the loss and metrics summed over micro-batches and DP ranks."""
        if len(micro_batches) < self._min_micro_batches():
            raise ValueError(f"train_step got {len(micro_batches)} micro-batches; this layout needs at least "
                             f"{self._min_micro_batches()} (the interleaved pipeline schedule needs >= pp)")
        for c in self.chunks:
            c.train()
            c.zero_grad_buffer()
        self.optimizer.zero_grad()

        def output_fn(lp, ent, batch):
            loss, metrics = loss_fn(lp, ent, batch)
            collected = {"loss": loss.detach().float()}
            for k, v in (metrics or {}).items():
                if k == "loss":
                    raise ValueError("the loss function's metrics must not use the reserved name 'loss'")
                collected[k] = torch.as_tensor(v).detach().float().reshape(())
            return loss, collected

        mbs, length = self._prepare(micro_batches, record=False)
        collected = schedule.run_schedule(self.chunks, mbs, length, self._logits_spec(temperature, True), output_fn,
                                          forward_only=False)
        return self._reduce_collected(collected)

    def optimizer_step(self) -> tuple[bool, float, float]:
        """The second half of `train_step`: clip, Adam update, LR schedule. Returns (updated, grad norm, lr used);
        a step with non-finite gradients is skipped (updated False) and does not advance the schedule."""
        lr = float(self.optimizer.param_groups[0]["lr"])
        update_ok, grad_norm, _ = self.optimizer.step()
        if update_ok:
            self.scheduler.step(increment=1)
            self._step += 1
        return bool(update_ok), float(grad_norm) if grad_norm is not None else float("nan"), lr

    def hf_gradients(self) -> dict[str, torch.Tensor]:
        """The gradients left by `forward_backward`, gathered as full HF-named tensors on global rank 0 ({} on
        other ranks). For tests and debugging; needs `use_distributed_optimizer=False` (with the distributed
        optimizer each rank only holds the reduced gradient of its own shard). Collective."""
        if self.config.optimizer.use_distributed_optimizer:
            raise TrainerConfigError("hf_gradients needs OptimizerSettings.use_distributed_optimizer=False")
        swapped = []
        for m in self.models:
            for p in m.parameters():
                grad = getattr(p, "main_grad", None)
                swapped.append((p, p.data))
                p.data = torch.zeros_like(p.data) if grad is None else grad.detach().to(p.dtype).view_as(p.data)
        try:
            return {k: v.clone() for bucket in self.export_hf(1 << 62) for k, v in bucket.tensors.items()}
        finally:
            for p, data in swapped:
                p.data = data

    def _reduce_collected(self, collected: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """Sum the last stage's per-micro-batch scalars over micro-batches and DP; share with every rank."""
        ps = self._ps
        payload = None
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            keys = sorted({k for d in collected for k in d})
            vec = torch.stack([sum(d[k] for d in collected if k in d).float().reshape(()) for k in keys]) \
                if keys else torch.zeros(0)
            vec = vec.to(self.device)
            dist.all_reduce(vec, group=ps.get_data_parallel_group())
            payload = dict(zip(keys, vec.tolist()))
        return self._from_last_stage(payload)

    def _from_last_stage(self, obj):
        """Broadcast a picklable object from the last pipeline stage to all stages."""
        ps = self._ps
        if self.config.parallel.pp == 1:
            return obj
        box = [obj]
        src = ps.get_pipeline_model_parallel_last_rank()
        dist.broadcast_object_list(box, src=src, group=ps.get_pipeline_model_parallel_group())
        return box[0]

    # ------------------------------------------------------------------------------------------- logprobs
    @torch.no_grad()
    def compute_logprobs(self, batch: PackedBatch, temperature: float = 1.0, return_entropy: bool = True,
                         routes: torch.Tensor | None = None) -> LogprobResult:
        if routes is not None:
            batch = PackedBatch(batch.tokens, batch.cu_seqlens, batch.loss_mask, batch.fields, routes)
        for c in self.chunks:
            c.eval()
        parts = _split_sequences(batch, self.config.logprob_micro_batch_sequences)
        num_real = len(parts)
        min_parts = self._min_micro_batches()
        if num_real < min_parts:  # the interleaved schedule needs >= pp micro-batches: pad with copies
            parts = _split_sequences(batch, 1)[:min_parts]
            num_real = len(parts)
            parts = parts + [parts[0]] * (min_parts - num_real)

        def output_fn(lp, ent, mb):
            out = {"logprobs": lp.float()}
            if ent is not None:
                out["entropy"] = ent.float()
            return torch.zeros((), device=lp.device), out

        mbs, length = self._prepare(parts, record=self._record_enabled)
        collected = schedule.run_schedule(self.chunks, mbs, length, self._logits_spec(temperature, return_entropy),
                                          output_fn, forward_only=True)
        result = None
        if self._ps.is_pipeline_last_stage(ignore_virtual=True):
            collected = collected[:num_real]  # drop padding micro-batches
            lp = torch.cat([d["logprobs"] for d in collected]).cpu()
            ent = torch.cat([d["entropy"] for d in collected]).cpu() if return_entropy else None
            result = (lp, ent)
        lp, ent = self._from_last_stage(result)
        routes = self._gather_recorded(mbs[:num_real]) if self._record_enabled else None
        return LogprobResult(lp, ent, routes)

    # --------------------------------------------------------------------------------------- routing (R3)
    def set_routing_replay(self, enabled: bool) -> None:
        self._replay_enabled = bool(enabled)

    def set_routing_record(self, enabled: bool) -> None:
        self._record_enabled = bool(enabled)

    def _prepare(self, micro_batches: list[PackedBatch], record: bool):
        return schedule.prepare(micro_batches, self._seq_multiple(), self.device,
                                self.config.model.num_hidden_layers, replay=self._replay_enabled, record=record)

    def _gather_recorded(self, mbs: list[schedule.MicroBatch]) -> torch.Tensor:
        """Assemble the routes recorded by every rank's MoE layers into `[T, num_hidden_layers, k]` (-1 on dense
        layers) on every rank. Collective over TP (SP token slices) and PP (layers of other stages)."""
        from types import SimpleNamespace

        from beamrl.trainer.megatron import replay

        ps = self._ps
        parts = []
        for mb in mbs:
            full = replay.recorded_routes(SimpleNamespace(recorded=mb.recorded), self.config.model, mb.thd.length,
                                          tp_group=ps.get_tensor_model_parallel_group(),
                                          pp_group=ps.get_pipeline_model_parallel_group(),
                                          sequence_parallel=self.config.parallel.sp)
            parts.append(full[:mb.thd.num_tokens])
        return torch.cat(parts)

    # ---------------------------------------------------------------------------------- checkpoints / HF
    def load_hf(self, path: str | Path) -> None:
        """Load an HF Beam checkpoint directory (config.json + safetensors) into this rank's shards.

        The checkpoint's config must equal the trainer's model config (a mismatch names the first field)."""
        from beamrl.models.beam.checkpoint import load_checkpoint

        config, tensors = load_checkpoint(path)
        mine, theirs = self.config.model.to_dict(), config.to_dict()
        diff = [k for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k) and k not in ("dtype",)]
        if diff:
            raise TrainerConfigError(f"{path}: config field {diff[0]!r} is {theirs.get(diff[0])!r} in the "
                                     f"checkpoint but {mine.get(diff[0])!r} in the trainer's model config")
        self.load_hf_state_dict(tensors)

    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load full HF-named tensors (every rank passes the same dict) into this rank's shards."""
        from beamrl.trainer.megatron import mapping

        mapping.load_hf_weights(self.models, tensors, strict=True)
        self._sync_main_params()

    def _sync_main_params(self) -> None:
        """Refresh the optimizer's FP32 main copies after the model weights were overwritten."""
        reload = getattr(self.optimizer, "reload_model_params", None)
        if reload is not None:
            reload()

    def export_hf(self, bucket_bytes: int = 256 << 20, dst_rank: int = 0) -> Iterator[HFBucket]:
        """Stream full HF tensors in buckets (`mapping.export_hf_tensors`). Collective: every rank must iterate
        to the end; buckets hold tensors on `dst_rank` only (other ranks get empty buckets)."""
        from beamrl.trainer.megatron import mapping

        for tensors in mapping.export_hf_tensors(self.models, bucket_bytes, dst_rank=dst_rank):
            yield HFBucket(dict(tensors))

    # ------------------------------------------------------------------------------------------------ LoRA
    def export_lora(self, bucket_bytes: int = 256 << 20, dst_rank: int = 0) -> Iterator[HFBucket]:
        """Stream the full adapter tensors (PEFT names, `lora_mapping.export_adapter_tensors`). Collective."""
        from beamrl.trainer.megatron import lora_mapping

        for tensors in lora_mapping.export_adapter_tensors(self.models, bucket_bytes, dst_rank=dst_rank):
            yield HFBucket(dict(tensors))

    def load_lora_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load full adapter tensors (every rank passes the same dict) into this rank's adapter shards."""
        from beamrl.trainer.megatron import lora_mapping

        lora_mapping.load_adapter_tensors(self.models, tensors, strict=True)
        self._sync_main_params()

    def save_lora_adapter(self, directory: str | Path) -> None:
        """Write the adapter in PEFT format (`beamrl.models.beam.peft_io`) on global rank 0. Collective."""
        from beamrl.models.beam.peft_io import save_peft_adapter

        tensors = {k: v for bucket in self.export_lora() for k, v in bucket.tensors.items()}
        if dist.get_rank() == 0:
            save_peft_adapter(directory, tensors, self.config.lora, self.config.model)

    def load_lora_adapter(self, directory: str | Path) -> None:
        """Load a PEFT-format adapter (resume, evaluation); its LoRAConfig must equal the trainer's."""
        from beamrl.models.beam.peft_io import load_peft_adapter

        lora, tensors = load_peft_adapter(directory, self.config.model)
        if lora.to_dict() != self.config.lora.to_dict():
            raise TrainerConfigError(f"{directory}: adapter LoRAConfig {lora.to_dict()} differs from "
                                     f"TrainerConfig.lora {self.config.lora.to_dict()}")
        self.load_lora_state_dict(tensors)

    def lora_gradients(self) -> dict[str, torch.Tensor]:
        """Adapter gradients left by `forward_backward` as full adapter tensors on global rank 0 ({} elsewhere).
        Needs `use_distributed_optimizer=False` (as `hf_gradients`). Collective."""
        from beamrl.trainer.megatron import lora_mapping

        if self.config.optimizer.use_distributed_optimizer:
            raise TrainerConfigError("lora_gradients needs OptimizerSettings.use_distributed_optimizer=False")
        return {k: v for bucket in lora_mapping.export_adapter_tensors(self.models, 1 << 62, source="main_grad")
                for k, v in bucket}

    def save_checkpoint(self, directory: str | Path) -> Path:
        from beamrl.trainer.megatron import checkpoint

        return checkpoint.save(self, directory)

    def load_checkpoint(self, directory: str | Path) -> None:
        from beamrl.trainer.megatron import checkpoint

        checkpoint.load(self, directory)

    def shutdown(self) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        RouterReplay.clear_global_router_replay_instances()
        self.chunks, self.optimizer, self.scheduler = [], None, None
        destroy_parallel()


def _applies_softcap(model) -> bool:
    from beamrl.trainer.megatron.model import BeamGPTModel

    return isinstance(model, BeamGPTModel)


def _split_sequences(batch: PackedBatch, per_micro_batch: int) -> list[PackedBatch]:
    """Split a packed batch into packed micro-batches of at most `per_micro_batch` sequences."""
    n = batch.num_sequences
    if n <= per_micro_batch:
        return [batch]
    out = []
    cu = batch.cu_seqlens
    for first in range(0, n, per_micro_batch):
        last = min(n, first + per_micro_batch)
        a, b = int(cu[first]), int(cu[last])
        out.append(PackedBatch(batch.tokens[a:b], cu[first:last + 1] - a, batch.loss_mask[a:b],
                               {k: v[a:b] for k, v in batch.fields.items()},
                               None if batch.routes is None else batch.routes[a:b]))
    return out
