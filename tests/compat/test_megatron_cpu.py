"""`beamrl.compat.megatron_cpu`: a stock Megatron GPTModel builds and trains one step on CPU (world 1, gloo)."""

import os

import pytest
import torch

from beamrl.compat import megatron_cpu

# In-process Megatron on CPU: the compatibility layer for this module only (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("megatron_cpu_shim")


@pytest.fixture(scope="module")
def world1():
    megatron_cpu.activate()
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    created = False
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = "0"  # one rank hosts the store: the OS picks the port as it binds
        dist.init_process_group("gloo", rank=0, world_size=1)
        created = True
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    yield
    parallel_state.destroy_model_parallel()
    if created:
        dist.destroy_process_group()


def test_activate_is_idempotent():
    megatron_cpu.activate()
    megatron_cpu.activate()
    assert megatron_cpu.is_active()


def test_cuda_requests_land_on_cpu():
    megatron_cpu.activate()
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.ones(2).cuda().device.type == "cpu"
    assert torch.ones(2).to(torch.cuda.current_device()).device.type == "cpu"
    assert torch.ones(2).to("cuda:0", torch.float64).dtype == torch.float64
    assert torch.ones(2, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.ones(2).type(torch.float64).dtype == torch.float64  # casts unchanged
    # W2: streams and events are no-ops that report completion (CPU work is synchronous)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        ev = torch.cuda.Event()
        ev.record()
    assert ev.query() and stream.query() and torch.cuda.current_stream().query()
    assert torch.cuda.current_stream().wait_event(ev) is None and torch.cuda.synchronize() is None
    assert torch.cuda.current_stream() == torch.cuda.default_stream() == stream
    t = torch.ones(2)
    t.record_stream(stream)  # a no-op, not "requires CUDA"
    assert torch.cuda.current_device() == 0


def test_deactivate_restores_torch_and_megatron():
    """The layer can be scoped: deactivate() puts back every patched attribute and the CUDA redirect is gone."""
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import torch_norm

    megatron_cpu.activate()
    patched = [(obj, name, getattr(obj, name)) for obj, name, _ in megatron_cpu._saved]
    assert len(patched) >= 20
    megatron_cpu.deactivate()
    try:
        assert not megatron_cpu.is_active() and not megatron_cpu._saved
        for obj, name, value in patched:
            assert getattr(obj, name) is not value, f"{obj}.{name} is still patched"
        assert "type" not in vars(torch.Tensor)  # an inherited method is deleted again, not shadowed
        assert isinstance(vars(torch_norm.WrappedTorchNorm)["__new__"], staticmethod)
        assert mrandom._get_cuda_rng_state.__module__ == mrandom.__name__
        assert torch.ones(2).type() == "torch.FloatTensor"
        with pytest.raises((AssertionError, RuntimeError)):  # no CUDA here: the request is no longer redirected
            torch.zeros(1, device="cuda")
        megatron_cpu.deactivate()  # idempotent
    finally:
        megatron_cpu.activate()  # the rest of this module runs with the layer (megatron_cpu_shim)
    assert torch.zeros(1, device="cuda").device.type == "cpu"


def test_device_rewrites_cover_every_form_without_a_torch_function_mode():
    megatron_cpu.activate()
    # No process-wide mode: it would run a Python handler for every torch op (W3 in the module docstring).
    assert torch._C._len_torch_function_stack() == 0
    x = torch.ones(3)
    for t in (torch.arange(3, device="cuda:0"), torch.empty(2, device=torch.device("cuda")),
              torch.tensor([1.0], device=0), torch.zeros_like(x, device="cuda"), torch.full((2,), 1.0, device="cuda"),
              x.new_zeros(2, device="cuda"), x.new_tensor([1.0], device=torch.cuda.current_device()),
              x.to(device="cuda"), x.to(torch.device("cuda", 0), torch.float64), x.to(0)):
        assert t.device.type == "cpu"
    assert x.to(torch.float64).dtype == torch.float64 and x.to(x).dtype == x.dtype  # non-device calls unchanged
    assert torch.zeros(2, device="meta").device.type == "meta"  # other devices untouched


def test_refuses_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(megatron_cpu, "_active", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(megatron_cpu.MegatronCpuError, match="CUDA"):
        megatron_cpu.activate()


def test_named_rng_streams_are_kept(world1):
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    assert {"model-parallel-rng", "expert-parallel-rng", "data-parallel-rng"} <= set(tracker.get_states())
    before = torch.get_rng_state()
    with tracker.fork("model-parallel-rng"):
        a = torch.rand(3)
    with tracker.fork("expert-parallel-rng"):
        b = torch.rand(3)
    assert not torch.equal(a, b)  # distinct streams
    assert torch.equal(torch.get_rng_state(), before)  # the default stream is restored


def test_stock_gpt_model_forward_backward(world1):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                            normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False,
                            num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                            moe_token_dispatcher_type="alltoall", hidden_dropout=0.0, attention_dropout=0.0,
                            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    model = GPTModel(cfg, get_gpt_layer_local_spec(num_experts=4), vocab_size=64, max_sequence_length=32)
    ids = torch.randint(0, 64, (2, 16))
    pos = torch.arange(16).expand(2, 16)
    loss = model(ids, pos, attention_mask=None, labels=ids).float().mean()
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_sequence_parallel_norm_is_marked_for_tp_allreduce():
    megatron_cpu.activate()
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm")
    cfg.sequence_parallel = True  # set after construction: at TP1 the config would reject it
    norm = WrappedTorchNorm(cfg, 8, eps=1e-6)
    assert getattr(norm.weight, "sequence_parallel", False)
    x = torch.randn(3, 8)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(norm(x), ref)


def test_split_sizes_become_numpy_for_gloo():
    import numpy as np

    megatron_cpu.activate()
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    for ns in (moe_utils, token_dispatcher):
        out = ns.maybe_move_tensor_to_cpu(torch.tensor([69, 62]), as_numpy=True)
        assert isinstance(out, np.ndarray) and out.tolist() == [69, 62]


def test_triton_free_paged_stash_stub():
    """W0 (only installed when triton is missing): the one triton-importing module is served as raising stubs."""
    import importlib.util

    spec = megatron_cpu._PagedStashStubFinder().find_spec(megatron_cpu.PAGED_STASH_OPS)
    assert megatron_cpu._PagedStashStubFinder().find_spec("triton") is None  # never a global fake triton
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.GLOBAL_BLOCK_SIZE == 1024
    with pytest.raises(megatron_cpu.MegatronCpuError, match="paged stash"):
        module.paged_stash_copy_kernel()


def test_foreach_grad_norm_and_scale_equal_megatron_fallbacks():
    """W6: the grad-norm and grad-clip replacements give Megatron's fallback results bit for bit, and
    `clip_grads` uses them while the layer is active."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    megatron_cpu.activate()
    assert clip_grads.l2_norm_impl is megatron_cpu.foreach_l2_norm
    assert clip_grads.multi_tensor_scale_impl is megatron_cpu.foreach_scale
    g = torch.Generator().manual_seed(0)
    shapes = [(16, 64), (4,), (64,), (16, 2, 64, 32), (16, 64, 32), (512, 64), (1,)] * 10  # the quickstart's kinds
    grads = [torch.randn(s, generator=g) * torch.rand(1, generator=g).item() for s in shapes]
    want, _ = utils.local_multi_tensor_l2_norm(2048 * 32, None, [grads], False)
    got, _ = megatron_cpu.foreach_l2_norm(2048 * 32, None, [grads], False)
    assert got.dtype == want.dtype and torch.equal(got, want)
    scaled_want = [t.clone() for t in grads]
    utils.local_multi_tensor_scale(2048 * 32, None, [scaled_want, scaled_want], 0.37)
    scaled_got = [t.clone() for t in grads]
    megatron_cpu.foreach_scale(2048 * 32, None, [scaled_got, scaled_got], 0.37)
    assert all(torch.equal(a, b) for a, b in zip(scaled_got, scaled_want))
    # dst other than src: Megatron's copy semantics
    out = [torch.empty_like(t) for t in grads]
    megatron_cpu.foreach_scale(2048 * 32, None, [grads, out], 0.37)
    assert all(torch.equal(a, b) for a, b in zip(out, scaled_want))
