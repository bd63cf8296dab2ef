"""free_port returns a port that can be bound on the address it was asked for."""

import socket

from beamrl.net import free_port


def test_free_port_can_be_bound():
    port = free_port("127.0.0.1")
    assert 1024 <= port <= 65535
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))
