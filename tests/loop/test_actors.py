"""Calls across the actor boundary cannot swap two flags: after its first argument, every trainer-rank method that
takes flags accepts them by keyword only (a positional call fails at once instead of training with the flags
exchanged)."""

import inspect

import pytest

from beamrl.loop.actors import TrainerActor


@pytest.mark.parametrize("method", ["compute_logprobs", "train_step", "sync_weights", "train_step_then_sync"])
def test_trainer_rank_flags_are_keyword_only(method):
    params = list(inspect.signature(getattr(TrainerActor.__ray_actor_class__, method)).parameters.values())[1:]
    positional = [p.name for p in params if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    assert len(positional) <= 1, f"TrainerActor.{method}: {positional[1:]} can be passed positionally"


def test_engine_ports_stay_reserved_until_the_engine_started():
    """`EngineActor.reserve` hands out ports no other process can take until `start` has built the engine (the
    servers of a multi-node engine start later, all at once); then they are released. Run in-process (no Ray)."""
    import socket

    from beamrl.loop.actors import EngineActor

    def taken(host, port):
        with socket.socket() as s:  # a plain bind, as any other process on the node would try
            try:
                s.bind((host, port))
            except OSError:
                return True
            return False

    seen = {}

    class Factory:
        def with_launch(self, **launch):
            def build():
                seen.update(launch, held=[taken(launch["host"], p) for p in (port, meet)])
                return object()
            return build

    actor = EngineActor.__ray_actor_class__(Factory())
    host, port, meet = actor.reserve()
    assert port != meet and taken(host, port) and taken(host, meet)
    assert actor.start(host=host, port=port, dist_init_addr=f"{host}:{meet}")
    assert seen == {"host": host, "port": port, "dist_init_addr": f"{host}:{meet}", "held": [True, True]}
    assert not taken(host, port) and not taken(host, meet)
