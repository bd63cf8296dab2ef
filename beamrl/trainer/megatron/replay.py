"""Routing replay (R3) and routing record for the Megatron Beam trainer (docs/trainer.md "Routing replay").

Layout of a route tensor: int64 `[T, L, k]` — T tokens of the microbatch in packed (THD) order (Megatron's
sequence-major `[s, b]` order; b = 1 for packed batches), L = `num_hidden_layers` (all layers; dense-layer
columns are ignored), k = `num_experts_per_tok`. A row with -1 on a MoE layer routes freely.

How replay works: the routes ride in the microbatch's `BeamPackedSeqParams` (`model.batch`). Every
`BeamMoELayer` takes its own layer column and, under sequence parallelism, its TP rank's contiguous token slice;
`BeamRouter` then uses exactly those experts with weights recomputed from the live FP32 sigmoid scores
(renormalised; 2.5 at the combine), so the router weight keeps receiving gradients. Because the routes are part
of the batch, an activation-recompute re-forward (Megatron's full recompute re-runs the layer closure with the
same `packed_seq_params`) and interleaved 1F1B (forward of microbatch i+1 before the backward of i) replay the
right routes without a forward/backward cursor (what Megatron's RouterReplay REPLAY_FORWARD/REPLAY_BACKWARD and
miles' replay manager need). With PP each stage reads only its own layers' columns.

Engine routes (SGLang): per sequence `[prompt + output - 1, L, k]` — the last generated token never went
through the model. `engine_routes_to_packed` pads that row with -1 (free routing; its output is unused) and
concatenates the sequences in packing order.

Self-check: while replaying, the trainer also records the routes its routers used and counts, per training
step, the (token, MoE layer) pairs whose experts differ from the given ones (`count_route_mismatches`; the
metrics `replay/route_mismatches` and `replay/routes_checked`, docs/metrics.md). R3 guarantees 0.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from beamrl.models.beam.config import BeamConfig
from beamrl.trainer.megatron.model.batch import BeamPackedSeqParams, packed_seq_params

FREE = -1


class RoutesError(ValueError):
    """Engine routes have the wrong shape, row count or expert ids (names the sequence and what was expected)."""


def engine_routes_to_packed(config: BeamConfig, routes: Sequence[torch.Tensor], seq_lens: Sequence[int]) -> torch.Tensor:
    """SGLang routed experts per sequence -> packed `[sum(seq_lens), L, k]` int64.

    routes[i]: `[seq_lens[i] - 1, L, k]` (engine convention) or `[seq_lens[i], L, k]` (already padded).
    Dense-layer columns may hold anything (SGLang returns zeros); they are set to -1."""
    if len(routes) != len(seq_lens):
        raise RoutesError(f"got routes for {len(routes)} sequences but {len(seq_lens)} sequence lengths")
    L, k, E = config.num_hidden_layers, config.num_experts_per_tok, config.num_experts
    moe = torch.tensor([config.is_moe(i) for i in range(L)])
    out = []
    for i, (r, n) in enumerate(zip(routes, seq_lens)):
        r = torch.as_tensor(r).to(torch.int64)
        if r.dim() != 3 or r.shape[1:] != (L, k) or r.shape[0] not in (n - 1, n):
            raise RoutesError(f"routes of sequence {i} have shape {tuple(r.shape)}; expected [{n - 1}, {L}, {k}] "
                              f"(prompt + output - 1 rows) or [{n}, {L}, {k}]")
        if r.shape[0] == n - 1:
            r = torch.cat([r, r.new_full((1, L, k), FREE)])
        r = torch.where(moe.view(1, L, 1), r, torch.full_like(r, FREE))
        body = r[:, moe]
        bad = (body != FREE) & ((body < 0) | (body >= E))
        if bad.any():
            raise RoutesError(f"routes of sequence {i} hold expert id {body[bad][0].item()} outside [0, {E})")
        out.append(r)
    return torch.cat(out) if out else torch.empty(0, L, k, dtype=torch.int64)


def replay_params(cu_seqlens: torch.Tensor, routes: torch.Tensor) -> BeamPackedSeqParams:
    """Per-microbatch params that make every MoE router use `routes` ([T, L, k], see module doc)."""
    return packed_seq_params(cu_seqlens, routes=routes)


def record_params(cu_seqlens: torch.Tensor, routes: Optional[torch.Tensor] = None) -> BeamPackedSeqParams:
    """Per-microbatch params that record the routes the trainer uses (optionally while replaying `routes`)."""
    return packed_seq_params(cu_seqlens, routes=routes, record=True)


def recorded_routes(params: BeamPackedSeqParams, config: BeamConfig, num_tokens: int, *,
                    tp_group=None, pp_group=None, sequence_parallel: bool = False,
                    device: torch.device | str = "cpu") -> torch.Tensor:
    """The routes recorded during a forward with `record_params`, as `[num_tokens, L, k]` int64 (-1 on dense
    layers). Collective: with sequence parallelism every TP rank holds its token slice (all-gathered over
    `tp_group`); with PP every stage holds its layers (merged with a MAX all-reduce over `pp_group`, -1 being
    'absent'). Pass the groups when they have more than one rank, and the rank's `device` (NCCL reduces device
    tensors only); the result is on the CPU."""
    L, k = config.num_hidden_layers, config.num_experts_per_tok
    tp = tp_group.size() if (sequence_parallel and tp_group is not None) else 1
    local_tokens = num_tokens // tp
    local = torch.full((local_tokens, L, k), FREE, dtype=torch.int64, device=device)
    for layer, ids in params.recorded.items():
        if ids.shape != (local_tokens, k):
            raise RoutesError(f"recorded routes of layer {layer} have shape {tuple(ids.shape)}, expected "
                              f"{(local_tokens, k)}")
        local[:, layer] = ids.to(device=local.device, dtype=torch.int64)
    full = local
    if tp > 1:
        parts = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(parts, local, group=tp_group)
        full = torch.cat(parts)
    if pp_group is not None and pp_group.size() > 1:
        dist.all_reduce(full, op=dist.ReduceOp.MAX, group=pp_group)
    return full.cpu()


def count_route_mismatches(recorded: dict, routes: torch.Tensor, moe_layers: Sequence[int], tp_rank: int = 0,
                           tp_size: int = 1) -> tuple[int, int]:
    """Replay self-check on one rank, after a forward with replay and record on: `(mismatched, checked)` over the
    (token, MoE layer) pairs whose given route is complete (no -1): checked counts them, mismatched those whose
    recorded experts differ from the given ones (ids and slot order, exactly as replay promises).

    recorded: `{global layer: ids [T_local, k]}` as the MoE layers left them (this rank's layers; under
    sequence parallelism this TP rank's contiguous token slice). routes: the micro-batch's full `[T, L, k]`
    (padding rows -1). tp_size: the SP split of the tokens (1 without SP). The slice is taken here again, not
    through the router's own code, so a wrong slice or layer column in the replay path shows as mismatches."""
    if routes.shape[0] % tp_size:
        raise RoutesError(f"{routes.shape[0]} route rows do not split over {tp_size} sequence-parallel ranks")
    n_local = routes.shape[0] // tp_size
    rows = routes[tp_rank * n_local:(tp_rank + 1) * n_local]
    mismatched = checked = 0
    for layer in moe_layers:
        if layer not in recorded:
            continue  # another pipeline stage's layer
        got = recorded[layer].to(torch.int64).cpu()
        want = rows[:, layer].to(torch.int64).cpu()
        if got.shape != want.shape:
            raise RoutesError(f"recorded routes of layer {layer} have shape {tuple(got.shape)}, the replayed ones "
                              f"{tuple(want.shape)}")
        given = (want >= 0).all(-1)
        checked += int(given.sum())
        mismatched += int((got[given] != want[given]).any(-1).sum())
    return mismatched, checked
