"""Routing replay (R3): forced routes that differ from the natural ones give exactly the reference model's
forward with the same forced routes (float32, <= 1e-5), also under full recompute (forward + backward) and under
PP2 / TP2+SP; record mode returns the trainer's own routes in the [T, L, k] layout."""

import pytest
import torch

from beamrl.models.beam import preset
from beamrl.models.beam.weights import random_state_dict

from .model._world import init_megatron, spawn, world1

# In-process Megatron on CPU: the compatibility layer for this module only (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("megatron_cpu_shim")

SEED = 5


def _forced_routes(config, T, seed):
    """Random distinct experts per (token, MoE layer); -1 on dense layers."""
    g = torch.Generator().manual_seed(seed)
    L, k, E = config.num_hidden_layers, config.num_experts_per_tok, config.num_experts
    r = torch.full((T, L, k), -1, dtype=torch.int64)
    for layer in config.moe_layers:
        r[:, layer] = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    return r


def _batch(config, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, config.vocab_size, (1, sum(lengths)), generator=g)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return ids, cu


def _reference(config, state):
    from beamrl.models.beam.model import BeamForCausalLM

    ref = BeamForCausalLM(config, dtype=torch.float32, seed=None)
    ref.load_hf_tensors(state, strict=True)
    return ref


def _model(config, state, recompute="none"):
    from beamrl.trainer.megatron.mapping import load_hf_weights
    from beamrl.trainer.megatron.model import build_beam_gpt_model

    model = build_beam_gpt_model(config, params_dtype=torch.float32, recompute=recompute)
    load_hf_weights(model, state)
    return model


@pytest.fixture(scope="module")
def tiny():
    world1()
    config = preset("tiny")
    state = random_state_dict(config, seed=SEED, dtype=torch.float32)
    return config, state, _reference(config, state)


def test_forced_routes_match_reference_and_differ_from_natural(tiny):
    from beamrl.trainer.megatron.replay import replay_params

    config, state, ref = tiny
    model = _model(config, state)
    ids, cu = _batch(config, [18, 30], seed=0)
    routes = _forced_routes(config, ids.shape[1], seed=1)
    with torch.no_grad():
        got = model(ids, None, None, packed_seq_params=replay_params(cu, routes))
        want = ref(ids, cu_seqlens=cu, forced_routes=routes[None]).logits
        natural = ref(ids, cu_seqlens=cu).logits
    assert (got - want).abs().max().item() <= 1e-5
    assert (natural - want).abs().max().item() > 1e-2  # the forced routes really change the model


def test_replay_under_full_recompute_forward_and_backward(tiny):
    from beamrl.trainer.megatron.replay import replay_params

    config, state, ref = tiny
    ids, cu = _batch(config, [24, 16], seed=2)
    routes = _forced_routes(config, ids.shape[1], seed=3)
    grads, outs = {}, {}
    for recompute in ("none", "full"):
        model = _model(config, state, recompute=recompute)
        model.train()
        out = model(ids, None, None, packed_seq_params=replay_params(cu, routes))
        out.logsumexp(-1).sum().backward()
        outs[recompute] = out.detach()
        grads[recompute] = {n: p.grad.clone() for n, p in model.named_parameters()}
    want = ref(ids, cu_seqlens=cu, forced_routes=routes[None]).logits.detach()
    assert (outs["full"] - want).abs().max().item() <= 1e-5
    router_grad = grads["full"]["decoder.layers.1.mlp.router.weight"]
    assert router_grad.abs().max().item() > 0  # the router keeps learning under replay
    for name, g in grads["none"].items():
        torch.testing.assert_close(grads["full"][name], g, rtol=0, atol=1e-6, msg=name)


def test_record_returns_the_trainers_routes(tiny):
    from beamrl.trainer.megatron.replay import record_params, recorded_routes, replay_params

    config, state, ref = tiny
    model = _model(config, state)
    ids, cu = _batch(config, [20, 12], seed=4)
    params = record_params(cu)
    with torch.no_grad():
        model(ids, None, None, packed_seq_params=params)
        want = ref(ids, cu_seqlens=cu, return_routes=True).routes[0].to(torch.int64)
    got = recorded_routes(params, config, ids.shape[1])
    assert got.shape == want.shape
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)
    # replaying the recorded routes reproduces the free forward bit for bit
    with torch.no_grad():
        a = model(ids, None, None, packed_seq_params=record_params(cu))
        b = model(ids, None, None, packed_seq_params=replay_params(cu, got))
    assert torch.equal(a, b)


def test_replay_self_check_counts_what_the_routers_used():
    """count_route_mismatches: pairs with a complete given route are checked, other experts (or the same experts in
    another slot order) are mismatches, and each SP rank is checked against its own token slice."""
    from beamrl.trainer.megatron.replay import count_route_mismatches

    config = preset("tiny")
    moe = config.moe_layers
    routes = _forced_routes(config, 8, seed=4)
    routes[7] = -1  # a padding row (free routing): not checked
    routes[5, moe[0], 1] = -1  # an incomplete route routes freely: not checked
    recorded = {layer: routes[:, layer].clone() for layer in moe}
    recorded[moe[0]][5] = 0  # what the router did on the free row does not matter
    assert count_route_mismatches(recorded, routes, moe) == (0, 7 * len(moe) - 1)
    recorded[moe[1]][2] = recorded[moe[1]][2].flip(0)  # same experts, other slot order
    recorded[moe[-1]][3, 0] = (recorded[moe[-1]][3, 0] + 1) % config.num_experts
    assert count_route_mismatches(recorded, routes, moe) == (2, 7 * len(moe) - 1)
    # SP rank 1 of 2 holds tokens 4..7: its recorded slice is compared with those rows, not with rows 0..3
    second = {layer: routes[4:, layer].clone() for layer in moe[:1]}  # a pipeline stage with one MoE layer
    assert count_route_mismatches(second, routes, moe, tp_rank=1, tp_size=2) == (0, 2)  # rows 4 and 6
    assert count_route_mismatches(second, routes, moe, tp_rank=0, tp_size=2) == (4, 4)  # a wrong slice shows
    with pytest.raises(ValueError, match="do not split"):
        count_route_mismatches(second, routes[:7], moe, tp_rank=0, tp_size=2)


def test_engine_routes_are_padded_and_validated():
    from beamrl.trainer.megatron.replay import RoutesError, engine_routes_to_packed

    config = preset("tiny")
    L, k = config.num_hidden_layers, config.num_experts_per_tok
    a, b = torch.randint(0, config.num_experts, (6, L, k)), torch.randint(0, config.num_experts, (3, L, k))
    packed = engine_routes_to_packed(config, [a, b], [7, 4])
    assert packed.shape == (11, L, k)
    assert torch.equal(packed[:6, 1:], a[:, 1:]) and torch.equal(packed[7:10, 1:], b[:, 1:])
    assert (packed[6] == -1).all() and (packed[10] == -1).all()  # final token of each sequence routes freely
    assert (packed[:, 0] == -1).all()  # dense layer 0 ignored
    with pytest.raises(RoutesError, match="sequence 1"):
        engine_routes_to_packed(config, [a, b], [7, 9])
    bad = a.clone()
    bad[0, 2, 0] = config.num_experts
    with pytest.raises(RoutesError, match="outside"):
        engine_routes_to_packed(config, [bad], [7])


def test_free_final_row_routes_naturally(tiny):
    """-1 rows route freely: replaying engine-style routes (last row padded) equals the free forward there."""
    from beamrl.trainer.megatron.replay import replay_params

    config, state, ref = tiny
    model = _model(config, state)
    ids, cu = _batch(config, [16], seed=6)
    routes = ref(ids, cu_seqlens=cu, return_routes=True).routes[0].to(torch.int64)
    routes[-1] = -1
    with torch.no_grad():
        got = model(ids, None, None, packed_seq_params=replay_params(cu, routes))
        want = ref(ids, cu_seqlens=cu).logits
    assert (got - want).abs().max().item() <= 1e-5


# ----------------------------------------------------------------------------------------- multi-process


def _replay_worker(rank, world, port, layouts):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from beamrl.trainer.megatron.mapping import load_hf_weights
    from beamrl.trainer.megatron.model import build_beam_gpt_model
    from beamrl.trainer.megatron.replay import record_params, recorded_routes

    config = preset("tiny")
    state = random_state_dict(config, seed=SEED, dtype=torch.float32)
    ref = _reference(config, state)
    ids, cu = _batch(config, [22, 10, 32], seed=7)
    T = ids.shape[1]
    routes = _forced_routes(config, T, seed=8)
    routes[5:9, 3] = -1  # some free rows on one layer
    for layout in layouts:
        init_megatron(rank, world, port, **layout)
        pp_rank, pp = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
        model = build_beam_gpt_model(config, params_dtype=torch.float32, pre_process=pp_rank == 0,
                                     post_process=pp_rank == pp - 1, recompute="full")
        load_hf_weights(model, state)
        params = record_params(cu, routes)
        with torch.no_grad():
            if pp == 1:
                out = model(ids, None, None, packed_seq_params=params)
            elif pp_rank == 0:
                dist.send(model(ids, None, None, packed_seq_params=params).contiguous(), dst=1)
                out = None
            else:
                hidden = torch.empty(T, 1, config.hidden_size)
                dist.recv(hidden, src=0)
                model.set_input_tensor(hidden)
                out = model(ids, None, None, packed_seq_params=params)
        used = recorded_routes(params, config, T, tp_group=ps.get_tensor_model_parallel_group(),
                               pp_group=ps.get_pipeline_model_parallel_group(),
                               sequence_parallel=ps.get_tensor_model_parallel_world_size() > 1)
        forced = routes[:, config.moe_layers] >= 0
        assert torch.equal(used[:, config.moe_layers][forced], routes[:, config.moe_layers][forced]), layout
        # the free rows took the trainer's natural choice; the reference replays the full used routes
        want = ref(ids, cu_seqlens=cu, forced_routes=used[None]).logits
        if out is not None:
            tp = ps.get_tensor_model_parallel_world_size()
            if tp > 1:
                parts = [torch.empty_like(out) for _ in range(tp)]
                dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
                out = torch.cat(parts, dim=-1)
            err = (out - want).abs().max().item()
            assert err <= 1e-5, f"{layout}: replayed logits differ from the reference by {err}"


@pytest.mark.slow
def test_replay_with_pp2_and_tp2_sp():
    spawn(_replay_worker, 2, [dict(pp=2), dict(tp=2)], timeout=180)
