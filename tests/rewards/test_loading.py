import sys

import pytest

from beamrl.rewards import FIELDS, REWARDS, RewardLoadError, load_reward_fn, reward

from . import sample_reward_fns as fns

M = fns.__name__  # "rewards.sample_reward_fns" (or "tests.rewards..." if tests/ becomes a package)


def test_only_requested_fields_are_injected():
    f = load_reward_fn(f"{M}:only_completion")
    assert f.params == ("completion",) and f.required == ("completion",) and not f.var_kwargs
    fields = {name: f"<{name}>" for name in FIELDS}
    assert f.call_kwargs(fields, {}) == {"completion": "<completion>"}


def test_var_kwargs_gets_every_field_and_component_kwarg():
    f = load_reward_fn(f"{M}:sees", kwarg_names=["scale"])
    got = f.call_kwargs({name: 0 for name in FIELDS}, {"scale": 2})
    assert set(got) == set(FIELDS) | {"scale"}


def test_missing_required_parameter_fails_at_load_naming_function_and_parameter():
    with pytest.raises(RewardLoadError, match=r"requires_answer.*requires parameter 'answer'"):
        load_reward_fn(f"{M}:requires_answer")
    # ... and a component kwarg of that name satisfies it
    assert load_reward_fn(f"{M}:requires_answer", kwarg_names=["answer"]).params == ("completion", "answer")
    # optional parameters that nothing provides keep their default (not passed)
    f = load_reward_fn(f"{M}:optional_answer")
    assert f.params == ("completion",)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_such_pkg_xyz.mod:fn", r"cannot import module 'no_such_pkg_xyz.mod'"),
        (f"{M}:missing_fn", rf"module '{M}' has no attribute 'missing_fn'"),
        (f"{M}:not_callable", r"resolves to a int, which is not callable"),
        ("pkg.mod:", r"must look like 'pkg.module:function'"),
        ("definitely_not_registered", r"unknown reward 'definitely_not_registered'.*known names: .*dapo_math"),
        ("", r"non-empty"),
    ],
)
def test_import_path_errors_are_clear(spec, message):
    with pytest.raises(RewardLoadError, match=message):
        load_reward_fn(spec)


def test_local_functions_are_refused():
    def local(completion):
        return 1.0

    name = f"tests.local_fn.{id(local)}"  # unique: the registry is process-global
    reward(name)(local)  # registered, but workers could never import it by name
    with pytest.raises(RewardLoadError, match="top level"):
        load_reward_fn(name)


def test_decorator_registry_resolves_to_an_importable_ref():
    f = load_reward_fn("tests.registered_len")
    assert REWARDS.get("tests.registered_len") is fns.registered_len
    assert f.ref == f"{M}:registered_len"
    builtin = load_reward_fn("exact_match")
    assert builtin.ref == "beamrl.rewards.exact:exact_match"


def test_entry_point_group(tmp_path, monkeypatch):
    dist = tmp_path / "fake_reward_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-reward-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[beamrl.rewards]\nplugin_len = {M}:needs_completion\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    f = load_reward_fn("plugin_len")
    assert f.ref == f"{M}:needs_completion" and f.params == ("completion",)


def test_async_is_detected():
    assert load_reward_fn(f"{M}:async_len").is_async
    assert not load_reward_fn(f"{M}:only_completion").is_async


def test_a_name_a_module_registers_is_found_through_the_module(tmp_path, monkeypatch):
    """`module:name` imports the module (which runs its @reward decorators), then takes its attribute `name`
    or, failing that, the function it registered as `name`; a bare name needs the module imported first."""
    (tmp_path / "cwd_registering_rewards.py").write_text(
        "from beamrl.rewards import reward\n\n"
        "@reward('cwd-digit-match')\n"
        "def digit_match(completion, ground_truth):\n"
        "    return float(completion.strip() == str(ground_truth))\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    with pytest.raises(RewardLoadError, match="cannot import module 'cwd_registering_rewards'.*working directory"):
        load_reward_fn("cwd_registering_rewards:cwd-digit-match")
    from beamrl.rewards.loading import importable_working_directory

    importable_working_directory()
    with pytest.raises(RewardLoadError, match="unknown reward 'cwd-digit-match'.*'your_module:cwd-digit-match'"):
        load_reward_fn("cwd-digit-match")  # the module was never imported: nothing registered that name yet
    f = load_reward_fn("cwd_registering_rewards:cwd-digit-match")
    assert f.ref == "cwd_registering_rewards:digit_match" and f.params == ("completion", "ground_truth")
    assert load_reward_fn("cwd_registering_rewards:digit_match").ref == "cwd_registering_rewards:digit_match"
    assert load_reward_fn("cwd-digit-match").ref == f.ref  # once imported, the bare name works too
    with pytest.raises(RewardLoadError, match="has no attribute 'exact_match'"):
        load_reward_fn("cwd_registering_rewards:exact_match")  # registered, but by another module


def test_a_kwarg_the_function_does_not_take_is_refused_naming_it_and_the_parameters():
    """A misspelt kwarg used to be dropped at every call, leaving the function's default in force."""
    from beamrl.rewards.loading import RewardKwargsError

    with pytest.raises(RewardKwargsError, match=r"no parameter 'incorect_score'.*correct_score, incorrect_score"):
        load_reward_fn("beamrl.rewards.math:dapo_math", ["incorect_score"])
    assert load_reward_fn("beamrl.rewards.math:dapo_math", ["incorrect_score"]).params[-1] == "incorrect_score"
    assert load_reward_fn(f"{M}:with_scale", ["scale"]).params == ("completion", "scale")


def test_the_recipe_names_the_component_kwargs(tmp_path):
    from beamrl.recipe import load_recipe
    from beamrl.recipe.errors import RecipeError
    from beamrl.recipe.preflight import load_reward_functions

    r = load_recipe("quickstart", [f"run.output_dir={tmp_path}", "rewards.0.fn=beamrl.rewards.math:dapo_math",
                                   "rewards.0.kwargs={incorect_score: -1.0}"])
    with pytest.raises(RecipeError, match=r"rewards\[0\]\.kwargs.*incorect_score"):
        load_reward_functions(r)
