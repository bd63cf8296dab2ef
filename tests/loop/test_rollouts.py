"""Rollouts -> packed trainer batch: token alignment, loss mask, R3 route conversion."""

import numpy as np
import pytest
import torch

from beamrl.loop.rollouts import Rollout, build_packed_batch, moe_routes_for_trainer, split_micro_batches
from beamrl.models.beam import preset
from beamrl.protocols.rollout import GenerateResult


def _rollout(cfg, prompt, out, adv, seed=0, routes=True):
    rng = np.random.default_rng(seed)
    n = len(prompt) + len(out) - 1
    r = rng.integers(0, cfg.num_experts, size=(n, cfg.num_hidden_layers, cfg.num_experts_per_tok)).astype(np.int32)
    r[:, [i for i in range(cfg.num_hidden_layers) if not cfg.is_moe(i)], :] = -1
    res = GenerateResult(prompt, out, [-0.5 - i for i in range(len(out))], "stop", 0, r if routes else None)
    return Rollout(prompt=None, group=0, result=res, advantage=adv)


def test_packed_batch_aligns_response_tokens(tiny_config):
    a = _rollout(tiny_config, [5, 6, 7], [8, 9], 1.5, seed=1)
    b = _rollout(tiny_config, [4, 5], [6, 7, 8], -0.5, seed=2)
    batch = build_packed_batch([a, b], tiny_config, with_routes=True)
    assert batch.tokens.tolist() == [5, 6, 7, 8, 9, 4, 5, 6, 7, 8]
    assert batch.loss_mask.tolist() == [0, 0, 0, 1, 1, 0, 0, 1, 1, 1]
    assert batch.fields["rollout_logprobs"].tolist() == [0, 0, 0, -0.5, -1.5, 0, 0, -0.5, -1.5, -2.5]
    assert batch.fields["advantages"].tolist() == [1.5] * 5 + [-0.5] * 5
    assert batch.routes.shape == (10, tiny_config.num_hidden_layers, tiny_config.num_experts_per_tok)
    # row t of the engine's routes is token t's forward; the last token repeats the previous row
    assert batch.routes.dtype == torch.int32  # shipped to the trainer as the engine returned them
    assert torch.equal(batch.routes[:4], torch.from_numpy(a.result.routed_experts))
    assert torch.equal(batch.routes[4], batch.routes[3])


def test_routes_shape_errors_name_the_problem(tiny_config):
    bad = np.zeros((3, tiny_config.num_hidden_layers, tiny_config.num_experts_per_tok), dtype=np.int32)
    with pytest.raises(ValueError, match="prompt\\+output-1"):
        moe_routes_for_trainer(bad, tiny_config, num_tokens=10)
    bad = np.full((9, tiny_config.num_hidden_layers, tiny_config.num_experts_per_tok), 99, dtype=np.int32)
    with pytest.raises(ValueError, match="outside"):
        moe_routes_for_trainer(bad, tiny_config, num_tokens=10)


def test_replay_without_engine_routes_is_a_clear_error(tiny_config):
    r = _rollout(tiny_config, [1, 2], [3], 0.0, routes=False)
    with pytest.raises(ValueError, match="routed experts"):
        build_packed_batch([r], tiny_config, with_routes=True)


def test_split_micro_batches_keeps_order_and_everything():
    items = list(range(10))
    parts = split_micro_batches(items, 3)
    assert [x for p in parts for x in p] == items and len(parts) == 3
    assert split_micro_batches(items, 50) == [[i] for i in items]


def test_aborted_or_empty_groups_are_dropped_whole(tiny_config):
    from beamrl.loop.step import drop_aborted

    ok = _rollout(tiny_config, [1, 2], [3], 0.0)
    aborted = _rollout(tiny_config, [1, 2], [3], 0.0)
    aborted.group, aborted.result.finish_reason = 1, "abort"
    sibling = _rollout(tiny_config, [1, 2], [4], 0.0)
    sibling.group = 1
    kept, n = drop_aborted([ok, aborted, sibling])
    assert kept == [ok] and n == 1
    with pytest.raises(RuntimeError, match="aborted"):
        drop_aborted([aborted])


def test_a_group_with_an_empty_sample_is_dropped_whole(tiny_config):
    """A sample that finished normally but with no output token drops its whole group, as an abort does."""
    from beamrl.loop.step import drop_aborted

    ok = _rollout(tiny_config, [1, 2], [3], 0.0, routes=False)
    empty = _rollout(tiny_config, [1, 2], [], 0.0, routes=False)
    empty.group = 1
    sibling = _rollout(tiny_config, [1, 2], [4], 0.0, routes=False)
    sibling.group = 1
    assert empty.result.finish_reason == "stop"
    kept, n = drop_aborted([ok, empty, sibling])
    assert kept == [ok] and n == 1


def test_packed_batch_equals_packing_each_rollout_separately(tiny_config):
    """The flat one-tensor-per-field build equals packing rollout by rollout (the way it was built before)."""
    from beamrl.trainer.protocol import PackedBatch

    rollouts = [_rollout(tiny_config, [1 + i] * (2 + i % 3), [7] * (1 + i % 2), 0.25 * i - 1, seed=i)
                for i in range(7)]
    batch = build_packed_batch(rollouts, tiny_config, with_routes=True)
    res = [r.result for r in rollouts]
    want = PackedBatch.from_sequences(
        [x.prompt_ids + x.output_ids for x in res],
        loss_masks=[[0.0] * len(x.prompt_ids) + [1.0] * len(x.output_ids) for x in res],
        fields={"advantages": [[r.advantage] * (len(r.result.prompt_ids) + len(r.result.output_ids))
                               for r in rollouts],
                "rollout_logprobs": [[0.0] * len(x.prompt_ids) + x.output_logprobs for x in res]},
        routes=[moe_routes_for_trainer(x.routed_experts, tiny_config, len(x.prompt_ids) + len(x.output_ids))
                for x in res])
    for name in ("tokens", "cu_seqlens", "loss_mask", "routes"):
        assert torch.equal(getattr(batch, name), getattr(want, name)), name
    assert batch.fields.keys() == want.fields.keys()  # only what the loss reads travels to the trainer
    for name in want.fields:
        assert torch.equal(batch.fields[name], want.fields[name]), name
