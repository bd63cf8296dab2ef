"""Per-GPU memory estimates for the trainer (per pipeline stage) and for one rollout-engine rank.

Parameters are counted tensor by tensor from `expected_tensors(config)` and sharded the way Megatron and
SGLang shard them; nothing is fitted to a measurement. Byte rules (trainer, Megatron-core mixed precision):
  * weights: 2 B (bf16) per parameter; FP32 tensors (router, expert-score bias) 4 B;
  * grads (DDP main_grad): 4 B with trainer.main_grads_dtype=fp32 (grad_reduce_in_fp32), else 2 B;
    FP32 parameters always 4 B; the expert-score bias is a buffer (no grad, no optimizer state);
  * Adam: FP32 master + m + v = 12 B per bf16 parameter (8 B for FP32 parameters: no separate master),
    divided by dp (dense) or expert-dp (experts) with the distributed optimizer, times
    (1 - optimizer_offload_fraction) for what stays on the GPU;
  * reference policy (algorithm.kl.reference): one more copy of the bf16 weights, kept on the GPU;
  * activations: see `_activation_bytes` (full recompute keeps only each layer's input; one layer's saved
    set is counted once more for its activation gradients during backward);
  * runtime: a fixed reserve for the CUDA context, NCCL communicators and allocator fragmentation;
  * LoRA (`trainer.lora`): the frozen base has weights only (no grads, no optimizer state); the adapters have
    weights, grads and Adam state, sharded like the weights they adapt (TP-split B of column-parallel and A of
    row-parallel bases, experts over EP); the merged weights W' of the targeted weights are saved for backward
    like activations (all of the stage's without recompute, one layer's with full recompute). An engine keeps a
    W0 copy of every targeted weight (beamrl's SGLang class: full HF tensors on each rank).
Capacities are the vendors' nominal sizes in 10^9 bytes (H200 141 GB, B200 180 GB), which is below what
the driver reports (about 140 GiB on an H200), so the check errs on the safe side.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from beamrl.models.beam import BeamConfig
from beamrl.models.beam.weights import expected_tensors

if TYPE_CHECKING:
    from beamrl.recipe.layout import Layout
    from beamrl.recipe.schema import Recipe

GPU_CAPACITY_BYTES = {"h200": 141e9, "b200": 180e9}
RUNTIME_RESERVE_BYTES = 4 * 2**30  # CUDA context ~0.6 GiB + NCCL buffers of ~10 communicators + fragmentation


@dataclass(frozen=True)
class TrainerMemory:
    stage: int
    params_dense: int
    params_expert: int
    weights: float
    grads: float
    optimizer: float
    activations: float
    reference: float
    runtime: float
    adapter_params: int = 0  # LoRA: trainable adapter parameters per rank (the grads/optimizer are theirs)

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.reference + self.runtime


@dataclass(frozen=True)
class EngineMemory:
    weights: float
    static_budget: float
    kv_pool: float
    bytes_per_token: float
    kv_tokens: int
    request_tokens: int
    full_layers: int
    swa_layers: int
    lora_w0: float = 0.0  # LoRA: W0 copies of the targeted weights, outside SGLang's static budget

    @property
    def total(self) -> float:
        return self.static_budget + self.lora_w0

    @property
    def max_full_requests(self) -> int:
        return self.kv_tokens // self.request_tokens


def gpu_capacity(r: "Recipe") -> float | None:
    """Bytes per GPU, or None on cluster.device=cpu (not checked)."""
    return None if r.cluster.device == "cpu" else GPU_CAPACITY_BYTES[r.cluster.gpu_type]


@lru_cache(maxsize=8)
def _tensor_table_cached(config_json: str) -> tuple[tuple[str, int, bool], ...]:
    c = BeamConfig.from_dict(json.loads(config_json))
    return tuple((name, math.prod(spec.shape), spec.fp32) for name, spec in expected_tensors(c).items())


def tensor_table(c: BeamConfig) -> tuple[tuple[str, int, bool], ...]:
    """(HF name, element count, stored FP32) of every tensor; cached (the 501B table has ~38k names)."""
    return _tensor_table_cached(json.dumps(c.to_dict(), sort_keys=True))


def _layer_of(name: str) -> int | None:
    return int(name.split(".")[2]) if name.startswith("model.layers.") else None


def trainer_memory(r: "Recipe", c: BeamConfig, lay: "Layout") -> list[TrainerMemory]:
    """One estimate per pipeline stage (every rank of a stage holds the same amount)."""
    tr = r.trainer
    model_bytes = 4 if r.model.dtype == "float32" else 2
    grad_bytes = 4 if tr.main_grads_dtype == "fp32" or r.model.dtype == "float32" else 2
    on_gpu = 1.0 - tr.optimizer_offload_fraction
    stage_of = {l: p for p, layers in enumerate(lay.stage_layers) for l in layers}
    last = lay.pp - 1
    out = []
    for p in range(lay.pp):
        dense = expert = 0
        w = g = o = 0.0
        for name, n, spec_fp32 in tensor_table(c):
            layer = _layer_of(name)
            owner = stage_of[layer] if layer is not None else (0 if name.startswith("model.embed_tokens") else last)
            if owner != p:
                continue
            is_expert = ".mlp.experts." in name
            replicated = name.endswith("norm.weight") or ".mlp.gate." in name  # norms, router, score bias
            shards = lay.ep * lay.etp if is_expert else (1 if replicated else lay.tp)
            n_local = n / shards
            fp32 = spec_fp32 or model_bytes == 4
            w += n_local * (4 if fp32 else model_bytes)
            if name.endswith("e_score_correction_bias"):
                continue  # a buffer: updated by the router-bias rule, not by Adam
            if is_expert:
                expert += n_local
            else:
                dense += n_local
            if tr.lora is not None:
                continue  # the frozen base: no grads, no optimizer state
            g += n_local * (4 if fp32 else grad_bytes)
            state = 8 if fp32 else 12
            shard = (lay.expert_dp if is_expert else lay.dp) if tr.distributed_optimizer else 1
            o += n_local * state / shard * on_gpu
        ref = float(w) if r.algorithm.kl.reference else 0.0
        runtime = 0.0 if r.cluster.device == "cpu" else float(RUNTIME_RESERVE_BYTES)
        act = _activation_bytes(r, c, lay, p)
        adapter = 0.0
        if tr.lora is not None:
            a_w, a_g, a_o, adapter, merged = _lora_trainer_bytes(r, c, lay, p, stage_of, model_bytes, grad_bytes)
            w, g, o, act = w + a_w, g + a_g, o + a_o * on_gpu, act + merged
        out.append(TrainerMemory(p, int(dense), int(expert), w, g, o, act, ref, runtime, int(adapter)))
    return out


def _lora_trainer_bytes(r: "Recipe", c: BeamConfig, lay: "Layout", stage: int, stage_of: dict, model_bytes: int,
                        grad_bytes: int) -> tuple[float, float, float, float, float]:
    """(adapter weights, grads, optimizer, adapter params, merged-W' bytes) per rank of pipeline stage `stage`."""
    from beamrl.models.beam.lora import adapted_weights

    tr, lora = r.trainer, r.trainer.lora
    column = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    params = merged_total = 0.0
    per_layer: dict[int, float] = {}
    shared_a: set[tuple[int, str]] = set()
    for wt in adapted_weights(c, lora):
        if stage_of[wt.layer] != stage:
            continue
        out_f, in_f, rk = wt.out_features, wt.in_features, lora.rank
        if wt.expert is not None:
            a = 0.0 if (wt.layer, wt.a) in shared_a else rk * in_f
            shared_a.add((wt.layer, wt.a))
            n = (a + out_f * rk) / lay.ep
            merged = out_f * in_f / lay.ep
        else:
            tp_a, tp_b = (1, lay.tp) if wt.weight.rsplit(".", 2)[1] in column else (lay.tp, 1)
            n = rk * in_f / tp_a + out_f * rk / tp_b
            merged = out_f * in_f / lay.tp
        params += n
        per_layer[wt.layer] = per_layer.get(wt.layer, 0.0) + merged * model_bytes
        merged_total += merged * model_bytes
    state = 8 if model_bytes == 4 else 12
    shard = lay.dp if tr.distributed_optimizer else 1  # (experts' factors: expert-dp; the difference is small)
    saved = max(per_layer.values(), default=0.0) if tr.recompute == "full" else merged_total
    return params * model_bytes, params * grad_bytes, params * state / shard, params, saved


def _layer_working_bytes(c: BeamConfig, layer: int, T: int, tp: int, sp: bool, etp: int, topk: int) -> float:
    """Bytes one layer saves for backward for T tokens (bf16 activations), per rank.

    Attention: norm out, q/k/v/gate projections, normed+roped q/k, attention output (flash-style: no
    [s, s] scores), gated output, o_proj out, post-norm out, residual. H-sized tensors are split over TP
    only with sequence parallelism; head-sized ones always are."""
    H, I, Ie = c.hidden_size, c.intermediate_size, c.moe_intermediate_size
    q = c.num_attention_heads * c.head_dim
    kv = c.num_key_value_heads * c.head_dim
    h_div = tp if sp else 1
    attn = T * (4 * H / h_div + (6 * q + 3 * kv) / tp) * 2 + T * c.num_attention_heads / tp * 4  # + fp32 LSE
    if not c.is_moe(layer):
        mlp = T * (3 * H / h_div + 3 * I / tp) * 2
    else:
        routed = T * topk * etp / tp  # token copies an expert rank processes (see docs/recipes.md)
        mlp = T * 3 * H / h_div * 2 + T / h_div * c.num_experts * 4 + routed * ((2 * H + 3 * Ie / etp) * 2 + 4)
    return attn + mlp


def _activation_bytes(r: "Recipe", c: BeamConfig, lay: "Layout", stage: int) -> float:
    tr = r.trainer
    T = tr.micro_batch_size * (r.data.max_prompt_len + r.rollout.max_new_tokens)
    layers = lay.stage_layers[stage]
    h_div = lay.tp if lay.sp else 1
    work = [_layer_working_bytes(c, l, T, lay.tp, lay.sp, lay.etp, c.num_experts_per_tok) for l in layers]
    M = lay.micro_batches_per_optimizer_step
    if lay.vpp:  # Megatron's interleaved warm-up: chunks in flight on this rank
        chunk = len(layers) // lay.vpp
        inflight_layers = min((lay.pp - stage - 1) * 2 + (lay.vpp - 1) * lay.pp + 1, M * lay.vpp) * chunk
    else:
        inflight_layers = min(lay.pp - stage, M) * len(layers)
    if tr.recompute == "full":
        saved = inflight_layers * T * c.hidden_size / h_div * 2 + max(work)  # inputs + one recomputed layer
    else:
        saved = inflight_layers / max(len(layers), 1) * sum(work)
    saved += max(work)  # gradients of the activations of the layer in backward, as large as its saved set
    if stage == lay.pp - 1:  # vocab-parallel logits: bf16 out, FP32 softcapped copy and its grad
        saved += T * c.vocab_size / lay.tp * (2 + 4 + 4)
    return saved


def engine_memory(r: "Recipe", c: BeamConfig, lay: "Layout") -> EngineMemory:
    """One SGLang TP rank: weights, static budget (mem_fraction x GPU) and the hybrid-SWA KV pool."""
    et, kv = lay.engine_tp, c.num_key_value_heads
    kv_shards = min(et, kv)  # beyond kv heads, SGLang replicates KV heads
    model_bytes = 4 if r.model.dtype == "float32" else 2
    w = 0.0
    for name, n, spec_fp32 in tensor_table(c):
        if name.endswith("norm.weight") or ".mlp.gate." in name:
            shards = 1
        elif name.endswith(("k_proj.weight", "v_proj.weight")):
            shards = kv_shards
        else:
            shards = et
        w += n / shards * (4 if spec_fp32 else model_bytes)
    w0 = 0.0
    if r.trainer.lora is not None:  # W0 copies of the targeted weights, full HF tensors on every engine rank
        from beamrl.models.beam.lora import adapted_num_parameters

        w0 = adapted_num_parameters(c, r.trainer.lora) * model_bytes
    request = r.data.max_prompt_len + r.rollout.max_new_tokens
    full = sum(1 for l in range(c.num_hidden_layers) if not c.is_sliding(l))
    swa = c.num_hidden_layers - full
    per_layer = 2 * max(kv // et, 1) * c.head_dim * model_bytes  # K and V
    ratio = r.rollout.swa_full_tokens_ratio if swa else 0.0
    bytes_per_token = per_layer * (full + ratio * swa) if full else per_layer * swa
    capacity = gpu_capacity(r)
    if capacity is None:
        return EngineMemory(w, w, 0.0, bytes_per_token, 0, request, full, swa, w0)
    budget = r.rollout.mem_fraction * capacity
    pool = max(budget - w, 0.0)
    return EngineMemory(w, budget, pool, bytes_per_token, int(pool // bytes_per_token), request, full, swa, w0)


def colocated_peak(trainer: list[TrainerMemory], engine: EngineMemory, trainer_sleeps: bool = True) -> float:
    """Colocated GPUs run one side at a time: the engines release their memory while the trainer trains, and the
    trainer sleeps while they generate (`trainer.sleep_during_rollout`), so the peak is the larger side. A trainer
    that does not sleep keeps its state (all but activations) next to the engine during rollout."""
    if trainer_sleeps:
        return max(max(m.total for m in trainer), engine.total)
    return max(max(m.total, m.total - m.activations + engine.total) for m in trainer)


def trainer_sleeps(r: "Recipe") -> bool:
    """`trainer.sleep_during_rollout` resolved (null: on for colocated placement on cuda)."""
    from beamrl.trainer.megatron.config import sleeps_during_rollout

    return sleeps_during_rollout(r.trainer.sleep_during_rollout, r.placement.mode, r.cluster.device)


def memory_problems(r: "Recipe", lay: "Layout", trainer: list[TrainerMemory], engine: EngineMemory) -> list[str]:
    """Messages for every GPU over its memory, naming the fields that would fix it."""
    capacity = gpu_capacity(r)
    if capacity is None:
        return []
    gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731
    problems = []
    worst = max(trainer, key=lambda m: m.total)
    trainer_peak = colocated_peak(trainer, engine, trainer_sleeps(r)) if lay.placement == "colocated" else worst.total
    if trainer_peak > capacity:
        problems.append(f"trainer: stage {worst.stage} needs {gib(trainer_peak)} per GPU > {gib(capacity)} "
                        f"({r.cluster.gpu_type}); raise trainer.pp / trainer.ep*etp, set trainer.recompute: full, "
                        "trainer.distributed_optimizer: true or trainer.optimizer_offload_fraction" +
                        ("" if lay.placement != "colocated" or trainer_sleeps(r) else
                         ", or trainer.sleep_during_rollout: true (the trainer's state stays next to the engine)"))
    if engine.weights >= engine.static_budget:
        problems.append(f"rollout.mem_fraction={r.rollout.mem_fraction}: the static budget {gib(engine.static_budget)} "
                        f"does not hold the weights {gib(engine.weights)} per engine rank; raise rollout.engine_tp")
    elif engine.lora_w0 and engine.total > capacity:
        problems.append(f"rollout: the static budget {gib(engine.static_budget)} + the LoRA W0 copies "
                        f"{gib(engine.lora_w0)} (trainer.lora.targets) exceed {gib(capacity)} per engine rank; lower "
                        "rollout.mem_fraction or target fewer weights")
    elif engine.max_full_requests < 1:
        problems.append(f"rollout: the KV pool ({engine.kv_tokens} tokens) cannot hold one request of "
                        f"{engine.request_tokens} tokens; raise rollout.mem_fraction or rollout.engine_tp, or lower "
                        "rollout.swa_full_tokens_ratio")
    return problems
