"""A train step's loss metrics are reduced over micro-batches and data-parallel ranks by their own operation: the
policy loss's means are token-weighted means, `num_tokens` a sum, `ratio_max` a max and `ratio_min` a min (they
were token-weighted averages of per-micro-batch values: with two micro-batches of 10 tokens, num_tokens read 10).

A real tiny Megatron trainer (gloo, float32) trains on micro-batches of different loss-token counts and ratio
extremes, with the real `PolicyLoss`; the expected values come from the logprobs the loss was given."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from beamrl.loop.losses import PolicyLoss
from beamrl.trainer.megatron.launch import LaunchError, launch

from . import _equivalence as E

OLD_SEED = 5


@dataclass
class _Recording(PolicyLoss):
    """`PolicyLoss` that keeps what each micro-batch's call saw (its `metric_reductions` are PolicyLoss's)."""

    seen: list = field(default_factory=list)

    def __call__(self, logprobs, entropy, batch):
        self.seen.append((logprobs.detach().clone(), batch.loss_mask.clone(), batch.fields["old_logprobs"].clone()))
        return super().__call__(logprobs, entropy, batch)


def _micro_batches(empty: int | None = None):
    """The equivalence tests' four micro-batches (32, 23, 21 and 22 loss tokens) with random old logprobs around
    the model's (so every micro-batch has its own ratio extremes); `empty`: that micro-batch has no loss token."""
    from beamrl.trainer.protocol import PackedBatch

    g = torch.Generator().manual_seed(OLD_SEED)
    level = -torch.log(torch.tensor(float(E.model_config().vocab_size)))
    out = []
    for i, b in enumerate(E.micro_batches()):
        fields = dict(b.fields, old_logprobs=level + 3.0 * (torch.rand(b.num_tokens, generator=g) - 0.5))
        mask = torch.zeros_like(b.loss_mask) if i == empty else b.loss_mask
        out.append(PackedBatch(b.tokens, b.cu_seqlens, mask, fields))
    return out


def _steps() -> dict:
    """Rank function: one train step on all four micro-batches, then a forward-backward whose third micro-batch has
    no loss token; this DP rank trains on its contiguous share. Returns the results and what the loss saw."""
    import torch.distributed as dist

    from beamrl.algorithms import AlgorithmConfig
    from beamrl.models.beam.weights import random_state_dict
    from beamrl.trainer.megatron.worker import MegatronTrainer

    cfg = E.trainer_config({})
    trainer = MegatronTrainer(cfg)
    trainer.load_hf_state_dict(random_state_dict(cfg.model, E.WEIGHT_SEED, torch.float32))
    dp, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for name, mbs in (("step", _micro_batches()), ("with_empty", _micro_batches(empty=2))):
        total = float(sum(b.num_loss_tokens for b in mbs))
        loss = _Recording(AlgorithmConfig(), normalizer=total, total_loss_tokens=total)
        mine = mbs[rank * len(mbs) // dp:(rank + 1) * len(mbs) // dp]
        if name == "step":
            metrics = trainer.train_step(mine, loss).metrics
        else:
            metrics = trainer.forward_backward(mine, loss)
            trainer.optimizer_step()
        out[name] = {"metrics": metrics, "seen": loss.seen}
    trainer.shutdown()
    return out


def _expected(seen: list) -> dict[str, float]:
    """The step's metrics from every micro-batch the loss saw (all ranks), the way `ppo_clip_loss` forms them."""
    lp, mask, old = (torch.cat([s[i] for s in seen]) for i in range(3))
    mask = mask > 0
    ratio = (torch.where(mask, lp, 0.0) - torch.where(mask, old, 0.0)).exp()[mask]
    return {"num_tokens": float(mask.sum()), "ratio_max": float(ratio.max()), "ratio_min": float(ratio.min()),
            "ratio_mean": float(ratio.sum() / mask.sum())}


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "dp2"])
def runs(request):
    try:
        return launch(_steps, request.param, timeout_s=300)
    except LaunchError as e:
        raise AssertionError(str(e)) from None


def test_num_tokens_is_a_sum_ratio_max_a_max_ratio_min_a_min_and_means_stay_token_weighted(runs):
    got = runs[0]["step"]["metrics"]
    seen = [s for rank in runs for s in rank["step"]["seen"]]
    assert len(seen) == 4  # every micro-batch once, over the ranks
    want = _expected(seen)
    counts = [int((s[1] > 0).sum()) for s in seen]
    assert counts == [32, 23, 21, 22] and want["num_tokens"] == sum(counts)
    # Not degenerate: the micro-batches' extremes differ, so a (weighted) average of them is not the extreme.
    ratios = [(s[0] - s[2]).exp()[s[1] > 0] for s in seen]
    assert len({float(r.max()) for r in ratios}) == 4 and len({float(r.min()) for r in ratios}) == 4
    assert got["num_tokens"] == want["num_tokens"]
    assert got["ratio_max"] == pytest.approx(want["ratio_max"], rel=1e-6)
    assert got["ratio_min"] == pytest.approx(want["ratio_min"], rel=1e-6)
    assert got["ratio_mean"] == pytest.approx(want["ratio_mean"], rel=1e-5)  # a mean: token-weighted
    # Every rank reports the same reduced metrics.
    assert all(rank["step"]["metrics"] == got for rank in runs)


def test_a_micro_batch_without_loss_tokens_does_not_count_in_the_extremes(runs):
    got = runs[0]["with_empty"]["metrics"]
    want = _expected([s for rank in runs for s in rank["with_empty"]["seen"]])
    assert got["num_tokens"] == want["num_tokens"] == 32 + 23 + 22
    assert got["ratio_max"] == pytest.approx(want["ratio_max"], rel=1e-6)
    assert got["ratio_min"] == pytest.approx(want["ratio_min"], rel=1e-6) and got["ratio_min"] > 0
    assert got["ratio_mean"] == pytest.approx(want["ratio_mean"], rel=1e-5)
