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


def test_list_and_dict_server_args_reach_sglang_as_its_parser_takes_them():
    """A list option that takes separate arguments, a JSON-list option, a JSON-string option: the command line
    spells each as SGLang's parser expects, and the in-process engine gets the value that command line makes."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    args = {"cuda_graph_bs_decode": [1, 2, 4], "remote_instance_weight_loader_send_weights_group_ports": [7, 8],
            "mm_process_config": {"image": {"max": 2}}}
    cfg = SGLangEngineConfig.on_cpu("/ckpt", dtype="float32", server_args=args)
    argv = cfg.launch_argv()
    assert argv[argv.index("--cuda-graph-bs-decode") + 1: argv.index("--cuda-graph-bs-decode") + 4] == ["1", "2", "4"]
    parser = argparse.ArgumentParser(allow_abbrev=False)
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv)  # SGLang's own parser takes the whole command line
    kw = cfg.engine_kwargs()
    for key, value in args.items():
        assert getattr(ns, key) == value == kw[key]
    # a string option given as a dict: both paths hand SGLang the same JSON string
    text = SGLangEngineConfig.on_cpu("/ckpt", server_args={"json_model_override_args": {"a": 1}})
    assert text.engine_kwargs()["json_model_override_args"] == '{"a": 1}'
    argv = text.launch_argv()
    assert argv[argv.index("--json-model-override-args") + 1] == '{"a": 1}'


@pytest.mark.parametrize("kwargs, field", [
    (dict(deterministic=True), "attention_backend"),
    (dict(deterministic=True, attention_backend="trtllm_mha"), "attention_backend"),
    (dict(engine_tp=0), "engine_tp"),
    (dict(mem_fraction=1.5), "mem_fraction"),
    (dict(device="tpu"), "device"),
    (dict(device="cpu", enable_memory_saver=True), "enable_memory_saver"),
    (dict(enable_weights_cpu_backup=True), "enable_weights_cpu_backup"),
    (dict(server_args={"tp_size": 2}), "server_args"),
    (dict(server_args={"nnodes": 2}), "server_args"),
    (dict(server_args={"api_key": "x"}), "server_args"),
    (dict(nnodes=2), "dist_init_addr"),
    (dict(nnodes=2, node_rank=2, dist_init_addr="10.0.0.1:5000", engine_tp=2), "node_rank"),
    (dict(nnodes=2, dist_init_addr="10.0.0.1:5000", engine_tp=3), "engine_tp"),
    (dict(host="10.0.0.1"), "api_key"),
    (dict(host="0.0.0.0"), "api_key"),
    (dict(api_key="-starts-like-a-flag"), "api_key"),
])
def test_invalid_fields_are_named(kwargs, field):
    with pytest.raises(SGLangConfigError, match=field):
        SGLangEngineConfig(model_path="/ckpt", **kwargs)


def test_weights_cpu_backup_renders_only_when_asked():
    """SGLang drops released weights unless asked to back them up (what LoRA's adapter-only syncs need)."""
    base = dict(model_path="/ckpt", enable_memory_saver=True)
    assert "--enable-weights-cpu-backup" not in SGLangEngineConfig(**base).launch_argv()
    cfg = SGLangEngineConfig(**base, enable_weights_cpu_backup=True)
    assert "--enable-weights-cpu-backup" in cfg.launch_argv() and cfg.engine_kwargs()["enable_weights_cpu_backup"]


def test_deterministic_with_explicit_backend_is_accepted():
    cfg = SGLangEngineConfig(model_path="/ckpt", deterministic=True, attention_backend="fa3")
    assert "--enable-deterministic-inference" in cfg.launch_argv()


def test_multi_node_server_arguments(tmp_path):
    """Every node of a TP16 engine on two nodes gets the same arguments except its node rank; the API key reaches
    SGLang through a file only this user can read, never the command line."""
    import stat

    from beamrl.rollout.sglang.server import SGLangServer

    common = dict(model_path="/ckpt", engine_tp=16, nnodes=2, dist_init_addr="10.0.0.1:5000", host="10.0.0.2",
                  port=31000, api_key="s3cret", random_seed=7)
    leader, follower = (SGLangEngineConfig(node_rank=r, **common) for r in (0, 1))
    a, b = leader.launch_argv(), follower.launch_argv()
    for argv, rank in ((a, "0"), (b, "1")):
        assert argv[argv.index("--tp-size") + 1] == "16" and argv[argv.index("--nnodes") + 1] == "2"
        assert argv[argv.index("--node-rank") + 1] == rank
        assert argv[argv.index("--dist-init-addr") + 1] == "10.0.0.1:5000"
        assert argv[argv.index("--random-seed") + 1] == "7" and argv[argv.index("--host") + 1] == "10.0.0.2"
    a[a.index("--node-rank") + 1] = b[b.index("--node-rank") + 1] = "?"
    assert a == b
    server = SGLangServer(follower, log_path=tmp_path / "node1" / "server.log")
    assert "s3cret" not in " ".join(server.command()) and "s3cret" not in repr(follower)
    server.log_path.parent.mkdir()
    server._write_secrets()
    assert server.command()[-2:] == ["--config", str(server.secrets_path)]
    assert stat.S_IMODE(server.secrets_path.stat().st_mode) == 0o600
    assert "s3cret" in server.secrets_path.read_text()
    server.stop()  # the key does not outlive the server
    assert not server.secrets_path.exists()
    single = SGLangEngineConfig(model_path="/ckpt", base_gpu_id=4)
    argv = single.launch_argv()
    assert "--nnodes" not in argv and argv[argv.index("--base-gpu-id") + 1] == "4"


def test_server_gets_its_gpus_and_cpu_tp_settings(monkeypatch):
    from beamrl.rollout.sglang.server import SGLangServer

    gpu = SGLangServer(SGLangEngineConfig(model_path="/ckpt", engine_tp=8, visible_gpus=(3, 1, 2, 0, 7, 6, 5, 4)))
    assert gpu._env()["CUDA_VISIBLE_DEVICES"] == "3,1,2,0,7,6,5,4"
    assert SGLangServer(SGLangEngineConfig(model_path="/ckpt"))._env() is None  # the actor's own GPUs
    cpu = SGLangServer(SGLangEngineConfig.on_cpu("/ckpt", engine_tp=2, nnodes=2, node_rank=1, base_gpu_id=1,
                                                 dist_init_addr="127.0.0.1:5000"))
    env = cpu._env()
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK"] == "0"
    assert len(env["SGLANG_CPU_OMP_THREADS_BIND"].split("|")) == 2  # rank slots 0 and 1 (base_gpu_id 1)
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in SGLangServer(SGLangEngineConfig.on_cpu("/ckpt"))._env()


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
