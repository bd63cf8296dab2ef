"""Rules that tie sections of a recipe together (no Beam config needed). Run on every load by `Recipe`'s validator.

Rules of one section live with the section's config class (`TrainerConfig` holds the parallel-layout rules,
`RolloutConfig`, `AlgorithmConfig`, `DataConfig` theirs) and run when the section is validated. Rules that need
the Beam config (heads, experts, layers) live in `layout.py`. Each rule raises `RecipeError(path, value,
allowed)` naming the field to change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from beamrl.config import ConfigError
from beamrl.recipe.errors import RecipeError
from beamrl.recipe.schema import REWARD_REF
from beamrl.trainer.batching import micro_batch_count

if TYPE_CHECKING:
    from beamrl.recipe.schema import Recipe


def _refuse_changed(section, prefix: str, fields: tuple[str, ...], because: str) -> None:
    """`Section.refuse_changed` for a rule that spans sections: the error names the field's recipe path."""
    try:
        section.refuse_changed(fields, because)
    except ConfigError as e:
        raise RecipeError(f"{prefix}.{e.path}", e.value, e.allowed) from None


def check_recipe(r: "Recipe") -> None:
    """Raise `RecipeError` for the first broken cross-section rule."""
    _check_model(r)
    _check_placement(r)
    _check_gpu_counts(r)
    _check_trainer_on_device(r)
    _check_batches(r)
    _check_rollout_on_device(r)
    _check_server_args(r)
    _check_algorithm(r)
    _check_rewards(r)


def _check_model(r: "Recipe") -> None:
    m = r.model
    if m.preset is None and m.checkpoint is None:
        raise RecipeError("model", m.model_dump(), "set model.checkpoint (a Beam HF directory) and/or model.preset")
    if m.checkpoint is not None and m.seed is not None:
        raise RecipeError("model.seed", m.seed, "only used for random init; remove it when model.checkpoint is set")
    if m.checkpoint is None and m.seed is None:
        raise RecipeError("model.seed", None, "random init (no model.checkpoint) needs an explicit integer seed")
    if m.config_overrides and m.checkpoint is not None:
        raise RecipeError("model.config_overrides", m.config_overrides, "only for a preset's random init; a "
                          "checkpoint carries its own config.json")


def _check_gpu_counts(r: "Recipe") -> None:
    total, t, ro = r.cluster.num_gpus, r.trainer.num_gpus, r.rollout.num_gpus
    where = f"cluster has {r.cluster.num_nodes} x {r.cluster.gpus_per_node} = {total} GPUs"
    if r.placement.mode == "colocated":
        if t != total:
            raise RecipeError("trainer.num_gpus", t, f"colocated placement uses every GPU for training: {where}")
        if ro != total:
            raise RecipeError("rollout.num_engines", r.rollout.num_engines,
                              f"colocated engines must cover the same GPUs as the trainer: num_engines * engine_tp "
                              f"= {r.rollout.num_engines} * {r.rollout.engine_tp} = {ro}, but {where}")
    else:
        if t + ro != total:
            raise RecipeError("trainer.num_gpus", t,
                              f"disaggregated trainer + rollout GPUs must add up to the cluster: {t} + "
                              f"{r.rollout.num_engines} * {r.rollout.engine_tp} = {t + ro}, but {where}")
    gpn, etp = r.cluster.gpus_per_node, r.rollout.engine_tp
    if etp <= gpn and gpn % etp:
        raise RecipeError("rollout.engine_tp", etp, f"must divide cluster.gpus_per_node={gpn} (an engine may not "
                          "straddle nodes partially) or be a multiple of it (a multi-node engine)")
    if etp > gpn and etp % gpn:
        raise RecipeError("rollout.engine_tp", etp, f"a multi-node engine must span whole nodes: a multiple of "
                          f"cluster.gpus_per_node={gpn}")


def _check_trainer_on_device(r: "Recipe") -> None:
    tr = r.trainer
    if r.cluster.device == "cpu":
        if tr.use_fused_kernels:
            raise RecipeError("trainer.use_fused_kernels", True, "fused kernels are GPU-only; set false on cluster.device=cpu")
        if tr.optimizer_offload_fraction > 0:
            raise RecipeError("trainer.optimizer_offload_fraction", tr.optimizer_offload_fraction,
                              "optimizer state is already in host memory on cluster.device=cpu; set 0")
    if tr.main_grads_dtype == "bf16" and r.model.dtype == "float32":
        raise RecipeError("trainer.main_grads_dtype", "bf16", "Megatron keeps the gradients of float32 parameters "
                          "in float32; bf16 main grads need model.dtype: bfloat16")
    if r.cluster.device == "cpu":
        _refuse_changed(r.cluster, "cluster", ("gpu_type",), "it sizes GPU memory (--dry-run), and cluster.device=cpu "
                    "has none")


def _check_batches(r: "Recipe") -> None:
    tr = r.trainer
    samples = r.rollout.samples_per_step
    if samples % tr.global_batch_size:
        raise RecipeError("trainer.global_batch_size", tr.global_batch_size,
                          f"must divide the rollout batch prompts_per_step * n_samples_per_prompt = "
                          f"{r.rollout.prompts_per_step} * {r.rollout.n_samples_per_prompt} = {samples} "
                          "(each rollout is split into whole optimizer steps)")
    if samples == tr.global_batch_size:
        _refuse_changed(r.algorithm, "algorithm", ("eps_clip_low", "eps_clip_high"), "one optimizer step per rollout "
                    "(trainer.global_batch_size = prompts_per_step * n_samples_per_prompt), so the policy ratio is "
                    "1 and PPO's clip never acts; a smaller global_batch_size gives several steps, where it does")
    if r.algorithm.advantage == "grpo" and r.rollout.n_samples_per_prompt < 2:
        raise RecipeError("rollout.n_samples_per_prompt", r.rollout.n_samples_per_prompt,
                          "GRPO computes advantages within a group: at least 2 samples per prompt")
    if r.sft is not None and r.sft.batch < tr.dp:
        raise RecipeError("sft.batch", r.sft.batch, f"at least one pair per data-parallel rank: >= trainer dp = "
                          f"{tr.dp} (each rank trains on its share of every SFT step)")
    if tr.vpp:  # Megatron's interleaved schedule needs at least pp micro-batches per DP rank in every step
        for path, samples_per_step in (("trainer.global_batch_size", tr.global_batch_size),
                                       *((("sft.batch", r.sft.batch),) if r.sft is not None else ())):
            per_rank = micro_batch_count(samples_per_step, tr.micro_batch_size, tr.dp) // tr.dp
            if per_rank < tr.pp:
                raise RecipeError("trainer.micro_batch_size", tr.micro_batch_size,
                                  f"with trainer.vpp set, every step needs >= pp = {tr.pp} micro-batches per DP rank; "
                                  f"{path} = {samples_per_step} gives {per_rank} (dp {tr.dp}): at most "
                                  f"{samples_per_step // (tr.pp * tr.dp)}")


def _check_rollout_on_device(r: "Recipe") -> None:
    ro = r.rollout
    if ro.deterministic and r.cluster.device == "cpu":
        raise RecipeError("rollout.deterministic", True, "SGLang refuses deterministic inference with the CPU "
                          "engine's torch_native attention; set false on cluster.device=cpu")
    if r.cluster.device == "cpu" and ro.engine == "sglang":
        _refuse_changed(ro, "rollout", ("mem_fraction", "swa_full_tokens_ratio"), "SGLang's CPU engine sizes its own "
                    "small pool (SGLangEngineConfig.on_cpu); it applies on cluster.device=cuda")
    if r.cluster.device == "cpu" and ro.attention_backend not in (None, "torch_native"):
        raise RecipeError("rollout.attention_backend", ro.attention_backend, "cluster.device=cpu allows only "
                          "null or 'torch_native'")
    if (r.cluster.device == "cpu" and ro.engine == "sglang" and ro.engine_tp > r.cluster.gpus_per_node
            and r.sync.transport == "colocated"):
        # A CPU engine that spans (simulated) nodes is a set of HTTP servers; SGLang's tensor path over HTTP
        # cannot carry CPU tensors (docs/sglang.md, weight updates). Refused at load, so that neither a dry run
        # nor a run's output directory gets that far.
        raise RecipeError("sync.transport", "colocated", "an SGLang CPU engine that spans nodes (rollout.engine_tp > "
                          "cluster.gpus_per_node) takes weights through 'disk' (or 'distributed' when disaggregated)")


def _check_server_args(r: "Recipe") -> None:
    """What the rollout section alone cannot see (its own rules name unknown keys and first-class fields)."""
    args = r.rollout.server_args
    if r.cluster.device == "cpu" and args:  # (the native engine refuses them in its own section)
        raise RecipeError("rollout.server_args", args, "SGLang's CPU engine runs beamrl's CPU settings "
                          "(SGLangEngineConfig.on_cpu) and would ignore them; they apply on cluster.device=cuda")
    if r.trainer.lora is not None and "json_model_override_args" in args:
        raise RecipeError("rollout.server_args.json_model_override_args", args["json_model_override_args"],
                          "with trainer.lora set beamrl passes the LoRA config to the engines through it")


def _check_placement(r: "Recipe") -> None:
    p, tr = r.placement, r.sync.transport
    if p.off_policy_steps == 1:
        if p.mode != "disaggregated":
            raise RecipeError("placement.off_policy_steps", 1, "one-step-off needs placement.mode: disaggregated "
                              "(colocated engines and trainer cannot run at the same time)")
        if r.algorithm.importance.mode == "none":
            raise RecipeError("algorithm.importance.mode", "none", "off-policy training (placement.off_policy_steps=1) "
                              "needs an importance correction: 'tis' or 'mis'")
    if r.trainer.sleep_during_rollout and p.mode != "colocated":
        raise RecipeError("trainer.sleep_during_rollout", True, "the trainer sleeps only to lend its devices to "
                          "colocated engines; set false or null with placement.mode: disaggregated")
    if tr == "colocated" and p.mode != "colocated":
        raise RecipeError("sync.transport", tr, "'colocated' (in-place/IPC) needs placement.mode: colocated; use "
                          "'distributed' or 'disk'")
    if tr == "distributed" and p.mode != "disaggregated":
        raise RecipeError("sync.transport", tr, "'distributed' (NCCL broadcast) is for placement.mode: disaggregated; "
                          "use 'colocated' or 'disk'")
    # On cluster.device=cpu the distributed transport broadcasts over gloo (CI, laptops); NCCL on CUDA.


def _check_algorithm(r: "Recipe") -> None:
    a = r.algorithm
    if a.overlong.enabled and a.overlong.buffer >= r.rollout.max_new_tokens:
        raise RecipeError("algorithm.overlong.buffer", a.overlong.buffer,
                          f"must be smaller than rollout.max_new_tokens={r.rollout.max_new_tokens}")
    if a.routing_replay is False and r.rollout.return_routed_experts is True:
        raise RecipeError("rollout.return_routed_experts", True, "the engine's routes are used only by "
                          "algorithm.routing_replay, which is false; set null or false")
    if a.routing_replay is True and r.rollout.return_routed_experts is False:
        raise RecipeError("rollout.return_routed_experts", False, "algorithm.routing_replay needs the engine's routes; "
                          "set true (or null)")


def _check_rewards(r: "Recipe") -> None:
    seen: set[str] = set()
    for i, c in enumerate(r.rewards):
        if c.name in seen:
            raise RecipeError(f"rewards[{i}].name", c.name, "reward names must be unique (they name the metrics)")
        seen.add(c.name)
        if not REWARD_REF.match(c.fn):
            raise RecipeError(f"rewards[{i}].fn", c.fn, "an import path 'package.module:function' or a registered "
                              "reward name")
        if c.timeout_s > r.reward_pool.batch_timeout_s:
            raise RecipeError(f"rewards[{i}].timeout_s", c.timeout_s,
                              "must not exceed the batch limit reward_pool.batch_timeout_s="
                              f"{r.reward_pool.batch_timeout_s}")
    if all(c.weight == 0 for c in r.rewards):
        raise RecipeError("rewards", [c.name for c in r.rewards], "at least one component needs a non-zero weight")
