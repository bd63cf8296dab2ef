"""Distributed checkpoints (2 gloo processes, float32 unless noted): written at TP2+SP x EP2 with an async save,
they resume at TP1 x EP2, PP2 and EP1 x DP2 with the next 3 losses of an uninterrupted run at that layout, the
same layout resumes bit for bit, and damaged files are named before anything is loaded; in bf16 with the
non-distributed optimizer, each parameter's state is stored under its own key, resumes bit for bit and reshards
unchanged. See `_checkpoint_runs.py` for how the comparisons are built; all of them run in one 2-process launch
(the `runs` fixture)."""

import json

import pytest
import torch

from beamrl.trainer.megatron.checkpoint import FORMAT, CheckpointError, check, read_meta
from beamrl.trainer.megatron.launch import launch

from . import _checkpoint_runs as R

pytestmark = pytest.mark.slow

TOL = 1e-5


def _max_gap(a, b):
    assert len(a) == len(b) == R.N
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of this module in one 2-process launch (`R.every_run`): per rank, run name -> its results, and the
    folder holding each run's `<name>/ckpt`."""
    base = tmp_path_factory.mktemp("checkpoints")
    return base, launch(R.every_run, 2, (str(base),), timeout_s=540)


@pytest.fixture(scope="module")
def distributed(runs):
    """The distributed optimizer: every target layout, plus the damaged-copy loads."""
    base, ranks = runs
    return base / "distributed" / "ckpt", ranks[0]["distributed"], [r["distributed"] for r in ranks]


def test_same_layout_resume_is_bit_exact(distributed):
    _, out, ranks = distributed
    assert out["same"]["step_after_load"] == R.K
    assert out["same"]["losses"] == out["saver"]  # the saver trained on during its async write
    for r in ranks:  # every rank's RNG streams continue where they were saved
        assert r["same"]["rng"] == r["rng"]
    assert ranks[0]["rng"] != ranks[1]["rng"]  # per rank (the TP stream differs): not a vacuous comparison


def test_beam_tensors_carry_their_sharding(distributed):
    """At TP2+SP x EP2 (4 heads, 16 experts): rank r holds heads 2r..2r+1 and experts 8r..8r+7."""
    _, _, ranks = distributed
    for r, out in enumerate(ranks):
        sh = out["sharding"]
        gate = sh["decoder.layers.1.self_attention.gate_bias"]
        assert gate["global_shape"] == [4] and gate["global_offset"] == [2 * r] and gate["replica_id"] == [0, 0, 0]
        for name in ("gate_up_weight", "down_weight"):
            e = sh[f"decoder.layers.1.mlp.experts.{name}"]
            assert e["global_shape"][0] == 16 and e["global_offset"][0] == 8 * r and e["replica_id"] == [0, 0, 0]
        for name in ("weight", "expert_bias"):  # replicated over TP: one main replica (TP rank 0), FP32
            router = sh[f"decoder.layers.1.mlp.router.{name}"]
            assert router["global_offset"] == [0] * len(router["global_shape"]) and router["dtype"] == "torch.float32"
            assert router["replica_id"] == [0, r, 0]
        assert sh["decoder.layers.1.mlp.router.expert_bias"]["global_shape"] == [16]
        fc1 = sh["fc1"]  # [gate; up] halves of the TP-independent [2 * 128, 64] tensor
        assert fc1["type"] == "ShardedTensorFactory"
        assert fc1["halves"] == [([256, 64], [64 * r, 0]), ([256, 64], [128 + 64 * r, 0])]


@pytest.mark.parametrize("target", list(R.TARGETS))
def test_resharded_resume_carries_weights_and_optimizer_state(distributed, target):
    _, out, _ = distributed
    r = out[target]
    assert r["resumed"]["step_after_load"] == R.K
    assert _max_gap(r["resumed"]["losses"], r["reference"]) <= TOL
    assert _max_gap(r["resumed"]["losses"], out["saver"]) <= TOL
    # Not vacuous: without the Adam moments and main copies the next steps differ far beyond the tolerance.
    assert _max_gap(r["weights_only"]["losses"], r["reference"]) > 100 * TOL
    assert r["reference"][0] != r["reference"][-1]


def test_checkpoint_files_and_metadata(distributed):
    directory, out, _ = distributed
    assert out["published"] == str(directory)
    meta = read_meta(directory)
    assert meta["format"] == FORMAT and meta["step"] == R.K and meta["adam_step"] == R.K
    assert meta["world_size"] == 2 and meta["parallel"]["tp"] == 2 and meta["parallel"]["ep"] == 2
    names = {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()}
    assert names == set(meta["files"]) | {"beamrl_checkpoint.json"}  # the manifest lists every other file
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "metadata.json", "rng/rank_00000.json"} <= names
    assert json.loads((directory / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    assert check(directory, full=True) == []


def test_damaged_files_are_named_before_loading(distributed):
    directory, out, _ = distributed
    errors = out["damage"]
    assert "CheckpointDamagedError" in errors["truncated"] and "__1_0.distcp" in errors["truncated"]
    assert "truncated" in errors["truncated"]
    assert "__0_0.distcp" in errors["flipped"] and "corrupted" in errors["flipped"]
    assert "/.metadata" in errors["metadata"] and "corrupted" in errors["metadata"]
    # The cheap check (sizes; digests of small files only) names the truncated shard and the metadata too.
    assert any("__1_0.distcp" in p for p in check(directory.parent / "ckpt-truncated", full=False))
    assert any(".metadata" in p for p in check(directory.parent / "ckpt-metadata", full=False))


def test_non_distributed_optimizer_reshards(runs):
    out = runs[1][0]["non_distributed"]
    assert out["same"]["losses"] == out["saver"]
    r = out["pp2"]
    assert _max_gap(r["resumed"]["losses"], r["reference"]) <= TOL
    assert _max_gap(r["weights_only"]["losses"], r["reference"]) > 100 * TOL


def test_bf16_resume_restores_the_fp32_main_copies_exactly(runs):
    out = runs[1][0]["bf16_resume"]
    assert out["resumed"] == out["straight"]
    assert out["straight"][0] != out["straight"][2]


def test_bf16_non_distributed_optimizer_resumes_and_reshards_exactly(runs):
    """Megatron's Float16 optimizer next to Beam's FP32 router: each parameter's state under its own key, a bit-exact
    resume at the same layout, and TP2+SP x EP2 -> TP1 x EP2 moves every weight, main copy and moment unchanged."""
    out = runs[1][0]["bf16_non_distributed"]
    assert out["labels"] == {"saver": [], "resharded": []}
    assert out["same"] == out["saver"]
    assert out["saver"][0] != out["saver"][-1]
    saved, resharded = out["saved"], out["resharded"]
    assert saved.keys() == resharded.keys()
    assert [k for k in saved if not torch.equal(saved[k], resharded[k])] == []
    # Not vacuous: the state holds the BF16 weights' FP32 main copies, the FP32 router's moments, and moments that
    # training made non-zero (a fresh trainer's would be zero, its weights random).
    router = "model.decoder.layers.1.mlp.router.weight"
    assert saved[f"optimizer.state.exp_avg.{router}"].dtype == torch.float32
    assert f"optimizer.state.fp32_param.{router}" not in saved  # FP32: optimised in place, no copy
    mains = [k for k in saved if k.startswith("optimizer.state.fp32_param.")]
    assert mains and all(saved[k].dtype == torch.float32 for k in mains)
    assert all(saved[k].abs().sum() > 0 for k in saved if k.startswith("optimizer.state.exp_avg_sq."))


def test_distributed_optimizer_state_is_written_by_each_dp_rank(runs):
    """At DP2 each rank writes the optimizer state it owns (no gather onto DP rank 0), and what is written is
    Megatron's fully_reshardable state element for element: checkpoints of either load bit for bit, and one written
    at DP2 reshards to TP2+SP x EP2 unchanged."""
    out = runs[1][0]["dp_sharded_save"]
    ours, megatron = out["written"]["ours"], out["written"]["megatron"]
    assert min(ours) > sum(ours) / 4  # both DP ranks write a share ...
    assert megatron[1] == 0 and sum(megatron) == sum(ours)  # ... where Megatron's gather leaves it all to DP rank 0
    assert out["ours"].keys() == out["megatron"].keys()
    assert [k for k in out["ours"] if not torch.equal(out["ours"][k], out["megatron"][k])] == []
    assert out["resumed"] == out["straight"] and out["resumed_megatron"] == out["straight"]
    assert out["straight"][0] != out["straight"][-1]
    assert out["resharded"].keys() == out["ours"].keys()
    assert [k for k in out["ours"] if not torch.equal(out["ours"][k], out["resharded"][k])] == []


def test_incomplete_checkpoint_is_refused(tmp_path):
    (tmp_path / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(CheckpointError, match="not a complete beamrl Megatron checkpoint"):
        read_meta(tmp_path)
    assert "not a complete" in check(tmp_path, full=False)[0]
