"""Rank functions of the LoRA layout tests (run through `beamrl.trainer.megatron.launch`).

The `_equivalence.py` model and micro-batches, with LoRA rank 4 on every target kind (attention q/k/v/gate/o,
the dense MLP, the routed experts). Gradient clipping is set low enough to be active, so the gradient norm (and
with it each factor's sharding attributes) is part of what the losses check.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from beamrl.models.beam.lora_config import ALL_TARGETS, LoRAConfig

from . import _equivalence as E

CLIP = 0.05
ADAPTER_SEED = 5


def lora_config(share_expert_a: bool = False) -> LoRAConfig:
    return LoRAConfig(rank=4, alpha=8.0, targets=ALL_TARGETS, share_expert_a=share_expert_a, seed=3)


def with_lora(cfg, lora: LoRAConfig, **trainer_fields):
    """`cfg` (a `TrainerSetup`) with `trainer.lora` (and other trainer fields) set."""
    trainer = type(cfg.trainer)(**{**cfg.trainer.model_dump(), "lora": lora.to_dict(), **trainer_fields})
    return dataclasses.replace(cfg, trainer=trainer)


def run_layout(parallel: dict, share_expert_a: bool = False, distributed_optimizer: bool = False) -> dict:
    """Load a random non-zero adapter and train E.STEPS steps; rank 0 returns losses, grad norms, adapter gradients
    of every step, the loaded and trained adapters, and whether the base weights are still the loaded ones bit
    for bit."""
    import torch.distributed as dist

    from beamrl.models.beam.lora import random_adapter
    from beamrl.models.beam.weights import random_state_dict
    from beamrl.trainer.megatron.worker import MegatronTrainer

    cfg = E.trainer_config(parallel, distributed_optimizer)
    cfg = with_lora(cfg, lora_config(share_expert_a), grad_clip=CLIP)
    trainer = MegatronTrainer(cfg)
    weights = random_state_dict(cfg.model, E.WEIGHT_SEED, torch.float32)
    trainer.load_hf_state_dict(weights)
    fresh = {k: v for u in trainer.export_lora() for k, v in u}
    # A non-zero B from the start, so that A gets gradients at step 0 too (a fresh adapter has B = 0).
    trainer.load_lora_state_dict(random_adapter(cfg.model, cfg.trainer.lora, ADAPTER_SEED))
    trainable = [n for m in trainer.models for n, p in m.named_parameters() if p.requires_grad]
    adapters = {p for m in trainer.models for p in m.parameters() if getattr(p, "is_lora_adapter", False)}
    in_ddp = {p for c in trainer.chunks for p in c.param_to_bucket_group}
    # (A distributed optimizer updates only this rank's shard of the expert-DP-sharded parameters: a subset.)
    only_adapters = in_ddp == adapters and set(_optimized_params(trainer.optimizer)) <= adapters
    mbs = E.micro_batches()
    loss_fn = E.make_loss(sum(b.num_loss_tokens for b in mbs))
    dp = cfg.trainer.dp
    dp_rank = trainer._ps.get_data_parallel_rank()
    mine = mbs[dp_rank * len(mbs) // dp:(dp_rank + 1) * len(mbs) // dp]
    initial = {k: v for u in trainer.export_lora() for k, v in u}
    losses, norms, grads = [], [], []
    for _ in range(E.STEPS):
        sums = trainer.forward_backward(mine, loss_fn)
        grads.append({} if distributed_optimizer else trainer.lora_gradients())
        _, norm, _ = trainer.optimizer_step()
        losses.append(sums["loss"])
        norms.append(norm)
    base = {k: v for u in trainer.export_hf() for k, v in u}
    adapter = {k: v for u in trainer.export_lora() for k, v in u}
    base_ok = dist.get_rank() != 0 or (base.keys() == weights.keys()
                                       and all(torch.equal(base[k], weights[k]) for k in weights))
    trainer.shutdown()
    return {"losses": losses, "norms": norms, "grads": grads, "initial": initial, "adapter": adapter,
            "base_unchanged": base_ok, "trainable": trainable, "fresh": fresh,
            "optimizer_holds_only_adapters": only_adapters}


def _optimized_params(optimizer) -> list:
    """The model parameters Megatron's (chained, possibly distributed) optimizer updates."""
    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        index = getattr(opt, "model_param_group_index_map", None)  # distributed optimizer: keyed by model param
        out += list(index) if index is not None else [p for g in opt.param_groups for p in g["params"]]
    return out


def run_layouts(layouts: list[tuple]) -> list[dict]:
    return [run_layout(*layout) for layout in layouts]


PROBES = [[1, 5, 9, 200, 17, 3, 88, 41, 2, 9], [7, 7, 7, 300, 2, 511, 64], [400, 12, 12, 99, 5]]


@functools.lru_cache(maxsize=1)
def trained_adapter_once() -> dict:
    """`trained_adapter()` run once per test session in a 1-rank launch (the engine tests share it)."""
    from beamrl.trainer.megatron.launch import launch

    return launch(trained_adapter, 1, (), timeout_s=300)[0]


def trained_adapter(steps: int = 1) -> dict:
    """World 1, float32, BF16-representable base weights (SGLang keeps lm_head in BF16): load a random adapter,
    train `steps` steps, and return the base (HF), the trainer's adapter, its merged weights (what its forward
    uses, exported as HF tensors) and its logprobs of `PROBES` (T = 1, per sequence, tokens 1..n-1)."""
    from beamrl.models.beam.lora import random_adapter
    from beamrl.models.beam.weights import random_state_dict
    from beamrl.trainer.megatron import lora_mapping
    from beamrl.trainer.megatron.worker import MegatronTrainer
    from beamrl.trainer.protocol import PackedBatch

    cfg = with_lora(E.trainer_config({}), lora_config())
    trainer = MegatronTrainer(cfg)
    base = {k: v.float() for k, v in random_state_dict(cfg.model, E.WEIGHT_SEED, torch.bfloat16).items()}
    trainer.load_hf_state_dict(base)
    trainer.load_lora_state_dict(random_adapter(cfg.model, cfg.trainer.lora, ADAPTER_SEED))
    mbs = E.micro_batches()
    loss_fn = E.make_loss(sum(b.num_loss_tokens for b in mbs))
    for _ in range(steps):
        trainer.train_step(mbs, loss_fn)
    adapter = {k: v for u in trainer.export_lora() for k, v in u}
    with lora_mapping.merged_base_weights(trainer.models):
        merged = {k: v for u in trainer.export_hf() for k, v in u}
    seqs = [torch.tensor(p) for p in PROBES]
    batch = PackedBatch.from_sequences(seqs, [torch.ones(len(p)) for p in PROBES], {})
    lp = trainer.compute_logprobs(batch, temperature=1.0, return_entropy=False).logprobs
    cu = batch.cu_seqlens.tolist()
    logprobs = [lp[a + 1:b].tolist() for a, b in zip(cu[:-1], cu[1:])]
    native = sync_into_native(trainer, base)
    trainer.shutdown()
    return {"config": cfg.model, "lora": cfg.trainer.lora, "base": base, "adapter": adapter, "merged": merged,
            "logprobs": logprobs, "native": native}


def sync_into_native(trainer, base: dict) -> dict:
    """An adapter-only sync of the trainer (`LoRAExportSource`, the RL loop's source) through the one orchestrator
    and the colocated transport into an embedded engine holding `base`: the report, the engine's weights after
    it and its logprobs of `PROBES`."""
    from beamrl.loop.weight_sync import LoRAExportSource
    from beamrl.models.beam.model import BeamForCausalLM
    from beamrl.rollout.native.engine import NativeEngine
    from beamrl.sync.orchestrator import ProbeCheck, SyncTimeouts, WeightSync
    from beamrl.sync.transports import TRANSPORTS

    model = BeamForCausalLM(trainer.config.model, dtype=torch.float32, seed=None)
    model.load_hf_tensors(base, strict=True)
    engine = NativeEngine.from_model(model, lora=trainer.lora)
    sync = WeightSync(lambda r: TRANSPORTS.get("colocated")(r), [engine], bucket_bytes=4096,
                      timeouts=SyncTimeouts.uniform(120), probe=ProbeCheck(PROBES, tolerance=1e-5), progress=None)
    try:
        report = sync.sync(LoRAExportSource(trainer))
    finally:
        sync.close()
    return {"report": dataclasses.asdict(report), "weights": {k: v.clone() for k, v in model.state_dict().items()},
            "logprobs": engine.score(PROBES, 60), "adapters_applied": engine.adapters_applied}


def peft_round_trip(directory: str) -> dict:
    """World 1: `trained_adapter()`, then a fresh trainer with that adapter writes it with `save_lora_adapter`,
    forgets it (zeros) and reads it back with `load_lora_adapter`; adds whether the reloaded adapter is
    bit-identical and the reloaded trainer's logprobs."""
    from beamrl.trainer.megatron.worker import MegatronTrainer
    from beamrl.trainer.protocol import PackedBatch

    out = trained_adapter()
    cfg = with_lora(E.trainer_config({}), lora_config())
    trainer = MegatronTrainer(cfg)
    trainer.load_hf_state_dict(out["base"])
    trainer.load_lora_state_dict(out["adapter"])
    trainer.save_lora_adapter(directory)
    trainer.load_lora_state_dict({k: torch.zeros_like(v) for k, v in out["adapter"].items()})
    trainer.load_lora_adapter(directory)
    reloaded = {k: v for u in trainer.export_lora() for k, v in u}
    seqs = [torch.tensor(p) for p in PROBES]
    batch = PackedBatch.from_sequences(seqs, [torch.ones(len(p)) for p in PROBES], {})
    lp = trainer.compute_logprobs(batch, temperature=1.0, return_entropy=False).logprobs
    cu = batch.cu_seqlens.tolist()
    out["reloaded_logprobs"] = [lp[a + 1:b].tolist() for a, b in zip(cu[:-1], cu[1:])]
    out["reloaded_equal"] = reloaded.keys() == out["adapter"].keys() and all(
        torch.equal(reloaded[k], v) for k, v in out["adapter"].items())
    trainer.shutdown()
    return out
