import yaml
import pytest

from beamrl.recipe import RecipeError, validate_recipe
from beamrl.recipe.schema import Recipe


def test_base_recipe_is_valid(base_raw):
    r = validate_recipe(base_raw)
    assert r.trainer.dp == 4 and r.trainer.etp == 1 and r.rollout.num_gpus == 8


def test_to_yaml_round_trip(base_raw):
    r = validate_recipe(base_raw)
    again = validate_recipe(yaml.safe_load(r.to_yaml()))
    assert again == r
    assert again.to_yaml() == r.to_yaml()


@pytest.mark.parametrize("section,key", [("trainer", "tensor_parallel"), ("rollout", "engine_tpp"), ("run", "steps")])
def test_unknown_field_names_path_and_valid_keys(base_raw, section, key):
    base_raw[section][key] = 1
    with pytest.raises(RecipeError) as e:
        validate_recipe(base_raw)
    assert e.value.path == f"{section}.{key}"
    assert "valid keys at " + section in str(e.value)
    assert sorted(Recipe.model_fields[section].annotation.model_fields)[0] in str(e.value)


def test_unknown_nested_field(base_raw):
    base_raw["algorithm"] = {"kl": {"coeff": 0.1}}
    with pytest.raises(RecipeError) as e:
        validate_recipe(base_raw)
    assert e.value.path == "algorithm.kl.coeff" and "'coef'" in str(e.value)


def test_unknown_field_in_list_item(base_raw):
    base_raw["rewards"][0]["wieght"] = 2
    with pytest.raises(RecipeError) as e:
        validate_recipe(base_raw)
    assert e.value.path == "rewards[0].wieght" and "weight" in str(e.value)


def test_bad_literal_names_field_and_allowed(base_raw):
    base_raw["trainer"]["recompute"] = "selective"
    with pytest.raises(RecipeError) as e:
        validate_recipe(base_raw)
    assert e.value.path == "trainer.recompute" and "'none'" in str(e.value) and "'full'" in str(e.value)


def test_missing_required_field(base_raw):
    del base_raw["trainer"]["lr"]
    with pytest.raises(RecipeError) as e:
        validate_recipe(base_raw)
    assert e.value.path == "trainer.lr" and "missing" in str(e.value)


def test_wrong_type(base_raw):
    base_raw["trainer"]["tp"] = "two"
    with pytest.raises(RecipeError) as e:
        validate_recipe(base_raw)
    assert e.value.path == "trainer.tp"


@pytest.mark.parametrize("section, key, value", [("timeouts", "sync_s", float("inf")),
                                                 ("rollout", "health_check_interval_s", float("inf")),
                                                 ("trainer", "lr", float("nan"))])
def test_no_float_field_takes_inf_or_nan(base_raw, section, key, value):
    base_raw.setdefault(section, {})[key] = value  # YAML's .inf / .nan
    with pytest.raises(RecipeError) as e:
        validate_recipe(base_raw)
    assert e.value.path == f"{section}.{key}" and "finite" in str(e.value)


def test_reward_sections_are_the_reward_packages_own_configs(base_raw):
    """No mirror: the recipe's `rewards` items and `reward_pool` are beamrl.rewards' config classes, so a
    field added there is a recipe field with the same name."""
    from beamrl.rewards.config import RewardComponentConfig, RewardPoolConfig

    r = validate_recipe(base_raw)
    assert type(r.rewards[0]) is RewardComponentConfig and type(r.reward_pool) is RewardPoolConfig
    base_raw["reward_pool"] = {"num_workers": 0}
    with pytest.raises(RecipeError) as e:
        validate_recipe(base_raw)
    assert e.value.path == "reward_pool.num_workers"
    del base_raw["reward_pool"]
    base_raw["rewards"][0]["kwargs"] = {"completion": 1}
    with pytest.raises(RecipeError) as e:
        validate_recipe(base_raw)
    assert e.value.path == "rewards[0].kwargs" and "shadow" in str(e.value)


def test_moved_reward_timeout_names_its_new_place(base_raw):
    base_raw["timeouts"] = {"reward_s": 60}
    with pytest.raises(RecipeError) as e:
        validate_recipe(base_raw)
    assert "reward_pool.batch_timeout_s" in str(e.value)


def test_an_override_of_a_moved_field_names_its_new_place_too():
    """Before, only a recipe file got the hint: the override said "unknown field 'reward_s'" and listed the keys."""
    from beamrl.recipe import load_recipe

    with pytest.raises(RecipeError) as e:
        load_recipe("quickstart", ["timeouts.reward_s=3"])
    assert e.value.path == "timeouts.reward_s" and "moved to reward_pool.batch_timeout_s" in str(e.value)
