"""Rank functions of the LoRA checkpoint tests: a LoRA trainer saves after K steps and trains N more; a fresh
trainer (other initial weights, other adapter seed, possibly another layout) loads the checkpoint and trains N
steps: the same losses and adapters, the frozen base as saved (`test_lora_checkpoint.py`)."""

from __future__ import annotations

import torch

from . import _equivalence as E
from . import _lora_equivalence as L

K, N = 2, 2


def _trainer(distributed_optimizer: bool, lora_seed: int, weights_seed: int, parallel: dict | None = None):
    from beamrl.models.beam.lora_config import LoRAConfig
    from beamrl.models.beam.weights import random_state_dict
    from beamrl.trainer.megatron.worker import MegatronTrainer

    lora = LoRAConfig(**{**L.lora_config().to_dict(), "seed": lora_seed})
    cfg = L.with_lora(E.trainer_config(parallel or {}, distributed_optimizer), lora)
    t = MegatronTrainer(cfg)
    t.load_hf_state_dict(random_state_dict(cfg.model, weights_seed, torch.float32))
    return t


def _steps(t, n: int) -> list[float]:
    mbs = E.micro_batches()
    loss_fn = E.make_loss(sum(b.num_loss_tokens for b in mbs))
    dp, r = t.config.trainer.dp, t._ps.get_data_parallel_rank()
    mine = mbs[r * len(mbs) // dp:(r + 1) * len(mbs) // dp]
    return [t.train_step(mine, loss_fn).loss for _ in range(n)]


def _adapter(t) -> dict:
    return {k: v.clone() for u in t.export_lora() for k, v in u}


def _base(t) -> dict:
    return {k: v.clone() for u in t.export_hf() for k, v in u}


def save_and_resume(directory: str, distributed_optimizer: bool, save_layout: dict | None = None,
                    load_layout: dict | None = None) -> dict:
    """Save at `save_layout` after K steps and train N more; a fresh trainer at `load_layout` loads and trains N."""
    saver = _trainer(distributed_optimizer, lora_seed=3, weights_seed=E.WEIGHT_SEED, parallel=save_layout)
    _steps(saver, K)
    saver.save_checkpoint(directory)
    saved_base = _base(saver)
    want = _steps(saver, N)
    want_adapter = _adapter(saver)
    saver.shutdown()
    resumed = _trainer(distributed_optimizer, lora_seed=11, weights_seed=E.WEIGHT_SEED + 1, parallel=load_layout)
    resumed.load_checkpoint(directory)
    base_ok = all(torch.equal(v, saved_base[k]) for k, v in _base(resumed).items())
    got = _steps(resumed, N)
    got_adapter = _adapter(resumed)
    resumed.shutdown()
    return {"want": want, "got": got, "base_restored": base_ok, "want_adapter": want_adapter,
            "got_adapter": got_adapter}


def runs(cases: list[tuple]) -> list[dict]:
    return [save_and_resume(*case) for case in cases]
