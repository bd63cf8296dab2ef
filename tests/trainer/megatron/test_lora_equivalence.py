"""LoRA training in TP2+SP x EP2 and PP2 layouts equals the world-1 run (gloo, float32): three losses, the
adapter gradients of every step, the trained adapter; the frozen base is bit-identical after training and only
adapter parameters train (`_lora_equivalence.py`)."""

import pytest
import torch

from beamrl.models.beam.lora import adapter_tensor_shapes
from beamrl.trainer.megatron.launch import launch

from . import _equivalence as E
from . import _lora_equivalence as L

pytestmark = pytest.mark.slow

LOSS_TOL = 1e-5
GRAD_REL_TOL = 1e-5

LAYOUTS = [
    ({"tp": 2, "sp": True, "ep": 2}, False),
    ({"pp": 2}, False),
    ({"ep": 2}, True),  # one A per expert projection shared over the EP ranks' experts
    ({"tp": 2, "sp": True}, False, True),  # distributed optimizer (DP-sharded adapter state): losses and norms
]


@pytest.fixture(scope="module")
def world1():
    return launch(L.run_layouts, 1, ([({}, False), ({}, True)],), timeout_s=300)[0]


@pytest.fixture(scope="module")
def layouts():
    return launch(L.run_layouts, 2, (LAYOUTS,), timeout_s=500)[0]


def _rel(ref: torch.Tensor, got: torch.Tensor) -> float:
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item() if ref.norm() > 0 else got.norm().item()


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[
    f"{l[0]}{'-shared-A' if l[1] else ''}{'-distopt' if l[2:] else ''}" for l in LAYOUTS])
def test_lora_layout_matches_world1(world1, layouts, index):
    layout, shared, distopt = (*LAYOUTS[index], False)[:3]
    ref, got = world1[int(shared)], layouts[index]
    assert got["base_unchanged"], f"{layout}: the frozen base changed during LoRA training"
    assert all(".lora." in n for n in got["trainable"]), f"{layout}: non-adapter parameters train"
    assert got["optimizer_holds_only_adapters"], f"{layout}: DDP buffers / optimizer hold non-adapter parameters"
    deltas = [abs(a - b) for a, b in zip(got["losses"], ref["losses"])]
    assert max(deltas) <= LOSS_TOL, f"{layout}: losses {got['losses']} vs world-1 {ref['losses']}"
    assert torch.allclose(torch.tensor(got["norms"]), torch.tensor(ref["norms"]), rtol=1e-5)
    if distopt:
        return  # each rank holds only its shard's reduced gradient: losses and norms cover the steps
    # Step 0: every adapter tensor's gradient (A and B both non-zero: the adapter is loaded, not fresh).
    g_ref, g_got = ref["grads"][0], got["grads"][0]
    assert g_got.keys() == g_ref.keys()
    errors = {k: _rel(v, g_got[k]) for k, v in g_ref.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= GRAD_REL_TOL, f"{layout}: step-0 gradient of {worst} off by {errors[worst]:.2e}"
    # Every step: the whole adapter gradient as one vector. (Per tensor, later steps inherit Adam's amplification
    # of last-bit gradient differences in near-zero elements, which moves single small tensors by ~1e-4.)
    for step, (g_ref, g_got) in enumerate(zip(ref["grads"], got["grads"])):
        flat_ref = torch.cat([v.flatten() for v in g_ref.values()])
        flat_got = torch.cat([g_got[k].flatten() for k in g_ref])
        assert _rel(flat_ref, flat_got) <= GRAD_REL_TOL, f"{layout}: step {step} adapter gradient differs"
    for k, v in ref["initial"].items():
        assert torch.equal(got["initial"][k], v), f"{layout}: loaded adapter {k} does not round-trip"


def test_world1_lora_run_is_not_degenerate(world1):
    """Every adapter tensor exists with its table shape and gets a non-zero step-0 gradient; clipping is active;
    the adapter moves; the losses move; a freshly built adapter has B = 0 (PEFT's init)."""
    cfg = E.model_config()
    for run, shared in zip(world1, (False, True)):
        shapes = adapter_tensor_shapes(cfg, L.lora_config(shared))
        assert {k: tuple(v.shape) for k, v in run["adapter"].items()} == shapes
        assert run["base_unchanged"]
        routed = [n for n in shapes if run["grads"][0][n].norm() > 0]
        assert len(routed) >= 0.9 * len(shapes)  # all but experts no token chose
        assert all(not torch.equal(run["adapter"][n], run["initial"][n]) for n in routed)
        assert all(n > L.CLIP for n in run["norms"]), run["norms"]  # clipping is active
        assert abs(run["losses"][-1] - run["losses"][0]) > 1e-4
        fresh = run["fresh"]
        assert fresh.keys() == shapes.keys()
        assert all(torch.count_nonzero(v) == 0 for n, v in fresh.items() if n.endswith("lora_B.weight"))
        assert all(v.abs().max() <= 1 / v.shape[1] ** 0.5 and v.std() > 0 for n, v in fresh.items()
                   if n.endswith("lora_A.weight"))
