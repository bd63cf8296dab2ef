"""TP/SP, PP, VPP, EP and TP x EP layouts of the Megatron trainer equal the world-1 run (gloo, float32).

Every layout loads the same random HF weights and trains three steps on the same four micro-batches
(`_equivalence.py`): the three losses (so the optimizer steps are covered), the step-0 gradients gathered as full
HF tensors and the logprobs must match the world-1 run. One 2-process launch runs all layouts in sequence to pay
the process start-up once.
"""

import pytest
import torch

from beamrl.trainer.megatron.launch import launch

from . import _equivalence as E

pytestmark = pytest.mark.slow

LOSS_TOL = 1e-5
GRAD_REL_TOL = 1e-5
LOGPROB_TOL = 1e-5
_ALL_MOE_TOKENS = sum(b.num_tokens for b in E.micro_batches()) * len(E.model_config().moe_layers)

# (parallel layout, distributed optimizer, compare gradients[, full recompute])
LAYOUTS = [
    ({"tp": 2, "sp": True}, False, True),
    ({"pp": 2}, False, True),
    ({"pp": 2, "vpp": 2}, False, True),
    ({"ep": 2}, False, True),
    ({"tp": 2, "sp": True, "ep": 2}, False, True),
    ({"ep": 2}, True, False),  # distributed optimizer (DP-sharded Adam state) + clipping: losses only
    ({"tp": 2, "sp": True}, False, True, True),  # full activation recompute (re-forward under the RNG tracker)
]


@pytest.fixture(scope="module")
def world1():
    return launch(E.run_layouts, 1, ([({}, False, True)],), timeout_s=300)[0][0]


@pytest.fixture(scope="module")
def layouts():
    return launch(E.run_layouts, 2, (LAYOUTS,), timeout_s=500)[0]


def _grad_errors(ref: dict, got: dict) -> dict[str, float]:
    assert set(got) == set(ref), f"gradient names differ: {sorted(set(ref) ^ set(got))[:5]}"
    return {k: ((got[k] - v).norm() / v.norm().clamp_min(1e-30)).item() for k, v in ref.items()
            if not k.endswith("e_score_correction_bias")}  # a frozen buffer, exported as its value


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[f"{l[0]}{'-distopt' if l[1] else ''}{'-recompute' if l[3:] else ''}" for l in LAYOUTS])
def test_layout_matches_world1(world1, layouts, index):
    layout, with_grads = LAYOUTS[index][0], LAYOUTS[index][2]
    got = layouts[index]
    assert got["export_round_trip"], f"{layout}: export_hf did not return the loaded HF weights bit for bit"
    loss_delta = max(abs(a - b) for a, b in zip(got["losses"], world1["losses"]))
    assert loss_delta <= LOSS_TOL, f"{layout}: losses {got['losses']} vs world-1 {world1['losses']}"
    assert torch.allclose(torch.tensor(got["entropies"]), torch.tensor(world1["entropies"]), atol=LOSS_TOL)
    lp_delta = (got["logprobs"] - world1["logprobs"]).abs().max().item()
    ent_delta = (got["entropy"] - world1["entropy"]).abs().max().item()
    assert lp_delta <= LOGPROB_TOL and ent_delta <= LOGPROB_TOL, f"{layout}: logprob {lp_delta}, entropy {ent_delta}"
    # Routing record gathers SP slices and PP stages into the world-1 routes; replaying them changes nothing.
    assert torch.equal(got["recorded"], world1["recorded"]), f"{layout}: recorded routes differ from world-1"
    assert (got["replayed"] - got["free"]).abs().max().item() <= LOGPROB_TOL
    assert (got["forced"] - world1["forced"]).abs().max().item() <= LOGPROB_TOL
    # Replay self-check of a training step: every (token, MoE layer) of every micro-batch, summed over the ranks
    # (TP/SP token slices, PP stages, DP shares), was checked once and used exactly the given experts.
    assert got["replay_check"] == (0, _ALL_MOE_TOKENS), f"{layout}: replay self-check {got['replay_check']}"
    if with_grads:
        errors = _grad_errors(world1["grads"], got["grads"])
        worst = max(errors, key=errors.get)
        assert errors[worst] <= GRAD_REL_TOL, f"{layout}: gradient of {worst} off by {errors[worst]:.2e} (relative)"


def test_world1_run_is_not_degenerate(world1):
    """The comparison means something: the loss moves, every gradient is finite and non-zero, recorded routes
    are valid expert ids on MoE layers (-1 on dense ones), and forcing other routes changes the logprobs."""
    cfg = E.model_config()
    assert world1["export_round_trip"]
    routes = world1["recorded"]
    assert routes.shape == (E.micro_batches()[1].num_tokens, cfg.num_hidden_layers, cfg.num_experts_per_tok)
    assert (routes[:, 0] == -1).all() and ((routes[:, 1:] >= 0) & (routes[:, 1:] < cfg.num_experts)).all()
    assert (world1["forced"] - world1["free"]).abs().max() > 1e-3
    assert world1["replay_check"] == (0, _ALL_MOE_TOKENS)
    losses = world1["losses"]
    assert len(losses) == E.STEPS and losses[0] != losses[1] != losses[2]
    for name, g in world1["grads"].items():
        assert torch.isfinite(g).all(), name
        if not name.endswith("e_score_correction_bias"):
            assert g.abs().sum() > 0, f"zero gradient for {name}"
