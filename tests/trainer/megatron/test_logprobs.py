"""Vocab-parallel logprobs/entropy equal a full-vocabulary log_softmax of softcap(logits)/T, values and gradients."""

import pytest
import torch

from beamrl.trainer.megatron.launch import launch
from beamrl.trainer.megatron.logprobs import vocab_parallel_logprobs

CAP, TEMP = 30.0, 0.7


def _reference(logits, targets, temperature, cap):
    z = (torch.tanh(logits.double() / cap) * cap) / temperature
    logp = torch.log_softmax(z, dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def _inputs(seed=0, shape=(3, 5, 40)):
    g = torch.Generator().manual_seed(seed)
    logits = 20 * torch.randn(shape, generator=g)  # large enough that the softcap matters
    targets = torch.randint(0, shape[-1], shape[:-1], generator=g)
    weights = torch.randn(shape[:-1], generator=g)
    return logits, targets, weights


def test_single_rank_matches_log_softmax():
    logits, targets, w = _inputs()
    x = logits.clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(x, targets, TEMP, CAP)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    ref_lp, ref_ent = _reference(logits, targets, TEMP, CAP)
    torch.testing.assert_close(lp.double(), ref_lp, atol=2e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=2e-5, rtol=0)
    ((lp + 0.3 * ent) * w).sum().backward()
    y = logits.double().clone().requires_grad_(True)
    a, b = _reference(y, targets, TEMP, CAP)
    ((a + 0.3 * b) * w.double()).sum().backward()
    torch.testing.assert_close(x.grad.double(), y.grad, atol=1e-5, rtol=1e-4)


def test_bf16_logits_are_upcast_before_the_softcap():
    logits, targets, _ = _inputs()
    lp16, _ = vocab_parallel_logprobs(logits.bfloat16(), targets, 1.0, CAP, return_entropy=False)
    ref, _ = _reference(logits.bfloat16().float(), targets, 1.0, CAP)
    torch.testing.assert_close(lp16.double(), ref, atol=2e-5, rtol=0)


def test_temperature_must_be_positive():
    logits, targets, _ = _inputs()
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs(logits, targets, 0.0, CAP)


def _sharded_rank():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    logits, targets, w = _inputs(seed=3)
    v = logits.shape[-1] // world
    x = logits[..., rank * v:(rank + 1) * v].clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(x, targets, TEMP, CAP, group=dist.group.WORLD, vocab_start=rank * v)
    ((lp - 0.5 * ent) * w).sum().backward()
    return lp.detach(), ent.detach(), x.grad


@pytest.mark.slow
def test_two_shards_match_the_full_vocabulary():
    """Values and gradients of each shard equal the full-vocab computation (an entropy written with the
    partition function inside a rank-local term gets wrong gradients; this catches it)."""
    out = launch(_sharded_rank, 2, timeout_s=300)
    logits, targets, w = _inputs(seed=3)
    y = logits.double().clone().requires_grad_(True)
    ref_lp, ref_ent = _reference(y, targets, TEMP, CAP)
    ((ref_lp - 0.5 * ref_ent) * w.double()).sum().backward()
    v = logits.shape[-1] // 2
    for rank, (lp, ent, grad) in enumerate(out):
        torch.testing.assert_close(lp.double(), ref_lp.detach(), atol=2e-5, rtol=0)
        torch.testing.assert_close(ent.double(), ref_ent.detach(), atol=2e-5, rtol=0)
        torch.testing.assert_close(grad.double(), y.grad[..., rank * v:(rank + 1) * v], atol=1e-5, rtol=1e-4)
