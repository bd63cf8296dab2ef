"""Rank functions of the trainer's multi-process tests (run through `beamrl.trainer.megatron.launch`).

A small 4-layer Beam (dense first layer, SWA + full/SSMax layers, 16 experts top-4 in 4 groups) trained in
float32 on four packed micro-batches of uneven lengths with an advantage-weighted logprob loss plus an entropy
term. Every layout loads the same random HF weights, so its three losses, step-0 gradients (full HF tensors) and
logprobs must equal the world-1 run's.
"""

from __future__ import annotations

import torch

from beamrl.models.beam import preset
from beamrl.models.beam.config import FULL, SLIDING

SEQ_LENS = [(17, 30), (25, 9), (31,), (12, 14, 5)]
VOCAB_SEED, WEIGHT_SEED = 7, 11
STEPS = 3


def model_config():
    return preset("tiny").replace(num_hidden_layers=4, layer_types=[SLIDING, FULL, SLIDING, FULL],
                                  mlp_layer_types=["dense", "sparse", "sparse", "sparse"])


def micro_batches():
    from beamrl.trainer.protocol import PackedBatch

    cfg = model_config()
    g = torch.Generator().manual_seed(VOCAB_SEED)
    out = []
    for lens in SEQ_LENS:
        seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lens]
        masks = [(torch.arange(n) >= n // 3).float() for n in lens]  # a "prompt" third without loss
        adv = [torch.full((n,), float(torch.randn((), generator=g))) for n in lens]
        out.append(PackedBatch.from_sequences(seqs, masks, {"advantages": adv}))
    return out


def replay_routes(batch, seed: int) -> torch.Tensor:
    """Random distinct experts for every (token, MoE layer) of `batch` (-1 on dense layers): routes that differ
    from the natural ones, for the replay self-check."""
    cfg = model_config()
    g = torch.Generator().manual_seed(seed)
    r = torch.full((batch.num_tokens, cfg.num_hidden_layers, cfg.num_experts_per_tok), -1, dtype=torch.int64)
    for layer in cfg.moe_layers:
        r[:, layer] = torch.stack([torch.randperm(cfg.num_experts, generator=g)[:cfg.num_experts_per_tok]
                                   for _ in range(batch.num_tokens)])
    return r


def make_loss(total_tokens: int):
    def loss_fn(logprobs, entropy, batch):
        m = batch.loss_mask
        pg = -(batch.fields["advantages"] * logprobs * m).sum() / total_tokens
        ent = (entropy * m).sum() / total_tokens
        return pg - 0.01 * ent, {"entropy": ent}

    return loss_fn


def trainer_config(parallel: dict, distributed_optimizer: bool = False, dtype: str = "float32",
                   recompute: bool = False):
    import os

    from beamrl.trainer.megatron.config import TrainerConfig
    from beamrl.trainer.megatron.worker import TrainerSetup

    world = int(os.environ["WORLD_SIZE"])  # set by beamrl.trainer.megatron.launch
    trainer = TrainerConfig(**parallel, num_gpus=world, global_batch_size=len(SEQ_LENS), lr=3e-3, grad_clip=1.0,
                            weight_decay=0.01, distributed_optimizer=distributed_optimizer,
                            recompute="full" if recompute else "none")
    return TrainerSetup(model=model_config(), trainer=trainer, dtype=dtype)


def run_layout(parallel: dict, distributed_optimizer: bool = False, with_grads: bool = True,
               recompute: bool = False) -> dict:
    """Train STEPS steps in this layout; rank 0 returns losses, step-0 HF gradients and logprobs."""
    import torch.distributed as dist

    from beamrl.models.beam.weights import random_state_dict
    from beamrl.trainer.megatron.worker import MegatronTrainer

    cfg = trainer_config(parallel, distributed_optimizer, recompute=recompute)
    trainer = MegatronTrainer(cfg)
    weights = random_state_dict(cfg.model, WEIGHT_SEED, torch.float32)
    trainer.load_hf_state_dict(weights)
    exported = {k: v for unit in trainer.export_hf() for k, v in unit}
    export_ok = dist.get_rank() != 0 or (exported.keys() == weights.keys()
                                         and all(torch.equal(exported[k], weights[k]) for k in weights))
    mbs = micro_batches()
    loss_fn = make_loss(sum(b.num_loss_tokens for b in mbs))
    dp = cfg.parallel.dp_size(dist.get_world_size())
    dp_rank = trainer._ps.get_data_parallel_rank()
    mine = mbs[dp_rank * len(mbs) // dp:(dp_rank + 1) * len(mbs) // dp]
    lp = trainer.compute_logprobs(mbs[0], temperature=0.7)  # before training: the loaded weights
    trainer.set_routing_record(True)
    recorded = trainer.compute_logprobs(mbs[1]).routes
    trainer.set_routing_record(False)
    trainer.set_routing_replay(True)
    replayed = trainer.compute_logprobs(mbs[1], routes=recorded).logprobs
    forced = recorded.clone()
    forced[:, cfg.model.moe_layers] = torch.arange(cfg.model.num_experts_per_tok)  # every token to experts 0..k-1
    forced_lp = trainer.compute_logprobs(mbs[1], routes=forced).logprobs
    trainer.set_routing_replay(False)
    free = trainer.compute_logprobs(mbs[1]).logprobs
    # Replay self-check of a training forward: every rank's routers must have used exactly the given routes.
    from beamrl.trainer.protocol import PackedBatch

    with_routes = [PackedBatch(b.tokens, b.cu_seqlens, b.loss_mask, b.fields, replay_routes(b, 100 + i))
                   for i, b in enumerate(mine)]
    trainer.set_routing_replay(True)
    replay_check = trainer.forward_backward(with_routes, loss_fn)
    trainer.set_routing_replay(False)
    losses, entropies, grads = [], [], None
    for step in range(STEPS):
        sums = trainer.forward_backward(mine, loss_fn)
        if step == 0 and with_grads:
            grads = trainer.hf_gradients()
        trainer.optimizer_step()
        losses.append(sums["loss"])
        entropies.append(sums["entropy"])
    trainer.shutdown()
    return {"losses": losses, "entropies": entropies, "grads": grads, "logprobs": lp.logprobs,
            "entropy": lp.entropy, "recorded": recorded, "replayed": replayed, "free": free, "forced": forced_lp,
            "export_round_trip": export_ok,
            "replay_check": (replay_check["replay/route_mismatches"], replay_check["replay/routes_checked"])}


def run_layouts(layouts: list[tuple[dict, bool, bool]]) -> list[dict]:
    """Several layouts one after the other in the same processes (saves process start-up)."""
    return [run_layout(*layout) for layout in layouts]
