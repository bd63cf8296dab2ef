import pytest

from beamrl.models.beam import preset
from beamrl.recipe import RecipeError, apply_override, validate_recipe
from beamrl.recipe.layout import check_model_fit, plan_layout


def _recipe(raw, *overrides):
    for o in overrides:
        apply_override(raw, o)
    return validate_recipe(raw)


@pytest.mark.parametrize("overrides,model_changes,path,words", [
    (["trainer.tp=8", "trainer.ep=1", "trainer.global_batch_size=8"], {}, "trainer.tp", "head counts"),
    ([], {"num_experts": 6, "n_group": 2, "topk_group": 2, "num_experts_per_tok": 4}, "trainer.ep", "num_experts=6"),
    (["trainer.pp=4", "trainer.tp=1", "trainer.sp=false", "trainer.ep=2", "trainer.global_batch_size=16"], {},
     "trainer.pp", "num_hidden_layers=6"),
    (["trainer.pp=2", "trainer.vpp=2", "trainer.tp=1", "trainer.sp=false", "trainer.ep=1",
      "trainer.global_batch_size=16"], {}, "trainer.vpp", "6 / 2 = 3"),
    (["rollout.engine_tp=8", "rollout.num_engines=1"], {}, "rollout.engine_tp", "num_attention_heads"),
    ([], {"intermediate_size": 129}, "trainer.tp", "intermediate_size=129"),
    (["rollout.engine_tp=2", "rollout.num_engines=4", "trainer.sp=true"], {"moe_intermediate_size": 33},
     "rollout.engine_tp", "moe_intermediate_size=33"),
    (["rollout.engine_tp=2", "rollout.num_engines=4", "trainer.tp=1", "trainer.sp=false", "trainer.ep=1",
      "trainer.global_batch_size=16"], {"intermediate_size": 129}, "rollout.engine_tp", "intermediate_size=129"),
    (["rollout.max_new_tokens=5000"], {}, "rollout.max_new_tokens", "max_position_embeddings"),
    (["data.tokenizer=digit"], {"eos_token_id": 5, "vocab_size": 16}, "data.tokenizer", "eos"),
    (["data.tokenizer=digit"], {"vocab_size": 10}, "data.tokenizer", "vocab_size == 16"),
    (["data.tokenizer=digit"], {"vocab_size": 512}, "data.tokenizer", "config_overrides.vocab_size"),
])
def test_model_rules(base_raw, overrides, model_changes, path, words):
    r = _recipe(base_raw, *overrides)
    c = preset("tiny").replace(**model_changes)
    with pytest.raises(RecipeError) as e:
        check_model_fit(r, c)
    assert e.value.path == path, str(e.value)
    assert words in str(e.value)


def test_moe_with_tp_needs_sp(base_raw):
    r = _recipe(base_raw, "trainer.ep=1", "trainer.sp=false", "trainer.global_batch_size=8")
    with pytest.raises(RecipeError) as e:
        check_model_fit(r, preset("tiny"))
    assert e.value.path == "trainer.sp"


def test_dense_model_rules(base_raw):
    dense = preset("tiny").replace(mlp_layer_types=["dense"] * 6)
    with pytest.raises(RecipeError) as e:
        check_model_fit(_recipe(base_raw), dense)
    assert e.value.path == "trainer.ep"
    with pytest.raises(RecipeError) as e:
        check_model_fit(_recipe(base_raw, "trainer.ep=1", "trainer.global_batch_size=8",
                                "algorithm.routing_replay=true"), dense)
    assert e.value.path == "algorithm.routing_replay"
    # a LoRA target of a layer kind the model lacks would get no adapter
    with pytest.raises(RecipeError) as e:
        check_model_fit(_recipe(base_raw, "trainer.ep=1", "trainer.global_batch_size=8",
                                "algorithm.routing_replay=null", "rollout.return_routed_experts=null",
                                "trainer.lora={rank: 4, targets: [self_attn.q_proj, mlp.experts.up_proj]}"), dense)
    assert e.value.path == "trainer.lora.targets[1]" and "no MoE layers" in str(e.value)


def test_routing_replay_on_by_default_needs_the_engines_routes(base_raw):
    """routing_replay null is on for a MoE model: with return_routed_experts false it failed at the first step."""
    with pytest.raises(RecipeError) as e:
        check_model_fit(_recipe(base_raw, "algorithm.routing_replay=null", "rollout.return_routed_experts=false"),
                        preset("tiny"))
    assert e.value.path == "rollout.return_routed_experts" and "null is on" in str(e.value)


def test_engine_kv_heads(base_raw):
    # engine TP 6 divides Beam's 48 heads but not its 8 KV heads, and 6 is no multiple of 8 -> refused
    r = _recipe(base_raw, "cluster.gpus_per_node=6", "rollout.engine_tp=6", "rollout.num_engines=1",
                "trainer.num_gpus=6", "trainer.tp=2", "trainer.ep=1", "trainer.global_batch_size=12",
                "rollout.prompts_per_step=6")
    with pytest.raises(RecipeError) as e:
        check_model_fit(r, preset("beam-501b"))
    assert e.value.path == "rollout.engine_tp" and "KV heads" in str(e.value)


def test_plan_layout(base_raw):
    lay = plan_layout(_recipe(base_raw), preset("tiny"))
    assert (lay.tp, lay.dp, lay.ep, lay.etp, lay.expert_dp) == (2, 4, 4, 1, 2)
    assert lay.micro_batches_per_optimizer_step == 4 and lay.optimizer_steps_per_rollout == 2
    assert lay.rollout_gpus == 8 and lay.nodes_per_engine == 0.5


def test_grpo_dapo_math_layout():
    from beamrl.recipe import load_recipe

    r = load_recipe("grpo_dapo_math")
    lay = plan_layout(r, preset("beam-501b"))
    assert (lay.trainer_gpus, lay.tp, lay.sp, lay.ep, lay.etp, lay.pp, lay.dp) == (64, 8, True, 64, 1, 1, 8)
    assert (lay.num_engines, lay.engine_tp, lay.nodes_per_engine, lay.rollout_gpus) == (2, 16, 2, 32)
    assert lay.trainer_gpus + lay.rollout_gpus == 96


def test_model_spec_errors(base_raw, tmp_path):
    from beamrl.recipe.model_spec import model_config_if_available, require_model_config

    with pytest.raises(RecipeError) as e:
        model_config_if_available(_recipe(base_raw, "model.preset=huge"))
    assert e.value.path == "model.preset" and "beam-501b" in str(e.value)
    bad = tmp_path / "ckpt"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "beam", "num_hidden_layers": -1}')
    r = _recipe(base_raw, "model.preset=tiny", f"model.checkpoint={bad}", "model.seed=null")
    with pytest.raises(RecipeError) as e:
        model_config_if_available(r)
    assert e.value.path == "model.checkpoint" and "num_hidden_layers" in str(e.value)
    r = _recipe(base_raw, f"model.checkpoint={tmp_path / 'not-mounted'}", "model.preset=null")
    with pytest.raises(RecipeError) as e:
        require_model_config(r)
    assert e.value.path == "model.checkpoint" and "not found on this machine" in str(e.value)


def test_config_overrides(base_raw):
    from beamrl.recipe.model_spec import model_config_if_available

    r = _recipe(base_raw, "model.config_overrides={vocab_size: 16, pad_token_id: 1}")
    c = model_config_if_available(r)
    assert (c.vocab_size, c.pad_token_id, c.hidden_size) == (16, 1, preset("tiny").hidden_size)
    with pytest.raises(RecipeError) as e:
        model_config_if_available(_recipe(base_raw, "model.config_overrides={vocab_sise: 15}"))
    assert e.value.path == "model.config_overrides.vocab_sise" and "vocab_size" in str(e.value)
    with pytest.raises(RecipeError) as e:
        model_config_if_available(_recipe(base_raw, "model.config_overrides={head_dim: 15}"))
    assert e.value.path == "model.config_overrides.head_dim" and "even" in str(e.value)
