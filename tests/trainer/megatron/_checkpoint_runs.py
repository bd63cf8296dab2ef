"""Rank functions of the checkpoint tests (run through `beamrl.trainer.megatron.launch`, 2 processes).

Everything runs in one launch (`every_run`: trainers are rebuilt in the same processes, as in
`_equivalence.run_layouts`, so the process start-up and the Megatron import are paid once), on `_equivalence`'s
tiny Beam, micro-batches and loss, in float32 unless noted.

BF16 with the non-distributed optimizer (`bf16_non_distributed`): see there.

Resharding comparison (`reshard`), for a checkpoint written at layout X = TP2+SP x EP2 after K = 2 steps:
- `saver`: the run at X itself, which saves asynchronously and trains N = 3 more steps while the files are written;
- for each target layout Y:
  - `reference`: an uninterrupted run at Y, from the same initial weights, K + N steps, never touching the
    checkpoint: after K steps it holds the same weights and optimizer state as the checkpoint (the layouts are
    numerically equivalent in float32), so its last N losses are the ones a correct resume must reproduce;
  - `resumed`: a fresh (randomly initialised) trainer at Y loads the checkpoint and trains N steps;
  - `weights_only`: the checkpoint's weights (exported from `resumed` right after loading) in a fresh trainer
    whose optimizer starts empty: what a resume that dropped the optimizer state would give (must differ).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from tests.trainer.megatron import _equivalence as E

SAVE_LAYOUT = {"tp": 2, "sp": True, "ep": 2}
TARGETS = {"tp1_ep2": {"ep": 2}, "pp2": {"pp": 2}, "ep1_dp2": {}}
K, N = 2, 3


def _trainer(parallel: dict, distributed_optimizer: bool, dtype: str = "float32", weights=None):
    from beamrl.models.beam.weights import random_state_dict
    from beamrl.trainer.megatron.worker import MegatronTrainer

    cfg = E.trainer_config(parallel, distributed_optimizer, dtype=dtype)
    t = MegatronTrainer(cfg)
    if weights == "initial":
        t.load_hf_state_dict(random_state_dict(cfg.model, E.WEIGHT_SEED, cfg.params_dtype))
    elif weights is not None:
        t.load_hf_state_dict(weights)
    return t


def _train(t, steps: int) -> list[float]:
    """`steps` optimizer steps, each DP rank on its share of the micro-batches; the global losses."""
    import torch.distributed as dist

    mbs = E.micro_batches()
    loss_fn = E.make_loss(sum(b.num_loss_tokens for b in mbs))
    dp, r = t.config.parallel.dp_size(dist.get_world_size()), t._ps.get_data_parallel_rank()
    mine = mbs[r * len(mbs) // dp:(r + 1) * len(mbs) // dp]
    return [t.train_step(mine, loss_fn).loss for _ in range(steps)]


def _hf_weights(t) -> dict[str, torch.Tensor]:
    """Full HF tensors on every rank (export gathers them on rank 0; broadcast to the others)."""
    import torch.distributed as dist

    tensors = {k: v for unit in t.export_hf() for k, v in unit}
    box = [tensors if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _rng_probe() -> list:
    """Draws from every generator a checkpoint restores (Python, NumPy, torch, Megatron's TP stream)."""
    import random

    import numpy as np
    from megatron.core import tensor_parallel

    with tensor_parallel.get_cuda_rng_tracker().fork():
        tp_stream = torch.rand(2).tolist()
    return [random.random(), float(np.random.rand()), torch.rand(2).tolist(), tp_stream]


def _sharding(t) -> dict:
    """Global shape, offset, replica id and dtype of Beam's own tensors in this rank's sharded state."""
    from beamrl.trainer.megatron.checkpoint.state import _model_chunk

    sd = _model_chunk(t.models[0])
    out = {}
    for name in ("decoder.layers.1.self_attention.gate_bias", "decoder.layers.1.mlp.experts.gate_up_weight",
                 "decoder.layers.1.mlp.experts.down_weight", "decoder.layers.1.mlp.router.weight",
                 "decoder.layers.1.mlp.router.expert_bias"):
        sh = sd[f"model.{name}"]
        out[name] = {"global_shape": list(sh.global_shape), "global_offset": list(sh.global_offset),
                     "replica_id": list(sh.replica_id), "dtype": str(sh.dtype)}
    fc1 = sd["model.decoder.layers.0.mlp.linear_fc1.weight"]
    out["fc1"] = {"type": type(fc1).__name__, "halves": [(list(x.global_shape), list(x.global_offset))
                                                        for x in fc1.build()]}
    return out


def _resume(parallel: dict, directory: str, distributed_optimizer: bool, weights_only: bool = False) -> dict:
    t = _trainer(parallel, distributed_optimizer)
    t.load_checkpoint(directory)
    step, rng = t.step, _rng_probe()
    if weights_only:
        weights = _hf_weights(t)
        t.shutdown()
        t = _trainer(parallel, distributed_optimizer, weights=weights)
    losses = _train(t, N)
    t.shutdown()
    return {"step_after_load": step, "losses": losses, "rng": rng}


def reshard(directory: str, distributed_optimizer: bool, targets: list[str], damage: bool = False) -> dict:
    """See the module docstring. Also the same-layout resume (`same`) and, with `damage`, the load errors of
    damaged copies (`damage`)."""
    t = _trainer(SAVE_LAYOUT, distributed_optimizer, weights="initial")
    _train(t, K)
    t.save_checkpoint(directory, async_save=True)
    rng, sharding = _rng_probe(), _sharding(t)
    saver = _train(t, N)  # trains on while the background writer writes
    published = t.finalize_checkpoint()
    t.shutdown()
    out = {"saver": saver, "published": str(published), "rng": rng, "sharding": sharding,
           "same": _resume(SAVE_LAYOUT, directory, distributed_optimizer)}
    for name in targets:
        y = TARGETS[name]
        reference = _trainer(y, distributed_optimizer, weights="initial")
        out[name] = {"reference": _train(reference, K + N)[K:],
                     "resumed": _resume(y, directory, distributed_optimizer),
                     "weights_only": _resume(y, directory, distributed_optimizer, weights_only=True)}
        reference.shutdown()
    if damage:
        out["damage"] = _damaged_loads(directory, distributed_optimizer)
    return out


def _damaged_loads(directory: str, distributed_optimizer: bool) -> dict[str, str]:
    """Load errors of damaged copies of the checkpoint: a truncated data file, a flipped byte in the middle of
    the other data file (same size), a corrupted `.metadata`."""
    import torch.distributed as dist

    from beamrl.trainer.megatron.checkpoint import CheckpointError

    src = Path(directory)
    cases = {"truncated": ("__1_0.distcp", _truncate), "flipped": ("__0_0.distcp", _flip),
             "metadata": (".metadata", _flip)}
    errors = {}
    t = _trainer(SAVE_LAYOUT, distributed_optimizer)
    for case, (name, damage) in cases.items():
        copy = src.parent / f"{src.name}-{case}"
        if dist.get_rank() == 0:
            shutil.copytree(src, copy)
            damage(copy / name)
        dist.barrier()
        try:
            t.load_checkpoint(copy)
            errors[case] = ""
        except CheckpointError as e:
            errors[case] = f"{type(e).__name__}: {e}"
    t.shutdown()
    return errors


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def bf16_resume(directory: str) -> dict:
    """bf16 + distributed optimizer at EP2 (FP32 main copies differ from the BF16 weights, so they must come from
    the checkpoint): 3 straight steps vs 1 step + sync save + fresh trainer + load + 2 steps."""
    t = _trainer({"ep": 2}, True, dtype="bfloat16", weights="initial")
    straight = _train(t, 3)
    t.shutdown()
    t = _trainer({"ep": 2}, True, dtype="bfloat16", weights="initial")
    resumed = _train(t, 1)
    t.save_checkpoint(directory)
    t.shutdown()
    t = _trainer({"ep": 2}, True, dtype="bfloat16")  # random init: everything must come from the checkpoint
    t.load_checkpoint(directory)
    resumed += _train(t, 2)
    t.shutdown()
    return {"straight": straight, "resumed": resumed}


def bf16_non_distributed(directory: str) -> dict:
    """bf16 + the non-distributed optimizer (Megatron's Float16 optimizer, Beam's FP32 router among BF16 weights),
    saved at TP2+SP x EP2 after K steps (async):
    - `labels`: every parameter's main copy and moments are stored under that parameter's own key (saver and
      resharded trainer);
    - `saver` / `same`: the next N losses of the saver and of a fresh trainer at the same layout that loads the
      checkpoint (must be bit-exact);
    - `saved` / `resharded`: every tensor of the checkpoint state as global tensors (rank 0), of the saver and of a
      fresh trainer at TP1 x EP2 that loads the checkpoint (must be bit-exact: resharding moves data only)."""
    t = _trainer(SAVE_LAYOUT, False, dtype="bfloat16", weights="initial")
    _train(t, K)
    out = {"labels": {"saver": _misfiled_optimizer_state(t)}, "saved": _global_state(t)}
    t.save_checkpoint(directory, async_save=True)
    out["saver"] = _train(t, N)
    t.finalize_checkpoint()
    t.shutdown()
    t = _trainer(SAVE_LAYOUT, False, dtype="bfloat16")  # random init: everything must come from the checkpoint
    t.load_checkpoint(directory)
    out["same"] = _train(t, N)
    t.shutdown()
    t = _trainer({"ep": 2}, False, dtype="bfloat16")
    t.load_checkpoint(directory)
    out["labels"]["resharded"] = _misfiled_optimizer_state(t)
    out["resharded"] = _global_state(t)
    t.shutdown()
    return out


def dp_sharded_save(directory: str) -> dict:
    """The distributed optimizer at EP2 (the dense parameters at DP2), float32, after K steps:
    - `written`: elements of dense parameters' optimizer state in each rank's main replicas, with beamrl's
      description (every DP rank writes what it owns) and with Megatron's own `fully_reshardable` one (gathered
      onto DP rank 0, which writes all of it);
    - `ours` / `megatron`: the whole checkpoint state as global tensors from each description (rank 0): equal;
    - sync saves in both (`<directory>`, `<directory>-megatron`: what the previous beamrl wrote), then N more
      steps (`straight`); fresh trainers that load each and train N steps (`resumed`, `resumed_megatron`);
    - `resharded`: the global state of a fresh trainer at TP2+SP x EP2 that loads the first checkpoint."""
    t = _trainer({"ep": 2}, True, weights="initial")
    _train(t, K)
    out = {"written": {"ours": _dense_optimizer_elements(t)}, "ours": _global_state(t)}
    with _megatron_optimizer_description():
        out["written"]["megatron"] = _dense_optimizer_elements(t)
        out["megatron"] = _global_state(t)
        t.save_checkpoint(f"{directory}-megatron", async_save=False)
    t.save_checkpoint(directory, async_save=False)
    out["straight"] = _train(t, N)
    t.shutdown()
    for name, source in (("resumed", directory), ("resumed_megatron", f"{directory}-megatron")):
        t = _trainer({"ep": 2}, True)  # random init: everything must come from the checkpoint
        t.load_checkpoint(source)
        out[name] = _train(t, N)
        t.shutdown()
    t = _trainer(SAVE_LAYOUT, True)
    t.load_checkpoint(directory)
    out["resharded"] = _global_state(t)
    t.shutdown()
    return out


def _dense_optimizer_elements(t) -> list[int]:
    """Per rank (on every rank): elements of non-expert parameters' optimizer state in this rank's main replicas."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import apply_factories, is_main_replica

    from beamrl.trainer.megatron.checkpoint import state

    sharded, _ = state.sharded_state(t, is_loading=False)
    apply_factories(sharded)
    mine = sum(sh.data.numel() for sh in nested_values(sharded) if sh.key.startswith("optimizer.state.")
               and ".experts." not in sh.key and is_main_replica(sh.replica_id))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


class _megatron_optimizer_description:
    """Within: the distributed optimizer is described by Megatron's own `fully_reshardable` gather (memory-efficient
    variant), and checkpoints record its metadata, as beamrl did before `checkpoint/distributed_optimizer.py`."""

    METADATA = {"distrib_optim_sharding_type": "fully_reshardable",
                "distrib_optim_fully_reshardable_mem_efficient": True, "chained_optim_avoid_prefix": True}

    def __enter__(self):
        from beamrl.trainer.megatron.checkpoint import distributed_optimizer, state

        self.saved = distributed_optimizer.sharded_state_dict, state.SHARDING_METADATA
        distributed_optimizer.sharded_state_dict = (
            lambda sub, model, is_loading: sub.sharded_state_dict(model, is_loading=is_loading,
                                                                  metadata=dict(self.METADATA)))
        state.SHARDING_METADATA = dict(self.METADATA)

    def __exit__(self, *exc):
        from beamrl.trainer.megatron.checkpoint import distributed_optimizer, state

        distributed_optimizer.sharded_state_dict, state.SHARDING_METADATA = self.saved


def _global_state(t) -> dict[str, torch.Tensor] | None:
    """Every tensor of `t`'s checkpoint state (model and optimizer) as one global tensor per key, assembled on rank 0
    from all ranks' main replicas (None elsewhere): what a checkpoint of `t` holds, whatever the layout."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import apply_factories, is_main_replica

    from beamrl.trainer.megatron.checkpoint import state

    sharded, _ = state.sharded_state(t, is_loading=False)
    apply_factories(sharded)
    mine = [(sh.key, tuple(sh.global_shape), tuple(sh.global_offset), sh.data.detach().cpu().clone())
            for sh in nested_values(sharded) if is_main_replica(sh.replica_id)]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() != 0:
        return None
    full, covered = {}, {}
    for key, shape, offset, data in (c for rank in gathered for c in rank):
        if key not in full:
            full[key] = torch.zeros(shape, dtype=data.dtype)
            covered[key] = torch.zeros(shape, dtype=torch.int32)
        where = tuple(slice(o, o + n) for o, n in zip(offset, data.shape))
        full[key][where] = data
        covered[key][where] += 1
    holes = [k for k, c in covered.items() if not bool((c == 1).all())]
    assert not holes, f"not covered exactly once by main replicas: {holes[:5]}"
    return full


def _misfiled_optimizer_state(t) -> list[str]:
    """Optimizer state entries of `t`'s checkpoint state that do not hold their own parameter's state. For every
    parameter w, Megatron's optimizer keeps the FP32 main copy m (`w.main_param` for a BF16 w, else w itself) and
    m's Adam moments; the entries `optimizer.state.fp32_param.<key of w>` (BF16 w only), `optimizer.state.exp_avg.
    <key of w>` and `optimizer.state.exp_avg_sq.<key of w>` must be exactly those tensors."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    from beamrl.trainer.megatron.checkpoint import state

    sharded, _ = state.sharded_state(t, is_loading=False)
    key_of, entries = {}, {}
    for sh in nested_values(sharded):
        if sh.key.startswith("optimizer.state."):
            slot, key = sh.key[len("optimizer.state."):].split(".", 1)
            entries[(slot, key)] = sh.data
        else:
            key_of[id(sh.data)] = sh.key
    subs = getattr(t.optimizer, "chained_optimizers", None) or [t.optimizer]
    adam = {}
    for sub in subs:
        adam.update(sub.optimizer.state)
    problems = []
    for chunk in t.models:
        for name, w in chunk.named_parameters():
            if not w.requires_grad:
                continue
            key, main = key_of[id(w)], getattr(w, "main_param", w)
            expected = {"exp_avg": adam[main]["exp_avg"], "exp_avg_sq": adam[main]["exp_avg_sq"]}
            if main is not w:
                expected["fp32_param"] = main
            for slot, tensor in expected.items():
                if entries.get((slot, key)) is not tensor:
                    problems.append(f"{slot}.{key} ({name})")
    return problems


# Every run of test_checkpoint.py, in this order (the distributed-optimizer resharding first, as when it had a launch
# of its own): name -> (rank function, arguments after the run's own checkpoint directory).
RUNS = {
    "distributed": (reshard, (True, list(TARGETS), True)),
    "non_distributed": (reshard, (False, ["pp2"])),
    "bf16_resume": (bf16_resume, ()),
    "bf16_non_distributed": (bf16_non_distributed, ()),
    "dp_sharded_save": (dp_sharded_save, ()),
}


def every_run(base: str) -> dict[str, dict]:
    """Each of `RUNS` one after the other, its checkpoint at `<base>/<name>/ckpt` (a folder of its own: the damaged
    copies are written next to the checkpoint)."""
    out = {}
    for name, (fn, args) in RUNS.items():
        directory = Path(base) / name / "ckpt"
        directory.parent.mkdir(parents=True, exist_ok=True)
        out[name] = fn(str(directory), *args)
    return out
