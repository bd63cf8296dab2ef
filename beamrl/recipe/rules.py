"""Cross-field rules that need only the recipe (no Beam config). Run on every load by `Recipe`'s validator.

Each rule raises `RecipeError(path, value, allowed)` naming the field to change. Parallelism rules follow
megatron-core 0.19.2 (`parallel_state.initialize_model_parallel`):
  * dense grid:  world % (tp * pp) == 0, dp = world / (tp * pp)            (no context parallelism here)
  * expert grid: world % (etp * ep * pp) == 0, i.e. ep * etp divides tp * dp; expert_dp = tp*dp/(ep*etp)
  * vpp needs pp > 1; sequence parallelism is a no-op at tp = 1; EP with TP needs SP.
Rules that need heads/experts/layers live in `layout.py`.
"""

from __future__ import annotations

import string
from typing import TYPE_CHECKING

from beamrl.recipe.errors import RecipeError
from beamrl.recipe.schema import DETERMINISTIC_ATTENTION_BACKENDS, REWARD_REF

if TYPE_CHECKING:
    from beamrl.recipe.schema import Recipe

# server_args keys that duplicate a first-class rollout field: set the field instead (one source of truth).
SERVER_ARGS_OWNED = {
    "tp_size": "rollout.engine_tp", "tp": "rollout.engine_tp",
    "mem_fraction_static": "rollout.mem_fraction",
    "attention_backend": "rollout.attention_backend",
    "swa_full_tokens_ratio": "rollout.swa_full_tokens_ratio",
    "enable_deterministic_inference": "rollout.deterministic",
    "enable_return_routed_experts": "rollout.return_routed_experts",
    "model_path": "model.checkpoint", "random_seed": "run.seed", "dtype": "model.dtype",
}


def check_recipe(r: "Recipe") -> None:
    """Raise `RecipeError` for the first broken cross-field rule."""
    _check_model(r)
    _check_placement(r)
    _check_gpu_counts(r)
    _check_trainer_parallelism(r)
    _check_batches(r)
    _check_rollout(r)
    _check_algorithm(r)
    _check_rewards(r)
    _check_data(r)


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


def _check_trainer_parallelism(r: "Recipe") -> None:
    tr = r.trainer
    if tr.num_gpus % (tr.tp * tr.pp):
        raise RecipeError("trainer.num_gpus", tr.num_gpus, f"must be a multiple of tp * pp = {tr.tp} * {tr.pp} "
                          f"= {tr.tp * tr.pp} (dp = num_gpus / (tp * pp))")
    if tr.etp != 1:
        raise RecipeError("trainer.etp", tr.etp, "Beam's trainer supports only 1 (whole experts per rank: the engine "
                          "rounds each expert's weighted down-projection once, which a TP-split expert cannot match); "
                          "scale experts with trainer.ep instead")
    expert_grid = tr.ep * tr.expert_tp * tr.pp
    if tr.num_gpus % expert_grid:
        raise RecipeError("trainer.ep", tr.ep, f"ep * etp = {tr.ep} * {tr.expert_tp} must divide tp * dp = "
                          f"{tr.tp * tr.dp} (Megatron: num_gpus={tr.num_gpus} divisible by etp*ep*pp={expert_grid})")
    if tr.vpp is not None and tr.pp < 2:
        raise RecipeError("trainer.vpp", tr.vpp, "interleaved pipelining needs trainer.pp >= 2; remove vpp")
    if tr.sp and tr.tp == 1:
        raise RecipeError("trainer.sp", True, "sequence parallelism shards over TP and does nothing at tp=1; set false")
    if tr.ep > 1 and tr.tp > 1 and not tr.sp:
        raise RecipeError("trainer.sp", False, "expert parallelism with tp > 1 requires sp: true (Megatron)")
    if tr.optimizer_offload_fraction > 0 and not tr.distributed_optimizer:
        raise RecipeError("trainer.optimizer_offload_fraction", tr.optimizer_offload_fraction,
                          "CPU offload of optimizer state needs trainer.distributed_optimizer: true")
    if r.cluster.device == "cpu":
        if tr.use_fused_kernels:
            raise RecipeError("trainer.use_fused_kernels", True, "fused kernels are GPU-only; set false on cluster.device=cpu")
        if tr.optimizer_offload_fraction > 0:
            raise RecipeError("trainer.optimizer_offload_fraction", tr.optimizer_offload_fraction,
                              "optimizer state is already in host memory on cluster.device=cpu; set 0")


def _check_batches(r: "Recipe") -> None:
    tr = r.trainer
    step = tr.micro_batch_size * tr.dp
    if tr.global_batch_size % step:
        raise RecipeError("trainer.global_batch_size", tr.global_batch_size,
                          f"must be a multiple of micro_batch_size * dp = {tr.micro_batch_size} * {tr.dp} = {step}")
    samples = r.rollout.samples_per_step
    if samples % tr.global_batch_size:
        raise RecipeError("trainer.global_batch_size", tr.global_batch_size,
                          f"must divide the rollout batch prompts_per_step * n_samples_per_prompt = "
                          f"{r.rollout.prompts_per_step} * {r.rollout.n_samples_per_prompt} = {samples} "
                          "(each rollout is split into whole optimizer steps)")
    if r.algorithm.advantage == "grpo" and r.rollout.n_samples_per_prompt < 2:
        raise RecipeError("rollout.n_samples_per_prompt", r.rollout.n_samples_per_prompt,
                          "GRPO computes advantages within a group: at least 2 samples per prompt")


def _check_rollout(r: "Recipe") -> None:
    ro = r.rollout
    if ro.top_k == 0 or ro.top_k < -1:
        raise RecipeError("rollout.top_k", ro.top_k, "-1 (off) or >= 1")
    for key in ro.server_args:
        if key in SERVER_ARGS_OWNED:
            raise RecipeError(f"rollout.server_args.{key}", ro.server_args[key],
                              f"set {SERVER_ARGS_OWNED[key]} instead (first-class field)")
    if ro.engine == "native":
        for path, value, ok in (("rollout.engine_tp", ro.engine_tp, ro.engine_tp == 1),
                                ("rollout.server_args", ro.server_args, not ro.server_args),
                                ("rollout.attention_backend", ro.attention_backend, ro.attention_backend is None),
                                ("rollout.deterministic", ro.deterministic, not ro.deterministic)):
            if not ok:
                raise RecipeError(path, value, "SGLang-only setting; the native engine takes none (engine_tp=1)")
    if ro.deterministic:
        if r.cluster.device == "cpu":
            raise RecipeError("rollout.deterministic", True, "SGLang refuses deterministic inference with the CPU "
                              "engine's torch_native attention; set false on cluster.device=cpu")
        if ro.attention_backend not in DETERMINISTIC_ATTENTION_BACKENDS:
            raise RecipeError("rollout.attention_backend", ro.attention_backend,
                              f"deterministic inference needs an explicit backend among "
                              f"{list(DETERMINISTIC_ATTENTION_BACKENDS)} (Beam's default trtllm_mha is not one)")
    if r.cluster.device == "cpu" and ro.attention_backend not in (None, "torch_native"):
        raise RecipeError("rollout.attention_backend", ro.attention_backend, "cluster.device=cpu allows only "
                          "null or 'torch_native'")


def _check_placement(r: "Recipe") -> None:
    p, tr = r.placement, r.sync.transport
    if p.off_policy_steps == 1:
        if p.mode != "disaggregated":
            raise RecipeError("placement.off_policy_steps", 1, "one-step-off needs placement.mode: disaggregated "
                              "(colocated engines and trainer cannot run at the same time)")
        if r.algorithm.importance.mode == "none":
            raise RecipeError("algorithm.importance.mode", "none", "off-policy training (placement.off_policy_steps=1) "
                              "needs an importance correction: 'tis' or 'mis'")
    if tr == "colocated" and p.mode != "colocated":
        raise RecipeError("sync.transport", tr, "'colocated' (in-place/IPC) needs placement.mode: colocated; use "
                          "'distributed' or 'disk'")
    if tr == "distributed" and p.mode != "disaggregated":
        raise RecipeError("sync.transport", tr, "'distributed' (NCCL broadcast) is for placement.mode: disaggregated; "
                          "use 'colocated' or 'disk'")
    # On cluster.device=cpu the distributed transport broadcasts over gloo (CI, laptops); NCCL on CUDA.


def _check_algorithm(r: "Recipe") -> None:
    a = r.algorithm
    if a.kl.coef > 0 and not a.kl.reference:
        raise RecipeError("algorithm.kl.reference", False, f"algorithm.kl.coef={a.kl.coef} > 0 needs a reference "
                          "policy; set reference: true (or coef: 0)")
    imp = a.importance
    if imp.mode == "tis":
        if imp.cap is None or imp.cap < 1:
            raise RecipeError("algorithm.importance.cap", imp.cap, "TIS truncates weights at cap: a number >= 1")
        for name in ("lo", "hi"):
            if getattr(imp, name) is not None:
                raise RecipeError(f"algorithm.importance.{name}", getattr(imp, name), "only used by mode 'mis'; remove it")
        if imp.level != "token":
            raise RecipeError("algorithm.importance.level", imp.level, "TIS is token-level; only mode 'mis' takes a level")
    elif imp.mode == "mis":
        if imp.lo is None or imp.hi is None or not imp.lo < 1 < imp.hi:
            raise RecipeError("algorithm.importance", {"lo": imp.lo, "hi": imp.hi},
                              "MIS masks tokens with weight outside [lo, hi]: need 0 <= lo < 1 < hi")
        if imp.cap is not None:
            raise RecipeError("algorithm.importance.cap", imp.cap, "only used by mode 'tis'; remove it")
    else:
        for name in ("cap", "lo", "hi"):
            if getattr(imp, name) is not None:
                raise RecipeError(f"algorithm.importance.{name}", getattr(imp, name),
                                  "importance.mode is 'none'; set mode 'tis' or 'mis', or remove it")
    if a.overlong.enabled and a.overlong.buffer >= r.rollout.max_new_tokens:
        raise RecipeError("algorithm.overlong.buffer", a.overlong.buffer,
                          f"must be smaller than rollout.max_new_tokens={r.rollout.max_new_tokens}")
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


def _check_data(r: "Recipe") -> None:
    d = r.data
    if d.format == "synthetic-addition":
        if d.source is not None:
            raise RecipeError("data.source", d.source, "format 'synthetic-addition' is generated in code; remove source")
    else:
        if d.source is None:
            raise RecipeError("data.source", None, f"format {d.format!r} needs a local jsonl/parquet path or a hub id")
        if d.synthetic is not None:
            raise RecipeError("data.synthetic", d.synthetic.model_dump(), "only used by format 'synthetic-addition'")
    if d.prompt_template is not None:
        if d.chat_template:
            raise RecipeError("data.prompt_template", d.prompt_template, "choose one of prompt_template and "
                              "chat_template: true")
        try:
            fields = {f for _, f, _, _ in string.Formatter().parse(d.prompt_template) if f is not None}
        except ValueError as e:
            raise RecipeError("data.prompt_template", d.prompt_template, f"not a valid format string ({e})") from None
        if fields != {"prompt"}:
            raise RecipeError("data.prompt_template", d.prompt_template,
                              f"must use exactly the placeholder {{prompt}}, found {sorted(fields)}")
    if d.chat_template and d.tokenizer == "digit":
        raise RecipeError("data.chat_template", True, "the built-in 'digit' tokenizer has no chat template")
