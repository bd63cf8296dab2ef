"""Picklable loss callables that run inside the trainer ranks (`TrainerWorker.train_step`'s `loss_fn`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from beamrl.algorithms import POLICY_LOSSES, AlgorithmConfig, LossInputs
from beamrl.algorithms.policy_loss import METRIC_REDUCTIONS
from beamrl.trainer.protocol import PackedBatch


def _local_seq_ids(batch: PackedBatch) -> torch.Tensor:
    """Each token's sequence (0..n-1) in the micro-batch, on the batch's device and without a host sync (the
    output size is the token count). An index made on the CPU failed the first GPU run of the loop."""
    cu = batch.cu_seqlens
    lens = cu[1:] - cu[:-1]
    return torch.repeat_interleave(torch.arange(lens.numel(), device=cu.device), lens,
                                   output_size=batch.tokens.numel())


@dataclass
class PolicyLoss:
    """The policy loss `algorithm.loss` on one micro-batch, as its contribution to the step's global loss.

    `normalizer` is the whole step's denominator (`beamrl.algorithms.loss_normalizer` over every
    micro-batch of every DP rank), so summing micro-batch contributions gives the full-batch loss.

    Its metrics reach the trainer ready for `metric_reductions` (`beamrl.trainer.protocol`): a mean over the
    micro-batch's loss tokens is weighted by the micro-batch's share of the step's loss tokens (the trainer's sum
    is then the token-weighted mean of the step); the loss's sums, maxima and minima (`METRIC_REDUCTIONS`) go as
    they are, combined by their own operation."""

    #: How the trainer combines each metric over micro-batches and DP ranks (undeclared: summed), and
    #: `beamrl.loop.train` over the optimizer steps of a rollout batch (undeclared: averaged).
    metric_reductions: ClassVar[dict[str, str]] = METRIC_REDUCTIONS

    algorithm: AlgorithmConfig
    normalizer: float
    total_loss_tokens: float

    def __call__(self, logprobs: torch.Tensor, entropy: torch.Tensor | None, batch: PackedBatch):
        f = batch.fields
        mask = batch.loss_mask > 0
        # One optimizer step per rollout batch: the policy that sampled-then-was-recomputed is the policy of this
        # forward, so pi_old = pi_theta detached (ratio 1, as TRL and verl do); no separate logprob pass.
        old = f["old_logprobs"].to(logprobs.dtype) if "old_logprobs" in f else logprobs.detach()
        inputs = LossInputs(
            logprobs=logprobs, old_logprobs=old,
            advantages=f["advantages"].to(logprobs.dtype), loss_mask=mask, seq_ids=_local_seq_ids(batch),
            rollout_logprobs=f.get("rollout_logprobs"), ref_logprobs=f.get("ref_logprobs"),
            normalizer=self.normalizer)
        out = POLICY_LOSSES.get(self.algorithm.loss)(inputs, self.algorithm)
        # Means over this micro-batch's loss tokens: weight them so the trainer's sum is the step's mean. The
        # declared sums, maxima and minima are left as they are (the trainer reduces them by their own op).
        share = float(mask.sum()) / max(self.total_loss_tokens, 1.0)
        metrics = {}
        for k, v in out.metrics.items():
            v = torch.as_tensor(v, dtype=torch.float32).detach()
            metrics[k] = v if k in self.metric_reductions else v * share
        if entropy is not None:
            metrics["entropy"] = (entropy.detach().float() * mask).sum() / max(self.total_loss_tokens, 1.0)
        if "rollout_logprobs" in f:
            diff = (old.detach().float() - f["rollout_logprobs"].float()).abs()
            metrics["train_rollout_logprob_abs_diff"] = (diff * mask).sum() / max(self.total_loss_tokens, 1.0)
        return out.loss, metrics


@dataclass
class SFTLoss:
    """Token-level negative log-likelihood on the loss-masked tokens (the SFT warm start)."""

    total_loss_tokens: float

    def __call__(self, logprobs: torch.Tensor, entropy: torch.Tensor | None, batch: PackedBatch):
        mask = batch.loss_mask
        loss = -(logprobs * mask).sum() / max(self.total_loss_tokens, 1.0)
        return loss, {"nll": loss.detach()}
