"""The real SGLang 0.5.23 CPU engine as the sync target (one engine start for the whole module).

It runs in float32 with its FP32 lm_head GEMM (`enable_fp32_lm_head`); SGLang's Beam stores lm_head in BF16, so the
trainer's lm_head is kept BF16-representable, and then the engine computes what the reference model computes:
after a sync through the colocated or distributed transport it matches the reference within 1e-4, and it scores
bit-identically to the same weights loaded by SGLang's own disk loader. The verification scenarios
(`verification.py`) run against it too, and so does the policy where no rollback is possible (a distributed session,
whose bytes the adapter never sees): the engine stops serving until its weights are reloaded."""

import pytest
import torch

from beamrl.models.beam import preset
from beamrl.models.beam.model import BeamForCausalLM
from beamrl.protocols.weights import WeightSyncError
from beamrl.protocols.rollout import EngineError
from beamrl.sync.export import StateDictSource
from beamrl.sync.orchestrator import ProbeCheck, SyncTimeouts, WeightSync
from beamrl.sync.transports import TRANSPORTS

from ..conftest import perturb
from ..contract import check_receiver_contract
from ..faults import FailsAfter
from ..verification import PROBES, engine_state, manifest_faults, transit_faults

pytestmark = pytest.mark.slow

TIMEOUTS = SyncTimeouts(connect=120, call=120, bucket=120, verify=120)
BUCKET = 512 * 1024  # a handful of buckets: each SGLang call costs ~0.5 s on a loaded CPU


def bf16_head(model):
    with torch.no_grad():
        model.lm_head.weight.copy_(model.lm_head.weight.bfloat16().float())


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from beamrl.rollout.sglang.config import SGLangEngineConfig
    from beamrl.rollout.sglang.engine import SGLangEngine

    torch.set_num_threads(1)
    model = BeamForCausalLM(preset("tiny"), dtype=torch.float32, seed=0).eval()
    bf16_head(model)
    ckpt = tmp_path_factory.mktemp("sgl-ckpt")
    model.save_pretrained(ckpt)
    engine = SGLangEngine(SGLangEngineConfig.on_cpu(str(ckpt), dtype="float32", return_routed_experts=False,
                                                    enable_fp32_lm_head=True), start_timeout=900)
    yield engine, model, tmp_path_factory.mktemp("sgl-disk"), str(ckpt)
    engine.shutdown()


def sync(engine, make, model, probe=None):
    ws = WeightSync(make, [engine], bucket_bytes=BUCKET, timeouts=TIMEOUTS, probe=probe,
                    initial_version=engine.weight_version, progress=None)
    try:
        report = ws.sync(StateDictSource.of_model(model))
    finally:
        ws.close()
    assert engine.weight_version == report.version
    return report, engine.score(PROBES, 120)


def test_sglang_engine_meets_receiver_contract(setup):
    engine, model, _, _ = setup
    check_receiver_contract(engine, lambda: engine.weight_version, model)


def test_float32_sync_matches_the_reference_to_1e4_and_a_disk_load_bit_for_bit(setup):
    engine, model, disk_dir, _ = setup
    config = preset("tiny").replace(dtype="float32")
    base = engine.score(PROBES, 120)
    for seed, name in ((1, "colocated"), (2, "distributed")):
        perturb(model, seed=seed, scale=0.2)
        bf16_head(model)
        want = StateDictSource.of_model(model).logprobs(PROBES)
        moved = max(abs(a - b) for x, y in zip(base, want) for a, b in zip(x, y))
        assert moved > 0.1  # the perturbation is visible far above the tolerance
        kwargs = {"device": "cpu"} if name == "distributed" else {}
        report, pushed = sync(engine, lambda r: TRANSPORTS.get(name)(r, **kwargs), model,
                              probe=ProbeCheck(PROBES, tolerance=1e-4))
        assert report.verified and report.max_abs_logprob_diff <= 1e-4, (name, report.max_abs_logprob_diff)
        _, loaded = sync(engine, lambda r: TRANSPORTS.get("disk")(r, directory=disk_dir / name, config=config), model)
        assert pushed == loaded, name  # bit-identical to SGLang's own loader
        base = pushed


def test_manifest_faults_are_refused_before_anything_is_applied(setup):
    engine, model, _, _ = setup
    perturb(model, seed=3, scale=0.2)
    manifest_faults(engine, [(n, p.detach()) for n, p in model.named_parameters()], BUCKET)


def test_faults_in_transit_are_refused_and_rolled_back(setup):
    engine, model, _, _ = setup
    perturb(model, seed=4, scale=0.2)
    transit_faults(engine, [(n, p.detach()) for n, p in model.named_parameters()], BUCKET)


def test_a_failed_distributed_session_leaves_the_engine_unhealthy_until_reloaded(setup):
    """The adapter cannot undo buckets it never saw (the broadcast goes straight into SGLang): it stops serving."""
    engine, model, _, ckpt = setup
    perturb(model, seed=5, scale=0.2)
    source = FailsAfter([(n, p.detach()) for n, p in model.named_parameters()], units=20, unit_size=4)
    ws = WeightSync(lambda r: TRANSPORTS.get("distributed")(r, device="cpu"), [engine], bucket_bytes=BUCKET,
                    timeouts=TIMEOUTS, initial_version=engine.weight_version, progress=None)
    v = engine.weight_version
    with pytest.raises(WeightSyncError, match="export failed after 20 units"):
        ws.sync(source)
    ws.close()
    assert engine.weight_version == v and "partly updated" in engine.sync_failure
    with pytest.raises(EngineError, match="not serving"):
        engine.score(PROBES, 60)
    engine.update_weights_from_disk(ckpt, 120)  # restart with the current weights: serving again
    fresh = BeamForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    got, want = engine.score(PROBES, 120), StateDictSource.of_model(fresh).logprobs(PROBES)
    assert engine.sync_failure is None and max(abs(a - b) for x, y in zip(got, want) for a, b in zip(x, y)) <= 1e-4
    assert engine_state(engine)[0] == v
