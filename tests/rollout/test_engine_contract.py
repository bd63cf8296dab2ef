"""One contract for every rollout engine: the real SGLang CPU engine (in-process and HTTP server), the embedded
`native` engine, and the `FakeEngine` used by fast unit tests (so the fake cannot drift from the real thing).

Each engine is started once per module (SGLang: ~25-100 s per start on a loaded 2-core machine). The dead-engine
test kills the engine, so it runs last for each engine.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch

from beamrl.models.beam import preset
from beamrl.net import reserve_port
from beamrl.processes import running
from beamrl.protocols.rollout import EngineError, GenerateRequest, SamplingParams
from beamrl.protocols.flat_bucket import FlatBucket
from beamrl.protocols.weights import WeightSyncError
from beamrl.sync.packing import pack_session

from .fake_engine import FakeEngine

# The SGLang engines take ~20-25 s to start on an idle 2-core machine (minutes when it is loaded): slow.
ENGINES = [pytest.param("sglang", marks=pytest.mark.slow), pytest.param("sglang-http", marks=pytest.mark.slow),
           "native", "fake"]
T = 180.0  # generous call timeout: the CPU is shared
# Engines whose logprobs come from a real Beam forward (the fake's are pseudo-random).
REAL_NUMERICS = {"sglang", "sglang-http", "native"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Tiny Beam stored in bf16 (SGLang keeps lm_head in bf16, so bf16-representable weights make fp32 exact)."""
    from beamrl.models.beam.checkpoint import save_checkpoint
    from beamrl.models.beam.weights import random_state_dict

    config = preset("tiny").replace(dtype="bfloat16")
    out = tmp_path_factory.mktemp("contract_ckpt")
    save_checkpoint(config, random_state_dict(config, 7, torch.bfloat16), out)
    return out


@pytest.fixture(scope="module", params=ENGINES)
def engine(request, checkpoint):
    name = request.param
    if name in ("sglang", "sglang-http"):
        from beamrl.rollout.sglang.config import SGLangEngineConfig

        with reserve_port() as reserved:  # held until the engine's server has bound it
            cfg = SGLangEngineConfig.on_cpu(checkpoint, dtype="float32", enable_fp32_lm_head=True,
                                              port=reserved.port)
            if name == "sglang":
                from beamrl.rollout.sglang.engine import SGLangEngine

                eng = SGLangEngine(cfg, start_timeout=600)
            else:
                from beamrl.rollout.sglang.http_engine import SGLangHTTPEngine

                eng = SGLangHTTPEngine.launch(cfg, start_timeout=600)
    elif name == "native":
        from beamrl.rollout.native import NativeEngine, NativeEngineConfig

        eng = NativeEngine(NativeEngineConfig(model_path=str(checkpoint), dtype="float32"))
    else:
        eng = FakeEngine(preset("tiny"))
    eng.contract_name = name
    yield eng
    eng.shutdown()


def _kill(engine) -> None:
    """Kill the engine the hard way its kind allows (SIGKILL of its processes; in-process engines: shutdown) and
    wait (bounded) until its processes are gone."""
    name = engine.contract_name
    if name == "sglang":
        for pid in engine.child_pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 60
        while any(running(pid) for pid in engine.child_pids):
            assert time.monotonic() < deadline, "SIGKILLed SGLang processes still alive after 60 s"
            time.sleep(0.05)
    elif name == "sglang-http":
        os.killpg(engine.server.pid, signal.SIGKILL)
        engine.server.process.wait(timeout=60)
    elif name == "native":
        engine.shutdown()
    else:
        engine.kill()


def _req(prompt, n=4, temperature=1.0, seed=None, routes=True, stop=(), ignore_eos=True):
    return GenerateRequest(prompt_ids=list(prompt), return_routed_experts=routes,
                           sampling=SamplingParams(max_new_tokens=n, temperature=temperature, seed=seed,
                                                   ignore_eos=ignore_eos, stop_token_ids=tuple(stop)))


def test_generate_shapes_and_alignment(engine):
    c = preset("tiny")
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    results = engine.generate([_req(prompts[0], 4), _req(prompts[1], 3)], timeout=T)
    assert len(results) == 2
    for prompt, n, res in zip(prompts, (4, 3), results):
        assert res.prompt_ids == prompt
        assert len(res.output_ids) == n and res.finish_reason == "length"
        assert len(res.output_logprobs) == n
        assert all(lp <= 0 and np.isfinite(lp) for lp in res.output_logprobs)
        assert all(0 <= t < c.vocab_size for t in res.output_ids)
        assert isinstance(res.weight_version, int)
        r = res.routed_experts
        assert r.dtype == np.int32 and r.shape == (len(prompt) + n - 1, c.num_hidden_layers, c.num_experts_per_tok)
        dense = [i for i in range(c.num_hidden_layers) if not c.is_moe(i)]
        assert (r[:, dense] == -1).all()
        moe = r[:, c.moe_layers]
        assert ((moe >= 0) & (moe < c.num_experts)).all()
        # top-k ids of one token and layer are distinct experts
        assert (np.sort(moe, axis=-1)[..., 1:] != np.sort(moe, axis=-1)[..., :-1]).all()


def test_no_routes_unless_asked(engine):
    (res,) = engine.generate([_req([3, 4, 5], 2, routes=False)], timeout=T)
    assert res.routed_experts is None


def test_greedy_is_reproducible(engine):
    a = engine.generate([_req([21, 22, 23, 24], 5, temperature=0.0, routes=False)], timeout=T)[0]
    b = engine.generate([_req([21, 22, 23, 24], 5, temperature=0.0, routes=False)], timeout=T)[0]
    assert a.output_ids == b.output_ids


def test_seeded_sampling_is_reproducible(engine, request):
    if engine.contract_name.startswith("sglang"):
        # SGLang 0.5.23 honours sampling_seed only with --enable-deterministic-inference
        # (sampling_batch_info.py:157-170), which the CPU engine cannot use (torch_native attention).
        request.applymarker(pytest.mark.xfail(strict=True, reason="SGLang CPU engine ignores sampling_seed"))
    outs = [engine.generate([_req([31, 32, 33], 8, seed=1234, routes=False)], timeout=T)[0].output_ids
            for _ in range(2)]
    assert outs[0] == outs[1]


def test_stop_token_finishes_with_stop(engine):
    # ignore_eos=False: SGLang 0.5.23 skips *all* token stops (stop_token_ids too) when ignore_eos is set
    # (schedule_batch.py:1856-1858).
    first = engine.generate([_req([41, 42, 43], 6, temperature=0.0, routes=False, ignore_eos=False)], timeout=T)[0]
    stop = first.output_ids[min(2, len(first.output_ids) - 1)]
    res = engine.generate([_req([41, 42, 43], 6, temperature=0.0, routes=True, stop=[stop], ignore_eos=False)],
                          timeout=T)[0]
    assert res.finish_reason == "stop"
    assert res.output_ids[-1] == stop and res.output_ids == first.output_ids[: res.output_ids.index(stop) + 1]
    assert len(res.output_logprobs) == len(res.output_ids)
    assert res.routed_experts.shape[0] == 3 + len(res.output_ids) - 1


def test_update_outside_session_fails(engine):
    with pytest.raises(WeightSyncError, match="begin_weight_update"):
        engine.update_weights_from_distributed(0, (0, 0), "no_such_group", timeout=T)
    bucket = FlatBucket.from_named_tensors([("model.norm.weight", torch.ones(64))])
    bucket.index, bucket.checksum = 0, (0, 0)
    with pytest.raises(WeightSyncError, match="begin_weight_update"):
        engine.update_weights_from_tensor(bucket, timeout=T)


def test_flat_bucket_update_matches_reference_and_bumps_version(engine, checkpoint, tmp_path):
    from beamrl.models.beam.model import BeamForCausalLM

    ref = BeamForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    state = dict(ref.state_dict())
    layer = preset("tiny").moe_layers[0]
    new = {
        "model.norm.weight": state["model.norm.weight"] * 1.25,
        # SGLang stores lm_head in bf16: keep the new values bf16-representable so fp32 stays exact.
        "lm_head.weight": (state["lm_head.weight"] + 0.05 * torch.randn(state["lm_head.weight"].shape, generator=g))
        .bfloat16().float(),
        f"model.layers.{layer}.mlp.gate.weight": state[f"model.layers.{layer}.mlp.gate.weight"]
        + 0.1 * torch.randn(state[f"model.layers.{layer}.mlp.gate.weight"].shape, generator=g),
        f"model.layers.{layer}.mlp.experts.0.down_proj.weight":
            state[f"model.layers.{layer}.mlp.experts.0.down_proj.weight"] * 0.5,
    }
    seqs = [[1, 5, 9, 13, 17, 21, 25, 29], [100, 3, 200, 7]]
    v = engine.weight_version
    manifest, buckets = pack_session(list({**state, **new}.items()), v + 1, bucket_bytes=1 << 16)
    if engine.contract_name not in REAL_NUMERICS:  # the fake has no model: the session and version contract only
        engine.begin_weight_update(manifest, timeout=T)
        for bucket in buckets:
            engine.update_weights_from_tensor(bucket, timeout=T)
        engine.end_weight_update(v + 1, timeout=T)
        (res,) = engine.generate([_req([1, 2, 3], 2, routes=False)], timeout=T)
        assert engine.weight_version == v + 1 == res.weight_version
        return
    before = engine.score(seqs, timeout=T)
    if engine.contract_name == "sglang-http":
        # Over HTTP the tensor path carries CUDA-IPC handles: a CPU bucket is refused by name, the server lives,
        # and the same weights go in through the disk path instead.
        engine.begin_weight_update(manifest, timeout=T)
        try:
            with pytest.raises(WeightSyncError, match="CUDA"):
                engine.update_weights_from_tensor(buckets[0], timeout=T)
        finally:
            assert engine.abort_weight_update("refused", timeout=T) == "untouched"
        assert engine.health(timeout=T)
        from beamrl.models.beam.checkpoint import save_checkpoint

        updated = {**state, **new}
        out = tmp_path / "updated"
        save_checkpoint(ref.config.replace(dtype="float32"), {k: v_.contiguous() for k, v_ in updated.items()}, out)
        engine.update_weights_from_disk(str(out), timeout=T)
        engine.update_weight_version(v + 1, timeout=T)
    else:
        engine.begin_weight_update(manifest, timeout=T)
        for bucket in buckets:
            engine.update_weights_from_tensor(bucket, timeout=T)
        engine.end_weight_update(v + 1, timeout=T)
    assert engine.weight_version == v + 1
    after = engine.score(seqs, timeout=T)
    ref.load_hf_tensors(new)
    want = [ref.token_logprobs(torch.tensor([s])).squeeze(0).tolist() for s in seqs]
    for a, w, b in zip(after, want, before):
        assert np.max(np.abs(np.array(a) - np.array(w))) < 1e-4
        assert np.max(np.abs(np.array(a) - np.array(b))) > 1e-3  # the update really changed the model
    (res,) = engine.generate([_req([1, 2, 3], 2, routes=False)], timeout=T)
    assert res.weight_version == v + 1


def test_health_answers_while_a_generate_runs(engine):
    """The loop checks an engine's health while it waits on a rollout: the answer may not queue behind the
    `generate` in progress (a busy engine taken for a dead one is restarted)."""
    import threading

    if engine.contract_name == "fake":
        pytest.skip("the fake's generate returns at once: nothing to overlap")
    busy = threading.Thread(target=engine.generate, args=([_req([5, 6, 7], 192) for _ in range(4)], T))
    busy.start()
    try:
        time.sleep(0.5)  # the generate has the engine
        t0 = time.monotonic()
        assert engine.health(timeout=30.0)
        answered = time.monotonic() - t0
        still_busy = busy.is_alive()
    finally:
        busy.join(T)
    assert still_busy, "the generate ended before the health check: make it longer"
    assert answered < 5.0


def test_dead_engine_fails_fast_with_clear_message(engine):
    _kill(engine)
    # The death is detected, not waited out: a call that ran into its deadline would say "timed out" /
    # "deadline", which this pattern does not accept.
    with pytest.raises(EngineError, match=r"(?i)dead|exited|not running|shutdown") as info:
        engine.generate([_req([1, 2, 3], 2)], timeout=T)
    assert not any(w in str(info.value).lower() for w in ("timed out", "deadline")), str(info.value)
    assert engine.health(timeout=5.0) is False
