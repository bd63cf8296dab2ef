"""Checkpoint save/load: bit-exact round trips in both expert layouts, HF sharding, and named validation errors."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from beamrl.models.beam import BeamConfigError, preset
from beamrl.models.beam import checkpoint as checkpoint_module
from beamrl.models.beam.checkpoint import (INDEX_FILE, SINGLE_FILE, CheckpointError, check_checkpoint, load_checkpoint,
                                           save_checkpoint)
from beamrl.models.beam.weights import expected_tensors, packed_expert_names, random_state_dict


@pytest.fixture(scope="module")
def cfg():
    return preset("tiny")


@pytest.fixture(scope="module")
def sd(cfg):
    return random_state_dict(cfg, seed=11, dtype=torch.bfloat16)


@pytest.mark.parametrize("layout", ["per_expert", "packed"])
@pytest.mark.parametrize("shard", [None, 150_000])
def test_round_trip_bit_exact(cfg, sd, tmp_path, layout, shard):
    files = save_checkpoint(cfg, sd, tmp_path, expert_layout=layout, max_shard_bytes=shard)
    assert (tmp_path / "config.json") in files
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "beam"
    if shard is None:
        assert (tmp_path / SINGLE_FILE).exists() and not (tmp_path / INDEX_FILE).exists()
    else:
        index = json.loads((tmp_path / INDEX_FILE).read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
        stored = {}
        for f in shards:
            stored.update(load_file(tmp_path / f))
        assert set(stored) == set(index["weight_map"])
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in stored.values())
    layer = cfg.moe_layers[0]
    names = set(load_file(tmp_path / SINGLE_FILE)) if shard is None else set(index["weight_map"])
    assert (packed_expert_names(layer)[0] in names) == (layout == "packed")
    if layout == "packed":
        gu = (load_file(tmp_path / SINGLE_FILE) if shard is None else stored)[packed_expert_names(layer)[0]]
        I = cfg.moe_intermediate_size
        p = f"model.layers.{layer}.mlp.experts.3."
        assert torch.equal(gu[3, :I], sd[p + "gate_proj.weight"]) and torch.equal(gu[3, I:], sd[p + "up_proj.weight"])
    config2, sd2 = load_checkpoint(tmp_path)
    assert config2.to_dict() == cfg.to_dict()
    assert set(sd2) == set(sd)
    for k in sd:
        assert sd2[k].dtype == sd[k].dtype and torch.equal(sd2[k], sd[k]), k


def test_reference_model_save_pretrained_round_trip(cfg, tmp_path):
    from beamrl.models.beam import BeamForCausalLM

    m = BeamForCausalLM(cfg, dtype=torch.float32, seed=3)
    m.save_pretrained(tmp_path, expert_layout="packed")
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "float32"
    m2 = BeamForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.arange(10).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(m(ids).logits, m2(ids).logits)


def _write(tmp_path, cfg, tensors):
    cfg.save(tmp_path)
    save_file(tensors, str(tmp_path / SINGLE_FILE))


def test_malformed_config_names_the_field(cfg, sd, tmp_path):
    save_checkpoint(cfg, sd, tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data["head_dim"] = 15
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(BeamConfigError, match="head_dim"):
        load_checkpoint(tmp_path)
    data["head_dim"], data["num_experts_per_tok"] = 16, "four"
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(BeamConfigError, match="num_experts_per_tok"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(BeamConfigError, match="config.json"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("read", [load_checkpoint, check_checkpoint], ids=["load", "headers-only"])
def test_missing_unexpected_shape_and_dtype_errors_name_the_tensor(cfg, sd, tmp_path, read):
    bad = dict(sd)
    del bad["model.layers.2.self_attn.k_norm.weight"]
    _write(tmp_path, cfg, bad)
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.self_attn\.k_norm\.weight.*missing"):
        read(tmp_path)

    bad = dict(sd, **{"model.layers.0.mlp.extra.weight": torch.zeros(2, dtype=torch.bfloat16)})
    _write(tmp_path, cfg, bad)
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.extra\.weight'"):
        read(tmp_path)

    bad = dict(sd, **{"model.norm.weight": torch.zeros(65, dtype=torch.bfloat16)})
    _write(tmp_path, cfg, bad)
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*\(65,\).*\(64,\)"):
        read(tmp_path)

    router = f"model.layers.{cfg.moe_layers[0]}.mlp.gate.weight"
    bad = dict(sd, **{router: sd[router].to(torch.bfloat16)})
    _write(tmp_path, cfg, bad)
    with pytest.raises(CheckpointError, match=rf"{router}.*bfloat16.*float32"):
        read(tmp_path)

    bad = dict(sd, **{"lm_head.weight": sd["lm_head.weight"].to(torch.float16)})
    _write(tmp_path, cfg, bad)
    with pytest.raises(CheckpointError, match=r"lm_head\.weight.*float16.*bfloat16"):
        read(tmp_path)

    with pytest.raises(CheckpointError, match="unexpected tensor"):
        save_checkpoint(cfg, dict(sd, bogus=torch.zeros(1)), tmp_path / "out")


@pytest.mark.parametrize("layout", ["per_expert", "packed"])
@pytest.mark.parametrize("shard", [None, 150_000])
def test_header_check_passes_a_good_checkpoint_without_reading_tensor_data(cfg, sd, tmp_path, monkeypatch,
                                                                          layout, shard):
    save_checkpoint(cfg, sd, tmp_path, expert_layout=layout, max_shard_bytes=shard)
    real_open = checkpoint_module.safe_open

    class HeadersOnly:  # the real file, with tensor reads forbidden
        def __init__(self, *args, **kwargs):
            self._f = real_open(*args, **kwargs)

        def __enter__(self):
            self._h = self._f.__enter__()
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

        def keys(self):
            return self._h.keys()

        def get_slice(self, name):
            return self._h.get_slice(name)

        def get_tensor(self, name):
            raise AssertionError(f"tensor data of {name} was read")

    monkeypatch.setattr(checkpoint_module, "safe_open", HeadersOnly)
    assert check_checkpoint(tmp_path) == cfg


def test_header_check_refuses_experts_given_both_packed_and_per_expert(cfg, sd, tmp_path):
    layer = cfg.moe_layers[0]
    gate_up, _ = packed_expert_names(layer)
    I, H = cfg.moe_intermediate_size, cfg.hidden_size
    both = dict(sd, **{gate_up: torch.zeros(cfg.num_experts, 2 * I, H, dtype=torch.bfloat16)})
    _write(tmp_path, cfg, both)
    with pytest.raises(CheckpointError, match=rf"layers\.{layer}\.mlp\.experts\.0\..*both packed and per expert"):
        check_checkpoint(tmp_path)


def test_missing_shard_file_is_named(cfg, sd, tmp_path):
    save_checkpoint(cfg, sd, tmp_path, max_shard_bytes=150_000)
    victim = sorted(tmp_path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        load_checkpoint(tmp_path)


def test_streamed_save_equals_mapping_save(cfg, sd, tmp_path):
    from beamrl.models.beam.weights import random_tensors

    save_checkpoint(cfg, random_tensors(cfg, 11, torch.bfloat16), tmp_path / "a", "packed", 200_000)
    save_checkpoint(cfg, sd, tmp_path / "b", "packed", 200_000)
    for f in sorted((tmp_path / "a").iterdir()):
        assert f.read_bytes() == (tmp_path / "b" / f.name).read_bytes(), f.name
    assert len(expected_tensors(cfg)) == len(load_checkpoint(tmp_path / "a")[1])
