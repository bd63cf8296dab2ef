"""ops dispatch: backend validation and the explicit errors of the fused path (no silent fallback)."""

import pytest
import torch

from beamrl.kernels import ops


def _qk():
    q = torch.randn(3, 2, 8, dtype=torch.bfloat16)
    k = torch.randn(3, 1, 8, dtype=torch.bfloat16)
    return q, k, torch.ones(8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16)


@pytest.mark.parametrize("call", [
    lambda b: ops.qk_norm_ssmax(*_qk(), torch.ones(3), 1e-6, backend=b),
    lambda b: ops.output_gate(*_qk()[:1], _qk()[0], torch.zeros(2, dtype=torch.bfloat16), backend=b),
    lambda b: ops.route(torch.randn(3, 8), torch.randn(4, 8), torch.zeros(4), 2, 2, 1, backend=b),
    lambda b: ops.attention(*_qk()[:2], _qk()[1], torch.tensor([0, 3]), None, backend=b),
])
def test_unknown_backend_is_refused(call):
    with pytest.raises(ops.KernelBackendError, match="backend must be one of"):
        call("cuda-fast")


def test_triton_on_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ops.KernelBackendError, match="needs CUDA tensors"):
        ops.qk_norm_ssmax(*_qk(), torch.ones(3), 1e-6, backend="triton")
    with pytest.raises(ops.KernelBackendError, match="needs CUDA tensors"):
        ops.route(torch.randn(3, 8), torch.randn(4, 8), torch.zeros(4), 2, 2, 1, backend="triton")


def test_block_mask_only_with_flex():
    q, k, _, _ = _qk()
    with pytest.raises(ops.KernelBackendError, match="block_mask"):
        ops.attention(q, k, k, torch.tensor([0, 3]), None, backend="eager", block_mask=object())


def test_forced_ids_shape_is_checked():
    with pytest.raises(ops.KernelBackendError, match="forced_ids"):
        ops.route(torch.randn(3, 8), torch.randn(4, 8), torch.zeros(4), 2, 2, 1,
                  forced_ids=torch.zeros(3, 3, dtype=torch.int64))
