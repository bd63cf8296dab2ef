"""ForwardingReceiver forwards every WeightReceiver method by name, with the timeout it was given."""

import inspect

from beamrl.sync.forwarding_receiver import ForwardingReceiver
from beamrl.protocols.weights import WeightReceiver


class _Recorder(ForwardingReceiver):
    def __init__(self):
        self.calls = []

    @property
    def tp_size(self) -> int:
        return 1

    def _forward(self, method, timeout, *args):
        self.calls.append((method, timeout, args))
        return None


def _protocol_methods():
    return [name for name, fn in inspect.getmembers(WeightReceiver, inspect.isfunction)
            if not name.startswith("_") and "timeout" in inspect.signature(fn).parameters]


def test_every_protocol_method_is_forwarded_with_its_arguments_and_timeout():
    rec = _Recorder()  # instantiable: no protocol method is left abstract
    methods = _protocol_methods()
    assert "end_weight_update" in methods and "update_weights_from_tensor" in methods
    for name in methods:
        params = [p for p in inspect.signature(getattr(WeightReceiver, name)).parameters if p not in ("self", "timeout")]
        args = tuple(f"{name}:{p}" for p in params)
        getattr(rec, name)(*args, timeout=7.5)
        assert rec.calls[-1] == (name, 7.5, args), name


def test_both_proxies_use_it():
    from beamrl.loop.weight_sync import ActorReceiver
    from beamrl.sync.process_receiver import ProcessReceiver

    assert issubclass(ActorReceiver, ForwardingReceiver) and issubclass(ProcessReceiver, ForwardingReceiver)
