"""Training on one rollout batch: split it into optimizer steps of `trainer.global_batch_size` samples and each
step into micro-batches (a multiple of the DP size), compute the old (and reference) logprobs where needed,
and run the policy loss of `algorithm.loss` with the step's loss normaliser."""

from __future__ import annotations

import math
import time

import torch

from beamrl.algorithms import AlgorithmConfig, loss_normalizer, token_kl
from beamrl.loop.groups import CarriedSync, EngineGroup, TrainerGroup
from beamrl.loop.losses import PolicyLoss
from beamrl.loop.rollouts import Rollout, build_packed_batch, split_micro_batches
from beamrl.loop.weight_sync import SyncRequest
from beamrl.models.beam.config import BeamConfig
from beamrl.trainer.batching import micro_batch_count
from beamrl.trainer.megatron.config import TrainerConfig
from beamrl.trainer.protocol import PackedBatch


def micro_batches(rollouts: list[Rollout], trainer: TrainerConfig, dp_size: int, model: BeamConfig,
                  replay: bool) -> list[PackedBatch]:
    """Micro-batches of about `micro_batch_size` samples, their number a multiple of the DP size (each DP
    rank trains on an equal share)."""
    if len(rollouts) < dp_size:
        raise ValueError(f"{len(rollouts)} samples left after filtering cannot feed {dp_size} data-parallel ranks")
    n_micro = micro_batch_count(len(rollouts), trainer.micro_batch_size, dp_size)
    return [build_packed_batch(chunk, model, replay) for chunk in split_micro_batches(rollouts, n_micro)]


def _extreme(op: str, a: float | None, b: float) -> float:
    """max or min of two step values, NaN-propagating (Python's max/min drop a NaN in second place)."""
    if a is None or math.isnan(b):
        return b
    return max(a, b) if op == "max" else min(a, b)


def _no_inf(op: str, v: float) -> float:
    """A max (min) over no loss token at all is -inf (+inf): logged as 0."""
    return 0.0 if v == {"max": -math.inf, "min": math.inf}.get(op) else v


def train_on_rollouts(rollouts: list[Rollout], *, trainer: TrainerGroup, reference: TrainerGroup | None,
                      trainer_config: TrainerConfig, algorithm: AlgorithmConfig, temperature: float,
                      model: BeamConfig, replay: bool,
                      then_sync: tuple[EngineGroup, SyncRequest] | None = None
                      ) -> tuple[dict[str, float], CarriedSync | None]:
    """Train on one rollout batch in `samples / global_batch_size` optimizer steps; returns the metrics and, with
    `then_sync` = (engines, request), the outcome of that weight sync, which the last step's call runs right after
    it (`TrainerGroup.train_step_then_sync`: one round trip fewer than a separate sync call).

    With one step, pi_old is the policy of the train forward itself (no extra pass). With several, the old
    logprobs of every sample are computed first, before the first update."""
    a = algorithm
    t0 = time.perf_counter()
    n_steps = max(1, len(rollouts) // trainer_config.global_batch_size)
    steps = [micro_batches(chunk, trainer_config, trainer.dp_size, model, replay)
             for chunk in split_micro_batches(rollouts, n_steps)]
    kls = []
    for micro in steps:
        for mb in micro:
            if n_steps > 1 or reference is not None:
                cur = trainer.compute_logprobs(mb, temperature=temperature, replay=replay)
                mb.fields["old_logprobs"] = cur.logprobs.detach().float()
            if reference is not None:
                ref = reference.compute_logprobs(mb, temperature=temperature, replay=replay)
                mb.fields["ref_logprobs"] = ref.logprobs.detach().float()
                kl = token_kl(mb.fields["old_logprobs"], mb.fields["ref_logprobs"], a.kl)
                kls.append((kl * mb.loss_mask).sum().item())
    logprob_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    reductions = PolicyLoss.metric_reductions  # the others are means: averaged over the steps
    sums: dict[str, float] = {}
    all_toks = 0.0
    carried = None
    for i, micro in enumerate(steps):
        toks = float(sum(mb.num_loss_tokens for mb in micro))
        all_toks += toks
        all_mask = torch.cat([mb.loss_mask for mb in micro])
        all_seq = torch.cat([torch.repeat_interleave(torch.arange(mb.num_sequences) + 10**6 * i,
                                                     mb.cu_seqlens[1:] - mb.cu_seqlens[:-1])
                             for i, mb in enumerate(micro)])
        normalizer = loss_normalizer(all_mask > 0, all_seq, a.loss_agg)
        loss = PolicyLoss(a, normalizer, toks)
        if then_sync is not None and i == len(steps) - 1:
            result, carried = trainer.train_step_then_sync(micro, loss, replay, temperature, *then_sync)
        else:
            result = trainer.train_step(micro, loss, replay=replay, temperature=temperature)
        for k, v in result.as_dict().items():
            op = reductions.get(k, "mean")
            if op in ("max", "min"):
                sums[k] = _extreme(op, sums.get(k), float(v))
            else:  # a mean (divided by the step count below) or a count
                sums[k] = sums.get(k, 0.0) + float(v)
    train_s = time.perf_counter() - t1
    # Means: the mean over this rollout's steps; a count: the total of its steps; an extreme: over all its steps.
    out = {f"train/{k}": v / len(steps) if k not in reductions else _no_inf(reductions[k], v)
           for k, v in sums.items()}
    out["train/optimizer_steps"] = float(len(steps))
    for key in ("train_rollout_logprob_abs_diff", "entropy"):
        if f"train/{key}" in out:
            out[key] = out.pop(f"train/{key}")
    n_tokens = float(sum(mb.num_tokens for micro in steps for mb in micro))
    out.update({"time/logprob_s": logprob_s, "time/train_s": train_s,
                "throughput/train_tokens_per_s": n_tokens / max(train_s, 1e-9)})
    if kls:
        out["kl"] = sum(kls) / max(all_toks, 1.0)
    return out, carried
