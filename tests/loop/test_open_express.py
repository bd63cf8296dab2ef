"""`open_express`: which way a run's calls go, said in one line, and nothing half-open when a channel fails (no Ray
here: the groups are stand-ins that hand out addresses of real servers in this process)."""

import threading
from types import SimpleNamespace

import pytest

from beamrl.loop import groups
from beamrl.loop.express import ExpressAddress, ExpressServer
from beamrl.loop.ray_utils import ActorCallError


class _Host:
    def __init__(self):
        self._serial = threading.RLock()


class _Trainers:
    def __init__(self, addresses):
        self.addresses, self.express = addresses, None

    def express_addresses(self):
        if isinstance(self.addresses, Exception):
            raise self.addresses
        return self.addresses

    def use_express(self, clients):
        self.express = clients


class _Engines:
    def __init__(self, addresses):
        self.addresses, self.running, self.names, self.channels = addresses, list(range(len(addresses))), \
            [f"native-{k}" for k in range(len(addresses))], None

    def express_address(self, k):
        return self.addresses[k]

    def use_express(self, channels):
        self.channels = channels


@pytest.fixture
def servers(monkeypatch):
    monkeypatch.setattr(groups.ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: "here"))
    made = [ExpressServer(_Host(), (), threading.RLock(), f"s{k}", node_id="here") for k in range(3)]
    yield [s.address for s in made]
    for s in made:
        s.close()


def test_every_actor_here_gets_a_channel(servers):
    trainers, engines = _Trainers(servers[:2]), _Engines(servers[2:])
    assert groups.open_express([trainers], engines, True).startswith("actor calls: express")
    assert len(trainers.express) == 2 and list(engines.channels) == [0] and engines.channels[0][0] == servers[2]


def test_an_actor_on_another_node_leaves_every_call_on_ray(servers):
    elsewhere = ExpressAddress("there", servers[2].socket, servers[2].authkey)
    trainers, engines = _Trainers(servers[:2]), _Engines([elsewhere])
    line = groups.open_express([trainers], engines, True)
    assert line == ("actor calls: through Ray (express calls need every actor on the driver's node; these run on 2 "
                    "node(s))")
    assert trainers.express is None and engines.channels is None


def test_a_channel_that_cannot_open_leaves_every_call_on_ray_and_says_why(servers):
    wrong_key = ExpressAddress("here", servers[2].socket, b"k" * 32)  # refused: a channel that cannot open
    trainers, engines = _Trainers(servers[:2]), _Engines([wrong_key])
    line = groups.open_express([trainers], engines, True)
    assert line.startswith("actor calls: through Ray (an express channel could not be opened: ")
    assert trainers.express is None and engines.channels is None


def test_a_server_that_cannot_open_leaves_every_call_on_ray_and_says_why(servers):
    trainers = _Trainers(ActorCallError("trainer.open_express: OSError: [Errno 98] Address already in use"))
    line = groups.open_express([trainers], _Engines(servers[2:]), True)
    assert line == ("actor calls: through Ray (an express server could not be opened: trainer.open_express: OSError: "
                    "[Errno 98] Address already in use)")
    assert trainers.express is None


def test_the_setting_off_leaves_every_call_on_ray_and_says_so(servers):
    trainers, engines = _Trainers(servers[:2]), _Engines(servers[2:])
    assert groups.open_express([trainers], engines, False) == "actor calls: through Ray (placement.express_calls: false)"
    assert trainers.express is None and engines.channels is None
