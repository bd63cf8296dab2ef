"""A checkpoint of another model, dtype or optimizer kind is refused before loading, naming the field; changed
optimizer settings are reported (no process group needed)."""

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from beamrl.trainer.megatron.checkpoint import CheckpointError
from beamrl.trainer.megatron.checkpoint.checkpointer import _check_compatible, _optimizer_settings
from beamrl.trainer.megatron.checkpoint.state import SHARDING_METADATA
from tests.trainer.megatron import _equivalence as E


@pytest.fixture(autouse=True)
def _two_rank_world(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # the layouts below are 2-rank ones (no process group is made)


def _meta(cfg):
    return {"model": cfg.model.to_dict(), "dtype": cfg.dtype, "sharding": dict(SHARDING_METADATA),
            "optimizer": _optimizer_settings(SimpleNamespace(config=cfg))}


def _with_trainer(cfg, **fields):
    """`cfg` (a TrainerSetup) with some fields of its trainer section changed."""
    return replace(cfg, trainer=cfg.trainer.model_copy(update=fields))


def test_same_model_passes_and_changed_settings_are_reported(capsys):
    cfg = E.trainer_config({"ep": 2}, True)
    _check_compatible(_meta(cfg), SimpleNamespace(config=cfg), Path("/ckpt"))
    assert capsys.readouterr().out == ""
    changed = _with_trainer(cfg, adam_beta2=0.95)
    _check_compatible(_meta(cfg), SimpleNamespace(config=changed), Path("/ckpt"))
    out = capsys.readouterr().out
    assert "optimizer settings differ" in out and "'adam_beta2': (0.999, 0.95)" in out


@pytest.mark.parametrize("change, field", [
    (lambda c: replace(c, model=c.model.replace(hidden_size=128)), "hidden_size"),
    (lambda c: replace(c, dtype="bfloat16"), "dtype"),
    (lambda c: _with_trainer(c, distributed_optimizer=False), "distributed_optimizer"),
])
def test_another_model_dtype_or_optimizer_kind_is_refused(change, field):
    cfg = E.trainer_config({"ep": 2}, True)
    with pytest.raises(CheckpointError, match=field) as e:
        _check_compatible(_meta(cfg), SimpleNamespace(config=change(cfg)), Path("/ckpt"))
    assert "/ckpt/beamrl_checkpoint.json" in str(e.value)


def test_another_optimizer_state_format_is_refused_naming_it():
    cfg = E.trainer_config({"ep": 2}, True)
    meta = _meta(cfg)
    meta["sharding"] = {**meta["sharding"], "distrib_optim_sharding_type": "dp_reshardable"}
    with pytest.raises(CheckpointError, match="'dp_reshardable' format; this trainer reads 'fully_reshardable'"):
        _check_compatible(meta, SimpleNamespace(config=cfg), Path("/ckpt"))
    # The previous beamrl recorded Megatron's gather option too: still the same format.
    meta["sharding"] = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True,
                        "distrib_optim_fully_reshardable_mem_efficient": True}
    _check_compatible(meta, SimpleNamespace(config=cfg), Path("/ckpt"))
