"""`MegatronTrainer`: one rank of the Beam policy trainer on Megatron-core (docs/trainer.md).

A plain class (the Ray actor wrapper lives with the RL loop), built from a `TrainerSetup` (the recipe's `trainer`
section plus run-level values). Construction joins the world, creates the model-parallel groups, builds the Beam
model chunks (one per virtual pipeline stage), wraps them in Megatron's `DistributedDataParallel` (main grads in
`trainer.main_grads_dtype`), builds Megatron's (distributed) Adam optimizer and a learning-rate scheduler, and
optionally loads an HF checkpoint through the mapping.

All ranks must make the same calls in the same order. Each data-parallel rank passes its own micro-batches to
`train_step`; all ranks of one model-parallel group (TP/PP/EP peers with the same DP rank) pass identical ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from beamrl.dtypes import RUN_DTYPES, torch_dtype
from beamrl.models.beam.config import BeamConfig
from beamrl.models.beam.lora_config import LoRAConfig
from beamrl.trainer.megatron import train_step as schedule
from beamrl.trainer.megatron.config import ParallelConfig, TrainerConfig
from beamrl.trainer.megatron.parallel import destroy_parallel, initialize_parallel
from beamrl.trainer.protocol import (
    LogprobResult,
    LossFn,
    PackedBatch,
    TrainerWorker,
    TrainStepResult,
    metric_reductions,
)

class TrainerConfigError(ValueError):
    """A trainer setting is invalid; the message names the field."""


@dataclass(frozen=True)
class LRSchedule:
    """Linear warm-up, then constant/cosine/linear decay to `min_lr` (the RL loop uses the default: constant).

    Internal to the trainer (not a recipe field): the peak LR is `TrainerConfig.lr`."""

    min_lr: float = 0.0
    warmup_steps: int = 0
    decay_steps: int = 1
    decay_style: str = "constant"

    def __post_init__(self) -> None:
        if self.warmup_steps < 0 or self.decay_steps < 1:
            raise TrainerConfigError("LRSchedule: warmup_steps must be >= 0 and decay_steps >= 1")
        if self.decay_style not in ("constant", "linear", "cosine"):
            raise TrainerConfigError(f"LRSchedule.decay_style={self.decay_style!r}; allowed: constant, linear, cosine")


@dataclass(frozen=True)
class TrainerSetup:
    """What one `MegatronTrainer` rank is built from besides the process env: the recipe's `trainer` section
    (`TrainerConfig`, read under its own field names) plus the run-level values it needs and internal knobs.

    dtype: model.dtype. seed: trainer.seed, or run.seed when that is null. timeout_s: every collective's limit."""

    model: BeamConfig
    trainer: TrainerConfig
    dtype: str = "bfloat16"
    seed: int = 1234
    timeout_s: float = 600.0
    lr_schedule: LRSchedule = field(default_factory=LRSchedule)
    #: Sequences per micro-batch in `compute_logprobs` (a packed batch is split into such micro-batches).
    logprob_micro_batch_sequences: int = 8
    #: The recipe's cluster.device ("cuda" or "cpu"): a rank that finds another device fails, naming it, instead of
    #: training elsewhere. None: whatever this machine has (tests and tools).
    device: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in RUN_DTYPES:
            raise TrainerConfigError(f"TrainerSetup.dtype={self.dtype!r}; allowed: {list(RUN_DTYPES)}")
        if self.device not in (None, "cuda", "cpu"):
            raise TrainerConfigError(f"TrainerSetup.device={self.device!r}; allowed: 'cuda', 'cpu' or None")
        if self.logprob_micro_batch_sequences < 1:
            raise TrainerConfigError("TrainerSetup.logprob_micro_batch_sequences must be >= 1")
        if not 0 <= self.lr_schedule.min_lr <= self.trainer.lr:
            raise TrainerConfigError(f"LRSchedule.min_lr={self.lr_schedule.min_lr!r} must be in [0, lr="
                                     f"{self.trainer.lr}]")
        self.trainer.check_model(self.model)

    @property
    def parallel(self) -> ParallelConfig:
        return self.trainer.parallel

    @property
    def params_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)


#: (transformer_config, pre_process, post_process, vp_stage) -> a Megatron GPTModel chunk.
ModelBuilder = Callable[..., torch.nn.Module]


def _beam_builder(cfg: TrainerSetup):
    """The Beam model's TransformerConfig and chunk builder (beamrl.trainer.megatron.model)."""
    from beamrl.trainer.megatron.model import beam_transformer_config, build_beam_gpt_model

    tconfig = beam_transformer_config(cfg.model, cfg.parallel, dtype=cfg.params_dtype,
                                      use_fused_kernels=cfg.trainer.use_fused_kernels, recompute=cfg.trainer.recompute,
                                      lora=cfg.trainer.lora)

    def build(tc, pre_process: bool, post_process: bool, vp_stage: int | None):
        return build_beam_gpt_model(cfg.model, pre_process=pre_process, post_process=post_process,
                                    vp_stage=vp_stage, transformer_config=tc)

    return tconfig, build


def megatron_optimizer_config(setup: "TrainerSetup"):
    """Megatron's `OptimizerConfig` for `setup`: Megatron's own names on the left (grad_clip -> clip_grad, ...);
    this is the boundary to Megatron. `grad_clip: null` is Megatron's 0 (no clipping)."""
    from megatron.core.optimizer import OptimizerConfig

    t, s = setup.trainer, setup.lr_schedule
    return OptimizerConfig(
        optimizer=t.optimizer, lr=t.lr, min_lr=s.min_lr, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2, adam_eps=t.adam_eps, clip_grad=0.0 if t.grad_clip is None else t.grad_clip,
        bf16=setup.params_dtype == torch.bfloat16, params_dtype=setup.params_dtype,
        use_distributed_optimizer=t.distributed_optimizer,
        optimizer_cpu_offload=t.optimizer_offload_fraction > 0,
        optimizer_offload_fraction=t.optimizer_offload_fraction)


class MegatronTrainer(TrainerWorker):
    """One rank of the Megatron policy trainer (see the module docstring and `TrainerWorker`)."""

    def __init__(self, config: TrainerSetup, hf_checkpoint: str | Path | None = None,
                 model_factory: Callable[[TrainerSetup], tuple[object, ModelBuilder]] | None = None):
        """`model_factory(config) -> (TransformerConfig, builder)` replaces the Beam model (tests of the
        training plumbing with stock Megatron models); leave it None for Beam."""
        self.config = config
        self.device = initialize_parallel(config.parallel, seed=config.seed, timeout_s=config.timeout_s,
                                          expected_device=config.device)
        if dist.get_world_size() != config.trainer.num_gpus:
            raise TrainerConfigError(f"trainer.num_gpus={config.trainer.num_gpus} but this trainer's world has "
                                     f"{dist.get_world_size()} ranks")
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.router_replay import RouterReplay

        self._ps = ps
        RouterReplay.clear_global_router_replay_instances()  # a class-level registry (note §6)
        tconfig, builder = (model_factory or _beam_builder)(config)
        self.transformer_config = tconfig
        self._configure_schedule(tconfig)
        self.chunks = self._build_chunks(tconfig, builder)
        self._all_modules = [m for c in self.chunks for m in c.modules()]  # `_set_training`'s check, listed once
        self.optimizer, self.scheduler = self._build_optimizer()
        self._replay_enabled = False
        self._record_enabled = False
        self._step = 0
        self._hf_exporters: dict = {}  # dst rank -> mapping.HFExporter of these chunks (`export_hf`)
        from beamrl.trainer.megatron.checkpoint.checkpointer import Checkpointer

        self._checkpointer = Checkpointer(self)
        from beamrl.trainer.megatron.sleep import DeviceStateSleeper, megatron_grad_tensors, megatron_state_tensors

        self._sleeper = DeviceStateSleeper(lambda: megatron_state_tensors(self.chunks, self.optimizer), self.device,
                                           grads=lambda: megatron_grad_tensors(self.chunks, self.optimizer))
        self._grads_pending = False  # forward_backward ran, its optimizer_step not yet (a sleep would drop them)
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
            grad_reduce_in_fp32=self.config.trainer.main_grads_dtype == "fp32", overlap_grad_reduce=False,
            use_distributed_optimizer=self.config.trainer.distributed_optimizer,
            check_for_nan_in_grad=True, average_in_collective=False)  # NaN/inf grads raise, naming the bucket
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
        from megatron.core.optimizer import get_megatron_optimizer

        from beamrl.trainer.megatron.scheduler import build_scheduler

        t = self.config.trainer
        optimizer = get_megatron_optimizer(megatron_optimizer_config(self.config), [c for c in self.chunks])
        self.transformer_config.grad_scale_func = optimizer.scale_loss
        return optimizer, build_scheduler(optimizer, t.lr, t.weight_decay, self.config.lr_schedule)

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

    # ------------------------------------------------------------------------------------------ sleep / wake
    @property
    def asleep(self) -> bool:
        """True between `sleep` and `wake`: the rank's device state lives in host copies."""
        return self._sleeper.asleep

    def sleep(self):
        """Colocated placement: release this rank's params, grads and optimizer state from the device (host copies;
        `beamrl.trainer.megatron.sleep`; the gradients are dropped, not copied: every step zeroes them first).
        Returns a `SleepReport`. A save in flight has already staged its data on the host, so it keeps writing.
        Idempotent. Refused between `forward_backward` and its `optimizer_step` (it would drop their gradients)."""
        if self._grads_pending:
            from beamrl.trainer.megatron.sleep import GradientsPendingError

            raise GradientsPendingError("MegatronTrainer.sleep between forward_backward and optimizer_step would "
                                        "drop the gradients of that step; call optimizer_step first")
        return self._sleeper.sleep()

    def wake(self):
        """Restore what `sleep` released, bit-exactly (gradients as zeros). Returns a `SleepReport`. Idempotent."""
        return self._sleeper.wake()

    def _require_awake(self, what: str) -> None:
        if self._sleeper.asleep:
            from beamrl.trainer.megatron.sleep import TrainerAsleepError

            raise TrainerAsleepError(f"MegatronTrainer.{what} while the trainer sleeps (its device state is in host "
                                     f"memory); call wake() first")

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
        DP), no optimizer update. Returns the loss and metrics summed over micro-batches and DP ranks (the max or
        min instead for the metrics `loss_fn.metric_reductions` declares so)."""
        self._require_awake("forward_backward")
        reductions = metric_reductions(loss_fn)
        if len(micro_batches) < self._min_micro_batches():
            raise ValueError(f"train_step got {len(micro_batches)} micro-batches; this layout needs at least "
                             f"{self._min_micro_batches()} (the interleaved pipeline schedule needs >= pp)")
        self._set_training(True)
        for c in self.chunks:
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._grads_pending = False  # zeroed: an earlier backward's gradients are gone anyway

        def output_fn(lp, ent, batch):
            loss, metrics = loss_fn(lp, ent, batch)
            collected = {"loss": loss.detach().float()}
            for k, v in (metrics or {}).items():
                if k == "loss":
                    raise ValueError("the loss function's metrics must not use the reserved name 'loss'")
                collected[k] = torch.as_tensor(v).detach().float().reshape(())
            return loss, collected

        # While replaying, the routers also record the routes they used: the replay self-check below.
        mbs, length = self._prepare(micro_batches, record=self._replay_enabled)
        collected = schedule.run_schedule(self.chunks, mbs, length, self._logits_spec(temperature, True), output_fn,
                                          forward_only=False)
        sums = self._reduce_collected(collected, reductions)
        if self._replay_enabled:
            sums.update(self._replay_self_check(mbs))
        self._grads_pending = True
        return sums

    def _set_training(self, mode: bool) -> None:
        """`train()` / `eval()` on every chunk, skipped when every module already is in `mode` (the usual case: a
        run's train steps follow each other; the recursive walk and `Module.__setattr__` cost ~1-2 ms per step on
        CPU). The check reads every module's flag, so a submodule switched on its own is still switched back."""
        if all(m.training is mode for m in self._all_modules):
            return
        for c in self.chunks:
            c.train(mode)

    def _replay_self_check(self, mbs: list[schedule.MicroBatch]) -> dict[str, float]:
        """`replay/route_mismatches` and `replay/routes_checked` of this step, summed over every rank (each rank
        counts its own layers and, under SP, its own tokens; DP ranks their own micro-batches). Collective."""
        from beamrl.trainer.megatron import replay

        ps = self._ps
        sp = self.config.parallel.sp
        counts = torch.zeros(2, dtype=torch.int64)
        for mb in mbs:
            mismatched, checked = replay.count_route_mismatches(
                mb.recorded, mb.thd.routes, self.config.model.moe_layers,
                tp_rank=ps.get_tensor_model_parallel_rank() if sp else 0,
                tp_size=ps.get_tensor_model_parallel_world_size() if sp else 1)
            counts += torch.tensor([mismatched, checked])
        if dist.get_world_size() > 1:  # the whole trainer world: the counts of different ranks never overlap
            counts = counts.to(self.device)
            dist.all_reduce(counts)
        mismatched, checked = counts.tolist()
        return {"replay/route_mismatches": float(mismatched), "replay/routes_checked": float(checked)}

    def optimizer_step(self) -> tuple[bool, float, float]:
        """The second half of `train_step`: clip, Adam update, LR schedule. Returns (updated, grad norm, lr used).
        Non-finite gradients never get here: Megatron's grad check (`check_for_nan_in_grad`) raises in the backward's
        reduction, naming the bucket, so no NaN reaches the weights (there is no loss scaler to skip such a step:
        bf16 and fp32 runs have none). A step Megatron skips (updated False) does not advance the schedule."""
        self._require_awake("optimizer_step")
        lr = float(self.optimizer.param_groups[0]["lr"])
        try:
            update_ok, grad_norm, _ = self.optimizer.step()
        finally:  # used (or failed with): the next step zeroes them before its backward
            self._grads_pending = False
        if update_ok:
            self.scheduler.step(increment=1)
            self._step += 1
        return bool(update_ok), float(grad_norm) if grad_norm is not None else float("nan"), lr

    def hf_gradients(self) -> dict[str, torch.Tensor]:
        """The gradients left by `forward_backward`, gathered as full HF-named tensors on global rank 0 ({} on
        other ranks). For tests and debugging; needs `use_distributed_optimizer=False` (with the distributed
        optimizer each rank only holds the reduced gradient of its own shard). Collective."""
        if self.config.trainer.distributed_optimizer:
            raise TrainerConfigError("hf_gradients needs TrainerConfig.distributed_optimizer=False")
        swapped = []
        for m in self.models:
            for p in m.parameters():
                grad = getattr(p, "main_grad", None)
                swapped.append((p, p.data))
                p.data = torch.zeros_like(p.data) if grad is None else grad.detach().to(p.dtype).view_as(p.data)
        try:
            return {k: v.clone() for unit in self.export_hf() for k, v in unit}
        finally:
            for p, data in swapped:
                p.data = data

    def _reduce_collected(self, collected: list[dict[str, torch.Tensor]],
                          reductions: dict[str, str] | None = None) -> dict[str, float]:
        """Reduce the last stage's per-micro-batch scalars over micro-batches and DP, each by its reduction ("sum"
        unless `reductions` names it "max" or "min"; the all-reduce uses the matching op); share with every rank."""
        ps = self._ps
        payload = None
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            reductions = reductions or {}
            keys = sorted({k for d in collected for k in d})
            dp_group = ps.get_data_parallel_group()
            names, parts = [], []
            for op in _REDUCE_OPS:  # every DP rank has the same keys, so the same collectives in the same order
                op_keys = [k for k in keys if reductions.get(k, "sum") == op]
                if not op_keys:
                    continue
                vec = torch.stack([_reduce_micro(op, [d[k] for d in collected if k in d]) for k in op_keys])
                if dist.get_world_size(dp_group) > 1:  # one rank: a reduction over one rank, without the round trip
                    vec = vec.to(self.device)
                    dist.all_reduce(vec, op=_REDUCE_OPS[op], group=dp_group)
                names += op_keys
                parts.append(vec.to(parts[0].device) if parts else vec)
            reduced = dict(zip(names, torch.cat(parts).tolist())) if parts else {}
            payload = {k: reduced[k] for k in keys}  # in name order, as before
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
        self._require_awake("compute_logprobs")
        if routes is not None:
            batch = PackedBatch(batch.tokens, batch.cu_seqlens, batch.loss_mask, batch.fields, routes)
        self._set_training(False)
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
                                          sequence_parallel=self.config.parallel.sp, device=self.device)
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
        self._require_awake("load_hf_state_dict")
        from beamrl.trainer.megatron import mapping

        mapping.load_hf_weights(self.models, tensors, strict=True)
        self._sync_main_params()

    def _sync_main_params(self) -> None:
        """Refresh the optimizer's FP32 main copies after the model weights were overwritten."""
        reload = getattr(self.optimizer, "reload_model_params", None)
        if reload is not None:
            reload()

    def export_hf(self, dst_rank: int = 0) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Stream full HF tensors, one list per export unit (`mapping.export_hf_tensors`). Collective: every rank
        must iterate to the end; the lists hold tensors on `dst_rank` only (other ranks get empty lists)."""
        self._require_awake("export_hf")
        yield from self._hf_exporter(dst_rank).stream()

    def _hf_exporter(self, dst_rank: int):
        """The export's fixed part, worked out once per destination rank (the chunks and the parallel layout of a
        trainer never change; every tensor is still read when an export runs: `mapping.HFExporter`)."""
        from beamrl.trainer.megatron import mapping

        if dst_rank not in self._hf_exporters:
            self._hf_exporters[dst_rank] = mapping.HFExporter(self.models, dst_rank)
        return self._hf_exporters[dst_rank]

    # ------------------------------------------------------------------------------------------------ LoRA
    @property
    def lora(self) -> LoRAConfig | None:
        """The trainer's LoRA config (`trainer.lora`; None: full-parameter training)."""
        return self.config.trainer.lora

    def export_lora(self, dst_rank: int = 0) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Stream the full adapter tensors (PEFT names), one list per layer (`lora_mapping.export_adapter_tensors`).
        Collective: every rank must iterate to the end; tensors on `dst_rank` only."""
        from beamrl.trainer.megatron import lora_mapping

        yield from lora_mapping.export_adapter_tensors(self.models, dst_rank=dst_rank)

    def export_lora_layout(self) -> list[list[tuple[str, tuple[int, ...], torch.dtype]]]:
        """(name, shape, dtype) per unit of `export_lora`, the same on every rank, without communication."""
        from beamrl.trainer.megatron import lora_mapping

        return lora_mapping.export_adapter_layout(self.models)

    def load_lora_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load full adapter tensors (every rank passes the same dict) into this rank's adapter shards."""
        from beamrl.trainer.megatron import lora_mapping

        lora_mapping.load_adapter_tensors(self.models, tensors, strict=True)
        self._sync_main_params()

    def save_lora_adapter(self, directory: str | Path) -> None:
        """Write the adapter in PEFT format (`beamrl.models.beam.peft_io`) on global rank 0. Collective."""
        from beamrl.models.beam.peft_io import save_peft_adapter

        tensors = {k: v for unit in self.export_lora() for k, v in unit}
        if dist.get_rank() == 0:
            save_peft_adapter(directory, tensors, self.lora, self.config.model)

    def load_lora_adapter(self, directory: str | Path) -> None:
        """Load a PEFT-format adapter (resume, evaluation); its LoRAConfig must equal the trainer's."""
        from beamrl.models.beam.peft_io import load_peft_adapter

        lora, tensors = load_peft_adapter(directory, self.config.model)
        if self.lora is None or lora.to_dict() != self.lora.to_dict():
            raise TrainerConfigError(f"{directory}: adapter LoRAConfig {lora.to_dict()} differs from "
                                     f"trainer.lora {None if self.lora is None else self.lora.to_dict()}")
        self.load_lora_state_dict(tensors)

    def lora_gradients(self) -> dict[str, torch.Tensor]:
        """Adapter gradients left by `forward_backward` as full adapter tensors on global rank 0 ({} elsewhere).
        Needs `distributed_optimizer=False` (as `hf_gradients`). Collective."""
        from beamrl.trainer.megatron import lora_mapping

        if self.config.trainer.distributed_optimizer:
            raise TrainerConfigError("lora_gradients needs TrainerConfig.distributed_optimizer=False")
        return {k: v for unit in lora_mapping.export_adapter_tensors(self.models, source="main_grad") for k, v in unit}

    def export_hf_layout(self) -> list[list[tuple[str, tuple[int, ...], torch.dtype]]]:
        """(name, shape, dtype) per unit of `export_hf`, the same on every rank, without communication."""
        return self._hf_exporter(0).layout()

    def save_checkpoint(self, directory: str | Path, async_save: bool = False) -> Path:
        """Write a distributed checkpoint to `directory` (absent or empty; docs/checkpoints.md). With `async_save`
        it returns once the state is staged and the files are being written in the background: complete it with
        `finalize_checkpoint` (a later save, load or shutdown does so first)."""
        self._require_awake("save_checkpoint")
        return self._checkpointer.save(directory, async_save)

    def finalize_checkpoint(self, blocking: bool = True, timeout_s: float | None = None) -> Path | None:
        """Publish the save in flight once every rank's files are written: its directory, or None if there is none
        or (`blocking=False`) it is still being written. Waits at most `timeout_s` (default `config.timeout_s`)."""
        return self._checkpointer.finalize(blocking, timeout_s)

    def load_checkpoint(self, directory: str | Path) -> None:
        """Restore a checkpoint written at any parallel layout of the same model (docs/checkpoints.md)."""
        self._require_awake("load_checkpoint")
        self._checkpointer.load(directory)

    def checkpoint_costs(self) -> dict:
        """Seconds and bytes of the last published save and the last load, per phase (docs/checkpoints.md, "What a
        save costs"): `{"save": {...}, "load": {...}}`, empty dicts before the first."""
        return {"save": dict(self._checkpointer.last_costs), "load": dict(self._checkpointer.last_load_costs)}

    def shutdown(self) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        try:
            self.finalize_checkpoint(blocking=True)  # a save in flight is completed, not abandoned
        finally:
            RouterReplay.clear_global_router_replay_instances()
            self.chunks, self.optimizer, self.scheduler, self._hf_exporters = [], None, None, {}
            self._all_modules = []
            destroy_parallel()


#: The data-parallel all-reduce of each metric reduction (`beamrl.trainer.protocol.metric_reductions`).
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _reduce_micro(op: str, values: list[torch.Tensor]) -> torch.Tensor:
    """One metric's per-micro-batch scalars reduced over this rank's micro-batches (FP32, 0-dim)."""
    if op == "sum":
        return sum(values).float().reshape(())  # the sum the trainer always took: the means stay bit-identical
    stacked = torch.stack([v.float().reshape(()) for v in values])
    return stacked.amax() if op == "max" else stacked.amin()


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
