"""LoRA trainer checkpoints (gloo, float32): the adapters and their optimizer state are saved and restored with
the frozen base, so a resumed trainer continues exactly: bit for bit at the same layout (both optimizers), and
within float32 layout equivalence when a TP2+SP x EP2 checkpoint (TP-split and EP-split factors) is loaded at PP2."""

import pytest
import torch

from beamrl.trainer.megatron.launch import launch

from . import _lora_checkpoint as C

pytestmark = pytest.mark.slow


OPTIMIZERS = [False, True]  # distributed_optimizer


@pytest.fixture(scope="module")
def same_layout(tmp_path_factory):
    """Both optimizers' world-1 save + resume, in one launch (one process start-up and Megatron import)."""
    base = tmp_path_factory.mktemp("lora-same")
    cases = [(str(base / f"ck-{i}"), d) for i, d in enumerate(OPTIMIZERS)]
    return launch(C.runs, 1, (cases,), timeout_s=300)[0]


@pytest.mark.parametrize("distributed_optimizer", OPTIMIZERS)
def test_same_layout_resume_is_bit_exact(same_layout, distributed_optimizer):
    out = same_layout[OPTIMIZERS.index(distributed_optimizer)]
    assert out["base_restored"] and out["got"] == out["want"]
    assert out["got_adapter"].keys() == out["want_adapter"].keys()
    assert all(torch.equal(v, out["want_adapter"][k]) for k, v in out["got_adapter"].items())


def test_resharded_resume_carries_adapters_and_optimizer_state(tmp_path):
    case = (str(tmp_path / "ck"), False, {"tp": 2, "sp": True, "ep": 2}, {"pp": 2})
    out = launch(C.runs, 2, ([case],), timeout_s=400)[0][0]
    assert out["base_restored"]
    assert max(abs(g - w) for g, w in zip(out["got"], out["want"])) <= 1e-5
    assert out["got_adapter"].keys() == out["want_adapter"].keys()
    for k, v in out["want_adapter"].items():
        assert torch.allclose(out["got_adapter"][k], v, rtol=1e-4, atol=1e-6), k
