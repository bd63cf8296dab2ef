"""How a step's samples are cut into micro-batches: one rule for the RL step, the SFT warm start and the recipe's
load-time checks."""

from __future__ import annotations


def micro_batch_count(num_samples: int, micro_batch_size: int, dp_size: int) -> int:
    """How many micro-batches a step of `num_samples` samples is cut into: about `micro_batch_size` samples each,
    their number a multiple of the DP size (each DP rank trains on an equal share). The RL step and the SFT warm
    start cut theirs by this one rule."""
    n_micro = max(1, num_samples // micro_batch_size)
    return max(dp_size, n_micro - n_micro % dp_size)


def trainable(num_samples: int, global_batch_size: int, micro_batch_size: int, dp_size: int,
              min_micro_per_rank: int = 1) -> bool:
    """Whether a rollout batch of `num_samples` can be trained on: every DP rank gets at least `min_micro_per_rank`
    micro-batches (pp with an interleaved pipeline) of at least one sample in each optimizer step. A full batch
    always can (the recipe's rules); one that lost samples (rewards with on_error: skip) may not."""
    if num_samples < dp_size:
        return False
    per_step = min(num_samples, global_batch_size)  # the smallest step's share
    return micro_batch_count(per_step, micro_batch_size, dp_size) // dp_size >= min_micro_per_rank
