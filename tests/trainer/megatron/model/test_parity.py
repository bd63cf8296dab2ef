"""TP1 parity: Megatron Beam logits equal the reference `BeamForCausalLM` in float32 (max abs <= 1e-5)."""

import pytest
import torch

from beamrl.models.beam import preset
from beamrl.models.beam.weights import random_state_dict

from ._world import world1

# In-process Megatron on CPU: the compatibility layer for this module only (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("megatron_cpu_shim")


@pytest.fixture(scope="module")
def setup():
    world1()
    from beamrl.models.beam.model import BeamForCausalLM
    from beamrl.trainer.megatron.mapping import load_hf_weights
    from beamrl.trainer.megatron.model import build_beam_gpt_model

    config = preset("tiny")
    state = random_state_dict(config, seed=3, dtype=torch.float32)
    ref = BeamForCausalLM(config, dtype=torch.float32, seed=None)
    ref.load_hf_tensors(state, strict=True)
    model = build_beam_gpt_model(config, params_dtype=torch.float32, pre_process=True, post_process=True)
    load_hf_weights(model, state)
    return config, state, ref, model


def _packed(config, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, config.vocab_size, (1, sum(lengths)), generator=g)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    return ids, cu


def test_packed_logits_match_reference(setup):
    from beamrl.trainer.megatron.model import packed_seq_params

    config, _, ref, model = setup
    ids, cu = _packed(config, [20, 13, 31])  # longer than the window (8): SWA and full layers both matter
    with torch.no_grad():
        want = ref(ids, cu_seqlens=cu).logits
        got = model(ids, None, None, packed_seq_params=packed_seq_params(cu))
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-5


def test_unpacked_batch_matches_reference(setup):
    config, _, ref, model = setup
    ids = torch.randint(1, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits
        got = model(ids, None, None)
    assert (got - want).abs().max().item() <= 1e-5


def test_softcap_applies(setup):
    config, _, _, model = setup
    ids = torch.randint(1, config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = model(ids, None, None)
    assert logits.abs().max().item() < config.final_logit_softcapping


def test_attention_mask_is_refused_not_ignored(setup):
    config, _, _, model = setup
    ids = torch.randint(1, config.vocab_size, (1, 8))
    with pytest.raises(ValueError, match="attention_mask"):
        model(ids, None, torch.ones(1, 1, 8, 8, dtype=torch.bool))
