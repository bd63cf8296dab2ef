"""HF <-> Megatron mapping: bit-exact round trips and, in float32, forward parity with the reference model under
TP2+SP, EP2 and PP2 (a wrong-but-invertible shard layout would round-trip; the forward catches it)."""

import pytest
import torch

from beamrl.models.beam import preset
from beamrl.models.beam.weights import expected_tensors, random_state_dict

from .model._world import init_megatron, spawn, world1

# In-process Megatron on CPU: the compatibility layer for this module only (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("megatron_cpu_shim")

SEED = 11


def _export_all(model):
    from beamrl.trainer.megatron.mapping import export_hf_tensors

    units = list(export_hf_tensors(model))
    out = {}
    for unit in units:
        for name, t in unit:
            assert name not in out, f"{name} exported twice"
            out[name] = t
    return units, out


def _assert_bit_exact(config, state, exported):
    assert set(exported) == set(expected_tensors(config)), "export must produce exactly the HF weight table"
    for name, t in state.items():
        assert exported[name].dtype == t.dtype, name
        assert torch.equal(exported[name], t), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip_tp1_is_bit_exact(dtype):
    world1()
    from beamrl.trainer.megatron.mapping import load_hf_weights
    from beamrl.trainer.megatron.model import build_beam_gpt_model

    config = preset("tiny")
    state = random_state_dict(config, seed=SEED, dtype=dtype)
    model = build_beam_gpt_model(config, params_dtype=dtype)
    assert load_hf_weights(model, state) > 0
    router = model.decoder.layers[1].mlp.router
    assert router.weight.dtype == torch.float32 and router.expert_bias.dtype == torch.float32
    _, exported = _export_all(model)
    _assert_bit_exact(config, state, exported)


def test_layout_announces_exactly_what_the_export_yields():
    """The weight sync sends its manifest (built from `export_hf_layout`) before the export runs: the layout must
    list every unit's tensors in the order, shapes and dtypes the export then yields (bf16 model, FP32 router)."""
    world1()
    from beamrl.trainer.megatron.mapping import export_hf_layout, load_hf_weights
    from beamrl.trainer.megatron.model import build_beam_gpt_model

    config = preset("tiny")
    state = random_state_dict(config, seed=SEED, dtype=torch.bfloat16)
    model = build_beam_gpt_model(config, params_dtype=torch.bfloat16)
    load_hf_weights(model, state)
    units, _ = _export_all(model)
    yielded = [[(n, tuple(t.shape), t.dtype) for n, t in unit] for unit in units]
    assert export_hf_layout(model) == yielded
    assert len(yielded) > 3 and ("model.layers.1.mlp.gate.weight", (config.num_experts, config.hidden_size),
                                 torch.float32) in yielded[4]


def test_a_kept_exporter_reads_the_weights_as_they_are_when_it_runs():
    """The trainer keeps one `HFExporter` for every weight sync: each export must read the weights as they are then,
    after a checkpoint load (in-place copies), a parameter whose `.data` was swapped (`hf_gradients`, LoRA's
    merged export) and a buffer that was reassigned (a device move replaces buffers)."""
    world1()
    from beamrl.trainer.megatron.mapping import HFExporter, load_hf_weights
    from beamrl.trainer.megatron.model import build_beam_gpt_model

    config = preset("tiny")
    model = build_beam_gpt_model(config, params_dtype=torch.float32)
    load_hf_weights(model, random_state_dict(config, seed=SEED, dtype=torch.float32))
    exporter = HFExporter(model)
    first = {n: t.clone() for unit in exporter.stream() for n, t in unit}

    loaded = random_state_dict(config, seed=SEED + 1, dtype=torch.float32)  # a checkpoint load
    load_hf_weights(model, loaded)
    _assert_bit_exact(config, loaded, {n: t.clone() for unit in exporter.stream() for n, t in unit})

    router, experts = model.decoder.layers[1].mlp.router, model.decoder.layers[1].mlp.experts
    swapped = torch.randn_like(router.weight)
    router.weight.data = swapped  # as hf_gradients swaps every parameter's data
    router.expert_bias = torch.arange(config.num_experts, dtype=torch.float32)  # a new buffer object
    gate_up = torch.randn_like(experts.gate_up_weight)
    experts.gate_up_weight.data = gate_up
    now = {n: t for unit in exporter.stream() for n, t in unit}
    inter = config.moe_intermediate_size
    last = config.num_experts - 1
    assert torch.equal(now["model.layers.1.mlp.experts.0.gate_proj.weight"], gate_up[0, :inter])
    assert torch.equal(now[f"model.layers.1.mlp.experts.{last}.up_proj.weight"], gate_up[last, inter:])
    assert torch.equal(now["model.layers.1.mlp.gate.weight"], swapped)
    assert torch.equal(now["model.layers.1.mlp.gate.e_score_correction_bias"], router.expert_bias)
    assert not torch.equal(now["model.layers.1.mlp.gate.weight"], first["model.layers.1.mlp.gate.weight"])
    assert exporter.layout() == [[(n, tuple(t.shape), t.dtype) for n, t in unit] for unit in exporter.stream()]


def test_missing_tensor_is_named():
    world1()
    from beamrl.trainer.megatron.mapping import MappingError, load_hf_weights
    from beamrl.trainer.megatron.model import build_beam_gpt_model

    config = preset("tiny")
    state = random_state_dict(config, seed=SEED, dtype=torch.float32)
    del state["model.layers.3.self_attn.gate_proj.weight"]
    model = build_beam_gpt_model(config, params_dtype=torch.float32)
    with pytest.raises(MappingError, match=r"model\.layers\.3\.self_attn\.gate_proj\.weight"):
        load_hf_weights(model, state)


# ----------------------------------------------------------------------------------------- multi-process


def _reference_logits(config, state, ids, cu):
    from beamrl.models.beam.model import BeamForCausalLM

    ref = BeamForCausalLM(config, dtype=torch.float32, seed=None)
    ref.load_hf_tensors(state, strict=True)
    with torch.no_grad():
        return ref(ids, cu_seqlens=cu).logits


def _batch(config, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, config.vocab_size, (1, sum(lengths)), generator=g)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return ids, cu


def _layout_worker(rank, world, port, layout):
    """Build under `layout`, load, forward a packed batch (per-rank batch for EP), compare with the reference,
    then export and check the round trip on rank 0."""
    import torch.distributed as dist

    init_megatron(rank, world, port, **layout)
    from megatron.core import parallel_state as ps

    from beamrl.trainer.megatron.mapping import load_hf_weights
    from beamrl.trainer.megatron.model import build_beam_gpt_model, packed_seq_params

    config = preset("tiny")
    state = random_state_dict(config, seed=SEED, dtype=torch.float32)
    pp_rank, pp = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    vpp = layout.get("vpp") or 1
    chunks = [build_beam_gpt_model(config, params_dtype=torch.float32, vp_stage=v if vpp > 1 else None,
                                   pre_process=pp_rank == 0 and v == 0, post_process=pp_rank == pp - 1 and v == vpp - 1)
              for v in range(vpp)]
    load_hf_weights(chunks, state)
    # EP ranks are data-parallel for dense params: give them different (unequal-length) batches.
    lengths = [20, 12, 32] if ps.get_data_parallel_rank() == 0 else [10, 16, 14]
    ids, cu = _batch(config, lengths, seed=ps.get_data_parallel_rank())
    params = packed_seq_params(cu)
    out = None
    with torch.no_grad():  # hand-run pipeline: chunk v of stage 0, chunk v of stage 1, chunk v+1 of stage 0, ...
        for v, chunk in enumerate(chunks):
            if pp > 1 and not (pp_rank == 0 and v == 0):
                hidden = torch.empty(ids.shape[1], 1, config.hidden_size)
                dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
                chunk.set_input_tensor(hidden)
            y = chunk(ids, None, None, packed_seq_params=params)
            if pp > 1 and not (pp_rank == pp - 1 and v == vpp - 1):
                dist.send(y.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            elif pp_rank == pp - 1 and v == vpp - 1:
                out = y
    model = chunks
    if out is not None:
        tp = ps.get_tensor_model_parallel_world_size()
        if tp > 1:
            parts = [torch.empty_like(out) for _ in range(tp)]
            dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
            out = torch.cat(parts, dim=-1)
        want = _reference_logits(config, state, ids, cu)
        err = (out - want).abs().max().item()
        assert err <= 1e-5, f"rank {rank} {layout}: max abs logit error {err}"
    _, exported = _export_all(model)
    if rank == 0:
        _assert_bit_exact(config, state, exported)
    else:
        assert exported == {}


def _layouts_worker(rank, world, port, layouts):
    for layout in layouts:  # one process pair for all layouts: process start-up dominates on a loaded CI box
        _layout_worker(rank, world, port, layout)


@pytest.mark.slow
def test_parallel_layouts_load_forward_and_export():
    """TP2+SP, EP2 (unequal per-rank token counts), PP2 and PP2xVPP3, each: load, forward == reference, export exact."""
    spawn(_layouts_worker, 2, [dict(tp=2), dict(ep=2), dict(pp=2), dict(pp=2, vpp=3)], timeout=240)
