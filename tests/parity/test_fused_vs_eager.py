"""Fused vs eager trainer logprobs: the bf16-tolerance criterion (CPU) and the real comparison (CUDA, issue #6)."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from beamrl.parity.fused_vs_eager import MAX_RATIO, MEAN_RATIO, FusedVsEager, Gap, route_agreement


def _result(eager: Gap, fused: Gap) -> FusedVsEager:
    return FusedVsEager(tokens=10, params=1, eager_vs_fp32=eager, fused_vs_fp32=fused,
                        fused_vs_eager_replayed=Gap(0, 0), fused_vs_eager_free=Gap(0, 0), free_route_agreement=1.0,
                        seconds=0.0)


def test_tolerance_is_relative_to_eager_bf16_error():
    eager = Gap(mean=1e-2, max=0.1)
    assert _result(eager, Gap(mean=1e-2 * MEAN_RATIO, max=0.1)).within_bf16_tolerance()[0]
    assert not _result(eager, Gap(mean=1e-2 * MEAN_RATIO * 1.01, max=0.1)).within_bf16_tolerance()[0]
    ok, why = _result(eager, Gap(mean=1e-3, max=0.1 * MAX_RATIO * 1.01)).within_bf16_tolerance()
    assert not ok and "max" in why


def test_gap_refuses_non_finite_logprobs():
    with pytest.raises(ValueError, match="non-finite"):
        Gap.of(torch.tensor([0.0, float("nan")]), torch.zeros(2))


def test_route_agreement_counts_sets_on_moe_layers_only():
    a = torch.tensor([[[-1, -1], [1, 2]], [[-1, -1], [3, 4]]])
    b = torch.tensor([[[-1, -1], [2, 1]], [[-1, -1], [3, 5]]])  # same set in token 0, not in token 1
    assert route_agreement(a, b, [1]) == 0.5
    with pytest.raises(ValueError):
        route_agreement(a, b[:1], [1])


def test_command_refuses_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("the refusal is for machines without CUDA")
    p = subprocess.run([sys.executable, "-m", "beamrl.parity.fused_vs_eager", "--layers", "2"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and "CUDA" in p.stderr


def test_self_check_runs_the_four_passes_on_cpu(tmp_path):
    """The comparison itself (record, replay, FP32 yardstick) on the real Megatron trainer, with the eager path
    in place of the fused one: fused-vs-eager gaps must be exactly 0, bf16-vs-FP32 must not."""
    out = tmp_path / "self_check.json"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:  # a parent's live store on MASTER_PORT
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(busy.getsockname()[1])}
        p = subprocess.run([sys.executable, "-m", "beamrl.parity.fused_vs_eager", "--tiny", "--self-check",
                            "--layers", "2", "--num-sequences", "2", "--seq-len", "32", "--json", str(out)],
                           capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["fused_vs_eager_free"] == {"mean": 0.0, "max": 0.0}
    assert r["fused_vs_eager_replayed"] == {"mean": 0.0, "max": 0.0}
    assert r["free_route_agreement"] == 1.0 and r["fused_vs_fp32"] == r["eager_vs_fp32"]
    assert r["eager_vs_fp32"]["mean"] > 0 and r["tokens"] == 64 and r["within_bf16_tolerance"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused path is CUDA-only; run on the H200")
def test_fused_path_within_bf16_tolerance_of_eager_on_gpu(tmp_path):
    out = tmp_path / "fused_vs_eager.json"
    p = subprocess.run([sys.executable, "-m", "beamrl.parity.fused_vs_eager", "--layers", "2", "--num-sequences",
                        "4", "--seq-len", "512", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
