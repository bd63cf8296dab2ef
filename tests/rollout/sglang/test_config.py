"""SGLangEngineConfig validation and rendering into Engine kwargs / launch_server arguments."""

import pytest

from beamrl.rollout.sglang.config import SGLangConfigError, SGLangEngineConfig


def test_cpu_recipe_renders_to_engine_kwargs_and_cli():
    cfg = SGLangEngineConfig.on_cpu("/ckpt", dtype="float32", server_args={"context_length": 512})
    kw = cfg.engine_kwargs()
    assert kw["device"] == "cpu" and kw["attention_backend"] == "torch_native" and kw["skip_tokenizer_init"]
    assert kw["enable_return_routed_experts"] and kw["context_length"] == 512 and kw["weight_version"] == "0"
    argv = cfg.launch_argv()
    assert argv[argv.index("--model-path") + 1] == "/ckpt"
    assert "--skip-tokenizer-init" in argv and "--enable-memory-saver" not in argv
    assert argv[argv.index("--context-length") + 1] == "512"


@pytest.mark.parametrize("kwargs, field", [
    (dict(deterministic=True), "attention_backend"),
    (dict(deterministic=True, attention_backend="trtllm_mha"), "attention_backend"),
    (dict(engine_tp=0), "engine_tp"),
    (dict(mem_fraction=1.5), "mem_fraction"),
    (dict(device="tpu"), "device"),
    (dict(device="cpu", enable_memory_saver=True), "enable_memory_saver"),
    (dict(server_args={"tp_size": 2}), "server_args"),
])
def test_invalid_fields_are_named(kwargs, field):
    with pytest.raises(SGLangConfigError, match=field):
        SGLangEngineConfig(model_path="/ckpt", **kwargs)


def test_deterministic_with_explicit_backend_is_accepted():
    cfg = SGLangEngineConfig(model_path="/ckpt", deterministic=True, attention_backend="fa3")
    assert "--enable-deterministic-inference" in cfg.launch_argv()


def test_lora_engine_launches_beamrls_model_class_with_the_trainers_lora_config():
    import json

    from beamrl.models.beam.lora_config import LoRAConfig
    from beamrl.rollout.sglang.config import EXTERNAL_MODEL_PACKAGE, LORA_FIELD

    lora = LoRAConfig(rank=4, alpha=8.0, targets=("self_attn.q_proj", "mlp.experts.down_proj"))
    cfg = SGLangEngineConfig.on_cpu("/ckpt", dtype="float32", lora=lora)
    assert json.loads(cfg.engine_kwargs()["json_model_override_args"]) == {LORA_FIELD: lora.to_dict()}
    assert cfg.launch_env() == {"SGLANG_EXTERNAL_MODEL_PACKAGE": EXTERNAL_MODEL_PACKAGE}
    argv = cfg.launch_argv()
    assert json.loads(argv[argv.index("--json-model-override-args") + 1])[LORA_FIELD]["rank"] == 4
    plain = SGLangEngineConfig.on_cpu("/ckpt", dtype="float32")
    assert "json_model_override_args" not in plain.engine_kwargs() and plain.launch_env() == {}
    with pytest.raises(SGLangConfigError, match="lora"):
        SGLangEngineConfig(model_path="/ckpt", lora={"rank": 4})
