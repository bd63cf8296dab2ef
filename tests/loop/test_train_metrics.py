"""`train_on_rollouts` combines the `train/*` metrics of a rollout batch's optimizer steps by each metric's
reduction (`PolicyLoss.metric_reductions`): means are averaged over the steps, `num_tokens` adds up, `ratio_max` and
`ratio_min` are the max and min over the steps (a step without loss tokens, -inf / +inf, does not count)."""

import math

import pytest
import torch

from beamrl.algorithms import AlgorithmConfig
from beamrl.loop.losses import PolicyLoss
from beamrl.loop.rollouts import Rollout
from beamrl.loop.train import train_on_rollouts
from beamrl.protocols.rollout import GenerateResult
from beamrl.trainer.megatron.config import TrainerConfig
from beamrl.trainer.protocol import LogprobResult, TrainStepResult


class _FakeTrainer:
    """A trainer group that returns the given step results in turn."""

    dp_size = 1

    def __init__(self, steps: list[dict[str, float]]):
        self.steps = list(steps)
        self.losses = []

    def compute_logprobs(self, mb, temperature, replay):
        return LogprobResult(torch.zeros(mb.num_tokens))

    def train_step(self, micro, loss, replay, temperature):
        self.losses.append(loss)
        metrics = dict(self.steps.pop(0))
        return TrainStepResult(loss=metrics.pop("loss"), grad_norm=1.0, lr=1e-6, num_micro_batches=len(micro),
                               metrics=metrics)


def _rollouts(n: int) -> list[Rollout]:
    return [Rollout(prompt=None, group=i, result=GenerateResult([1, 2, 3], [4, 5], [-0.5, -1.0], "stop", 0),
                    advantage=1.0) for i in range(n)]


def _train(steps: list[dict[str, float]], algorithm: AlgorithmConfig | None = None
           ) -> tuple[dict[str, float], _FakeTrainer]:
    from beamrl.models.beam import preset

    trainer = _FakeTrainer(steps)
    config = TrainerConfig(num_gpus=1, global_batch_size=2, micro_batch_size=1, lr=1e-6)  # 2 steps of 2 samples
    out, _ = train_on_rollouts(_rollouts(4), trainer=trainer, reference=None, trainer_config=config,
                               algorithm=algorithm or AlgorithmConfig(), temperature=1.0, model=preset("tiny"),
                               replay=False)
    return out, trainer


def test_steps_combine_by_each_metrics_reduction():
    out, trainer = _train([
        {"loss": 0.25, "ratio_mean": 1.1, "ratio_max": 2.0, "ratio_min": 0.5, "num_tokens": 30.0},
        {"loss": 0.75, "ratio_mean": 0.9, "ratio_max": 3.0, "ratio_min": 0.7, "num_tokens": 12.0},
    ])
    assert len(trainer.losses) == 2 and all(isinstance(loss, PolicyLoss) for loss in trainer.losses)
    assert out["train/optimizer_steps"] == 2.0
    assert out["train/num_tokens"] == 42.0  # a count: the rollout batch's total
    assert out["train/ratio_max"] == 3.0 and out["train/ratio_min"] == 0.5  # extremes over every step
    assert out["train/ratio_mean"] == pytest.approx(1.0) and out["train/loss"] == pytest.approx(0.5)  # means
    assert out["train/num_micro_batches"] == 2.0  # per optimizer step: averaged


def test_a_step_without_loss_tokens_does_not_count_in_the_extremes():
    out, _ = _train([
        {"loss": 0.0, "ratio_max": -math.inf, "ratio_min": math.inf, "num_tokens": 0.0},
        {"loss": 0.5, "ratio_max": 1.5, "ratio_min": 0.8, "num_tokens": 12.0},
    ])
    assert (out["train/ratio_max"], out["train/ratio_min"], out["train/num_tokens"]) == (1.5, 0.8, 12.0)
    out, _ = _train([{"loss": 0.0, "ratio_max": -math.inf, "ratio_min": math.inf, "num_tokens": 0.0} for _ in range(2)])
    assert (out["train/ratio_max"], out["train/ratio_min"], out["train/num_tokens"]) == (0.0, 0.0, 0.0)


def test_a_nan_extreme_stays_nan():
    out, _ = _train([
        {"loss": 0.5, "ratio_max": 1.5, "ratio_min": 0.8, "num_tokens": 4.0},
        {"loss": 0.5, "ratio_max": math.nan, "ratio_min": math.nan, "num_tokens": 4.0},
    ])
    assert math.isnan(out["train/ratio_max"]) and math.isnan(out["train/ratio_min"])


def test_a_seq_mean_normaliser_counts_the_sequences_of_every_micro_batch_of_the_step():
    """seq-mean: each step's normaliser is its number of sequences with loss tokens, over all its micro-batches (a
    sequence of one micro-batch is not the same sequence as one with the same local index in another)."""
    step = {"loss": 0.5, "num_tokens": 2.0}
    _, trainer = _train([step, step], AlgorithmConfig(loss_agg="seq-mean-token-mean"))
    # 2 optimizer steps of 2 samples, each step cut into 2 micro-batches of 1 sample (micro_batch_size=1): every
    # sample has 2 response (loss) tokens, so each step's denominator is its 2 sequences
    assert [loss.normalizer for loss in trainer.losses] == [2.0, 2.0]
