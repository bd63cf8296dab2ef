import pytest
import yaml

from beamrl.recipe import RecipeError, apply_override, load_recipe, resolve_recipe_path, shipped_recipes


@pytest.fixture
def recipe_file(tmp_path, base_raw):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(base_raw))
    return path


def test_load_with_overrides(recipe_file):
    r = load_recipe(recipe_file, ["trainer.lr=3e-6", "rollout.server_args.chunked_prefill_size=4096",
                                  "rewards.0.weight=0.5", "data.synthetic.seed=3", "data.format=synthetic-addition",
                                  "data.source=null"])
    assert r.trainer.lr == 3e-6 and r.rewards[0].weight == 0.5
    assert r.rollout.server_args == {"chunked_prefill_size": 4096}
    assert r.data.synthetic.seed == 3 and r.data.synthetic.num_samples == 1000


def test_override_defaulted_section(recipe_file):
    r = load_recipe(recipe_file, ["logging.wandb.mode=online", "algorithm.kl={coef: 0.1, reference: true}"])
    assert r.logging.wandb.mode == "online" and r.algorithm.kl.coef == 0.1


@pytest.mark.parametrize("item,path,listed", [
    ("trainer.learning_rate=1", "trainer.learning_rate", "'lr'"),
    ("trainers.lr=1", "trainers.lr", "'trainer'"),
    ("algorithm.kl.coeff=1", "algorithm.kl.coeff", "'coef'"),
])
def test_unknown_override_path_lists_valid_keys(base_raw, item, path, listed):
    with pytest.raises(RecipeError) as e:
        apply_override(base_raw, item)
    assert e.value.path == path and "valid keys" in str(e.value) and listed in str(e.value)


def test_override_errors(base_raw):
    with pytest.raises(RecipeError, match="key.path=value"):
        apply_override(base_raw, "trainer.lr")
    with pytest.raises(RecipeError, match="use an index 0..0"):
        apply_override(base_raw, "rewards.3.weight=1")
    with pytest.raises(RecipeError, match="is a value, not a section"):
        apply_override(base_raw, "trainer.lr.x=1")


def test_an_override_one_past_the_last_list_entry_is_a_recipe_error(base_raw):
    """Index len(list) is out of range too: a RecipeError naming the valid indices, not an IndexError."""
    assert len(base_raw["rewards"]) == 1
    with pytest.raises(RecipeError, match=r"use an index 0\.\.0") as e:
        apply_override(base_raw, "rewards.1.weight=1")
    assert e.value.path == "rewards.1.weight"


def test_override_is_validated(recipe_file):
    with pytest.raises(RecipeError) as e:
        load_recipe(recipe_file, ["trainer.tp=3"])
    assert e.value.path == "trainer.num_gpus"


def test_missing_file_and_shipped_names(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_recipe(tmp_path / "nope.yaml")
    assert {"quickstart", "grpo_dapo_math"} <= set(shipped_recipes())
    assert resolve_recipe_path("quickstart").name == "quickstart.yaml"


def test_bad_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(bad)
    bad.write_text("- a\n- b\n")
    with pytest.raises(RecipeError, match="mapping"):
        load_recipe(bad)


def test_model_rules_run_at_load(recipe_file):
    # tiny has 4 attention heads: tp=8 is refused only with the model config (not by the schema rules)
    with pytest.raises(RecipeError) as e:
        load_recipe(recipe_file, ["trainer.tp=8", "trainer.ep=1", "trainer.global_batch_size=8",
                                  "trainer.num_gpus=8"])
    assert e.value.path == "trainer.tp" and "num_attention_heads=4" in str(e.value)
    load_recipe(recipe_file, ["trainer.tp=8", "trainer.ep=1", "trainer.global_batch_size=8"], check_model=False)


def test_checkpoint_config_must_match_preset(tmp_path, recipe_file):
    from beamrl.models.beam import preset

    ckpt = tmp_path / "ckpt"
    preset("tiny").replace(num_hidden_layers=4, layer_types=None, mlp_layer_types=None).save(ckpt)
    with pytest.raises(RecipeError) as e:
        load_recipe(recipe_file, [f"model.checkpoint={ckpt}", "model.seed=null"])
    assert e.value.path == "model.preset" and "num_hidden_layers" in str(e.value)
    r = load_recipe(recipe_file, [f"model.checkpoint={ckpt}", "model.seed=null", "model.preset=null"])
    assert r.model.checkpoint == str(ckpt)


@pytest.mark.parametrize("name", ["quickstart", "grpo_dapo_math"])
def test_shipped_recipes_load_and_round_trip(name):
    r = load_recipe(name)
    assert r.to_yaml() == load_recipe(name).to_yaml()
    from beamrl.recipe import validate_recipe

    assert validate_recipe(yaml.safe_load(r.to_yaml())) == r
