"""`cli_args`: recipe values as SGLang 0.5.23's own parser takes them, and the keys it names."""

import argparse
import os
import subprocess
import sys

import pytest

from beamrl.rollout.sglang import cli_args
from beamrl.rollout.sglang.config import PLACEMENT_ARGS
from beamrl.rollout.config import SERVER_ARGS_FIXED, SERVER_ARGS_OWNED


def test_false_reaches_sglang_for_a_flag_pair_and_a_plain_flag():
    # --x/--no-x whose default is None: False must say --no-x (was: nothing, which SGLang reads as None)
    assert cli_args.render("enable_tf32_matmul", False) == ["--no-enable-tf32-matmul"]
    assert cli_args.parse("enable_tf32_matmul", False) is False
    assert cli_args.parse("enable_tf32_matmul", True) is True
    # a store_true flag whose default is False: False is its default, said by leaving it out
    assert cli_args.render("disable_radix_cache", False) == []
    assert cli_args.parse("disable_radix_cache", True) is True


def test_a_value_the_command_line_cannot_say_is_refused():
    with pytest.raises(ValueError, match="cannot be said"):  # --enable-lora can set True; its default is None
        cli_args.render("enable_lora", False)
    with pytest.raises(ValueError, match="cannot be said"):
        cli_args.render("disable_radix_cache", 1)  # not a bool: neither the constant nor the default


@pytest.mark.parametrize("alias, field", [("tensor_parallel_size", "tp_size"), ("ep", "ep_size"),
                                          ("model", "model_path"), ("nccl_init_addr", "dist_init_addr")])
def test_another_spelling_of_a_field_is_refused_naming_the_field(alias, field):
    with pytest.raises(ValueError, match=f"write {field}"):
        cli_args.parse(alias, 2)


def test_an_option_whose_flag_differs_from_its_field_is_written_as_sglang_spells_it():
    assert cli_args.render("fp8_gemm_runner_backend", "auto")[0] == "--fp8-gemm-backend"
    assert cli_args.parse("fp8_gemm_runner_backend", "auto") == "auto"


def test_list_items_that_are_dicts_are_written_as_json():
    """SGLang's --lora-paths takes `name=path` items or JSON objects (was: a dict item became Python's repr)."""
    items = [{"lora_name": "a", "lora_path": "/p"}, "b=/q"]
    assert cli_args.render("lora_paths", items)[1] == '{"lora_name": "a", "lora_path": "/p"}'
    assert cli_args.parse("lora_paths", items) == items


def test_every_argument_beamrl_sets_on_a_gpu_engine_is_refused_in_server_args_at_load():
    """The engine config refuses server_args that override what beamrl sets (at engine start); the recipe's rules
    must name each such key at load. (json_model_override_args: the LoRA rule in recipe/rules.py.)"""
    from beamrl.models.beam.lora_config import LoRAConfig
    from beamrl.rollout.sglang.config import SGLangEngineConfig

    cfg = SGLangEngineConfig(model_path="/x", engine_tp=2, attention_backend="fa3", nnodes=2, node_rank=0,
                             dist_init_addr="h:1", base_gpu_id=1, api_key="k", host="10.0.0.1", lora=LoRAConfig())
    set_by_beamrl = set(cfg._modelled_kwargs()) - {"json_model_override_args"}
    guarded = set(SERVER_ARGS_OWNED) | set(SERVER_ARGS_FIXED) | set(PLACEMENT_ARGS)
    assert set_by_beamrl <= guarded, set_by_beamrl - guarded


def test_every_key_beamrl_guards_is_an_sglang_field_name():
    """The placement and first-class-field checks compare field names: a name that is not one guards nothing."""
    _, by_dest, _ = cli_args._sglang_parser()
    assert set(PLACEMENT_ARGS) | set(SERVER_ARGS_OWNED) | set(SERVER_ARGS_FIXED) <= set(by_dest)


def test_checking_server_args_leaves_the_environment_as_it_was():
    """Importing sglang sets cache-folder variables; a recipe check must not (Ray's processes inherit them)."""
    code = ("import os; before = dict(os.environ); from beamrl.rollout.sglang import cli_args; "
            "cli_args.check({'context_length': 8}); import sglang; "
            "print([k for k in os.environ if before.get(k) != os.environ[k]])")
    env = {k: v for k, v in os.environ.items() if not k.endswith("_CACHE_DIR") and k != "CUDA_CACHE_PATH"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_without_sglang_the_recipe_error_names_the_key(monkeypatch):
    from beamrl.config import ConfigError

    cli_args._sglang_parser.cache_clear()
    monkeypatch.setitem(sys.modules, "sglang.srt.server_args", None)  # import of it raises ImportError
    try:
        with pytest.raises(ConfigError, match="server_args.context_length.*not importable"):
            cli_args.check({"context_length": 8})
    finally:
        cli_args._sglang_parser.cache_clear()


def test_null_and_non_bools_for_a_flag_pair():
    assert cli_args.render("enable_tf32_matmul", None) == []  # its default is None: leaving it out says that
    with pytest.raises(ValueError, match="true or false"):
        cli_args.render("lora_strict_loading", None)  # default False: null would have turned it on
    with pytest.raises(ValueError, match="true or false"):
        cli_args.render("enable_tf32_matmul", "true")


def test_a_bool_for_an_option_that_takes_a_value_is_refused():
    with pytest.raises(ValueError, match="not False"):
        cli_args.parse("served_model_name", False)  # was the string 'False'
