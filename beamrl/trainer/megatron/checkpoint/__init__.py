"""Trainer checkpoints in Megatron-core's distributed checkpoint format (torch_dist backend) that reshard, save
asynchronously and never unpickle (docs/checkpoints.md).

A checkpoint directory:

- `__<rank>_<i>.distcp`: torch DCP data files, up to 4 per rank that owns main replicas (`file_writer`), holding
  Megatron `dist_checkpointing` sharded tensors with global keys, shapes and offsets: the model chunks and the
  optimizer's FP32 main copies and Adam moments, see `state.py`;
- `.metadata`: torch DCP's index of every tensor chunk (pickled by torch; read through an allowlist,
  `safe_unpickle.py`); `metadata.json`: Megatron's backend record (`torch_dist`);
- `rng/rank_<r>.json`: each rank's RNG state (JSON);
- `beamrl_checkpoint.json` (written last by rank 0, its presence marks a complete checkpoint): format, step, Adam's
  step count, world size and parallel layout, dtype, model config, optimizer settings, LR-scheduler state, and a
  manifest (size + SHA-256) of every other file.

Loading works at any TP/SP/EP/PP/DP layout of the same model (`checkpointer.Checkpointer.load`).

This package's top level imports no Megatron (the RL driver uses `format`'s names to validate checkpoints).
"""

from beamrl.trainer.megatron.checkpoint.format import (FORMAT, META_FILE, CheckpointDamagedError, CheckpointError,
                                                       check, read_meta)

__all__ = ["FORMAT", "META_FILE", "CheckpointDamagedError", "CheckpointError", "check", "read_meta"]
