"""Every cross-field rule of rules.py: break one field, expect a RecipeError naming it."""

import pytest

from beamrl.recipe import RecipeError, apply_override, validate_recipe

CASES = [
    # (overrides, error path, words in the message)
    (["model.preset=null"], "model", "model.checkpoint"),
    (["model.checkpoint=/ckpt"], "model.seed", "random init"),
    (["model.seed=null"], "model.seed", "explicit integer seed"),
    (["model.checkpoint=/ckpt", "model.seed=null", "model.config_overrides={vocab_size: 16}"],
     "model.config_overrides", "random init"),
    (["trainer.num_gpus=16"], "trainer.num_gpus", "add up to the cluster"),
    (["placement.mode=colocated", "sync.transport=colocated"], "trainer.num_gpus", "every GPU"),
    (["placement.mode=colocated", "sync.transport=colocated", "trainer.num_gpus=16", "trainer.global_batch_size=32"],
     "rollout.num_engines", "same GPUs"),
    (["rollout.engine_tp=3", "rollout.num_engines=4", "trainer.num_gpus=4"], "rollout.engine_tp", "divide"),
    (["rollout.engine_tp=12", "rollout.num_engines=1", "trainer.num_gpus=4", "trainer.global_batch_size=8"],
     "rollout.engine_tp", "whole nodes"),
    (["trainer.tp=3"], "trainer.num_gpus", "tp * pp"),
    (["trainer.ep=16"], "trainer.ep", "must divide tp * dp"),
    (["trainer.etp=2", "trainer.ep=2"], "trainer.etp", "supports only 1"),
    (["trainer.vpp=2"], "trainer.vpp", "pp >= 2"),
    (["trainer.tp=1", "trainer.ep=1", "trainer.global_batch_size=32"], "trainer.sp", "tp=1"),
    (["trainer.sp=false"], "trainer.sp", "requires sp"),
    (["trainer.distributed_optimizer=false", "trainer.optimizer_offload_fraction=0.5"],
     "trainer.optimizer_offload_fraction", "distributed_optimizer"),
    (["trainer.global_batch_size=6"], "trainer.global_batch_size", "micro_batch_size * dp"),
    (["trainer.global_batch_size=24"], "trainer.global_batch_size", "prompts_per_step * n_samples_per_prompt"),
    (["rollout.n_samples_per_prompt=1", "trainer.global_batch_size=8"], "rollout.n_samples_per_prompt", "group"),
    (["rollout.top_k=0"], "rollout.top_k", "-1"),
    # settings that would have no effect, named at load
    (["trainer.global_batch_size=32", "algorithm.eps_clip_high=0.28"], "algorithm.eps_clip_high",
     "one optimizer step per rollout"),
    (["algorithm.routing_replay=false", "rollout.return_routed_experts=true"], "rollout.return_routed_experts",
     "routing_replay"),
    (["trainer.main_grads_dtype=bf16", "model.dtype=float32"], "trainer.main_grads_dtype", "model.dtype"),
    (["algorithm.overlong={enabled: true, penalty: 0}"], "algorithm.overlong.penalty", "no effect"),
    (["sft={steps: 2, lr: 0.001, batch: 2}"], "sft.batch", "data-parallel rank"),
    (["rollout.server_args={mem_fraction_static: 0.5}"], "rollout.server_args.mem_fraction_static",
     "rollout.mem_fraction"),
    # the placement arguments come from the plan and the run's API key, one set per engine process
    (["rollout.server_args={nnodes: 2}"], "rollout.server_args.nnodes", "placement plan"),
    (["rollout.server_args={api_key: k}"], "rollout.server_args.api_key", "placement plan"),
    # SGLang's own parser, at load: a key this SGLang does not know, a value it refuses
    (["rollout.server_args={cuda_graph_bs: [1, 2]}"], "rollout.server_args.cuda_graph_bs", "not an SGLang"),
    (["rollout.server_args={context_length: lots}"], "rollout.server_args.context_length", "refuses"),
    # another spelling of a field: it would slip past the checks above, which look at field names
    (["rollout.server_args={tensor_parallel_size: 2}"], "rollout.server_args.tensor_parallel_size", "tp_size"),
    (["rollout.server_args={nccl_init_addr: 'h:1'}"], "rollout.server_args.nccl_init_addr", "dist_init_addr"),
    (["rollout.server_args={model: /x}"], "rollout.server_args.model", "model_path"),
    # a value SGLang's command line cannot say (this flag's default is None; leaving it out is not False)
    (["rollout.server_args={enable_lora: false}"], "rollout.server_args.enable_lora", "cannot be said"),
    # what beamrl sets for every engine, named at load (it failed at engine start)
    (["rollout.server_args={log_level: info}"], "rollout.server_args.log_level", "beamrl sets it"),
    (["rollout.server_args={device: cuda}"], "rollout.server_args.device", "cluster.device"),
    (["trainer.lora={rank: 4}", "rollout.server_args={json_model_override_args: '{}'}"],
     "rollout.server_args.json_model_override_args", "trainer.lora"),
    (["rollout.deterministic=true"], "rollout.attention_backend", "fa3"),
    (["rollout.deterministic=true", "rollout.attention_backend=trtllm_mha"], "rollout.attention_backend", "fa3"),
    (["rollout.engine=native"], "rollout.engine_tp", "native engine"),
    (["placement.off_policy_steps=1"], "algorithm.importance.mode", "tis"),
    (["placement.mode=colocated", "placement.off_policy_steps=1"], "placement.off_policy_steps", "disaggregated"),
    (["sync.transport=colocated"], "sync.transport", "colocated"),
    (["trainer.sleep_during_rollout=true"], "trainer.sleep_during_rollout", "colocated engines"),
    (["placement.mode=colocated", "trainer.num_gpus=16", "rollout.num_engines=4", "trainer.global_batch_size=32"],
     "sync.transport", "disaggregated"),
    (["rollout.engine=native", "rollout.engine_tp=1", "rollout.num_engines=8", "rollout.server_args={x: 1}"],
     "rollout.server_args", "native engine"),
    (["algorithm.kl.coef=0.1"], "algorithm.kl.reference", "reference"),
    (["algorithm.importance.mode=tis"], "algorithm.importance.cap", ">= 1"),
    (["algorithm.importance={mode: tis, cap: 2, lo: 0.5}"], "algorithm.importance.lo", "mis"),
    (["algorithm.importance={mode: tis, cap: 2, level: sequence}"], "algorithm.importance.level", "token"),
    (["algorithm.importance={mode: mis, lo: 1.5, hi: 2}"], "algorithm.importance.lo", "lo < 1 < hi"),
    (["algorithm.importance={mode: mis, lo: 0.5, hi: 0.9}"], "algorithm.importance.hi", "lo < 1 < hi"),
    (["algorithm.importance={mode: mis, lo: 0.5, hi: 2, cap: 2}"], "algorithm.importance.cap", "tis"),
    (["algorithm.importance.cap=2"], "algorithm.importance.cap", "none"),
    (["algorithm.importance.lo=0.5"], "algorithm.importance.lo", "none"),
    (["algorithm.importance.level=sequence"], "algorithm.importance.level", "none"),
    (["algorithm.overlong={enabled: true, buffer: 64}"], "algorithm.overlong.buffer", "max_new_tokens"),
    (["algorithm.routing_replay=true", "rollout.return_routed_experts=false"], "rollout.return_routed_experts",
     "routing_replay"),
    (["rewards.0.fn='pkg module:f'"], "rewards[0].fn", "package.module:function"),
    (["rewards=[{name: a, fn: 'm:f'}, {name: a, fn: 'm:g'}]"], "rewards[1].name", "unique"),
    (["rewards.0.timeout_s=1000"], "rewards[0].timeout_s", "reward_pool.batch_timeout_s"),
    (["rewards.0.weight=0"], "rewards", "non-zero"),
    (["data.source=null"], "data.source", "jsonl/parquet"),
    (["data.format=synthetic-addition"], "data.source", "remove source"),
    (["data.synthetic={num_samples: 4}"], "data.synthetic", "synthetic-addition"),
    (["data.prompt_template='Q: {question}'"], "data.prompt_template", "{prompt}"),
    (["data.prompt_template='Q: {prompt}'", "data.chat_template=true"], "data.prompt_template", "chat_template"),
    (["data.tokenizer=digit", "data.chat_template=true"], "data.chat_template", "chat template"),
]

CPU_CASES = [
    (["trainer.distributed_optimizer=true", "trainer.optimizer_offload_fraction=0.5"],
     "trainer.optimizer_offload_fraction", "host memory"),
    (["trainer.use_fused_kernels=true"], "trainer.use_fused_kernels", "GPU-only"),
    (["sync.transport=disk", "rollout.engine=sglang", "rollout.deterministic=true", "rollout.attention_backend=fa3"],
     "rollout.deterministic", "CPU engine"),
    (["rollout.engine=sglang", "rollout.attention_backend=fa3"], "rollout.attention_backend", "cpu"),
    (["rollout.engine=sglang", "rollout.mem_fraction=0.5"], "rollout.mem_fraction", "CPU engine"),
    (["rollout.engine=sglang", "rollout.swa_full_tokens_ratio=0.5"], "rollout.swa_full_tokens_ratio", "CPU engine"),
    (["rollout.mem_fraction=0.5"], "rollout.mem_fraction", "native engine"),  # the native engine sizes nothing
    (["cluster.gpu_type=b200"], "cluster.gpu_type", "no effect"),
    (["data.split=test"], "data.split", "synthetic-addition"),
    # the CPU engine is built from its own settings: server_args would be dropped without a word
    (["rollout.engine=sglang", "rollout.server_args={context_length: 64}"], "rollout.server_args", "ignore"),
]


def _broken(raw, overrides):
    for o in overrides:
        apply_override(raw, o)
    with pytest.raises(RecipeError) as e:
        validate_recipe(raw)
    return e.value


@pytest.mark.parametrize("overrides,path,words", CASES, ids=[",".join(c[0]) for c in CASES])
def test_rule(base_raw, overrides, path, words):
    err = _broken(base_raw, overrides)
    assert err.path == path, str(err)
    assert words in str(err)


CPU_BASE = {
    "run": {"name": "cpu", "num_steps": 1}, "model": {"preset": "tiny", "seed": 0}, "cluster": {"device": "cpu",
    "gpus_per_node": 1}, "trainer": {"num_gpus": 1, "global_batch_size": 8, "lr": 1e-3},
    "rollout": {"engine": "native", "max_new_tokens": 3, "n_samples_per_prompt": 2, "prompts_per_step": 4},
    "rewards": [{"name": "r", "fn": "m:f"}], "data": {"format": "synthetic-addition", "max_prompt_len": 8},
}


@pytest.mark.parametrize("overrides,path,words", CPU_CASES, ids=[",".join(c[0]) for c in CPU_CASES])
def test_cpu_rule(overrides, path, words):
    import copy

    err = _broken(copy.deepcopy(CPU_BASE), overrides)
    assert err.path == path, str(err)
    assert words in str(err)


def test_cpu_base_valid():
    import copy

    validate_recipe(copy.deepcopy(CPU_BASE))


@pytest.mark.parametrize("extra,path_in_message", [
    ([], "trainer.global_batch_size = 64 gives 1"),
    (["trainer.micro_batch_size=32", "sft.batch=32"], "sft.batch = 32 gives 1"),
])
def test_vpp_needs_pp_micro_batches_per_rank_in_every_step(tmp_path, extra, path_in_message):
    """The interleaved schedule refuses fewer than pp micro-batches per DP rank; the recipe said OK and the run
    failed at its first train step, naming no field."""
    from beamrl.recipe import load_recipe

    layout = ["cluster.gpus_per_node=2", "trainer.num_gpus=2", "rollout.num_engines=2", "trainer.pp=2",
              "trainer.vpp=3", f"run.output_dir={tmp_path}"]
    with pytest.raises(RecipeError) as e:
        load_recipe("quickstart", layout + extra)
    assert e.value.path == "trainer.micro_batch_size" and path_in_message in str(e.value), str(e.value)
    load_recipe("quickstart", layout + ["trainer.micro_batch_size=32"])  # 2 per rank: launchable


def test_a_reward_timeout_equal_to_the_batch_limit_is_accepted(base_raw):
    """rewards[i].timeout_s may equal reward_pool.batch_timeout_s ("must not exceed"); only above it is refused."""
    for o in ("rewards.0.timeout_s=30", "reward_pool.batch_timeout_s=30"):
        apply_override(base_raw, o)
    r = validate_recipe(base_raw)
    assert r.rewards[0].timeout_s == r.reward_pool.batch_timeout_s == 30


def test_one_zero_weight_reward_beside_a_weighted_one_is_accepted(base_raw):
    """Only rewards that are all weight 0 are refused: a zero-weight component next to a weighted one is fine."""
    apply_override(base_raw, "rewards=[{name: a, fn: 'm:f', weight: 0}, {name: b, fn: 'm:g', weight: 1}]")
    assert [c.weight for c in validate_recipe(base_raw).rewards] == [0, 1]
    apply_override(base_raw, "rewards.1.weight=0")
    with pytest.raises(RecipeError) as e:
        validate_recipe(base_raw)
    assert e.value.path == "rewards" and "non-zero" in str(e.value)
