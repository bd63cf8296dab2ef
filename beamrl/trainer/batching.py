"""How a step's samples are cut into micro-batches: one rule for the RL step, the SFT warm start and the recipe's
load-time checks."""

from __future__ import annotations


def micro_batch_count(num_samples: int, micro_batch_size: int, dp_size: int) -> int:
    """How many micro-batches a step of `num_samples` samples is cut into: about `micro_batch_size` samples each,
    their number a multiple of the DP size (each DP rank trains on an equal share). The RL step and the SFT warm
    start cut theirs by this one rule."""
    n_micro = max(1, num_samples // micro_batch_size)
    return max(dp_size, n_micro - n_micro % dp_size)
