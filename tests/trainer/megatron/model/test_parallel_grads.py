"""Gradients of the Beam Megatron modules under TP2+SP and EP2 equal the reference model's (float32), after the
reductions Megatron's DDP / finalize_model_grads would apply (which the parameter flags select): this checks the
custom autograd paths (EP token exchange, SP slicing of routes/tokens) and the `sequence_parallel` /
`allreduce` / q-k-norm flags together. Every rank runs the same batch (its SP slice under TP), so after the
expert-data-parallel reduction an expert parameter holds world/tp copies of the reference gradient."""

import pytest
import torch

from beamrl.models.beam import preset
from beamrl.models.beam.weights import random_state_dict

from ._world import init_megatron, spawn

SEED = 21


def _grads_worker(rank, world, port, layouts):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from beamrl.models.beam.model import BeamForCausalLM
    from beamrl.trainer.megatron.mapping import load_hf_weights
    from beamrl.trainer.megatron.model import (beam_transformer_config, build_beam_gpt_model,
                                               current_parallel_settings, packed_seq_params)

    config = preset("tiny")
    state = random_state_dict(config, seed=SEED, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, config.vocab_size, (1, 48), generator=g)
    cu = torch.tensor([0, 30, 48], dtype=torch.int32)
    probe = torch.randn(48, config.vocab_size, generator=g)
    ref = BeamForCausalLM(config, dtype=torch.float32, seed=None)
    ref.load_hf_tensors(state, strict=True)
    (ref(ids, cu_seqlens=cu).logits[0] * probe).sum().backward()
    ref_grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in ref.named_parameters()}
    for layout in layouts:
        layout = dict(layout)
        dispatcher = layout.pop("dispatcher", "alltoall")
        init_megatron(rank, world, port, **layout)
        tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        tconfig = beam_transformer_config(config, current_parallel_settings(), dtype=torch.float32,
                                          moe_token_dispatcher_type=dispatcher)
        model = build_beam_gpt_model(config, transformer_config=tconfig)
        load_hf_weights(model, state)
        expected = build_beam_gpt_model(config, params_dtype=torch.float32)
        load_hf_weights(expected, ref_grads)  # the reference gradient, sharded exactly like the parameters
        logits = model(ids, None, None, packed_seq_params=packed_seq_params(cu))
        v = config.vocab_size // tp
        (logits[0] * probe[:, tp_rank * v:(tp_rank + 1) * v]).sum().backward()
        want = dict(expected.named_parameters())
        for name, p in model.named_parameters():
            grad = p.grad.clone()
            expert = not getattr(p, "allreduce", True)
            if expert:  # DDP reduces expert params over the expert-data-parallel group
                if ps.get_expert_data_parallel_world_size() > 1:
                    dist.all_reduce(grad, group=ps.get_expert_data_parallel_group())
            elif tp > 1 and (getattr(p, "sequence_parallel", False) or "layernorm" in name):
                dist.all_reduce(grad, group=ps.get_tensor_model_parallel_group())  # partial over TP tokens/heads
            # the world holds world/tp copies of the batch's tokens; each copy reaches every expert once
            scale = world // tp if expert else 1
            target = scale * want[name]
            err = ((grad - target).abs().max() / target.abs().max().clamp(min=1e-6)).item()
            assert err <= 1e-5, f"{layout} {dispatcher} {name}: gradient differs from the reference by {err} (relative)"


@pytest.mark.slow
def test_gradients_match_reference_under_tp2_sp_and_ep2():
    """EP2 with both token exchanges (alltoall, allgather); TP2+SP; TP2+SP x EP2 on the same ranks."""
    spawn(_grads_worker, 2, [dict(tp=2), dict(ep=2), dict(ep=2, dispatcher="allgather"), dict(tp=2, ep=2)],
          timeout=300)
