"""The GPU layout of a recipe, checked against the Beam config, and its printable summary (`--dry-run`).

The model-fit rules are the components' own: the trainer's (`TrainerConfig.check_model`: TP/EP/ETP/PP/VPP
against heads, experts, widths and layers, megatron-core 0.19.2) and the engines' (`RolloutConfig.check_model`:
SGLang 0.5.23 TP sharding). Here they run under their section's path, plus the rules that tie the model to
other sections: routing replay needs MoE layers, max_prompt_len + max_new_tokens fits the model's positions,
and the digit tokenizer matches the model's vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from beamrl.cluster.placement import Placement, plan_placement
from beamrl.cluster.report import format_placement, ranges
from beamrl.models.beam import BeamConfig
from beamrl.models.beam.lora_config import DENSE_MLP_TARGETS, EXPERT_TARGETS
from beamrl.recipe.errors import RecipeError, in_section

if TYPE_CHECKING:
    from beamrl.recipe.memory import EngineMemory, TrainerMemory
    from beamrl.recipe.schema import Recipe


def check_model_fit(r: "Recipe", c: BeamConfig) -> None:
    """Raise `RecipeError` for the first layout rule the Beam config `c` breaks."""
    with in_section("trainer"):
        r.trainer.check_model(c)
    if not c.moe_layers and r.algorithm.routing_replay:
        raise RecipeError("algorithm.routing_replay", True, "the model has no MoE layers to replay")
    if resolved_routing_replay(r, c) and r.rollout.return_routed_experts is False:
        raise RecipeError("rollout.return_routed_experts", False, "routing replay is on (algorithm.routing_replay "
                          "null is on for a MoE model) and needs the engine's routes; set true or null, or "
                          "algorithm.routing_replay: false")
    lora = r.trainer.lora
    if lora is not None:
        dense = len(c.moe_layers) < c.num_hidden_layers
        for i, target in enumerate(lora.targets):
            if target in EXPERT_TARGETS and not c.moe_layers or target in DENSE_MLP_TARGETS and not dense:
                kind = "MoE" if target in EXPERT_TARGETS else "dense MLP"
                raise RecipeError(f"trainer.lora.targets[{i}]", target, f"the model has no {kind} layers: this "
                                  "target would get no adapter")
    with in_section("rollout"):
        r.rollout.check_model(c)
    seq = r.data.max_prompt_len + r.rollout.max_new_tokens
    if seq > c.max_position_embeddings:
        raise RecipeError("rollout.max_new_tokens", r.rollout.max_new_tokens, f"data.max_prompt_len + max_new_tokens "
                          f"= {seq} exceeds max_position_embeddings={c.max_position_embeddings}")
    if r.data.tokenizer == "digit":
        from beamrl.data.digit_tokenizer import DigitTokenizer

        tok = DigitTokenizer()
        if tok.vocab_size != c.vocab_size:
            raise RecipeError("data.tokenizer", "digit", f"needs the model's vocab_size == {tok.vocab_size} (model has "
                              f"{c.vocab_size}; set model.config_overrides.vocab_size: {tok.vocab_size}): a larger "
                              "vocabulary lets the policy sample ids the tokenizer cannot decode")
        if c.eos_token_id not in (None, tok.eos_token_id):
            raise RecipeError("data.tokenizer", "digit", f"eos id {tok.eos_token_id} differs from the model's "
                              f"eos_token_id={c.eos_token_id}")


def placement_of(r: "Recipe") -> Placement:
    """The run's placement plan (`beamrl.cluster.placement`): who runs on which node and GPU. The same function
    serves `--dry-run` and the launcher. Raises `RecipeError` naming the field to change."""
    cl, tr, ro = r.cluster, r.trainer, r.rollout
    with in_section(""):
        return plan_placement(device=cl.device, num_nodes=cl.num_nodes, gpus_per_node=cl.gpus_per_node,
                              trainer=tr.parallel, trainer_gpus=tr.num_gpus, engine=ro.engine,
                              num_engines=ro.num_engines, engine_tp=ro.engine_tp, mode=r.placement.mode,
                              reference=r.algorithm.kl.reference)


@dataclass(frozen=True)
class Layout:
    """Who runs where. `stage_layers[p]` lists the global layer ids held by pipeline rank p (all its
    virtual chunks)."""

    device: str
    gpu_type: str
    num_nodes: int
    gpus_per_node: int
    placement: str
    trainer_gpus: int
    tp: int
    sp: bool
    ep: int
    etp: int
    pp: int
    vpp: int | None
    dp: int
    expert_dp: int
    stage_layers: list[list[int]]
    micro_batches_per_optimizer_step: int
    optimizer_steps_per_rollout: int
    engine: str
    num_engines: int
    engine_tp: int
    nodes_per_engine: float
    rollout_gpus: int
    samples_per_step: int
    plan: Placement  # who runs on which node and GPU (`placement_of`)
    warnings: list[str] = field(default_factory=list)


def plan_layout(r: "Recipe", c: BeamConfig) -> Layout:
    """Check `r` against `c` (raises `RecipeError`) and return the layout."""
    check_model_fit(r, c)
    placement = placement_of(r)
    tr, ro, cl = r.trainer, r.rollout, r.cluster
    warnings: list[str] = []
    if cl.device == "cuda" and r.placement.mode == "disaggregated" and tr.num_gpus % cl.gpus_per_node:
        warnings.append(f"trainer.num_gpus={tr.num_gpus} is not whole nodes: trainer and engines share a node")
    if c.moe_layers and r.algorithm.routing_replay is False:
        warnings.append("algorithm.routing_replay=false on a MoE model: the trainer re-routes tokens, so train "
                        "and rollout logprobs can disagree where routing ties flip")
    return Layout(
        device=cl.device, gpu_type=cl.gpu_type, num_nodes=cl.num_nodes, gpus_per_node=cl.gpus_per_node,
        placement=r.placement.mode, trainer_gpus=tr.num_gpus, tp=tr.tp, sp=tr.sp, ep=tr.ep, etp=tr.etp,
        pp=tr.pp, vpp=tr.vpp, dp=tr.dp, expert_dp=tr.expert_dp_size(tr.num_gpus),
        stage_layers=tr.stage_layers(c.num_hidden_layers),
        micro_batches_per_optimizer_step=tr.global_batch_size // (tr.micro_batch_size * tr.dp),
        optimizer_steps_per_rollout=ro.samples_per_step // tr.global_batch_size,
        engine=ro.engine, num_engines=ro.num_engines, engine_tp=ro.engine_tp,
        nodes_per_engine=ro.engine_tp / cl.gpus_per_node, rollout_gpus=ro.num_gpus,
        samples_per_step=ro.samples_per_step, plan=placement, warnings=warnings,
    )


def resolved_routing_replay(r: "Recipe", c: BeamConfig) -> bool:
    """algorithm.routing_replay with its default applied: on for MoE models."""
    return bool(c.moe_layers) if r.algorithm.routing_replay is None else r.algorithm.routing_replay


def _gib(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 (GiB, MiB or KiB)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _params(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def format_layout(r: "Recipe", c: BeamConfig, source: str, lay: Layout,
                  trainer_mem: list["TrainerMemory"], engine_mem: "EngineMemory", capacity: float | None) -> str:
    """The human-readable dry-run report."""
    from beamrl.recipe.memory import colocated_peak, trainer_sleeps

    L = []
    add = L.append
    add(f"recipe {r.run.name}: model {source}: {_params(c.num_parameters())} parameters "
        f"({len(c.moe_layers)} MoE layers x {c.num_experts} experts top-{c.num_experts_per_tok}), {r.model.dtype}")
    where = f"{lay.device}" if lay.device == "cpu" else f"{lay.gpu_type.upper()}"
    add(f"cluster: {lay.num_nodes} node(s) x {lay.gpus_per_node} {where} = {lay.num_nodes * lay.gpus_per_node} "
        f"{'workers' if lay.device == 'cpu' else 'GPUs'}; placement {lay.placement}, "
        f"off_policy_steps={r.placement.off_policy_steps}")
    unit = "workers" if lay.device == "cpu" else "GPUs"
    add(f"trainer: {lay.trainer_gpus} {unit} = TP{lay.tp} x PP{lay.pp} x DP{lay.dp}"
        f"{' (SP)' if lay.sp else ''}; experts EP{lay.ep} x ETP{lay.etp} x expert-DP{lay.expert_dp}"
        f"{f'; VPP{lay.vpp}' if lay.vpp else ''}")
    add(f"  checks: tp*pp*dp = {lay.tp}*{lay.pp}*{lay.dp} = {lay.tp * lay.pp * lay.dp} == {lay.trainer_gpus}; "
        f"ep*etp = {lay.ep * lay.etp} divides tp*dp = {lay.tp * lay.dp}; heads {c.num_attention_heads}/"
        f"{c.num_key_value_heads} % tp ok; experts {c.num_experts} % ep ok; layers {c.num_hidden_layers} % pp ok")
    for p, layers in enumerate(lay.stage_layers):
        add(f"  stage {p}: layers {ranges(layers)} ({len(layers)})")
    add(f"  batch: {r.rollout.prompts_per_step} prompts x {r.rollout.n_samples_per_prompt} samples = "
        f"{lay.samples_per_step} per step = {lay.optimizer_steps_per_rollout} optimizer step(s) of "
        f"{r.trainer.global_batch_size} = {lay.micro_batches_per_optimizer_step} micro-batch(es) of "
        f"{r.trainer.micro_batch_size} per DP rank")
    routes = r.rollout.return_routed_experts
    if routes is None:
        routes = resolved_routing_replay(r, c)
    add(f"rollout: {lay.num_engines} x {lay.engine} engine(s) of TP{lay.engine_tp}"
        f"{f' ({lay.nodes_per_engine:g} nodes each)' if lay.nodes_per_engine > 1 else ''} = {lay.rollout_gpus} {unit}; "
        f"max_new_tokens {r.rollout.max_new_tokens}; routed experts {'on' if routes else 'off'}")
    add(format_placement(lay.plan))
    add("memory per GPU (estimate):")
    for m in trainer_mem:
        add(f"  trainer stage {m.stage}: {_gib(m.total)} = weights {_gib(m.weights)} + grads {_gib(m.grads)} + "
            f"optimizer {_gib(m.optimizer)} + activations {_gib(m.activations)} + reference {_gib(m.reference)} + "
            f"runtime {_gib(m.runtime)}  [{_params(m.params_dense)} dense + {_params(m.params_expert)} expert "
            f"params per rank" + (f"; frozen, LoRA adapters {_params(m.adapter_params)} trainable" if r.trainer.lora
                                  else "") + "]")
    e = engine_mem
    if capacity is None:
        add(f"  rollout engine rank: weights {_gib(e.weights)}; KV {_gib(e.bytes_per_token)}/token "
            "(pool not sized on cpu)")
    else:
        add(f"  rollout engine rank: static {_gib(e.static_budget)} (mem_fraction {r.rollout.mem_fraction:g}) = "
            f"weights {_gib(e.weights)} + KV pool {_gib(e.kv_pool)}; {_gib(capacity - e.static_budget)} left for "
            "activations and CUDA graphs")
        add(f"    KV: {_gib(e.bytes_per_token)}/token/rank ({e.full_layers} full + "
            f"{r.rollout.swa_full_tokens_ratio:g} x {e.swa_layers} SWA layers) -> {e.kv_tokens:,} tokens = "
            f"{e.max_full_requests:,} requests of {e.request_tokens} tokens at once "
            f"(this step: {lay.samples_per_step // max(lay.num_engines, 1)} per engine)")
    if e.lora_w0:
        add(f"    +  LoRA W0 copies {_gib(e.lora_w0)} (the targeted weights, kept to merge each "
            "adapter; outside the static budget)")
    if lay.placement == "colocated":
        if trainer_sleeps(r):
            add(f"  colocated peak (trainer and engine swap via memory release; trainer.sleep_during_rollout on): "
                f"{_gib(colocated_peak(trainer_mem, e))}")
        else:
            add(f"  colocated peak (the trainer keeps its state during rollout: trainer.sleep_during_rollout off): "
                f"{_gib(colocated_peak(trainer_mem, e, trainer_sleeps=False))}")
    if capacity is None:
        add("  capacity: not checked on cluster.device=cpu")
    else:
        peak = (colocated_peak(trainer_mem, e, trainer_sleeps(r)) if lay.placement == "colocated"
                else max(max(m.total for m in trainer_mem), e.total))
        add(f"  capacity: {_gib(capacity)} ({capacity / 1e9:.0f} GB) per {lay.gpu_type.upper()}; highest estimate "
            f"{_gib(peak)} ({peak / 1e9:.0f} GB, {100 * peak / capacity:.0f}%)")
    for w in lay.warnings:
        add(f"warning: {w}")
    return "\n".join(L)

