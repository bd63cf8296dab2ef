"""The SFT warm start's export is reused on resume only when whole: it is written under `.partial` and renamed
into place (a crash mid-export left a `sft_checkpoint` with config.json and missing shards, which the next
`--resume` reused: its engines and reference then started from it). The training itself runs in the e2e tests
(tests/loop/test_first_run.py resumes a run with SFT)."""

from types import SimpleNamespace

import pytest
import torch

from beamrl.loop.sft import sft_warm_start
from beamrl.models.beam import preset
from beamrl.models.beam.checkpoint import save_checkpoint
from beamrl.models.beam.weights import random_state_dict


def _run(tmp_path):
    return SimpleNamespace(recipe=SimpleNamespace(sft=SimpleNamespace(steps=1, batch=1, lr=1e-3)), out_dir=tmp_path)


def test_a_whole_export_is_reused(tmp_path):
    config = preset("tiny").replace(dtype="float32")
    save_checkpoint(config, random_state_dict(config, 0, torch.float32), tmp_path / "sft_checkpoint")
    assert sft_warm_start(_run(tmp_path)) == str(tmp_path / "sft_checkpoint")


def test_an_export_cut_short_is_named_not_reused(tmp_path):
    config = preset("tiny").replace(dtype="float32")
    out = tmp_path / "sft_checkpoint"
    out.mkdir()
    config.save(out)  # written first: what a crash mid-export used to leave
    with pytest.raises(RuntimeError, match="not a whole checkpoint.*delete it"):
        sft_warm_start(_run(tmp_path))
