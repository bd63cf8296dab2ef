"""An engine left stopped (its restart failed while another engine was healthy) must not shift the others: the
trainer's sync calls get the engines in engine order and sync only the running ones, and scores keep their
engines' names. (The group's receivers used to drop the stopped engine, so names, TP sizes and the orchestrator's
slots no longer lined up: engine k+1's weights could go to slot k.) No Ray here: the group holds plain objects;
the real restarts run in tests/loop/test_faults.py."""

from types import SimpleNamespace

from beamrl.loop import groups
from beamrl.loop import weight_sync as W
from beamrl.loop.groups import EngineGroup


def _group(nodes):
    group = EngineGroup.__new__(EngineGroup)
    group.nodes, group.names, group.tp_sizes = nodes, [f"sglang-{k}" for k in range(len(nodes))], [1] * len(nodes)
    group.express = None
    return group


def test_sync_arguments_keep_engine_order_and_name_the_running_engines():
    a, c = object(), object()
    args = _group([[a], [], [c]]).sync_arguments(W.SyncRequest(7, "shm", 1, 60.0))
    assert args["receivers"] == [a, None, c] and args["engine_names"] == ["sglang-0", "sglang-1", "sglang-2"]
    assert args["request"].engines == (0, 2) and args["request"].version == 7
    every = _group([[a], [c]]).sync_arguments(W.SyncRequest(7, "shm", 1, 60.0))
    assert every["request"].engines is None  # all running: a full sync, as before
    # with express calls the trainer gets each running engine's address instead, in the same places
    express = _group([[a], [], [c]])
    express.use_express({0: ("address-0", None), 2: ("address-2", None)})
    assert express.sync_arguments(W.SyncRequest(7, "shm", 1, 60.0))["receivers"] == ["address-0", None, "address-2"]


class _Recorder:
    def __init__(self, n):
        self.engines, self.calls = [f"receiver-{k}" for k in range(n)], []

    def sync(self, source, engines=None, version=0):
        self.calls.append((engines, version))


def test_a_sync_with_a_stopped_engine_reaches_the_running_ones_on_every_rank(monkeypatch):
    recorder = _Recorder(3)
    monkeypatch.setattr(W, "_orchestrator", lambda *args, **kwargs: recorder)
    trainer = SimpleNamespace(lora=None, export_hf_layout=lambda: [])
    request = W.SyncRequest(7, "shm", 1, 60.0, engines=(0, 2))
    W.sync_on_rank(trainer, 0, [], [], [], request)
    W.sync_on_rank(trainer, 1, [], [], [], request)  # a subset sync on every rank: the collectives match
    assert recorder.calls == [(["receiver-0", "receiver-2"], 7), ([], 7)]


def test_scores_keep_their_engines_names_when_one_is_stopped(monkeypatch):
    class _Leader:
        def __init__(self, k):
            self.call = SimpleNamespace(remote=lambda method, **kw: f"scores of {k}")

    monkeypatch.setattr(groups, "ray_get", lambda refs, timeout, what: list(refs))
    group = _group([[_Leader(0)], [], [_Leader(2)]])
    assert group.score([[1, 2]], 10.0) == {"sglang-0": "scores of 0", "sglang-2": "scores of 2"}
