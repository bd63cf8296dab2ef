"""NativeEngine against the reference model: seeds, logprobs, routes, stops, weight updates, memory, abort."""

import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch

from beamrl.models.beam import BeamForCausalLM, preset
from beamrl.models.beam.weights import random_state_dict
from beamrl.rollout.native import NativeEngine
from beamrl.protocols.rollout import EngineError, GenerateRequest, SamplingParams
from beamrl.protocols.flat_bucket import FlatBucket
from beamrl.protocols.weights import WeightSyncError
from beamrl.net import reserve_port
from beamrl.sync.packing import pack_session

T_OUT = 120.0


@pytest.fixture(scope="module")
def cfg():
    return preset("tiny")


@pytest.fixture(scope="module")
def ref(cfg):
    return BeamForCausalLM(cfg, dtype=torch.float32, seed=1).eval()


@pytest.fixture
def engine(cfg):
    e = NativeEngine.from_model(BeamForCausalLM(cfg, dtype=torch.float32, seed=1))
    yield e
    e.shutdown()


def _reqs(n_tokens=12, routes=True, **sp):
    prompts = [[5, 9, 33], [7, 1, 2, 3, 100, 200, 300, 17, 11, 12], [44], [250, 251, 252, 253, 254]]
    return [GenerateRequest(prompt_ids=p, sampling=SamplingParams(max_new_tokens=n_tokens, seed=10 + i, **sp),
                            return_routed_experts=routes, request_id=f"r{i}") for i, p in enumerate(prompts)]


def test_seeded_generation_is_reproducible_and_batch_independent(engine):
    reqs = _reqs(temperature=1.0, ignore_eos=True)
    a = engine.generate(reqs, T_OUT)
    b = engine.generate(reqs[::-1], T_OUT)[::-1]  # other order, so other batch rows
    c = engine.generate([reqs[1]], T_OUT)
    assert [r.output_ids for r in a] == [r.output_ids for r in b]
    assert a[1].output_ids == c[0].output_ids
    assert a[1].output_logprobs == pytest.approx(c[0].output_logprobs, abs=1e-5)
    other = engine.generate([GenerateRequest(prompt_ids=reqs[1].prompt_ids,
                                             sampling=SamplingParams(max_new_tokens=12, seed=999, ignore_eos=True))],
                            T_OUT)
    assert other[0].output_ids != a[1].output_ids
    assert all(r.finish_reason == "length" and len(r.output_ids) == 12 for r in a)
    assert [r.request_id for r in a] == ["r0", "r1", "r2", "r3"]


def test_logprobs_and_routes_equal_the_reference_model(engine, ref, cfg):
    reqs = _reqs(temperature=0.7, top_p=0.9, top_k=40, ignore_eos=True)
    for r in engine.generate(reqs, T_OUT):
        seq = torch.tensor(r.prompt_ids + r.output_ids).unsqueeze(0)
        lp = ref.token_logprobs(seq, temperature=0.7)[0, len(r.prompt_ids) - 1:]
        assert torch.allclose(torch.tensor(r.output_logprobs), lp, atol=1e-5), r.request_id
        with torch.no_grad():
            routes = ref(seq[:, :-1], return_routes=True).routes[0].numpy()
        assert r.routed_experts.dtype == np.int32
        assert r.routed_experts.shape == (len(r.prompt_ids) + len(r.output_ids) - 1, cfg.num_hidden_layers,
                                          cfg.num_experts_per_tok)
        assert np.array_equal(r.routed_experts, routes)
        assert (r.routed_experts[:, 0] == -1).all()  # dense layer 0


def test_greedy_equals_top_k_1_and_reference_argmax(engine, ref):
    greedy = engine.generate(_reqs(temperature=0.0, ignore_eos=True, routes=False), T_OUT)
    top1 = engine.generate(_reqs(temperature=1.3, top_k=1, ignore_eos=True, routes=False), T_OUT)
    assert [r.output_ids for r in greedy] == [r.output_ids for r in top1]
    r = greedy[1]
    seq = torch.tensor(r.prompt_ids + r.output_ids).unsqueeze(0)
    with torch.no_grad():
        logits = ref(seq).logits[0]
    P = len(r.prompt_ids)
    assert r.output_ids == logits[P - 1:-1].argmax(-1).tolist()
    # greedy logprobs are T = 1 logprobs (SGLang turns T = 0 into top_k = 1 at T = 1)
    assert torch.allclose(torch.tensor(r.output_logprobs), ref.token_logprobs(seq)[0, P - 1:], atol=1e-5)


def test_stop_tokens_eos_and_ignore_eos(engine):
    base = engine.generate([_reqs(temperature=0.0, ignore_eos=True, routes=True)[1]], T_OUT)[0]
    stop = base.output_ids[3]
    first = base.output_ids.index(stop)
    req = GenerateRequest(prompt_ids=base.prompt_ids, return_routed_experts=True,
                          sampling=SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(stop,)))
    r = engine.generate([req], T_OUT)[0]
    assert r.finish_reason == "stop" and r.output_ids == base.output_ids[: first + 1]
    assert r.routed_experts.shape[0] == len(r.prompt_ids) + len(r.output_ids) - 1
    assert np.array_equal(r.routed_experts, base.routed_experts[: r.routed_experts.shape[0]])



def test_requests_with_one_prompt_share_its_prefill(engine):
    """GRPO's n samples of a prompt: the prompt is prefilled once (one batch row per distinct prompt) and every
    sample still draws from its own seed, exactly as when generated alone."""
    prompts = [[5, 9, 33], [7, 1, 2, 3, 100, 17], [5, 9, 33], [44], [7, 1, 2, 3, 100, 17], [5, 9, 33]]
    reqs = [GenerateRequest(prompt_ids=p, return_routed_experts=True, request_id=f"r{i}",
                            sampling=SamplingParams(max_new_tokens=6, temperature=1.0, seed=100 + i, ignore_eos=True))
            for i, p in enumerate(prompts)]
    prefill_rows = []
    hook = engine.model.register_forward_hook(
        lambda mod, args, kwargs, out: prefill_rows.append(args[0].shape) if args[0].shape[1] > 1 else None,
        with_kwargs=True)
    try:
        together = engine.generate(reqs, T_OUT)
    finally:
        hook.remove()
    assert prefill_rows == [(3, 6)]  # 3 distinct prompts, left-padded to the longest
    for r, got in zip(reqs, together):
        alone = engine.generate([r], T_OUT)[0]
        assert got.request_id == r.request_id and got.prompt_ids == list(r.prompt_ids)
        assert got.output_ids == alone.output_ids
        assert got.output_logprobs == pytest.approx(alone.output_logprobs, abs=1e-5)
        assert np.array_equal(got.routed_experts, alone.routed_experts)
    copies = [together[i] for i in (0, 2, 5)]  # one prompt, three seeds: three samples, not one
    assert len({tuple(c.output_ids) for c in copies}) > 1
    assert all(np.array_equal(c.routed_experts[:3], copies[0].routed_experts[:3]) for c in copies)


def test_a_shared_prefill_keeps_each_request_s_own_limits_routes_and_batch(cfg):
    """Copies of one prompt that stop at different points (stop ids, max_new_tokens), that ask for routes or not, and
    that fall into different batches of `max_batch_size`, each give what they give when generated alone."""
    engine = NativeEngine.from_model(BeamForCausalLM(cfg, dtype=torch.float32, seed=1), max_batch_size=4)
    try:
        base = engine.generate([GenerateRequest(prompt_ids=[5, 9, 33], sampling=SamplingParams(
            max_new_tokens=8, temperature=0.0, ignore_eos=True))], T_OUT)[0]
        stop = base.output_ids[2]  # greedy copies of the prompt stop here; the others run to their limits
        reqs = [GenerateRequest(prompt_ids=p, return_routed_experts=i not in (1, 6), request_id=f"r{i}",
                                sampling=SamplingParams(max_new_tokens=3 + i, temperature=t, seed=7 + i,
                                                        stop_token_ids=(stop,), ignore_eos=True))
                for i, (p, t) in enumerate([([5, 9, 33], 0.0), ([5, 9, 33], 1.0), ([44], 1.0), ([5, 9, 33], 0.0),
                                            ([44], 0.0), ([5, 9, 33], 1.0), ([7, 1, 2, 3], 1.0), ([44], 1.0)])]
        together = engine.generate(reqs, T_OUT)
        for r, got in zip(reqs, together):
            alone = engine.generate([r], T_OUT)[0]
            assert (got.output_ids, got.finish_reason) == (alone.output_ids, alone.finish_reason), r.request_id
            assert got.output_logprobs == pytest.approx(alone.output_logprobs, abs=1e-5)
            assert (got.routed_experts is None) == (not r.return_routed_experts)
            if r.return_routed_experts:
                assert np.array_equal(got.routed_experts, alone.routed_experts)
        assert {together[i].finish_reason for i in (0, 3)} == {"stop"} and together[0].output_ids[-1] == stop
        assert {r.finish_reason for r in together} == {"stop", "length"}
    finally:
        engine.shutdown()

def test_score_equals_reference_token_logprobs(engine, ref):
    seqs = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [400, 3], [9, 8, 7, 6]]
    scores = engine.score(seqs, T_OUT)
    for s, got in zip(seqs, scores):
        assert len(got) == len(s) - 1
        assert torch.allclose(torch.tensor(got), ref.token_logprobs(torch.tensor([s]))[0], atol=1e-5)


def _session(sd, version, bucket_bytes=1 << 15):
    """A full weight-update session for the state dict `sd`: (manifest, buckets with index and checksum)."""
    return pack_session(list(sd.items()), version, bucket_bytes)


def test_weight_update_via_flat_buckets_matches_new_weights_and_bumps_version(engine, cfg):
    new = random_state_dict(cfg, seed=2, dtype=torch.float32)
    target = BeamForCausalLM(cfg, dtype=torch.float32, seed=2).eval()
    reqs = _reqs(temperature=0.0, ignore_eos=True, routes=False)
    before = engine.generate(reqs, T_OUT)
    manifest, buckets = _session(new, 5)
    engine.begin_weight_update(manifest, T_OUT)
    for b in buckets:
        engine.update_weights_from_tensor(b, T_OUT)
    with pytest.raises(EngineError, match="session"):
        engine.generate(reqs, T_OUT)  # never serves a half-updated model
    engine.end_weight_update(5, T_OUT)
    assert engine.weight_version == 5
    after = engine.generate(reqs, T_OUT)
    assert [r.output_ids for r in after] != [r.output_ids for r in before]
    assert all(r.weight_version == 5 for r in after)
    for r in after:
        seq = torch.tensor(r.prompt_ids + r.output_ids).unsqueeze(0)
        with torch.no_grad():
            logits = target(seq).logits[0]
        assert r.output_ids == logits[len(r.prompt_ids) - 1:-1].argmax(-1).tolist()


def test_update_outside_session_errors_and_changes_nothing(engine, cfg):
    new = random_state_dict(cfg, seed=3, dtype=torch.float32)
    _, buckets = _session(new, 1)
    with pytest.raises(WeightSyncError, match="between begin_weight_update"):
        engine.update_weights_from_tensor(buckets[0], T_OUT)
    with pytest.raises(WeightSyncError, match="begin_weight_update"):
        engine.end_weight_update(3, T_OUT)
    assert engine.weight_version == 0 and engine.health(T_OUT)
    assert not torch.equal(engine.model.state_dict()["lm_head.weight"], new["lm_head.weight"])


def _corrupt(bucket):
    buf = bucket.buffer.clone()
    buf[7] ^= 1
    return FlatBucket(buf, bucket.metas, index=bucket.index, checksum=bucket.checksum)


def test_a_bad_bucket_after_good_ones_is_rolled_back_on_cpu(engine, cfg):
    """CPU default: the session's writes are undone; the engine serves its previous weights and version."""
    old = {k: v.clone() for k, v in engine.model.state_dict().items()}
    manifest, buckets = _session(random_state_dict(cfg, seed=4, dtype=torch.float32), 7)
    engine.begin_weight_update(manifest, T_OUT)
    engine.update_weights_from_tensor(buckets[0], T_OUT)
    with pytest.raises(WeightSyncError, match="bucket 1 failed its checksum"):
        engine.update_weights_from_tensor(_corrupt(buckets[1]), T_OUT)
    assert engine.abort_weight_update("bucket 1 refused", T_OUT) == "rolled back"
    assert engine.weight_version == 0 and engine.health(T_OUT)
    assert all(torch.equal(v, old[k]) for k, v in engine.model.state_dict().items())
    assert len(engine.generate(_reqs(), T_OUT)) == 4


def test_without_rollback_a_failed_update_stops_serving_until_full_reload(cfg, tmp_path):
    engine = NativeEngine.from_model(BeamForCausalLM(cfg, dtype=torch.float32, seed=1), rollback=False)
    new = random_state_dict(cfg, seed=4, dtype=torch.float32)
    manifest, buckets = _session(new, 7)
    engine.begin_weight_update(manifest, T_OUT)
    engine.update_weights_from_tensor(buckets[0], T_OUT)
    with pytest.raises(WeightSyncError, match="failed its checksum"):
        engine.update_weights_from_tensor(_corrupt(buckets[1]), T_OUT)
    with pytest.raises(WeightSyncError, match=r"without serving version 7 \(unhealthy\)"):
        engine.end_weight_update(7, T_OUT)
    assert engine.weight_version == 0 and not engine.health(T_OUT)
    with pytest.raises(EngineError, match="not serving"):
        engine.generate(_reqs(), T_OUT)
    model = BeamForCausalLM(cfg, dtype=torch.float32, seed=4)
    model.save_pretrained(tmp_path)
    engine.update_weights_from_disk(str(tmp_path), T_OUT)
    assert engine.health(T_OUT)
    assert all(torch.equal(v, new[k]) for k, v in engine.model.state_dict().items())
    engine.shutdown()


def test_release_and_resume_weights(engine):
    reqs = _reqs(temperature=0.0, routes=False)
    before = engine.generate(reqs, T_OUT)
    engine.release_memory(None, T_OUT)
    assert engine.model.lm_head.weight.numel() == 0
    with pytest.raises(EngineError, match="released"):
        engine.generate(reqs, T_OUT)
    manifest, _ = _session(dict(BeamForCausalLM(preset("tiny"), dtype=torch.float32, seed=9).state_dict()), 1)
    with pytest.raises(WeightSyncError, match="released"):
        engine.begin_weight_update(manifest, T_OUT)
    assert engine.weight_version == 0  # a refused update changed nothing
    with pytest.raises(EngineError, match="unknown memory tag"):
        engine.resume_memory(["bogus"], T_OUT)
    engine.resume_memory(["weights"], T_OUT)
    engine.resume_memory(["kv_cache", "cuda_graph"], T_OUT)
    assert engine.health(T_OUT)
    assert [r.output_ids for r in engine.generate(reqs, T_OUT)] == [r.output_ids for r in before]


def test_release_without_backup_serves_only_after_a_full_load(cfg, tmp_path):
    """weights_cpu_backup off (SGLang's default): nothing is copied out; after resume the engine is healthy but
    refuses work until a full weight update has loaded every weight; a failed one leaves it refusing."""
    from beamrl.rollout.native import NativeEngineConfig

    engine = NativeEngine(NativeEngineConfig(model_path="<in-memory>", weights_cpu_backup=False),
                          BeamForCausalLM(cfg, dtype=torch.float32, seed=1))
    try:
        reqs = _reqs(temperature=0.0, ignore_eos=True, routes=False)
        engine.release_memory(["weights"], T_OUT)
        assert engine.model.lm_head.weight.numel() == 0 and not engine._host_weights  # no host copy
        engine.resume_memory(["weights"], T_OUT)
        assert engine.model.lm_head.weight.shape == (cfg.vocab_size, cfg.hidden_size)
        assert engine.health(T_OUT)  # waiting for its weights is not a fault (no restart)
        with pytest.raises(EngineError, match="before the weights were loaded"):
            engine.generate(reqs, T_OUT)
        new = random_state_dict(cfg, seed=2, dtype=torch.float32)
        manifest, buckets = _session(new, 3)
        engine.begin_weight_update(manifest, T_OUT)
        engine.update_weights_from_tensor(buckets[0], T_OUT)
        engine.abort_weight_update("test", T_OUT)  # an aborted sync loads nothing
        with pytest.raises(EngineError, match="before the weights were loaded"):
            engine.score([[1, 2, 3]], T_OUT)
        engine.begin_weight_update(manifest, T_OUT)
        with pytest.raises(EngineError, match="open weight-update session"):
            engine.release_memory(["weights"], T_OUT)  # would lose the session's buckets
        for b in buckets:
            engine.update_weights_from_tensor(b, T_OUT)
        engine.end_weight_update(3, T_OUT)
        target = NativeEngine.from_model(BeamForCausalLM(cfg, dtype=torch.float32, seed=2))
        assert [r.output_ids for r in engine.generate(reqs, T_OUT)] == \
            [r.output_ids for r in target.generate(reqs, T_OUT)]
        target.shutdown()
        # update_weights_from_disk loads every weight too
        engine.release_memory(None, T_OUT)
        engine.resume_memory(None, T_OUT)
        BeamForCausalLM(cfg, dtype=torch.float32, seed=1).save_pretrained(tmp_path)
        engine.update_weights_from_disk(str(tmp_path), T_OUT)
        engine.generate(reqs, T_OUT)
    finally:
        engine.shutdown()


def test_abort_all_and_timeout(engine):
    req = GenerateRequest(prompt_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=3000, ignore_eos=True, seed=1))
    out, forwards, decoding = {}, [], threading.Event()

    def count_forwards(*_):  # prefill, then one forward per decode step: the 2nd means a token was sampled
        forwards.append(1)
        if len(forwards) >= 2:
            decoding.set()

    hook = engine.model.register_forward_hook(count_forwards)
    try:
        t = threading.Thread(target=lambda: out.setdefault("r", engine.generate([req], T_OUT)))
        t.start()
        assert decoding.wait(T_OUT), "generation did not start decoding"
        engine.abort_all(T_OUT)
        t.join(T_OUT)
    finally:
        hook.remove()
    r = out["r"][0]
    assert r.finish_reason == "abort" and 0 < len(r.output_ids) < 3000
    with pytest.raises(EngineError, match="deadline"):
        engine.generate([req], 0.5)
    assert engine.health(T_OUT)  # a timeout does not break the engine


def test_engine_from_checkpoint_config(cfg, tmp_path):
    from beamrl.rollout.native import NativeEngineConfig, NativeEngineConfigError

    BeamForCausalLM(cfg, dtype=torch.bfloat16, seed=1).save_pretrained(tmp_path)
    e = NativeEngine(NativeEngineConfig(model_path=str(tmp_path), dtype="float32"))
    assert e.model.dtype == torch.float32 and e.model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    r = e.generate([GenerateRequest(prompt_ids=[3, 4], sampling=SamplingParams(max_new_tokens=3))], T_OUT)[0]
    assert 1 <= len(r.output_ids) <= 3
    with pytest.raises(NativeEngineConfigError, match="dtype"):
        NativeEngineConfig(model_path=str(tmp_path), dtype="int8")


_SENDER = textwrap.dedent("""
    import os, sys, torch
    from beamrl.models.beam import preset
    from beamrl.models.beam.weights import random_state_dict
    from beamrl.sync.packing import pack_session
    from beamrl.sync.update_group import init_update_group, broadcast_from_rank0, destroy_update_group
    port, timeout = int(sys.argv[1]), float(sys.argv[2])
    sd = random_state_dict(preset("tiny"), seed=6, dtype=torch.float32)
    pg = init_update_group("gloo", "127.0.0.1", port, 2, 0, "native-test", timeout)
    for b in pack_session(list(sd.items()), 2, 1 << 17)[1]:
        broadcast_from_rank0(pg, b.buffer)
    destroy_update_group(pg)
    # Its work is done: leave without the interpreter's teardown, where a gloo/store thread still joinable once
    # aborted the process ("terminate called without an active exception", exit -6) after a complete broadcast.
    sys.stderr.flush()
    os._exit(0)
""")


# The sender is a fresh interpreter that imports torch and beamrl before it opens the rendezvous: on a loaded
# 2-core CI machine that alone has taken most of a minute, so the group gets 3 minutes (a 60 s timeout flaked).
_GROUP_TIMEOUT_S = 180.0


def test_update_weights_from_distributed_gloo(engine, cfg):
    reserved = reserve_port()  # held until the sender's store has bound it (the sender hosts rank 0)
    port = reserved.port
    sender = subprocess.Popen([sys.executable, "-c", _SENDER, str(port), str(_GROUP_TIMEOUT_S)],
                              stderr=subprocess.PIPE, text=True)
    try:
        engine.init_weights_update_group("127.0.0.1", port, 1, 2, "native-test", "gloo", _GROUP_TIMEOUT_S)
        new = random_state_dict(cfg, seed=6, dtype=torch.float32)
        manifest, buckets = pack_session(list(new.items()), 2, 1 << 17)  # the sender packs the same session
        engine.begin_weight_update(manifest, T_OUT)
        for b in buckets:
            engine.update_weights_from_distributed(b.index, b.checksum, "native-test", _GROUP_TIMEOUT_S)
        engine.end_weight_update(2, T_OUT)
        engine.destroy_weights_update_group("native-test", T_OUT)
        assert sender.wait(_GROUP_TIMEOUT_S) == 0, sender.stderr.read()[-3000:]
    finally:
        reserved.close()
        if sender.poll() is None:
            sender.kill()
    assert engine.weight_version == 2
    assert all(torch.equal(v, new[k]) for k, v in engine.model.state_dict().items())
