"""End to end on CPU through the one orchestrator: perturb the trainer's weights, sync them to the native engine in
its own process through each transport; the engine's prompt logprobs must match the trainer's (fp32 parity, 1e-4)
and its version step by one. Plus: a failed verification, an empty export, a failure on another trainer rank, a
subset sync (one restarted engine, current version), and the progress lines."""

import pytest
import torch

from beamrl.models.beam import BeamForCausalLM, preset
from beamrl.protocols.weights import WeightSyncError
from beamrl.sync.export import StateDictSource
from beamrl.sync.local_receiver import model_receiver
from beamrl.sync.orchestrator import ProbeCheck, SyncTimeouts, WeightSync, logprob_gap
from beamrl.sync.transports import TRANSPORTS

from .conftest import perturb
from .faults import NaNScores, StaleAfterCommit

PROBES = [[1, 5, 9, 200, 17, 3, 88, 41, 2, 9], [7, 7, 7, 300, 2, 511, 64]]
TIMEOUTS = SyncTimeouts(connect=60, call=30, bucket=60, verify=60)


def transport_factory(name, tmp_path):
    kwargs = {}
    if name == "distributed":
        kwargs = {"device": "cpu"}
    if name == "disk":
        kwargs = {"directory": tmp_path / "sync", "config": preset("tiny").replace(dtype="float32")}
    return lambda receivers: TRANSPORTS.get(name)(receivers, **kwargs)


@pytest.mark.parametrize("transport_name", ["colocated", "distributed", "disk"])
def test_perturbed_sync_matches_trainer_logprobs(transport_name, hosted_engine, trainer_model, tmp_path):
    perturb(trainer_model, seed=len(transport_name))
    source = StateDictSource.of_model(trainer_model, unit_size=25)
    before = hosted_engine.score(PROBES, timeout=30)
    want = source.logprobs(PROBES)
    assert max(abs(a - b) for x, y in zip(before, want) for a, b in zip(x, y)) > 1e-3  # the sync must matter

    v0 = hosted_engine.weight_version
    sync = WeightSync(transport_factory(transport_name, tmp_path), [hosted_engine], bucket_bytes=64 * 1024,
                      probe=ProbeCheck(PROBES, tolerance=1e-4), timeouts=TIMEOUTS, initial_version=v0, progress=None)
    try:
        report = sync.sync(source)
    finally:
        sync.close()
    assert report.version == v0 + 1 == hosted_engine.weight_version
    assert report.verified and report.max_abs_logprob_diff <= 1e-4
    assert report.bytes == sum(p.numel() * p.element_size() for p in trainer_model.parameters())
    assert report.buckets == len(sync.plan(source).buckets) > 3
    assert report.seconds > 0 and report.gbps == pytest.approx(report.bytes / report.seconds / 1e9, rel=1e-12)
    assert report.code_path == "beamrl.sync.orchestrator.WeightSync + beamrl.sync.packing.pack_bucket"
    if transport_name == "colocated":
        assert sync.transport.mode == "staged"  # the native engine takes staged buckets, shared once


def test_failed_verification_raises_and_blocks_further_syncs(hosted_engine, trainer_model):
    """A trainer/engine disagreement after a sync is an error, never a silent pass."""
    frozen = StateDictSource.of_model(trainer_model).logprobs(PROBES)  # logprobs of the UNperturbed weights
    perturb(trainer_model, seed=77)
    source = StateDictSource(list(trainer_model.named_parameters()), score=lambda seqs: frozen)
    sync = WeightSync(TRANSPORTS.get("colocated")([hosted_engine]), [hosted_engine],
                      probe=ProbeCheck(PROBES, tolerance=1e-4), timeouts=TIMEOUTS,
                      initial_version=hosted_engine.weight_version, progress=None)
    with pytest.raises(WeightSyncError, match="native-engine-0: post-sync verification failed"):
        sync.sync(source)
    assert "native-engine-0" in sync.unhealthy
    with pytest.raises(WeightSyncError, match="refusing to sync"):
        sync.sync(source)
    sync.close()


def test_a_nan_logprob_gap_is_nan_in_the_max_and_the_mean():
    """A NaN anywhere in the probe's logprobs makes both statistics NaN (so it fails every tolerance)."""
    nan = float("nan")
    gap = logprob_gap([[0.0, nan, 0.0]], [[0.0, 0.0, 0.5]])
    assert gap.max != gap.max and gap.mean != gap.mean, gap


def test_nan_engine_logprobs_fail_the_post_sync_verification(trainer_model):
    """An engine that scores the probes with a NaN fails verification (NaN is not within any tolerance) and is
    marked unhealthy."""
    engine = NaNScores(type(trainer_model)(preset("tiny"), dtype=torch.float32, seed=5).eval(), name="eng")
    sync = WeightSync(TRANSPORTS.get("colocated")([engine]), [engine], probe=ProbeCheck(PROBES, tolerance=1e-4),
                      timeouts=TIMEOUTS, progress=None)
    try:
        with pytest.raises(WeightSyncError, match="eng: post-sync verification failed: max .* = nan"):
            sync.sync(StateDictSource.of_model(trainer_model))
    finally:
        sync.close()
    assert "eng" in sync.unhealthy


def test_an_engine_serving_the_old_version_after_the_commit_fails_the_sync(trainer_model):
    """The served version is read back after the commit: an engine still at the old one fails the sync and is marked
    unhealthy."""
    engine = StaleAfterCommit(type(trainer_model)(preset("tiny"), dtype=torch.float32, seed=5).eval(), name="eng")
    sync = WeightSync(TRANSPORTS.get("colocated")([engine]), [engine], timeouts=TIMEOUTS, progress=None)
    try:
        with pytest.raises(WeightSyncError, match="eng: serves weight version 0 after the sync to 1"):
            sync.sync(StateDictSource(list(trainer_model.named_parameters())))
    finally:
        sync.close()
    assert "eng" in sync.unhealthy and sync.version == 0


def _shifted(logprobs, shift):
    """The trainer-side probe logprobs, moved by `shift(sequence, token)`."""
    return [[lp + shift(i, t) for t, lp in enumerate(seq)] for i, seq in enumerate(logprobs)]


@pytest.mark.parametrize("case", ["one token off by 0.9", "every token off by 0.6"])
def test_the_bf16_alarm_bounds_the_mean_gap_and_the_exact_check_the_largest(case, hosted_engine, trainer_model):
    """The loose bf16 alarm (mean over the probe's tokens <= 0.5) passes one token far off (a router near-tie that
    flipped on one side), which the max would fail, and fails when every token is off (wrong weights); both gaps
    are reported."""
    perturb(trainer_model, seed=5)
    exact = StateDictSource.of_model(trainer_model).logprobs(PROBES)
    one = case.startswith("one")
    moved = _shifted(exact, (lambda i, t: 0.9 if (i, t) == (0, 3) else 0.0) if one else (lambda i, t: 0.6))
    source = StateDictSource(list(trainer_model.named_parameters()), score=lambda seqs: moved)
    tokens = sum(len(s) - 1 for s in PROBES)  # a prompt's first token has no logprob
    # the alarm: the largest loosely, the mean at 0.5; or the largest alone at 0.5
    bounds = {"mean": dict(tolerance=3.0, mean_tolerance=0.5), "max": dict(tolerance=0.5)}
    for statistic, ok in (("mean", one), ("max", False)):
        sync = WeightSync(TRANSPORTS.get("colocated")([hosted_engine]), [hosted_engine],
                          probe=ProbeCheck(PROBES, **bounds[statistic]), timeouts=TIMEOUTS,
                          initial_version=hosted_engine.weight_version, progress=None)
        try:
            if ok:
                report = sync.sync(source)
                assert report.max_abs_logprob_diff == pytest.approx(0.9, abs=1e-4)
                assert report.mean_abs_logprob_diff == pytest.approx(0.9 / tokens, abs=1e-4)
            else:
                with pytest.raises(WeightSyncError, match=f"verification failed: {statistic} .*max 9.0|verification "
                                                          f"failed: {statistic} .*max 6.0"):
                    sync.sync(source)
        finally:
            sync.close()


@pytest.mark.parametrize("off", [0.9, 3.5])
def test_the_alarms_looser_bound_on_the_largest_fails_a_few_tokens_far_off(off, hosted_engine, trainer_model):
    """The mean alarm also bounds the largest gap, loosely (`tolerance`): a token 3.5 off (weights wrong only where it is
    routed) fails although the mean is small; a near-tie's 0.9 passes."""
    perturb(trainer_model, seed=6)
    exact = StateDictSource.of_model(trainer_model).logprobs(PROBES)
    moved = _shifted(exact, lambda i, t: off if (i, t) == (1, 2) else 0.0)
    source = StateDictSource(list(trainer_model.named_parameters()), score=lambda seqs: moved)
    sync = WeightSync(TRANSPORTS.get("colocated")([hosted_engine]), [hosted_engine],
                      probe=ProbeCheck(PROBES, tolerance=3.0, mean_tolerance=0.5), timeouts=TIMEOUTS,
                      initial_version=hosted_engine.weight_version, progress=None)
    try:
        if off < 3.0:
            assert sync.sync(source).mean_abs_logprob_diff < 0.5
        else:
            with pytest.raises(WeightSyncError, match=r"verification failed: max .* > tolerance 3\.0e\+00"):
                sync.sync(source)
    finally:
        sync.close()


def test_a_probe_mean_bound_must_lie_within_its_bound_on_the_largest():
    with pytest.raises(ValueError, match=r"mean_tolerance=4.0 must be in \[0, tolerance=3.0\]"):
        ProbeCheck(PROBES, tolerance=3.0, mean_tolerance=4.0)


def test_empty_export_raises_before_touching_engines(hosted_engine):
    transport = TRANSPORTS.get("colocated")([hosted_engine])
    sync = WeightSync(transport, [hosted_engine], timeouts=TIMEOUTS, initial_version=hosted_engine.weight_version,
                      progress=None)
    v = hosted_engine.weight_version
    with pytest.raises(WeightSyncError, match="zero tensors"):
        sync.sync(StateDictSource([]))
    assert sync.version == v == hosted_engine.weight_version  # no version bump
    assert not transport.unhealthy and transport.manifest is None  # refused before any engine call


class FailingRank(StateDictSource):
    """The shipping rank's view of an export that another trainer rank failed (`finish` says so)."""

    def finish(self, ok):
        return False


def test_a_failure_on_another_rank_aborts_the_session_and_keeps_the_weights(trainer_model):
    engine_model = type(trainer_model)(preset("tiny"), dtype=torch.float32, seed=5).eval()
    snap = {n: p.clone() for n, p in engine_model.named_parameters()}
    receiver = model_receiver(engine_model, name="eng")
    sync = WeightSync(TRANSPORTS.get("colocated")([receiver]), [receiver], timeouts=TIMEOUTS, progress=None,
                      bucket_bytes=32 * 1024)
    with pytest.raises(WeightSyncError, match="another trainer rank failed its part of the export"):
        sync.sync(FailingRank(list(trainer_model.named_parameters())))
    assert receiver.weight_version == 0 and not receiver.in_session  # every bucket was loaded, then rolled back
    assert all(torch.equal(p, snap[n]) for n, p in engine_model.named_parameters())
    assert not sync.transport.unhealthy  # rolled back: it may serve and take the next sync
    assert sync.sync(StateDictSource(list(trainer_model.named_parameters()))).version == 1


def test_a_subset_sync_gives_one_restarted_engine_the_current_weights(trainer_model):
    models = [type(trainer_model)(preset("tiny"), dtype=torch.float32, seed=s).eval() for s in (5, 6)]
    receivers = [model_receiver(m, name=f"eng-{i}") for i, m in enumerate(models)]
    sync = WeightSync(lambda recs: TRANSPORTS.get("colocated")(recs), receivers, timeouts=TIMEOUTS, progress=None)
    source = StateDictSource(list(trainer_model.named_parameters()))
    assert sync.sync(source).engines == ["eng-0", "eng-1"] and sync.version == 1
    restarted = type(trainer_model)(preset("tiny"), dtype=torch.float32, seed=9).eval()
    replacement = model_receiver(restarted, name="eng-1")  # serves version 0 from its checkpoint
    report = sync.sync(source, engines=[replacement])
    assert report.engines == ["eng-1"] and report.version == 1 == replacement.weight_version == sync.version
    assert all(torch.equal(a, b) for a, b in zip(restarted.parameters(), trainer_model.parameters()))
    with pytest.raises(WeightSyncError, match="refusing a stale weight version"):
        sync.sync(source, engines=[replacement])  # it already serves the current version


def test_timeouts_must_be_finite():
    with pytest.raises(ValueError, match="SyncTimeouts.bucket"):
        SyncTimeouts(bucket=float("inf"))


def test_progress_lines_say_bucket_i_of_n_and_the_rate(trainer_model):
    lines = []
    receiver = model_receiver(type(trainer_model)(preset("tiny"), dtype=torch.float32, seed=1), name="local")
    sync = WeightSync(TRANSPORTS.get("colocated")([receiver]), [receiver], bucket_bytes=256 * 1024,
                      progress=lines.append, progress_every_s=0.0)
    report = sync.sync(StateDictSource(list(trainer_model.named_parameters())))
    assert report.version == 1 == receiver.weight_version
    assert len(lines) == report.buckets + 1
    assert lines[0].startswith(f"[weight sync v1] bucket 1/{report.buckets}:")
    assert "GB/s" in lines[-1] and f"in {report.buckets} buckets" in lines[-1] and "checksums verified" in lines[-1]


def test_short_syncs_say_only_the_first_summary(trainer_model):
    """Progress is for long work: a sync shorter than `progress_every_s` prints no bucket lines, and only the first
    sync's summary (the RL loop syncs every step; its console line already shows the sync time)."""
    lines = []
    receiver = model_receiver(type(trainer_model)(preset("tiny"), dtype=torch.float32, seed=1), name="local")
    sync = WeightSync(TRANSPORTS.get("colocated")([receiver]), [receiver], bucket_bytes=256 * 1024,
                      progress=lines.append, progress_every_s=3600.0)
    for _ in range(3):
        sync.sync(StateDictSource(list(trainer_model.named_parameters())))
    assert len(lines) == 1 and lines[0].startswith("[weight sync v1] done:")


def test_released_staging_buffers_are_freed_and_shared_anew_at_the_next_sync(hosted_engine, trainer_model):
    """A colocated trainer going to sleep frees its staging slots (`release_buffers`); the next sync makes and
    shares new ones with the engine (in its own process) and still lands exactly."""
    import os

    v0 = hosted_engine.weight_version
    sync = WeightSync(TRANSPORTS.get("colocated")([hosted_engine]), [hosted_engine], bucket_bytes=64 * 1024,
                      probe=ProbeCheck(PROBES, tolerance=1e-4), timeouts=TIMEOUTS, initial_version=v0, progress=None)
    try:
        perturb(trainer_model, seed=11)
        assert sync.sync(StateDictSource.of_model(trainer_model)).verified
        paths = [s.path for s in sync.transport._slots]
        assert paths and all(os.path.exists(p) for p in paths)
        sync.release_buffers()
        assert sync.transport._slots == [] and not any(os.path.exists(p) for p in paths)
        perturb(trainer_model, seed=12)
        report = sync.sync(StateDictSource.of_model(trainer_model))
        assert report.verified and report.max_abs_logprob_diff <= 1e-4 and report.version == v0 + 2
        assert sync.transport.mode == "staged" and len(sync.transport._slots) == len(paths)
    finally:
        sync.close()


def test_a_replaced_engine_takes_the_next_full_syncs_and_its_failure_marks_are_dropped(trainer_model):
    models = [type(trainer_model)(preset("tiny"), dtype=torch.float32, seed=s).eval() for s in (5, 6)]
    receivers = [model_receiver(m, name=f"eng-{i}") for i, m in enumerate(models)]
    sync = WeightSync(lambda recs: TRANSPORTS.get("colocated")(recs), receivers, timeouts=TIMEOUTS, progress=None)
    source = StateDictSource(list(trainer_model.named_parameters()))
    sync.sync(source)
    sync.mark_unhealthy("eng-1", "died")  # e.g. it failed a sync before it was restarted
    restarted = type(trainer_model)(preset("tiny"), dtype=torch.float32, seed=9).eval()
    replacement = model_receiver(restarted, name="eng-1")
    sync.replace_engine(1, replacement)
    assert sync.sync(source, engines=[replacement]).version == 1 == replacement.weight_version
    perturb(trainer_model, seed=3)
    report = sync.sync(StateDictSource(list(trainer_model.named_parameters())))
    assert report.version == 2 == receivers[0].weight_version == replacement.weight_version  # the new engine took it
    assert receivers[1].weight_version == 1  # the replaced one no longer gets syncs
    assert all(torch.equal(a, b) for a, b in zip(restarted.parameters(), trainer_model.parameters()))


def test_a_marked_engine_blocks_only_syncs_that_target_it(trainer_model):
    """An engine marked by a failed sync and left stopped (its restart failed while another was healthy) must not
    block the subset sync of the running ones (it refused them all: "must be restarted first")."""
    models = [type(trainer_model)(preset("tiny"), dtype=torch.float32, seed=s).eval() for s in (5, 6)]
    receivers = [model_receiver(m, name=f"eng-{i}") for i, m in enumerate(models)]
    sync = WeightSync(lambda recs: TRANSPORTS.get("colocated")(recs), receivers, timeouts=TIMEOUTS, progress=None)
    source = StateDictSource(list(trainer_model.named_parameters()))
    sync.sync(source)
    sync.mark_unhealthy("eng-1", "died during the probe")
    assert sync.sync(source, engines=[receivers[0]], version=2).version == 2 == receivers[0].weight_version
    with pytest.raises(WeightSyncError, match="eng-1: died during the probe"):
        sync.sync(source, version=3)  # a full sync still includes it: refused


def test_the_probe_runs_on_the_first_sync_then_every_nth(hosted_engine, trainer_model):
    """`ProbeCheck.every`: syncs 1, 1 + N, 1 + 2N, ... are verified (the first at once, so a wrong layout shows in
    the first step); the others still check every bucket's checksum and the served version."""
    v0 = hosted_engine.weight_version
    sync = WeightSync(TRANSPORTS.get("colocated")([hosted_engine]), [hosted_engine], bucket_bytes=256 * 1024,
                      probe=ProbeCheck(PROBES, tolerance=1e-4, every=3), timeouts=TIMEOUTS, initial_version=v0,
                      progress=None)
    try:
        perturb(trainer_model, seed=21)
        source = StateDictSource.of_model(trainer_model)
        reports = [sync.sync(source) for _ in range(7)]
    finally:
        sync.close()
    assert [r.verified for r in reports] == [True, False, False, True, False, False, True]
    assert [r.version for r in reports] == list(range(v0 + 1, v0 + 8)) and hosted_engine.weight_version == v0 + 7
    assert all(r.max_abs_logprob_diff <= 1e-4 for r in reports if r.verified)


class _OrderedProxy:
    """Builds a `ForwardingReceiver` in front of an in-process receiver that logs when each call is issued and
    when its reply is waited for (calls run at once, so in issue order, as on the Ray and pipe proxies)."""

    @staticmethod
    def around(inner, events):
        from beamrl.protocols.weights import PendingCall
        from beamrl.sync.forwarding_receiver import ForwardingReceiver

        class _Logged(PendingCall):
            def __init__(self, method, result=None, error=None):
                super().__init__(result, error)
                self.method = method

            def wait(self, timeout):
                events.append(("wait", self.method))
                return super().wait(timeout)

        class Proxy(ForwardingReceiver):
            name = inner.name
            tp_size = 1

            def _submit(self, method, timeout, *args):
                events.append(("issue", method))
                try:
                    return _Logged(method, result=getattr(inner, method)(*args, timeout))
                except WeightSyncError as exc:
                    return _Logged(method, error=exc)

        return Proxy()


def test_a_proxy_gets_begin_behind_the_pause_and_the_version_read_behind_the_commit(trainer_model):
    """Where calls run in issue order, the pause's reply is not waited for before `begin` goes out, and the version
    check's read goes out right behind the commit: two round trips fewer per sync, every check kept."""
    engine = BeamForCausalLM(preset("tiny"), dtype=torch.float32, seed=0).eval()
    events = []
    proxy = _OrderedProxy.around(model_receiver(engine, name="eng"), events)
    perturb(trainer_model, seed=3)
    sync = WeightSync(transport_factory("colocated", None), [proxy], bucket_bytes=64 * 1024, timeouts=TIMEOUTS,
                      progress=None)
    pack = sync.pack
    sync.pack = lambda *args: (events.append(("pack", None)), pack(*args))[1]
    try:
        report = sync.sync(StateDictSource.of_model(trainer_model, unit_size=25))
    finally:
        sync.close()
    assert report.version == 1 == proxy.served_weight_version(5)
    issued = [m for kind, m in events if kind == "issue"]
    assert issued.count("served_weight_version") == 2 and issued.count("abort_all") == 1  # (one read is this test's)
    pos = {e: events.index(e) for e in [("issue", "abort_all"), ("wait", "abort_all"), ("issue", "begin_weight_update"),
                                         ("wait", "begin_weight_update"), ("pack", None),
                                         ("issue", "load_staged_bucket"), ("issue", "end_weight_update"),
                                         ("wait", "end_weight_update"), ("issue", "served_weight_version")]}
    assert pos[("issue", "begin_weight_update")] < pos[("wait", "abort_all")]
    # the first bucket is exported and packed while the pause and begin are answered; both are taken before it goes
    assert pos[("issue", "begin_weight_update")] < pos[("pack", None)] < pos[("wait", "abort_all")]
    assert pos[("wait", "abort_all")] < pos[("wait", "begin_weight_update")] < pos[("issue", "load_staged_bucket")]
    assert pos[("issue", "served_weight_version")] < pos[("wait", "end_weight_update")]


def test_a_refused_begin_behind_a_proxy_fails_the_sync_before_any_bucket_goes_out(trainer_model):
    """`begin` is only issued to a proxy; its refusal (here: a stale version) is still taken before the first bucket
    is sent, named as the refusal of `begin_weight_update`, and the engine keeps its weights and version."""
    engine = BeamForCausalLM(preset("tiny"), dtype=torch.float32, seed=0).eval()
    before = {n: p.detach().clone() for n, p in engine.named_parameters()}
    events = []
    inner = model_receiver(engine, name="eng", initial_version=5)
    proxy = _OrderedProxy.around(inner, events)
    perturb(trainer_model, seed=4)
    sync = WeightSync(transport_factory("colocated", None), [proxy], bucket_bytes=64 * 1024, timeouts=TIMEOUTS,
                      initial_version=2, progress=None)
    try:
        with pytest.raises(WeightSyncError, match="begin_weight_update failed on 1 engine.*stale weight version"):
            sync.sync(StateDictSource.of_model(trainer_model, unit_size=25))
    finally:
        sync.close()
    assert ("issue", "load_staged_bucket") not in events and ("issue", "abort_weight_update") in events
    assert inner.weight_version == 5 and not inner.in_session
    assert all(torch.equal(p, before[n]) for n, p in engine.named_parameters())


def test_one_proxied_engine_is_called_from_the_syncing_thread_alone(trainer_model):
    """A proxy keeps each call's deadline itself (`bounded_calls`): with one engine no call of a sync, probe and
    commit included, needs a thread of its own (`run_concurrently` runs it in the caller's thread)."""
    import threading

    engine = BeamForCausalLM(preset("tiny"), dtype=torch.float32, seed=0).eval()
    threads = set()
    inner = model_receiver(engine, name="eng")
    inner.score = lambda seqs, timeout: StateDictSource.of_model(engine).logprobs(seqs)  # as an engine scores
    proxy = _OrderedProxy.around(inner, [])
    submit = proxy._submit

    def tracked(method, timeout, *args):
        threads.add((method, threading.current_thread().name))
        return submit(method, timeout, *args)

    proxy._submit = tracked
    perturb(trainer_model, seed=5)
    source = StateDictSource.of_model(trainer_model, unit_size=25)
    sync = WeightSync(transport_factory("colocated", None), [proxy], bucket_bytes=64 * 1024, timeouts=TIMEOUTS,
                      probe=ProbeCheck(PROBES, tolerance=1e-4), progress=None)
    try:
        report = sync.sync(source)
    finally:
        sync.close()
    assert report.verified and report.version == 1 == inner.weight_version
    methods = {m for m, _ in threads}
    assert {"staging_supported", "attach_staging", "begin_weight_update", "load_staged_bucket", "end_weight_update",
            "score"} <= methods
    assert {t for _, t in threads} == {threading.current_thread().name}


def test_a_refused_pause_still_fails_the_sync_when_begin_went_out_behind_it(trainer_model):
    engine = BeamForCausalLM(preset("tiny"), dtype=torch.float32, seed=0).eval()
    inner = model_receiver(engine, name="eng")

    def refuse(timeout):
        raise WeightSyncError("eng: cannot pause")

    inner.abort_all = refuse
    proxy = _OrderedProxy.around(inner, [])
    sync = WeightSync(transport_factory("colocated", None), [proxy], bucket_bytes=64 * 1024, timeouts=TIMEOUTS,
                      progress=None)
    try:
        with pytest.raises(WeightSyncError, match="abort_all \\(pause\\) failed on 1 engine.*cannot pause"):
            sync.sync(StateDictSource.of_model(trainer_model, unit_size=25))
    finally:
        sync.close()
    assert proxy.served_weight_version(5) == 0  # nothing was committed


def test_disk_transport_keeps_only_the_last_version_and_the_run_end_removes_it(hosted_engine, trainer_model,
                                                                                tmp_path):
    """Each version's checkpoint replaces the previous one; when the run ends (`discard_buffers`, as the trainer's
    shutdown calls it) the last one and the transport's directory go too."""
    root = tmp_path / "sync"
    sync = WeightSync(transport_factory("disk", tmp_path), [hosted_engine], timeouts=TIMEOUTS,
                      initial_version=hosted_engine.weight_version, progress=None)
    v0 = hosted_engine.weight_version
    for seed in (1, 2):
        perturb(trainer_model, seed=seed)
        sync.sync(StateDictSource.of_model(trainer_model))
    assert [p.name.split("-")[0] for p in root.iterdir()] == [f"v{v0 + 2:06d}"]
    sync.discard_buffers()
    assert not root.exists()
    assert hosted_engine.weight_version == v0 + 2  # the engine keeps what it loaded


def test_disk_transport_resync_at_the_same_version_writes_the_current_weights_and_old_versions_go(
        hosted_engine, trainer_model, tmp_path):
    """A restarted engine's resync (a subset sync: another transport instance on the run's root) at the current
    version gets the trainer's weights of now, though that version was written before with other weights (the
    trainer stepped since; it refused "already exists"); an instance that did not write the old versions (the one
    built after an engine was replaced) still removes them."""
    root = tmp_path / "sync"
    v0 = hosted_engine.weight_version
    sync = WeightSync(transport_factory("disk", tmp_path), [hosted_engine], timeouts=TIMEOUTS, initial_version=v0,
                      probe=ProbeCheck(PROBES, tolerance=1e-4), progress=None)
    perturb(trainer_model, seed=1)
    sync.sync(StateDictSource.of_model(trainer_model))
    perturb(trainer_model, seed=2)  # the trainer steps; the engine is resynced at the version it holds
    report = sync.sync(StateDictSource.of_model(trainer_model), engines=[hosted_engine], version=v0 + 1)
    assert report.verified and report.max_abs_logprob_diff <= 1e-4 and hosted_engine.weight_version == v0 + 1
    other = WeightSync(transport_factory("disk", tmp_path), [hosted_engine], timeouts=TIMEOUTS,
                       initial_version=v0 + 1, progress=None)
    perturb(trainer_model, seed=3)
    other.sync(StateDictSource.of_model(trainer_model))
    assert [p.name.split("-")[0] for p in root.iterdir()] == [f"v{v0 + 2:06d}"]


def test_the_summary_says_what_each_transport_checked(trainer_model, tmp_path):
    """The console's summary claimed "checksums verified" for every transport; the disk transport compares none
    (and SGLang's distributed receive cannot: the post-sync probe is its check)."""
    from beamrl.sync.transports.distributed import DistributedTransport

    lines = []
    receiver = model_receiver(type(trainer_model)(preset("tiny"), dtype=torch.float32, seed=1), name="local")
    config = preset("tiny").replace(dtype="float32")
    disk = TRANSPORTS.get("disk")([receiver], directory=tmp_path / "sync", config=config)
    sync = WeightSync(disk, [receiver], bucket_bytes=256 * 1024, progress=lines.append, progress_every_s=0.0)
    sync.sync(StateDictSource(list(trainer_model.named_parameters())))
    assert receiver.weight_version == 1
    assert "checksums verified" not in lines[-1] and "no checksum" in lines[-1], lines[-1]
    assert "cannot compare" in DistributedTransport.content_check
